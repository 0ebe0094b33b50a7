"""The smoke's held resume imports the job's frameworks while the run to kill trains (runtime/launch.py
`warm_frameworks`): the modules the entry's top level imports, with the environment it sets before them,
and none of the job's own code run."""

from __future__ import annotations

import json
import os
import sys

from kchain.runtime import launch
from kchain.runtime.launch import warm_frameworks


def test_the_entrys_frameworks_are_imported_with_its_environment_and_none_of_its_code(tmp_path, monkeypatch):
    (tmp_path / "warmjob.py").write_text(
        "import os\n"
        "os.environ['KCHAIN_TEST_WARM_OFFLINE'] = '1'\n"
        "os.environ.setdefault('KCHAIN_TEST_WARM_BARS', '1')\n"
        "import json\n"
        "from warmframe import Trainer\n"
        "raise SystemExit('the job module itself must not run at the gate')\n"
    )
    # A stand-in framework (a real one, once imported, cannot be imported afresh in this process): it
    # records the environment it was imported with, as huggingface_hub reads HF_HUB_OFFLINE at its import.
    (tmp_path / "warmframe.py").write_text("import os\nSEEN = os.environ.get('KCHAIN_TEST_WARM_OFFLINE')\n"
                                           "Trainer = object\n")
    monkeypatch.setattr(launch, "FRAMEWORKS", ("warmframe",))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"job": "warm", "entry": "warmjob:main"}))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KCHAIN_TEST_WARM_OFFLINE", raising=False)
    monkeypatch.delenv("KCHAIN_TEST_WARM_BARS", raising=False)
    monkeypatch.delitem(sys.modules, "warmframe", raising=False)
    assert warm_frameworks(["launch", str(config)]) == ["warmframe"]  # json is no framework: left to the entry
    assert sys.modules["warmframe"].SEEN == "1" and "warmjob" not in sys.modules
    assert os.environ["KCHAIN_TEST_WARM_OFFLINE"] == "1" and os.environ["KCHAIN_TEST_WARM_BARS"] == "1"
    assert warm_frameworks(["launch", str(tmp_path / "missing.json")]) == []  # nothing to read: nothing warmed
