"""The tests mirror the package (issue 57 item 5): every module of kchain has tests/<its folder>/test_<name>.py
(cli.py and errors.py, at the package's top, in tests/cli/), or is listed below with its reason. A reason
"covered by tests/X/test_Y.py" is held to the code: that file exists and imports or names the module."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kchain"
TESTS = ROOT / "tests"
NO_TEST_YET = "no test of its own yet"

# A module with no test file of its own, and why: the test that covers it, or NO_TEST_YET.
WITHOUT_OWN_FILE: dict[str, str] = {
    "kchain/cli.py": "covered by tests/cli/test_cli_help.py",
    "kchain/errors.py": "covered by tests/cli/test_cli_help.py",
    "kchain/store/names.py": "covered by tests/scenarios/test_reset_after_acting.py",
    "kchain/kaggle/datasets.py": "covered by tests/scenarios/test_reset_after_acting.py",
    "kchain/job/extras.py": "covered by tests/chain/test_doctor.py",
    "kchain/job/spec_targets.py": NO_TEST_YET,
    "kchain/chain/advance.py": "covered by tests/scenarios/test_stale_running.py",
    "kchain/chain/budget.py": "covered by tests/scenarios/test_quota_week.py",
    "kchain/chain/outcome.py": "covered by tests/scenarios/test_chain_result.py",
    "kchain/result/plot.py": "covered by tests/store/test_ledger.py",
    "kchain/result/traces.py": "covered by tests/scenarios/test_smoke.py",
    "kchain/local/rehearse.py": "covered by tests/scenarios/test_rehearse.py",
    "kchain/local/smoke.py": "covered by tests/scenarios/test_smoke.py",
    "kchain/targets/commands.py": "covered by tests/targets/test_targets.py",
    "kchain/targets/rehearsal.py": NO_TEST_YET,
    "kchain/targets/skycheck.py": NO_TEST_YET,
    "kchain/targets/skypilot.py": "covered by tests/targets/test_targets.py",
    "kchain/targets/slurm.py": "covered by tests/targets/test_targets.py",
    "kchain/targets/workfolder.py": "covered by tests/targets/test_targets.py",
    "kchain/common/eventfiles.py": "covered by tests/common/test_trackers.py",
    "kchain/common/keepbest.py": "covered by tests/runtime/checkpoint/test_keep_best.py",
    "kchain/common/nextkernel.py": "covered by tests/common/test_push_once.py",
    "kchain/common/publish.py": "covered by tests/common/test_publish_read.py",
    "kchain/common/publishplan.py": "covered by tests/runtime/test_clock.py",
    "kchain/common/relay.py": NO_TEST_YET,
    "kchain/common/statefolder.py": "covered by tests/runtime/checkpoint/test_keep_best.py",
    "kchain/common/wheelinstall.py": "covered by tests/job/test_kagglepip.py",
    "kchain/emulator/app.py": "covered by tests/emulator/test_emulator.py",
    "kchain/emulator/faults.py": NO_TEST_YET,
    "kchain/emulator/rpcs.py": "covered by tests/scenarios/test_quota_week.py",
    "kchain/emulator/server.py": NO_TEST_YET,
    "kchain/emulator/sessions.py": "covered by tests/scenarios/test_rehearse.py",
    "kchain/emulator/state.py": NO_TEST_YET,
    "kchain/runtime/forkranks.py": "covered by tests/runtime/test_distributed.py",
    "kchain/runtime/progress.py": "covered by tests/runtime/checkpoint/test_checkpointer.py",
    "kchain/runtime/torchrun.py": "covered by tests/runtime/test_distributed.py",
    "kchain/runtime/checkpoint/snapshot.py": "covered by tests/runtime/checkpoint/test_checkpoint_state.py",
    "kchain/runtime/checkpoint/state.py": "covered by tests/runtime/checkpoint/test_checkpoint_state.py",
    "kchain/runtime/checkpoint/statedigest.py": "covered by tests/local/test_statecheck.py",
    "kchain/runtime/checkpoint/untracked.py": NO_TEST_YET,
    "kchain/runtime/frameworks/mlflow_store.py": NO_TEST_YET,
    "kchain/runtime/frameworks/tensorboard.py": "covered by tests/result/test_pull.py",
}


def modules() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" and "init_templates" not in p.parts)


def own_test(module: str) -> Path:
    """kchain/<folder>/<name>.py -> tests/<folder>/test_<name>.py; the package's top -> tests/cli/."""
    path = Path(module).relative_to("kchain")
    return TESTS / (path.parent if path.parent.parts else Path("cli")) / f"test_{path.stem}.py"


def names_module(test_file: Path, module: str) -> bool:
    """Whether the file imports or names the module: its dotted name, or `from <package> import ... <name>`
    (a subprocess's code in a string included)."""
    dotted = module.removesuffix(".py").replace("/", ".")
    package, name = dotted.rsplit(".", 1)
    text = test_file.read_text()
    return bool(re.search(rf"\b{re.escape(dotted)}\b", text)
                or re.search(rf"\bfrom {re.escape(package)} import [\w\s,()]*\b{name}\b", text))


def test_every_module_has_a_test_file_of_its_own_or_a_reason():
    lacking = [m for m in modules() if not own_test(m).exists() and m not in WITHOUT_OWN_FILE]
    assert lacking == [], "give each its tests/<folder>/test_<name>.py, or list it in WITHOUT_OWN_FILE with why"


def test_no_listed_module_is_gone_or_has_gained_a_file_of_its_own():
    assert sorted(set(WITHOUT_OWN_FILE) - set(modules())) == [], "listed, but no such module"
    assert [m for m in WITHOUT_OWN_FILE if own_test(m).exists()] == [], "has its own test file now: unlist it"


def test_each_reason_names_a_test_that_exists_and_imports_the_module():
    stale = []
    for module, reason in WITHOUT_OWN_FILE.items():
        if reason == NO_TEST_YET:
            continue
        found = re.fullmatch(r"covered by (tests/[\w/]+\.py)", reason)
        if not found or not (ROOT / found.group(1)).is_file() or not names_module(ROOT / found.group(1), module):
            stale.append(f"{module}: {reason}")
    assert stale == [], f"a reason is '{NO_TEST_YET}' or 'covered by tests/...py' naming a file that imports it"
