"""`kchain pull`: the chain's result brought home as a plain folder, from the newest state version.

Laptop side. The state dataset is named by the job alone (`<owner>/<name>-state`), so a laptop that
never saw the chain pulls it; the chain's records (this laptop's, or rebuilt from Kaggle as `status` does)
say whether it has ended (kchain/chain/outcome.py: the word `continue` says), so `--final` serves the newest
version when it holds the step the chain ended at, whichever session published it. Files come one by one
through the official client (kaggle_api), only those the choice needs, and are checked against the
checkpoint's manifest without torch (runtime/checkpoint_files); only the conversion of state.pt into weight
files imports torch, inside `write_weights`.

What a pull takes from the version is a list of names (`Fetch`): the marker and summary, the chosen
checkpoint's files (--best: its `best.*` files, or the newest's when the newest is the best), and with
--final the `export.*` files of run.export_dir. Another folder of the same version (logs, later) is one
more list of names fetched the same way.

Off Kaggle (a SkyPilot or Slurm target) the result is in the runs' state folder, the state sink their
runtime publishes each verified checkpoint to (common/sink.py: `step-*/` copies and the `latest` pointer):
a Slurm job's `slurm.state_dir/<name>`, or any such folder given with `--from` (a SkyPilot bucket's
`<name>/` folder, mounted or copied here). It is read in place, its newest published copy's manifest says
the result (outcome.of_state_folder), and the chosen copy is verified like any checkpoint.

The folder written:
    model.safetensors          the tracked module's weights (one file per module, named for it, when
                               several are tracked); state_dict.pt when safetensors cannot hold a dtype
    metrics.json               step, the metric values at that step, sessions, GPU-hours, fingerprint
    export/                    what the finishing session wrote under run.export_dir (--final; from its
                               output here when it trained nothing past the state it resumed, so published none)
    .kchain-pull.json          kchain's mark: the files this pull wrote (what a later --force may replace)

Nothing kchain did not write is ever deleted: `-o` is a new or empty folder, or one a pull wrote before
(its mark names every file in it), which `--force` replaces. A folder holding a job (job.yaml), a ledger
(.kchain/) or any other file, and a plain file, are refused in one line naming them, --force or not.
The scratch folder is `.tmp-pull-<pid>-...` beside the target; a pull removes those whose process is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kchain
from kchain.chain import outcome
from kchain.chain.sessions import refresh
from kchain.common import atomic, eventfiles, layout, summary
from kchain.common.checkpoint_files import (
    ATTACHED_KEY,
    BEST_KEY,
    FROZEN_KEY,
    MODULES_KEY,
    CheckpointInvalid,
    check_sha256,
    read_manifest,
    verify,
)
from kchain.common.nextsession import ENDED
from kchain.common.say import gb
from kchain.common.sink import read_pointer
from kchain.common.statefolder import STATE_MARKER
from kchain.errors import KchainError
from kchain.job.spec import Job, load_job
from kchain.kaggle.client import KaggleClient
from kchain.kaggle.datasets import current_version
from kchain.store.ledger import Ledger, state_dir
from kchain.store.names import state_dataset

Echo = Callable[[str], None]
WHICH = ("best", "final", "step")
METRICS_FILE = "metrics.json"
EXPORT_SUBDIR = "export"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "state_dict.pt"
PULL_MARK = ".kchain-pull.json"  # in every folder a pull writes: the files it wrote
JOB_MARKS = ("job.yaml", ".kchain")  # a job's folder and its ledger: never replaced
SCRATCH = f"{layout.TMP_PREFIX}pull-"  # + the pulling process's id: a folder being written beside the target
SHOWN = 5  # offending names a refusal lists before "and N more"


@dataclass(frozen=True)
class Want:
    """Which weights: the kept best, the finished chain's final ones, or those of one step."""

    which: str = "final"  # best | final | step
    step: int | None = None

    def label(self) -> str:
        return f"step-{self.step}" if self.which == "step" else self.which

    def flag(self) -> str:
        """As the command line says it: --best, --final, --step N."""
        return f"--step {self.step}" if self.which == "step" else f"--{self.which}"


