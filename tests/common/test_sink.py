"""The state sink (common/sink.py): a real SIGKILL at every point of a publish, each followed by a
resume on a fresh, empty working folder with that bucket folder; the resumed trace must be the
uninterrupted run's, bit for bit. The kills at each point are of a small publishing process (the
sink needs no torch); one more is of a training process, inside its sink thread. And newest-only
publishing when the bucket falls behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers import known
from helpers import loss_trace as trace

from kchain.common import layout, sink
from kchain.common.config import RuntimeConfig
from kchain.common.faults import SINK_POINTS, Faults
from kchain.common.settings import Settings
from kchain.runtime.run import Run

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "tests" / "runtime_jobs"
TOTAL, EVERY = 12, 2
TIMEOUT_S = 120  # a hung child fails the test instead of hanging CI; never a speed bound


def config(keep: int = 2) -> dict:
    return {"job": "tiny", "entry": "tiny_job:main", "fingerprint": "f00d", "kchain_version": "0.1.0",
            "params": {"d_model": 16, "steps": TOTAL, "workers": 0},
            "train": {"checkpoint_every": {"steps": EVERY}, "keep": keep, "heartbeat_s": 0}}


def launch(root: Path, bucket: Path | None, fault: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True)
    (root / "cfg.json").write_text(json.dumps(config()))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KCHAIN_", "RANK", "WORLD_SIZE"))}
    env.update(KCHAIN_ROOT=str(root), PYTHONPATH=os.pathsep.join([str(REPO), str(JOBS)]), PYTHONUNBUFFERED="1",
               KCHAIN_FAULT=fault, KCHAIN_ACCELERATOR_CHECK="off",  # a GPU job's target run, on this CPU
               **({layout.STATE_SINK_ENV: str(bucket)} if bucket else {}))
    return subprocess.run([sys.executable, "-m", "kchain.runtime.launch", str(root / "cfg.json")], env=env,
                          cwd=root, capture_output=True, text=True, timeout=TIMEOUT_S)


def in_process(root: Path, bucket: Path | None, keep: int = 2) -> Run:
    if str(JOBS) not in sys.path:
        sys.path.insert(0, str(JOBS))
    import tiny_job

    env = {layout.ROOT_ENV: str(root), **({layout.STATE_SINK_ENV: str(bucket)} if bucket else {})}
    run = Run(config(keep), env)
    try:
        tiny_job.main(run)
    finally:
        run.close()
    return run


def in_bucket(bucket: Path) -> dict[str, Any]:
    """{checkpoint folder: its files} in the bucket, and the pointer's checkpoint under 'latest'."""
    got = {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(bucket.glob("step-*"))}
    pointer = sink.read_pointer(bucket)
    return {**got, "latest": pointer and pointer["checkpoint"]}


# A process that publishes two of the reference's checkpoints, the second with KCHAIN_FAULT's sink_kill:
# the sink is standard library only, so each kill costs a Python start, not a training process.
PUBLISHER = """
import os, sys
from pathlib import Path
from kchain.common.faults import Faults
from kchain.common.sink import Sink
bucket, first, second = map(Path, sys.argv[1:4])
whole = Sink(bucket, 1, "tiny")
whole.publish(first)
whole.flush()
killed = Sink(bucket, 1, "tiny", Faults.parse(os.environ["KCHAIN_FAULT"]))
killed.publish(second)
killed.flush()
"""


