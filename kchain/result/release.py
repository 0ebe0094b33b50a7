"""`kchain release`: the pulled folder published as a Kaggle Model variation's new version (or a dataset's).

Laptop side, through the official client only: `model_create_new` (model-metadata.json) when the model
does not exist, `model_instance_create` (model-instance-metadata.json, the files as version 1) when the
variation does not exist, else `model_instance_version_create`. Each creating call is sent once
(common/sendonce.py, kaggle_api's OutcomeUnknown); a lost answer is settled by reading Kaggle
(`sendonce.send_and_settle`: the model, the variation, or a new version number appears), and only a call that
did not land is sent again. The description holds a card: the metric and step, sessions, GPU-hours,
the code's fingerprint, kchain's version.

A release is sent once, across runs too: what it sends (the weights' digest, `weights_digest`) and the
target's version before the send are recorded in the ledger (`releases.json`) before the creating call. A
run again after a kill settles an unsettled record by reading the target's versions (a version past the
one recorded is that send's) and sends only when none appeared; after a clean finish the version that
holds these weights is named, and nothing sent. `--new` publishes the same weights again on purpose.
The chain's own datasets (its state, cache and pip datasets) are never a target.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kchain
from kchain.common import layout
from kchain.common.checkpoint_files import sha256_of
from kchain.common.sendonce import NotLanded, send_and_settle, settle
from kchain.common.statefolder import write_dataset_metadata
from kchain.errors import KaggleError, UsageError
from kchain.job.spec import MODEL_SLUG_RE, OWNER_RE, SLUG_RE, load_job
from kchain.kaggle.client import KaggleClient, lost_answer, missing
from kchain.kaggle.datasets import current_version, ensure_dataset, new_version
from kchain.result.pull import METRICS_FILE, PULL_MARK, Want, pull
from kchain.store.ledger import Ledger, iso, now_utc, state_dir
from kchain.store.names import cache_dataset, pip_dataset, state_dataset

Echo = Callable[[str], None]
ATTEMPTS = 4  # sends of one creating call whose answers were lost, before giving up
SETTLE_S = 120.0  # how long a lost answer's outcome is looked for (a new version is hidden while processed)
READY_S = 1800.0  # how long a new version may take to be listed (processed) before the command gives up
MODEL_SLUG_LEN = (3, 50)  # assumption (docs/emulator.md): the client checks the syntax, not the length


@dataclass(frozen=True)
class Target:
    """Where a release goes: `owner/model/framework/variation`."""

    owner: str
    model: str
    framework: str
    variation: str

    @property
    def instance(self) -> str:
        return f"{self.owner}/{self.model}/{self.framework}/{self.variation}"


def _parse_target(text: str) -> Target:
    """--model OWNER/MODEL/FRAMEWORK/VARIATION, checked as the client and Kaggle would, in one line."""
    parts = text.split("/")
    example = "e.g. --model alice/tiny-gpt/pytorch/default"
    if len(parts) != 4 or not all(parts):
        raise UsageError(f"--model {text!r}: write OWNER/MODEL/FRAMEWORK/VARIATION, {example}")
    owner, model, framework, variation = parts
    if not OWNER_RE.fullmatch(owner):
        raise UsageError(f"--model {text!r}: {owner!r} is not a Kaggle username, {example}")
    if not SLUG_RE.fullmatch(model) or not MODEL_SLUG_LEN[0] <= len(model) <= MODEL_SLUG_LEN[1]:
        raise UsageError(f"--model {text!r}: Kaggle refuses the model slug {model!r}; use {MODEL_SLUG_LEN[0]}-"
                          f"{MODEL_SLUG_LEN[1]} lowercase letters, digits and single dashes inside, {example}")
    if layout.model_framework_key(framework) not in layout.MODEL_FRAMEWORKS:
        raise UsageError(f"--model {text!r}: {framework!r} is not a Kaggle model framework; use one of "
                          f"{', '.join(layout.MODEL_FRAMEWORKS)}")
    if not MODEL_SLUG_RE.fullmatch(variation) or len(variation) > MODEL_SLUG_LEN[1]:
        raise UsageError(f"--model {text!r}: {variation!r} is not a variation slug; use lowercase letters, "
                          f"digits and single . _ - inside, {example}")
    return Target(owner, model, framework, variation)


def _parse_dataset(ref: str, job: str) -> str:
    """--dataset OWNER/SLUG, checked as Kaggle would, and never one of the chain's own datasets."""
    parts = ref.split("/")
    if len(parts) != 2 or not OWNER_RE.fullmatch(parts[0]) or not SLUG_RE.fullmatch(parts[1]) \
            or not 6 <= len(parts[1]) <= 50:
        raise UsageError(f"--dataset {ref!r}: write OWNER/SLUG, the slug 6-50 lowercase letters, digits and dashes")
    owner = parts[0]
    for what, of in (("state", state_dataset), ("cache", cache_dataset), ("pip", pip_dataset)):
        if ref == of(owner, job):
            raise UsageError(f"--dataset {ref}: that is the chain's own {what} dataset, which pull and continue "
                              f"read; release to another, e.g. --dataset {owner}/{job}-model")
    return ref