@dataclass
class Fetch:
    """Names in one state version to bring into a folder (the unit a later `--logs` adds one of)."""

    names: list[str]
    fetched: list[Path] = field(default_factory=list)

    def run(self, client: KaggleClient, ref: str, version: int, into: Path) -> list[Path]:
        into.mkdir(parents=True, exist_ok=True)
        for name in self.names:
            self.fetched.append(client.download_dataset_file(ref, version, name, into))
        return self.fetched


@dataclass(frozen=True)
class Pulled:
    """What `pull` wrote: the folder, its weight files, the step, the bytes fetched."""

    folder: Path
    source: str  # the state version ("owner/slug-state version N") or the state folder read
    weights: dict[str, str]  # tracked name -> file in the folder
    step: int
    fetched_bytes: int
    note: str | None  # why the weights are not safetensors, or what they leave out
    best: dict | None = None  # --best: the kept best these weights are (metric, mode, value, step)

    def lines(self) -> list[str]:
        files = ", ".join([*self.weights.values(), METRICS_FILE])
        which = f" (the kept best: {outcome.best_words(self.best)})" if self.best else ""
        out = [f"pulled step {self.step}{which} from {self.source} ({gb(self.fetched_bytes)} fetched): "
               f"{self.folder} ({files})"]
        if self.note:
            out.append(self.note)
        return out


def begin(job_file: Path, out: Path | None, label: str, force: bool, client: KaggleClient | None,
          echo: Echo, job: Job | None = None) -> tuple[Job, Path, KaggleClient, str, int, Path]:
    """A pull's start: the job, the folder to write (default <name>-<label> beside the job file, refused
    when it holds something unless --force, before any download), the client, the state dataset and its
    newest version, and the scratch folder the pull is written in. job: the job as its chain ran it, when it is
    not job_file's as written (a queued run's, chain/queue.py)."""
    job = job or load_job(job_file)
    out = _out_for(job, out, label, force)
    client = client or KaggleClient()
    ref, version = _newest_state(job_file, job, client, echo)
    return job, out, client, ref, version, _scratch_beside(out)


def _out_for(job: Job, out: Path | None, label: str, force: bool) -> Path:
    """The folder to write (default <name>-<label> beside the job file), refused when it holds something
    unless --force; the scratch folders killed pulls left beside it cleaned."""
    out = Path(out) if out is not None else job.path.parent / f"{job.name}-{label}"
    _check_out(out, force)
    _clear_scratch(out)
    return out


def _newest_state(job_file: Path, job: Job, client: KaggleClient, echo: Echo) -> tuple[str, int]:
    """The job's state dataset and its newest version, ready (one line when no session published yet)."""
    ref = state_dataset(job.kaggle.owner or client.username, job.name)
    if not client.dataset_exists(ref):
        raise KchainError(f"{job_file}: nothing to pull, {ref} does not exist (no session published state yet): "
                          f"`kchain push {job_file}` starts the chain")
    return ref, current_version(client, ref, echo)