def test_a_sigkill_at_every_point_of_a_publish_then_a_fresh_machine_resumes_bit_exact(tmp_path, capsys):
    reference = tmp_path / "reference"
    in_process(reference, None, keep=TOTAL)  # every checkpoint kept: the publisher's sources
    ref = trace(reference)
    assert [s for s, _ in ref] == list(range(1, TOTAL + 1))
    local = reference / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR
    step2, step4 = layout.checkpoint_name(2), layout.checkpoint_name(4)
    full = sorted([layout.STATE_FILE, layout.METRICS, layout.DIGESTS, layout.MANIFEST])
    # Step 2 published whole, then the publish of step 4 killed: what the bucket holds, and where a
    # fresh machine resumes. Nothing the pointer names is ever gone; a copy without its manifest is never read.
    after = {
        "after_local": ({step2: full, "latest": step2}, 2),
        "mid_files": ({step2: full, step4: [layout.STATE_FILE], "latest": step2}, 2),
        "before_manifest": ({step2: full, step4: [n for n in full if n != layout.MANIFEST], "latest": step2}, 2),
        "before_pointer": ({step2: full, step4: full, "latest": step2}, 4),
        "before_prune": ({step2: full, step4: full, "latest": step4}, 4),  # keep 1: step 2 goes next
    }
    assert list(after) == list(SINK_POINTS)
    for point, (holds, resumes) in after.items():
        bucket = tmp_path / f"bucket-{point}"
        died = subprocess.run([sys.executable, "-c", PUBLISHER, str(bucket), str(local / step2), str(local / step4)],
                              env={**os.environ, "PYTHONPATH": str(REPO), "KCHAIN_FAULT": f"sink_kill={point}"},
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr
        assert in_bucket(bucket) == holds, point
        machine = tmp_path / f"machine-{point}"  # a fresh machine: an empty working folder
        run = in_process(machine, bucket)
        assert (run.resumed_from, run.status) == (resumes, "finished"), point
        assert trace(machine) == ref, point
        assert known(sink.read_pointer(bucket))["step"] == TOTAL
    # The same machine again after `after_local` (a requeue on the node that saved step 4): it resumes from
    # its own step 4, newer than the bucket's pointer, and publishes it first.
    bucket, again = tmp_path / "bucket-again", tmp_path / "machine-again"
    subprocess.run([sys.executable, "-c", PUBLISHER, str(bucket), str(local / step2), str(local / step4)],
                   env={**os.environ, "PYTHONPATH": str(REPO), "KCHAIN_FAULT": "sink_kill=after_local"}, timeout=TIMEOUT_S)
    shutil.copytree(local / step4, again / layout.WORKING_DIR / layout.KCHAIN_DIR / layout.CHECKPOINTS_DIR / step4)
    capsys.readouterr()
    run = in_process(again, bucket)
    assert (run.resumed_from, run.finished) == (4, True) and trace(again) == ref
    said = capsys.readouterr().out
    assert f"published {step4}" in said or f"replaces {step4}" in said


def test_the_training_process_killed_in_its_sink_thread_resumes_from_the_bucket_bit_exact(tmp_path):
    # The same kill from inside a training process: its writer queued the checkpoint, the sink's
    # thread dies before the pointer moves while training goes on; the next machine starts empty.
    reference = tmp_path / "reference"
    in_process(reference, None)
    bucket, machine = tmp_path / "bucket", tmp_path / "machine"
    died = launch(tmp_path / "killed", bucket, "sink_kill=before_pointer")
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr
    # One whole copy and no pointer: step 2's (or step 4's, had a busy machine let it replace step 2 in the queue).
    full = sorted([layout.STATE_FILE, layout.METRICS, layout.DIGESTS, layout.MANIFEST])
    whole = sink.candidates(bucket)
    assert len(whole) == 1 and in_bucket(bucket) == {whole[0].name: full, "latest": None}
    run = in_process(machine, bucket)
    assert (run.resumed_from, run.finished) == (sink.step_of(whole[0]), True)
    assert trace(machine) == trace(reference)
    # The pointer moved to the end; the older copies were pruned after it (train.keep: 2). The copy kept
    # beside step 12 is step 10's, or an earlier one's when a busy machine let step 12 replace step 10
    # in the sink's queue (the newest queued checkpoint wins; it is never older than the one it replaces).
    held = in_bucket(bucket)
    assert held.pop("latest") == layout.checkpoint_name(12) and held.pop(layout.checkpoint_name(12)) == full
    (kept, files), = held.items()
    assert files == full and sink.step_of(bucket / kept) in range(sink.step_of(whole[0]), 11), kept


def fake_checkpoint(folder: Path, step: int) -> Path:
    """A complete checkpoint folder as the writer leaves it (the sink reads files and manifest only)."""
    ckpt = folder / layout.checkpoint_name(step)
    ckpt.mkdir(parents=True)
    files = {}
    for name, data in ((layout.STATE_FILE, os.urandom(4096)), (layout.METRICS, b"{}\n")):
        (ckpt / name).write_bytes(data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (ckpt / layout.MANIFEST).write_text(json.dumps({layout.MARKER: 1, "job": "unit", "step": step, "files": files}))
    return ckpt


def test_a_sink_that_falls_behind_publishes_the_newest_and_skips_the_queued_one(tmp_path):
    made = [fake_checkpoint(tmp_path / "local", step) for step in (1, 2, 3)]
    bucket = tmp_path / "bucket"
    slow = sink.Sink(bucket, keep=5, job="unit", faults=Faults(sink_stall=0.5))
    for ckpt in made:
        slow.publish(ckpt)  # all three while the first publish waits on the slow bucket
    slow.flush()
    names = [c.name for c in made]
    assert slow.replaced and slow.published[-1] == names[-1]
    assert sorted(slow.published + slow.replaced) == names
    assert sorted(d.name for d in bucket.glob("step-*")) == sorted(slow.published)
    assert known(sink.read_pointer(bucket))["checkpoint"] == names[-1]
    # A corrupted local copy is never published: the pointer stays where it was.
    bad = fake_checkpoint(tmp_path / "local", 4)
    (bad / layout.STATE_FILE).write_bytes(os.urandom(4096))
    slow.publish(bad)
    slow.flush()
    assert known(sink.read_pointer(bucket))["checkpoint"] == names[-1] and not (bucket / bad.name).exists()


def test_the_guard_never_starts_fresh_on_a_missing_mount_an_emptied_requeue_or_a_deleted_pointer(tmp_path):
    bucket = tmp_path / "bucket"
    # A sink folder whose mount is missing (a bucket not mounted, a wrong path): lost, not a first run.
    assert "does not exist" in known(sink.behind_pointer(tmp_path / "unmounted" / "job", None, []))
    bucket.mkdir()
    assert sink.behind_pointer(bucket / "job", None, []) is None  # a first run: nothing published yet
    # A requeued run (SLURM_RESTART_COUNT > 0) on an empty sink: its state was lost; KCHAIN_START_OVER=1 is the way.
    assert "KCHAIN_START_OVER=1" in known(sink.behind_pointer(bucket / "job", None, [], requeued=True))
    settings_of = RuntimeConfig.from_dict(config())
    assert Settings.parse(settings_of, {"SLURM_RESTART_COUNT": "2"}).requeued
    assert not Settings.parse(settings_of, {"SLURM_RESTART_COUNT": "2", "KCHAIN_START_OVER": "1"}).requeued
    assert not Settings.parse(settings_of, {"SLURM_RESTART_COUNT": "0"}).requeued
    # `latest` deleted with the newest copy: the newest mark still says step 2 was published.
    publisher = sink.Sink(bucket / "job", keep=2, job="unit")
    for step in (1, 2):
        publisher.publish(fake_checkpoint(tmp_path / "local", step))
        publisher.flush()
    (bucket / "job" / sink.POINTER).unlink()
    shutil.rmtree(bucket / "job" / layout.checkpoint_name(2))
    assert known(sink.read_pointer(bucket / "job"))["step"] == 2
    assert "no checkpoint at or after it verifies" in known(sink.behind_pointer(bucket / "job", 1, []))
    assert sink.behind_pointer(bucket / "job", 2, []) is None