def weights_digest(folder: Path) -> str:
    """What a release sends, as one sha256 over each file's path and sha256 (metrics.json left out: its
    GPU-hours and the chain's status change while the weights do not)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != METRICS_FILE:
            digest.update(f"{rel}\0{sha256_of(path)}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Record:
    """This laptop's record of sending these weights to one target (the ledger's releases.json): written
    before the creating call, so a later run settles it by reading the target's versions, never sends twice."""

    ledger: Ledger
    target: str  # owner/model/framework/variation, or owner/slug
    digest: str  # weights_digest
    step: int
    which: str  # best, final, step-N

    def prior(self) -> dict[str, Any] | None:
        return self.ledger.release_record(self.target, self.digest)

    def sending(self, before: int) -> None:
        """Before the send: the target's newest version then (0: none), so a version past it is this one's."""
        self._save({"before": before, "number": None})

    def landed(self, number: int) -> None:
        self._save({**(self.prior() or {}), "number": number})

    def _save(self, fields: dict[str, Any]) -> None:
        self.ledger.save_release(self.target, self.digest, {
            "step": self.step, "which": self.which, "sent": iso(now_utc()), **fields})


def _earlier(record: Record, new: bool, newest: Callable[[], int], echo: Echo) -> int | None:
    """The version an earlier run of this release made, if any (None: send): one that settled and is still
    there, or one sent before a kill, found past the version recorded before it was sent."""
    prior = None if new else record.prior()
    if prior is None:
        return None
    if prior.get("number") is not None:
        return int(prior["number"]) if int(prior["number"]) <= newest() else None  # gone: sent again
    before = int(prior.get("before") or 0)
    echo(f"  an earlier release of these weights to {record.target} was sent and never settled (the command "
         "ended): reading its versions")
    if not settle(lambda: newest() > before, SETTLE_S, poll_s=2.0):
        echo("  it did not land: sending it")
        return None
    number = newest()
    record.landed(number)
    return number


# Kaggle's licence names are short (Apache 2.0, CC-BY-SA-4.0; docs/datasets_metadata.md lists them) and it
# documents no bound; 100 is kchain's conservative one, so a pasted file never becomes a model's licence.
MAX_LICENSE_CHARS = 100


def card(metrics: dict, title: str) -> str:
    """The description: what the weights are and what made them."""
    best = metrics.get("keep_best") or {}
    values = ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics["metrics"].items())
    hours = metrics.get("gpu_hours")
    lines = [f"# {title}", "",
             f"Weights of step {metrics['step']} ({metrics['which']})" + (f": {values}" if values else "") + ".",
             *([f"The best {best['metric']} ({best['mode']}) of the chain: {best['value']} at step {best['step']}."]
               if best and metrics["which"] == "best" else []),
             f"- sessions: {metrics['sessions']}",
             f"- GPU-hours: {hours if hours is not None else 'unknown (no session records where it was released)'}",
             f"- code fingerprint: {metrics.get('fingerprint')}",
             f"- trained with kchain {metrics.get('kchain_version')}, released with kchain {kchain.__version__}",
             f"- state: {metrics['state']}", "",
             "Files: " + ", ".join(metrics["weights"].values()) + f", {METRICS_FILE}"]
    return "\n".join(lines) + "\n"