def _scratch_beside(out: Path) -> Path:
    """A `.tmp-pull-<pid>-` folder beside `out` (the same disk): the pull is written there, then renamed into
    place. The process id tells a later pull whether the folder is still being written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH}{os.getpid()}-{out.name}-", dir=out.parent))


def _clear_scratch(out: Path) -> None:
    """The scratch folders beside `out` that killed pulls left (`.tmp-pull-<pid>-*` whose process is gone)."""
    try:
        entries = list(out.parent.iterdir())
    except OSError:  # no folder there yet: nothing left in it
        return
    for entry in entries:
        pid = entry.name.removeprefix(SCRATCH).split("-")[0]
        if entry.name.startswith(SCRATCH) and pid.isdigit() and entry.is_dir() and not entry.is_symlink() \
                and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (another user's counts: its folder is not ours to take)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_out(out: Path, force: bool) -> None:
    """`-o` is a new or empty folder, or one a pull wrote before (--force replaces it); anything else is
    refused in one line naming what it holds (checked before any download, and again before the rename)."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        what = "a link" if out.is_symlink() else "a file"
        raise KchainError(f"{out} is {what}, not a folder: a pull never replaces it, --force or not; -o a new "
                          "folder (or one an earlier pull wrote)")
    if not any(out.iterdir()):
        return
    if any((out / name).exists() or (out / name).is_symlink() for name in JOB_MARKS):
        raise KchainError(f"{out} is a job's folder ({_names(_foreign(out, set()))}): a pull never writes over a job "
                          "or its ledger, --force or not; -o a new folder")
    written = _written(out)
    if written is None:
        raise KchainError(f"{out} was not written by kchain pull ({_names(_foreign(out, set()))}): --force replaces "
                          "only a pull's own folder; -o a new folder")
    foreign = _foreign(out, written)
    if foreign:
        raise KchainError(f"{out} holds files kchain pull did not write ({_names(foreign)}): --force replaces only "
                          "a folder holding nothing else; move them out, or -o a new folder")
    if not force:
        raise KchainError(f"{out} exists and is not empty: pass --force to replace it, or -o another folder")


def _written(out: Path) -> set[str] | None:
    """The files an earlier pull wrote in `out`, from its mark; None when `out` carries no readable mark."""
    try:
        files = json.loads((out / PULL_MARK).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return {str(f) for f in files} if isinstance(files, list) else None


def _foreign(out: Path, written: set[str]) -> list[str]:
    """What `out` holds beyond `written` and the mark: files by their path, a folder no written file is
    in by its name and a slash (not walked), links never followed; a job's marks first, then sorted."""
    folders = {parent.as_posix() for rel in written for parent in Path(rel).parents if parent != Path(".")}
    found: list[str] = []
    for root, dirs, files in os.walk(out):
        here = Path(root).relative_to(out)
        for name in sorted(dirs):
            rel = (here / name).as_posix()
            if rel not in folders or (Path(root) / name).is_symlink():
                found.append(rel + "/")
                dirs.remove(name)
        found += [rel for rel in ((here / name).as_posix() for name in files) if rel not in written | {PULL_MARK}]
    return sorted(found, key=lambda rel: (rel.rstrip("/") not in JOB_MARKS, rel))


def _names(names: list[str]) -> str:
    """The first few names, then how many more."""
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def _mark(folder: Path, state: str) -> None:
    """The mark of a folder a pull wrote: every file in it, so that a later --force replaces only those."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    atomic.write_json(folder / PULL_MARK, {"written_by": f"kchain {kchain.__version__} pull",
                                           "state": state, "files": files})


def pull(job_file: Path, want: Want, out: Path | None = None, force: bool = False, echo: Echo = print,
         client: KaggleClient | None = None, source: Path | None = None, verb: str = "pull",
         job: Job | None = None) -> Pulled:
    """Fetch the wanted checkpoint from the newest state version, verify it, write the plain folder; a
    target's from its state folder instead (`source`, --from; a Slurm job's state_dir by default). verb: the
    kchain command the messages of a state folder name again (release pulls too); job: a queued run's (begin)."""
    folder = state_folder(job_file, job or load_job(job_file), source, want, verb)
    if folder is not None:
        return pull_folder(job_file, folder, want, out, force, given=source is not None, verb=verb)
    job, out, client, ref, version, work = begin(job_file, out, want.label(), force, client, echo, job)
    where = f"{ref} version {version}"
    try:
        said = chain_result(client, job)
        raw = work / "fetched"
        Fetch([STATE_MARKER]).run(client, ref, version, raw)
        marker = json.loads((raw / STATE_MARKER).read_text())
        if not marker.get("session") or marker.get("step") is None:
            raise KchainError(f"{job_file}: nothing to pull, {where} holds no checkpoint yet: "
                              + _unpublished(job_file, said))
        ended = _summary(client, ref, version, raw, marker)
        prefix = choose(job_file, want, marker, ended, where, said)
        Fetch([prefix + layout.MANIFEST]).run(client, ref, version, raw)
        listed = json.loads((raw / (prefix + layout.MANIFEST)).read_text()).get("files") or {}
        by_version = ended is not None and ended.status in ENDED  # the finishing session published this version
        exported = (marker.get("export") or {}) if want.which == "final" and by_version else {}
        Fetch([prefix + name for name in listed] + list(exported)).run(client, ref, version, raw)
        manifest = _verified(raw, prefix, where)
        about = About(job, want, f"{ref}/{version}", marker.get("step"),
                      said.ended or (ended.status if ended is not None else None))
        weights, note = _write_out(about, raw, prefix, manifest, work, out, force, exported,
                                   said.output if want.which == "final" and not by_version else None)
        fetched = sum(p.stat().st_size for p in raw.rglob("*") if p.is_file())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Pulled(out, where, weights, int(manifest["step"]), fetched, note,
                  manifest.get(BEST_KEY) if want.which == "best" else None)


