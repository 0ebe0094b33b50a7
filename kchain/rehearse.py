"""`kchain rehearse`: the whole chain on this machine, against the local Kaggle, before any quota.

The job is pushed to a private emulator with a short session limit (the runtime's deadline guard is
set from it, as on Kaggle), chosen sessions are killed at a random moment, and `continue` chains
session after session until training is done. Beside it, the same notebook runs once,
uninterrupted. The two metrics traces are compared step by step.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kchain.chain import wait_ready, watch
from kchain.emulator import Emulator, Faults
from kchain.errors import KchainError
from kchain.inputs import local_inputs, mount_inputs
from kchain.kaggle_api import KaggleClient
from kchain.ledger import Ledger, new_run_id, state_dir
from kchain.plot import newest_trace
from kchain.push import push_job, write_dataset_metadata
from kchain.render import render_job, write_rendered
from kchain.runtime import layout
from kchain.spec import Job, load_job
from kchain.traces import compare_traces, read_trace, sandbox_trace

Echo = Callable[[str], None]
USER = "rehearsal"


@dataclass
class Rehearsal:
    identical: bool
    verdict: str
    sessions: list[dict[str, Any]]
    reference: list[dict[str, Any]]
    chained: list[dict[str, Any]]
    emulator_sessions: list[dict[str, Any]] = field(default_factory=list)
    dataset_versions: list[dict[str, Any]] = field(default_factory=list)
    work: Path | None = None


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def short_session_job(job: Job, session_limit_s: float, params: dict[str, Any]) -> Job:
    """The job with the rehearsal's session limit (the margin and cadence scaled to it)."""
    margin = max(3.0, round(session_limit_s * 0.25, 1))  # start-up and shutdown under load need room
    train = job.train.model_copy(update={
        "session_limit": f"{session_limit_s}s", "margin": f"{margin}s",
        "checkpoint_every": f"{max(1.0, round(session_limit_s / 6, 1))}s", "heartbeat": "2s",
    })
    kaggle = job.kaggle.model_copy(update={"owner": USER})
    return job.model_copy(update={"train": train, "kaggle": kaggle, "params": {**job.params, **params}})