def release(job_file: Path, want: Want, model: str | None, dataset: str | None, public: bool, license_name: str,
            echo: Echo, client: KaggleClient | None = None, new: bool = False, source: Path | None = None) -> list[str]:
    """Pull (a target's from its state folder: `source`, --from, as pull's), then publish as a model version (or
    a dataset version) unless a version holds these weights already (`new`: publish them again); the lines to
    print."""
    if (model is None) == (dataset is None):
        raise UsageError("kchain release: give one of --model OWNER/MODEL/FRAMEWORK/VARIATION or --dataset OWNER/SLUG")
    _check_license(license_name)
    target = _parse_target(model) if model is not None else None
    job = load_job(job_file)
    if dataset is not None:
        _parse_dataset(dataset, job.name)
    client = client or KaggleClient(progress=True)
    work = Path(tempfile.mkdtemp(prefix="kchain-release-"))
    try:
        folder = work / "release"
        pulled = pull(job_file, want, folder, echo=echo, client=client, source=source, verb="release")
        (folder / PULL_MARK).unlink()  # the laptop's note of what a pull wrote, not part of the release
        metrics = json.loads((folder / METRICS_FILE).read_text())
        record = Record(Ledger(state_dir(job.path)), target.instance if target is not None else str(dataset),
                        weights_digest(folder), pulled.step, want.label())
        if target is not None:
            number, already = _publish_model(client, target, folder, card(metrics, target.model), public,
                                             license_name, echo, record, new)
            ref = f"{target.instance}/{number}"
            attach = f"attach it: kaggle.models: [{ref}]   (kernel-metadata.json: \"model_sources\": [\"{ref}\"])"
            done = f"{ref} ({'public' if public else 'private'})"
        else:
            assert dataset is not None
            number, already = _publish_dataset(client, dataset, folder, card(metrics, dataset), echo, record, new)
            ref = f"{dataset}/{number}"
            attach = (f"attach it: kaggle.datasets: [{ref}]   (kernel-metadata.json: \"dataset_sources\": "
                      f"[\"{dataset}\"])")
            done = f"dataset {dataset} version {number}"
        if already:
            where = f"--model {target.instance}" if target is not None else f"--dataset {dataset}"
            where += f" --from {source}" if source is not None else ""
            return [f"step {pulled.step} is released already as {done}, these same weights: nothing sent "
                    f"(`kchain release {job_file} {want.flag()} {where} --new` publishes them again)", attach]
        return [f"released step {pulled.step} as {done}", attach]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_license(name: str) -> None:
    """A licence name is a short name from Kaggle's list: refused before anything is pulled or sent."""
    if not name.strip() or len(name) > MAX_LICENSE_CHARS or not name.isprintable():
        what = f"is {len(name)} characters" if len(name) > MAX_LICENSE_CHARS else "is not a licence name"
        raise UsageError(f"--license {name[:40]!r}{'...' if len(name) > 40 else ''}: {what}; a licence name is at "
                          f"most {MAX_LICENSE_CHARS} characters on one line (kchain's bound: Kaggle publishes none, and "
                          "its names are short), e.g. --license 'Apache 2.0'")


def _send_once(send: Callable[[], None], landed: Callable[[], bool], what: str, echo: Echo) -> None:
    """A creating call sent once (sendonce.send_and_settle): a lost answer settled by reading (`landed`)."""
    try:
        _, seen = send_and_settle(send, landed, lost=lost_answer, attempts=ATTEMPTS, settle_s=SETTLE_S)
    except NotLanded as exc:
        raise KaggleError(f"{what}: {exc}; run the command again later") from exc
    except KaggleError as exc:
        if "already" in str(exc) and landed():
            return  # an earlier send whose answer was lost made it
        raise
    if seen:
        echo(f"  the answer to {what} was lost, but it landed")