@dataclass(frozen=True)
class About:
    """What metrics.json says of pulled weights beyond their checkpoint: which, where from, the chain's word."""

    job: Job
    want: Want
    state: str  # "owner/slug-state/N", or the state folder
    chain_step: int | None  # the newest step the state holds
    chain_status: str | None  # finished or stopped once the chain ended, else the newest session's end


def _verified(raw: Path, prefix: str, where: str,
              fix: str = "pull again (a download cut short), or pull another checkpoint") -> dict:
    """The checkpoint's manifest once every file it lists has its size and sha256; one line otherwise."""
    try:
        return verify(raw, prefix)
    except CheckpointInvalid as e:
        raise KchainError(f"{where}: {e}; {fix}") from None


def _write_out(about: About, raw: Path, prefix: str, manifest: dict, work: Path, out: Path, force: bool,
               exported: dict[str, str], output: str | None) -> tuple[dict[str, str], str | None]:
    """The plain folder from a verified checkpoint's files (in `raw`, each name `prefix`ed), written in the
    scratch folder `work` and renamed into `out`: its weights, attached files, run.export_dir's files (from
    the state, `exported`, or from the finishing session's output here) and metrics.json."""
    folder = work / "out"
    folder.mkdir()
    groups = write_attached(raw, prefix, manifest, folder)
    weights, note = write_weights(raw / (prefix + layout.STATE_FILE), manifest.get(MODULES_KEY), folder, groups)
    for flat, rel in exported.items():
        dest = folder / EXPORT_SUBDIR / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(raw / flat, dest)
    if output:
        _export_from_output(output, folder / EXPORT_SUBDIR)
    metrics = describe(about, manifest, raw / (prefix + layout.METRICS), weights)
    (folder / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    _mark(folder, about.state)
    _replace(folder, out, work, force)
    return weights, note


def state_folder(job_file: Path, job: Job, source: Path | None, want: Want, verb: str = "pull") -> Path | None:
    """The state folder a pull reads, or None for a Kaggle job's state dataset: `source` (--from) when given,
    else a Slurm job's state_dir/<name> (where its runs publish); a SkyPilot job's is in its bucket, which
    this laptop has no path to: one line saying how to bring it here."""
    if source is not None:
        return Path(source)
    if job.target == "slurm":
        return Path(job.slurm.sink(job.name))
    if job.target == "skypilot":
        bucket = job.skypilot.bucket
        assert bucket is not None  # load_job refused a SkyPilot job without one (target_problem)
        copy = {"s3": f"aws s3 sync s3://{bucket.name}/{job.name} {job.name}-state",
                "gcs": f"gcloud storage rsync -r gs://{bucket.name}/{job.name} {job.name}-state"}.get(bucket.store)
        how = f"`{copy}`" if copy else f"with the {bucket.store} store's own copy tool, into {job.name}-state"
        raise KchainError(f"{job_file}: a SkyPilot job's state is in its bucket ({bucket.store} bucket {bucket.name}, "
                          f"folder {job.name}/), which pull reads as a folder: copy it here {how}, or mount it, then "
                          f"`kchain {verb} {job_file} {want.flag()} --from {job.name}-state`")
    return None


def pull_folder(job_file: Path, folder: Path, want: Want, out: Path | None, force: bool,
                given: bool = True, verb: str = "pull") -> Pulled:
    """`pull` from a state folder (a target's state sink), read in place: its newest published copy says the
    result (outcome.of_state_folder); `given`: the folder came with --from (the commands it names repeat it);
    verb: the command that asked (pull, or release), named again where a copy of the folder is to be read."""
    job = load_job(job_file)
    out = _out_for(job, out, want.label(), force)
    again = f" --from {folder}" if given else ""
    newest, manifest = _newest_in(job_file, folder, want, again, f"{job.name}-state", verb)
    said = outcome.of_state_folder(manifest)
    ckpt = _chosen_in(job_file, folder, newest, want, said, again)
    manifest = _verified(ckpt, "", str(folder), "copy the folder again, or pull another checkpoint")
    work = _scratch_beside(out)
    try:
        about = About(job, want, str(folder), said.newest, said.ended)
        weights, note = _write_out(about, ckpt, "", manifest, work, out, force, {}, None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    read = sum(int(f["size"]) for f in manifest["files"].values())
    return Pulled(out, str(folder), weights, int(manifest["step"]), read, note,
                  manifest.get(BEST_KEY) if want.which == "best" else None)


def _newest_in(job_file: Path, folder: Path, want: Want, again: str, copy: str, verb: str) -> tuple[Path, dict]:
    """The state folder's newest published copy (the one its `latest` pointer names) and its manifest; `copy`:
    the folder a copy of it here is named in the command said when there is none."""
    pointer = read_pointer(folder) if folder.is_dir() else None
    if pointer is None:
        what = "holds no published checkpoint" if folder.is_dir() else "does not exist"
        raise KchainError(f"{job_file}: nothing to pull, {folder} {what} (no run of the job published state there "
                          f"yet, or not on this machine): `kchain status {job_file}` says where the run is; pull "
                          f"where the folder is (the cluster's shared file system), or copy it here as {copy} (scp -r, "
                          f"rsync) and `kchain {verb} {job_file} {want.flag()} --from {copy}`")
    ckpt = folder / str(pointer.get("checkpoint"))
    try:
        return ckpt, read_manifest(ckpt)
    except CheckpointInvalid as e:
        raise KchainError(f"{job_file}: {folder}'s newest published checkpoint (step {pointer['step']}) is not whole "
                          f"here: {e}; copy the folder again, or pull an older step (`kchain pull {job_file} --step "
                          f"N{again}`)") from None


def _chosen_in(job_file: Path, folder: Path, newest: Path, want: Want, said: outcome.Result, again: str) -> Path:
    """The copy in the state folder the wish names: the newest once the run finished (--final), the kept best
    the newest records (--best), or step N's while the folder keeps it (--step); one line when it cannot."""
    holds = f"{folder} holds step {said.newest} (the newest published" + \
        (f", of {said.total})" if said.total else ")")
    if want.which == "final":
        if not said.final:
            why = "the run goes on" if said.total else "its manifest names no total (an older kchain's run)"
            raise KchainError(f"{job_file}: nothing finished yet: {holds}; {why}: `kchain status {job_file}` asks its "
                              f"engine, or `kchain pull {job_file} --step {said.newest}{again}` pulls those weights")
        return newest
    if want.which == "best":
        if not said.best:
            raise KchainError(f"{job_file}: train.keep_best: {holds} and no best checkpoint (keep_best is off, or its "
                              "metric was never logged at a checkpoint step): log it with run.log at the steps you "
                              f"checkpoint, or `kchain pull {job_file} --step {said.newest}{again}`")
        return folder / layout.checkpoint_name(int(said.best["step"]))
    assert want.step is not None
    named = folder / layout.checkpoint_name(want.step)
    if not (named / layout.MANIFEST).is_file():
        raise KchainError(f"{job_file}: step {want.step} is not in the state folder: {holds}; older checkpoints were "
                          "pruned (train.keep)")
    return named


def chain_result(client: KaggleClient, job: Job) -> outcome.Result:
    """What the chain's records say of its result (rebuilt from Kaggle when this laptop has none); an empty
    Result when Kaggle gives no answer about them: the state version's own summary decides then."""
    try:
        return outcome.of_chain(refresh(client, Ledger(state_dir(job.path)), job.name))
    except KchainError:
        return outcome.Result()


def _unpublished(job_file: Path, said: outcome.Result) -> str:
    """Why a state version holds nothing yet, and the command that helps."""
    if said.newest is not None and not said.published:
        return f"step {said.newest} is only in a session's output; `kchain continue {job_file}` publishes it"
    return f"the chain's first session has not published; `kchain status {job_file}` says where it is"


def _export_from_output(output: str, dest: Path) -> None:
    """run.export_dir's files from the finishing session's output on this laptop, for a chain whose last
    session trained nothing past the state it resumed (so the newest version is an earlier session's)."""
    src = Path(output) / layout.KCHAIN_DIR / layout.EXPORT_DIR
    for root, dirs, files in os.walk(src):  # links are never followed, nor copied
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
        for name in files:
            path = Path(root) / name
            if path.is_symlink() or not path.is_file():
                continue
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def pull_logs(job_file: Path, out: Path | None = None, force: bool = False, echo: Echo = print,
              client: KaggleClient | None = None) -> list[str]:
    """`kchain pull --logs`: the chain's one TensorBoard run (run.tensorboard_dir, carried in the newest
    checkpoint of the newest state version) laid out in `out`, verified, whatever sessions were killed or
    deleted: `tensorboard --logdir out` shows the whole chain as one run."""
    job, out, client, ref, version, work = begin(job_file, out, "logs", force, client, echo)
    try:
        raw = work / "fetched"
        Fetch([layout.MANIFEST]).run(client, ref, version, raw)
        manifest = json.loads((raw / layout.MANIFEST).read_text())
        names = (manifest.get(ATTACHED_KEY) or {}).get(eventfiles.GROUP) or {}
        if not names:
            raise KchainError(f"{job_file}: {ref} version {version} holds no TensorBoard log: write one with "
                              "run.summary_writer() (or under run.tensorboard_dir, or train.trackers: {tensorboard: true})")
        Fetch(list(names)).run(client, ref, version, raw)
        try:
            for flat in names:
                check_sha256(raw / flat, manifest["files"][flat])
        except (CheckpointInvalid, KeyError) as e:
            raise KchainError(f"{ref} version {version}: {e}; pull again (a download cut short)") from None
        eventfiles.state_dir(raw, work / "out")
        fetched = sum((raw / flat).stat().st_size for flat in names)
        _mark(work / "out", f"{ref}/{version}")
        _replace(work / "out", out, work, force)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [f"pulled the TensorBoard log of step {manifest.get('step')} from {ref} version {version} "
            f"({gb(fetched)}, {len(names)} file{'s' if len(names) != 1 else ''}): tensorboard --logdir {out}"]


def pull_for(job_file: Path, want: Want, out: Path | None, force: bool, echo: Echo,
             source: Path | None = None, job: Job | None = None) -> list[str]:
    """`kchain pull`'s lines: what was fetched, where it went, and any note (job: a queued run's)."""
    client = KaggleClient(progress=True)  # a checkpoint can be gigabytes: kchain says how far the download is
    return pull(job_file, want, out, force, echo, client, source, job=job).lines()


def _summary(client: KaggleClient, ref: str, version: int, raw: Path, marker: dict) -> summary.Summary | None:
    """The summary of the session that published the version (an old version may have none)."""
    try:
        Fetch([layout.SUMMARY]).run(client, ref, version, raw)
    except KchainError:
        return None
    return summary.read(raw / layout.SUMMARY)


def choose(job_file: Path, want: Want, marker: dict, ended: summary.Summary | None, where: str,
           said: outcome.Result | None = None) -> str:
    """The name prefix of the wanted checkpoint's files in the version ('' the newest, 'best.' the kept
    best); a wish the version cannot meet is one line saying what it holds. --final: the chain has ended (its
    records say so, `said`, or the version's own summary) and the version holds the step it ended at."""
    said = said or outcome.Result()
    newest, best = int(marker["step"]), marker.get("best")
    holds = f"{where} holds step {newest} (the newest)" + \
            (f" and step {best['step']} (the best {best['metric']})" if best and best["step"] != newest else "")
    if want.which == "best":
        if not best:
            raise KchainError(f"{job_file}: train.keep_best: {holds} and no best checkpoint (keep_best is off, or "
                              "its metric was never logged at a checkpoint step): log it with run.log at the "
                              f"steps you checkpoint, or `kchain pull {job_file} --step {newest}` pulls the newest")
        return str(best.get("prefix", ""))
    if want.which == "final":
        status = ended.status if ended is not None else None
        if said.ended is None and status not in ENDED:
            raise KchainError(f"{job_file}: nothing finished yet: {holds}, from a session that ended "
                              f"{status or 'without a summary'}; `kchain continue {job_file}` finishes the chain, "
                              f"or `kchain pull {job_file} --step {newest}` pulls those weights")
        if said.ended is not None and said.step is not None and newest != said.step:
            raise KchainError(f"{job_file}: the chain has ended ({said.ended} at step {said.step}), but {holds}: its "
                              f"final state is in no state version yet; `kchain continue {job_file}` publishes it, "
                              f"then `kchain pull {job_file} --final`")
        return ""
    if want.step == newest:
        return ""
    if best and want.step == best["step"]:
        return str(best.get("prefix", ""))
    raise KchainError(f"{job_file}: step {want.step} is not in the state: {holds}; older checkpoints were pruned "
                      "(train.keep)")


def _replace(folder: Path, out: Path, work: Path, force: bool) -> None:
    """The finished folder renamed into place: an existing one (an empty folder, or an earlier pull's with
    --force, checked again now: the download took a while) set aside first, then removed."""
    _check_out(out, force)
    aside = None
    if out.exists():
        aside = work / "replaced"
        os.replace(out, aside)
    os.replace(folder, out)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _rows_at(metrics: Path, step: int) -> dict[str, Any]:
    """The values logged at `step` in a checkpoint's copy of the trace."""
    values: dict[str, Any] = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("step") == step:
                values.update({k: v for k, v in row.items() if k not in ("step", "time")})
    return values


def gpu_hours(job: Job, sessions: int) -> float | None:
    """The GPU-hours of the chain's first `sessions` sessions, from this laptop's records (None without)."""
    from kchain.store.ledger import Ledger, session_hours, state_dir

    chain = [s for s in Ledger(state_dir(job.path)).sessions(job.name) if s.get("session", 0) <= sessions]
    if not chain or not all(s.get("started") and s.get("ended") for s in chain):
        return None
    return round(sum(session_hours(s) for s in chain if s.get("gpu")), 3)


def describe(about: About, manifest: dict, metrics: Path, weights: dict[str, str]) -> dict[str, Any]:
    """metrics.json: what the weights are, where they came from, and what the chain spent on them."""
    step, sessions = int(manifest["step"]), int(manifest.get("session") or 0)
    return {
        "job": about.job.name,
        "which": about.want.label(),
        "step": step,
        "metrics": _rows_at(metrics, step),
        "keep_best": manifest.get(BEST_KEY),
        "sessions": sessions,
        "gpu_hours": gpu_hours(about.job, sessions),
        "fingerprint": manifest.get("fingerprint"),
        "kchain_version": manifest.get("kchain_version"),
        "params": manifest.get("params"),
        "state": about.state,
        "chain_status": about.chain_status,
        "chain_step": about.chain_step,
        "weights": weights,
        "left_out": sorted(manifest.get(FROZEN_KEY) or {}),  # modules whose frozen base is not in the weights
    }


def write_attached(raw: Path, prefix: str, manifest: dict, folder: Path) -> list[str]:
    """A framework's own checkpoint files the checkpoint holds (the HF Trainer's checkpoint-N: its
    model.safetensors or adapter, config), as that framework wrote them, under folder/<group>/."""
    groups = sorted(manifest.get(ATTACHED_KEY) or {})
    for group in groups:
        for flat, rel in (manifest[ATTACHED_KEY][group] or {}).items():
            dest = folder / group / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(raw / (prefix + flat), dest)
    return groups


def _module_state(value: Any) -> dict | None:
    """The weights a tracked state holds: a module's state dict, or Lightning's (the bridge tracks the
    Trainer's checkpoint, whose `state_dict` is the LightningModule's)."""
    import torch

    def weights(d: Any) -> bool:
        return isinstance(d, dict) and bool(d) and all(isinstance(v, torch.Tensor) for v in d.values())

    if weights(value):
        return value
    inner = (value.get("trainer") or {}).get("state_dict") if isinstance(value, dict) else None
    return inner if weights(inner) else None


def write_weights(state_file: Path, modules: list[str] | None, folder: Path,
                  attached: Sequence[str] = ()) -> tuple[dict[str, str], str | None]:
    """Each tracked module's weights from state.pt as safetensors (torch imported here only).

    One module: model.safetensors; several: <tracked name>.safetensors each. A tensor sharing storage
    with another (tied weights) is written as its own copy (safetensors refuses shared storage); a
    module with a dtype safetensors cannot hold is written as a torch state dict instead, and the note
    says why. A fine-tune's frozen base is not in the checkpoint, so it is not in these files either.
    """
    import torch
    from safetensors.torch import save_file

    # weights_only=False: the chain's own state.pt, its sha256 checked against the manifest just now
    # (its RNG states hold numpy arrays and tuples, which the weights-only unpickler refuses).
    state = torch.load(state_file, map_location="cpu", weights_only=False, mmap=True)
    tracked = state.get("tracked") or {}
    names = [n for n in (modules or []) if n in tracked and _module_state(tracked[n]) is not None] \
        or [n for n, v in tracked.items() if _module_state(v) is not None]
    if not names and attached:  # the HF Trainer's: its own files are the model
        return {}, f"the model is the framework's own files, under {', '.join(g + '/' for g in attached)}"
    if not names:
        raise KchainError(f"{state_file.name}: the checkpoint tracks no model (run.track(model=...)): nothing to pull")
    written: dict[str, str] = {}
    notes: list[str] = []
    for name in names:
        tensors = {k: v for k, v in (_module_state(tracked[name]) or {}).items() if isinstance(v, torch.Tensor)}
        stem = "model" if len(names) == 1 else name
        seen: set[int] = set()
        plain = {}
        for key, tensor in tensors.items():
            ptr = tensor.untyped_storage().data_ptr()
            plain[key] = tensor.detach().clone() if ptr in seen or not tensor.is_contiguous() else tensor.detach()
            seen.add(ptr)
        try:
            save_file(plain, str(folder / f"{stem}.safetensors"), metadata={"format": "pt"})
            atomic.give_usual_mode(folder / f"{stem}.safetensors")  # safetensors writes a 0600 temporary file
            written[name] = f"{stem}.safetensors"
        except (ValueError, TypeError, RuntimeError, KeyError) as e:  # KeyError: a dtype it has no name for
            (folder / f"{stem}.safetensors").unlink(missing_ok=True)
            file = TORCH_FILE if len(names) == 1 else f"{name}.{TORCH_FILE}"
            torch.save(tensors, folder / file)
            written[name] = file
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            notes.append(f"{name}: written as {file} (torch.load), not safetensors, which cannot hold it: {why}")
    return written, "; ".join(notes) or None
