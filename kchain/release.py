"""`kchain release`: the pulled folder published as a Kaggle Model variation's new version (or a dataset's).

Laptop side, through the official client only: `model_create_new` (model-metadata.json) when the model
does not exist, `model_instance_create` (model-instance-metadata.json, the files as version 1) when the
variation does not exist, else `model_instance_version_create`. Each creating call is sent once
(common/sendonce.py, kaggle_api's OutcomeUnknown); a lost answer is settled by reading Kaggle
(`sendonce.send_and_settle`: the model, the variation, or a new version number appears), and only a call that
did not land is sent again. The description holds a card: the metric and step, sessions, GPU-hours,
the code's fingerprint, kchain's version.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import kchain
from kchain.common import layout
from kchain.common.sendonce import NotLanded, send_and_settle, settle
from kchain.common.statefolder import write_dataset_metadata
from kchain.datasets import ensure_dataset, new_version
from kchain.errors import KaggleError, KchainError
from kchain.kaggle_api import KaggleClient, lost_answer, missing
from kchain.pull import METRICS_FILE, PULL_MARK, Want, pull
from kchain.spec import MODEL_SLUG_RE, OWNER_RE, SLUG_RE

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
        raise KchainError(f"--model {text!r}: write OWNER/MODEL/FRAMEWORK/VARIATION, {example}")
    owner, model, framework, variation = parts
    if not OWNER_RE.fullmatch(owner):
        raise KchainError(f"--model {text!r}: {owner!r} is not a Kaggle username, {example}")
    if not SLUG_RE.fullmatch(model) or not MODEL_SLUG_LEN[0] <= len(model) <= MODEL_SLUG_LEN[1]:
        raise KchainError(f"--model {text!r}: Kaggle refuses the model slug {model!r}; use {MODEL_SLUG_LEN[0]}-"
                          f"{MODEL_SLUG_LEN[1]} lowercase letters, digits and single dashes inside, {example}")
    if layout.model_framework_key(framework) not in layout.MODEL_FRAMEWORKS:
        raise KchainError(f"--model {text!r}: {framework!r} is not a Kaggle model framework; use one of "
                          f"{', '.join(layout.MODEL_FRAMEWORKS)}")
    if not MODEL_SLUG_RE.fullmatch(variation) or len(variation) > MODEL_SLUG_LEN[1]:
        raise KchainError(f"--model {text!r}: {variation!r} is not a variation slug; use lowercase letters, "
                          f"digits and single . _ - inside, {example}")
    return Target(owner, model, framework, variation)


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
            echo: Echo, client: KaggleClient | None = None) -> list[str]:
    """Pull, then publish as a model version (or a dataset version); the lines to print."""
    if (model is None) == (dataset is None):
        raise KchainError("kchain release: give one of --model OWNER/MODEL/FRAMEWORK/VARIATION or --dataset OWNER/SLUG")
    target = _parse_target(model) if model is not None else None
    client = client or KaggleClient(progress=True)
    work = Path(tempfile.mkdtemp(prefix="kchain-release-"))
    try:
        folder = work / "release"
        pulled = pull(job_file, want, folder, echo=echo, client=client)
        (folder / PULL_MARK).unlink()  # the laptop's note of what a pull wrote, not part of the release
        metrics = json.loads((folder / METRICS_FILE).read_text())
        if target is not None:
            number = _publish_model(client, target, folder, card(metrics, target.model), public, license_name, echo)
            ref = f"{target.instance}/{number}"
            return [f"released step {pulled.step} as {ref} ({'public' if public else 'private'})",
                    f"attach it: kaggle.models: [{ref}]   (kernel-metadata.json: \"model_sources\": [\"{ref}\"])"]
        assert dataset is not None
        number = _publish_dataset(client, dataset, folder, card(metrics, dataset), echo)
        return [f"released step {pulled.step} as dataset {dataset} version {number}",
                f"attach it: kaggle.datasets: [{dataset}/{number}]   (kernel-metadata.json: \"dataset_sources\": "
                f"[\"{dataset}\"])"]
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
                  license_name: str, echo: Echo) -> int:
    """The folder as the variation's next version (the model and the variation made first when missing)."""
    model_ref = f"{target.owner}/{target.model}"
    if not client.model_exists(model_ref):
        meta = _work_meta(folder.parent / "model", "model-metadata.json", {
            "ownerSlug": target.owner, "slug": target.model, "title": target.model.replace("-", " ").title(),
            "subtitle": "", "isPrivate": not public, "description": description, "publishTime": "",
            "provenanceSources": ""})
        _send_once(lambda: client.create_model(meta), lambda: client.model_exists(model_ref),
                   f"creating model {model_ref}", echo)
        echo(f"  created model {model_ref} ({'public' if public else 'private'})")
    before = _versions(client, target.instance)
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
    return number


def _work_meta(folder: Path, name: str, meta: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def usage(target: Target) -> str:
    mount = f"/kaggle/input/{layout.model_mount(target.instance + '/1').parent.as_posix()}/<version>"
    return ("```python\nfrom safetensors.torch import load_file\n"
            f"model.load_state_dict(load_file('{mount}/model.safetensors'))\n```\n")


def _publish_dataset(client: KaggleClient, ref: str, folder: Path, description: str, echo: Echo) -> int:
    """The folder as a new version of the dataset `ref` (made first, private, when missing)."""
    parts = ref.split("/")
    if len(parts) != 2 or not OWNER_RE.fullmatch(parts[0]) or not SLUG_RE.fullmatch(parts[1]) \
            or not 6 <= len(parts[1]) <= 50:
        raise KchainError(f"--dataset {ref!r}: write OWNER/SLUG, the slug 6-50 lowercase letters, digits and dashes")
    ensure_dataset(client, ref, parts[1], echo)
    write_dataset_metadata(folder, ref, parts[1])
    (folder / "README.md").write_text(description)
    return new_version(client, folder, ref, "kchain release", "zip", echo)