def _versions(client: KaggleClient, instance: str) -> list[int] | None:
    """The variation's listed versions, or None when it does not exist (yet) for this account."""
    try:
        return client.model_versions(instance)
    except KaggleError as exc:
        if missing(exc):
            return None
        raise


def _publish_model(client: KaggleClient, target: Target, folder: Path, description: str, public: bool,
                  license_name: str, echo: Echo, record: Record, new: bool) -> tuple[int, bool]:
    """The folder as the variation's next version (the model and the variation made first when missing), or
    the version an earlier run made of these weights; (its number, whether an earlier run made it)."""
    model_ref = f"{target.owner}/{target.model}"
    if not client.model_exists(model_ref):
        meta = _work_meta(folder.parent / "model", "model-metadata.json", {
            "ownerSlug": target.owner, "slug": target.model, "title": target.model.replace("-", " ").title(),
            "subtitle": "", "isPrivate": not public, "description": description, "publishTime": "",
            "provenanceSources": ""})
        _send_once(lambda: client.create_model(meta), lambda: client.model_exists(model_ref),
                   f"creating model {model_ref}", echo)
        echo(f"  created model {model_ref} ({'public' if public else 'private'})")
    earlier = _earlier(record, new, lambda: max(_versions(client, target.instance) or [0]), echo)
    if earlier is not None:
        return earlier, True
    before = _versions(client, target.instance)
    record.sending(max(before or [0]))
    if before is None:
        (folder / "model-instance-metadata.json").write_text(json.dumps({
            "ownerSlug": target.owner, "modelSlug": target.model, "instanceSlug": target.variation,
            "framework": target.framework, "overview": description, "usage": usage(target),
            "licenseName": license_name, "fineTunable": False, "trainingData": [],
            "modelInstanceType": "Unspecified", "baseModelInstance": "", "externalBaseModelUrl": ""}, indent=1))
        _send_once(lambda: client.create_model_instance(folder),
                   lambda: _versions(client, target.instance) is not None,
                   f"creating variation {target.instance}", echo)
        number = 1
    else:
        _send_once(lambda: client.create_model_instance_version(target.instance, folder, description),
                   lambda: max(_versions(client, target.instance) or [0]) > max(before, default=0),
                   f"versioning {target.instance}", echo)
        number = max(before, default=0) + 1
    echo(f"  waiting for {target.instance}/{number} to be processed")
    if not settle(lambda: number in (_versions(client, target.instance) or []), READY_S, poll_s=2.0):
        raise KaggleError(f"{target.instance}/{number} was sent but is not listed after {READY_S:.0f}s; look at it "
                          "on Kaggle before releasing again")
    record.landed(number)
    return number, False


def _work_meta(folder: Path, name: str, meta: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def usage(target: Target) -> str:
    mount = f"/kaggle/input/{layout.model_mount(target.instance + '/1').parent.as_posix()}/<version>"
    return ("```python\nfrom safetensors.torch import load_file\n"
            f"model.load_state_dict(load_file('{mount}/model.safetensors'))\n```\n")


def _publish_dataset(client: KaggleClient, ref: str, folder: Path, description: str, echo: Echo, record: Record,
                     new: bool) -> tuple[int, bool]:
    """The folder as a new version of the dataset `ref` (made first, private, when missing), or the version
    an earlier run made of these weights; (its number, whether an earlier run made it)."""
    slug = ref.split("/")[1]
    ensure_dataset(client, ref, slug, echo)
    earlier = _earlier(record, new, lambda: current_version(client, ref, echo), echo)
    if earlier is not None:
        return earlier, True
    write_dataset_metadata(folder, ref, slug)
    (folder / "README.md").write_text(description)
    before = current_version(client, ref, echo)
    record.sending(before)
    number = new_version(client, folder, ref, "kchain release", "zip", echo, before=before)
    record.landed(number)
    return number, False
