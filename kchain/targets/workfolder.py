"""A target's work folder: what the notebook embeds, unpacked, plus the engine's file.

Pure like the Kaggle render: the same job gives byte-identical files (the runtime and the code from
render.render_payload, with its credential and .kchainignore guards; config.json; the engine's
task.yaml or sbatch script). `write_folder` replaces the folder whole, so a file deleted from the
code never lingers in what the engine uploads. The run script both engines execute is built here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kchain.common import atomic, layout, sink
from kchain.errors import RenderError
from kchain.job.render import Payload
from kchain.kaggle.credentials import secret_strings

CONFIG_FILE = "config.json"
PYTHON = "python"  # the engine's Python: SkyPilot's image and a Slurm job's activated environment
LAUNCH = f"{PYTHON} -m kchain.runtime.launch {CONFIG_FILE}"
MASTER_PORT = 29500  # torchrun's default port, between the nodes of one job


@dataclass(frozen=True)
class TargetRendered:
    """A job rendered for SkyPilot or Slurm: every file of its work folder, by relative path."""

    target: str
    name: str
    engine_file: str  # task.yaml or job.sbatch
    files: dict[str, bytes]
    fingerprint: str
    payload: Payload

    @property
    def engine_text(self) -> str:
        return self.files[self.engine_file].decode()


def folder_files(payload: Payload, engine_file: str, engine_text: str, where: str) -> dict[str, bytes]:
    """The work folder: the payload's files, config.json and the engine's file; refused when any of
    them holds the Kaggle key (a setup line may)."""
    config = json.dumps(payload.config, sort_keys=True, indent=1) + "\n"
    if any(secret in engine_text for secret in secret_strings()):
        raise RenderError(f"{where}: a value holds your Kaggle key; remove it (give the engine its own secret "
                          "instead)")
    return {**payload.files, CONFIG_FILE: config.encode(), engine_file: engine_text.encode()}


def run_lines(defaults: dict[str, str], launch: list[str]) -> list[str]:
    """The shell lines both engines run in the work folder: the runtime's variables (each the
    engine's value unless already set), then the launch, with SIGTERM and SIGINT passed on to the
    training (a preemption's warning), and the script's exit code the training's own: 75 "saved,
    not done" for the engine to act on (docs/targets.md)."""
    folder = f"${layout.STATE_SINK_ENV}"
    lines = ["set -u"]
    lines += [f'export {name}="${{{name}:-{value}}}"' for name, value in defaults.items()]
    lines += [
        # The sink's folder is the bucket's mount (or the shared file system): checked before anything is
        # made, or the mkdir below would make it on the machine's own disk, and a recovered job would find no
        # checkpoint there and start fresh (issue 59). The runtime's guard says the same (sink.unmounted).
        f'sink_parent="$(dirname -- "{folder}")"',
        f'if [ -n "{folder}" ] && [ ! -d "$sink_parent" ]; then',
        f'  echo "[kchain] {sink.unmounted(folder, "$sink_parent")}" >&2',
        "  exit 1",
        "fi",
        'export PYTHONPATH="$PWD:$PWD/code${PYTHONPATH:+:$PYTHONPATH}"',
        "export PYTHONUNBUFFERED=1",
        f'mkdir -p "${layout.ROOT_ENV}/{layout.INPUT_DIR}" "${layout.ROOT_ENV}/{layout.WORKING_DIR}" "{folder}"',
        *launch[:-1],
        f"{launch[-1]} &",
        "child=$!",
        "trap 'kill -TERM \"$child\" 2>/dev/null' TERM INT",
        'while kill -0 "$child" 2>/dev/null; do wait "$child"; done',
        'wait "$child"; code=$?',
    ]
    return lines


def saved_not_done_check() -> list[str]:
    """After an outer torchrun (which returns only 0 or 1): the runtime's code for this node, from the
    summary this run wrote on it (75 after a SIGTERM stop; torchrun's code on the other nodes)."""
    return [f'{PYTHON} -m kchain.runtime.launch --exit-code "$code"; code=$?']


def write_folder(rendered: TargetRendered, out_dir: Path) -> list[Path]:
    """Write the work folder (each file atomically), replacing what was there; returns the engine
    file and config.json."""
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=layout.TMP_PREFIX, dir=out_dir.parent))
    for rel, data in sorted(rendered.files.items()):
        atomic.write_bytes(fresh / rel, data)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    fresh.rename(out_dir)
    return [out_dir / rendered.engine_file, out_dir / CONFIG_FILE]