def run_reference(job: Job, root: Path, sources: dict[tuple[str, str, str], Path]) -> list[dict[str, Any]]:
    """The same notebook, one uninterrupted session with no time limit, in a process of its own."""
    rendered = render_job(job, owner=USER)
    write_rendered(rendered, root.parent / "reference-kernel")
    root.mkdir(parents=True, exist_ok=True)
    mount_inputs(root, sources)
    env = {**os.environ, layout.SESSION_LIMIT_ENV: str(30 * 24 * 3600)}
    notebook = root.parent / "reference-kernel" / rendered.notebook_file
    with open(root.parent / "reference.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "kchain.local", "run", str(notebook), "--root", str(root)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode != 0:
        raise KchainError(f"the reference run failed (exit {done.returncode}); see {root.parent / 'reference.log'}")
    return read_trace(sandbox_trace(root))


def upload_inputs(emu: Emulator, job: Job, sources: dict[tuple[str, str, str], Path], keys: dict[str, str],
                  scratch: Path, echo: Echo) -> None:
    """Publish the local copy of each attached dataset to the local Kaggle, as its owner, so the
    sessions get it mounted like Kaggle would (a pinned version N exists as version N)."""
    pinned = {tuple(ref.split("/")[:2]): int(ref.split("/")[2]) for ref in job.kaggle.datasets if ref.count("/") == 2}
    for (_, owner, slug), source in sources.items():
        folder = scratch / owner / slug
        shutil.copytree(source, folder, symlinks=False)
        write_dataset_metadata(folder, f"{owner}/{slug}", slug)
        with _env({**emu.env(owner)}):
            client = KaggleClient(backoff_s=0.2, max_backoff_s=2.0)
            client.create_dataset(folder, public=True, dir_mode="zip")
            for _ in range(pinned.get((owner, slug), 1) - 1):
                wait_ready(client, f"{owner}/{slug}", echo)
                client.version_dataset(folder, "rehearsal copy", dir_mode="zip")
        echo(f"  input {owner}/{slug}: the local copy {source} is on the local Kaggle")


def rehearse(job_file: Path, session_limit_s: float = 20.0, kills: int = 1, seed: int = 0,
             params: dict[str, Any] | None = None, faults: Faults | None = None, internet: bool | None = None,
             echo: Echo = print, poll_s: float = 0.5, key: str | None = None) -> Rehearsal:
    base = load_job(job_file)
    job = short_session_job(base, session_limit_s, params or {})
    if internet is not None:
        job = job.model_copy(update={"kaggle": job.kaggle.model_copy(update={"internet": internet})})
    work = state_dir(base.path) / "rehearse" / new_run_id("rehearse")
    ledger = Ledger(work / "ledger")
    key = key or secrets.token_hex(16)  # a throwaway user of the throwaway Kaggle
    rng = random.Random(seed)
    faults = faults or Faults(seed=seed)
    if job.kaggle.competition:
        raise KchainError(f"{job_file}: kaggle.competition: competitions are not emulated; to rehearse, "
                          "attach a small copy of the data as a dataset")
    sources = local_inputs(job, state_dir(base.path) / "inputs", echo=echo)
    owners = {owner: secrets.token_hex(16) for (_, owner, _) in sources if owner != USER}
    emu = Emulator(work / "kaggle", users={USER: key, **owners}, session_limit_s=session_limit_s * 1.05,
                   secrets={USER: {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": key}}, faults=faults)
    emu.start()
    try:
        upload_inputs(emu, job, sources, {USER: key, **owners}, work / "upload", echo)
    except BaseException:
        emu.stop()
        raise
    reference: list[dict[str, Any]] = []
    ref_error: list[BaseException] = []

    def reference_thread() -> None:
        try:
            reference.extend(run_reference(job, work / "reference", sources))
        except BaseException as exc:  # noqa: BLE001 - reported after the chain
            ref_error.append(exc)

    ref = threading.Thread(target=reference_thread, daemon=True)
    ref.start()
    kill_set: set[int] = set()

    def before_each(session: int) -> None:
        # Session 1 runs clean; then `kills` of the next sessions die at a random moment.
        if session >= 2 and len(kill_set) < kills and session not in kill_set and rng.random() < 0.7:
            kill_set.add(session)
        emu.faults.kill_random_s = (session_limit_s * 0.3, session_limit_s * 0.8) if session in kill_set else None

    echo(f"kchain rehearse {job_file}: sessions of {session_limit_s:g}s against a local Kaggle at {emu.url}")
    try:
        with _env({**emu.env(USER), "KCHAIN_HOME": str(work / "ledger")}):
            client = KaggleClient(backoff_s=0.2, max_backoff_s=2.0)
            before_each(1)
            push_job(job, ledger, client, skip_smoke=True, force=True, echo=echo)
            watch(job, ledger, client, force=True, skip_smoke=True, echo=echo, poll_s=poll_s,
                  max_poll_s=max(poll_s, 2.0), before_each=before_each)
        ref.join()
    finally:
        emu.stop()
    if ref_error:
        raise ref_error[0]
    chain = ledger.sessions(job.name)
    trace_path = newest_trace(chain)
    chained = read_trace(trace_path) if trace_path else []
    rows, first = compare_traces(reference, chained)
    steps = max((r["step"] for r in reference), default=0)
    identical = first is None and bool(rows) and all(r[3] is not None for r in rows)
    if identical:
        verdict = f"identical: {len(rows)} values over {steps} steps, {len(chain)} sessions, largest difference 0.0"
    elif first is None:
        verdict = "incomplete: the chained trace is missing steps the reference has"
    else:
        verdict = f"differs first at step {first[0]} ({first[1]})"
    _print(echo, chain, rows)
    echo(f"verdict: {verdict}")
    return Rehearsal(identical, verdict, chain, reference, chained, emu.sessions(),
                     emu.dataset_versions(f"{USER}/{job.name}-state"), work)


def _print(echo: Echo, chain: list[dict[str, Any]], rows: list[tuple[int, str, float, float | None]]) -> None:
    echo(f"{'session':>7}  {'status':<9} {'ended as':<12} {'resumed at':>10} {'reached':>8}  {'published':<9} uploaded")
    for s in chain:
        summary = s.get("summary") or {}
        publish = s.get("publish") or {}
        published = publish.get("published") or summary.get("published") or "-"
        uploaded = f"{publish['uploaded_bytes'] / 1e6:.2f} MB" if publish.get("uploaded_bytes") else "-"
        echo(f"{s['session']:>7}  {s['status']:<9} {summary.get('status') or 'killed':<12} "
             f"{s.get('resumes_at', 0):>10} {summary.get('step') or '-':>8}  {published:<9} {uploaded}")
    starts = {s.get("resumes_at", 0) for s in chain}
    shown = [r for r in rows if r[1] == "loss" and (r[0] - 1 in starts or r[0] % 25 == 0)]
    echo(f"{'step':>6}  {'uninterrupted':>16} {'chained':>16}")
    for step, _key, a, b in shown:
        mark = "  <- session boundary" if step - 1 in starts and step > 1 else ""
        echo(f"{step:>6}  {a:>16.8g} {'missing' if b is None else f'{b:.8g}':>16}{mark}")


def parse_sets(values: tuple[str, ...]) -> dict[str, Any]:
    """--set steps=300 --set lr=1e-3 -> {'steps': 300, 'lr': 0.001} (values read as YAML, as params are)."""
    from kchain.spec import parse_overrides

    return parse_overrides(values)

