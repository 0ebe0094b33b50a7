"""`kchain doctor`: prove the account and the kernel image before the first GPU-hour, for free.

Stages, each a list of checklist lines (`ok` / `warn` / `FAIL`, the fix in the text):

1. laptop: the job loads and renders, smoke status, local python/torch/numpy, which credential
   source the official client will use (`--offline` stops here);
2. account: the user, the GPU quota left, and how Kaggle answers a lookup of something missing
   (403 or 404, recorded);
3. sources: every attached dataset and model version looked up by name before anything is
   saved, then the job's notebook and metadata saved without running (the client's quick save,
   `no_run`) as the separate kernel `<name>-doctor`, and every source Kaggle calls invalid named;
4. image (`--no-probe` skips it): the probe notebook as the next version of `<name>-doctor` on a
   free CPU session (accelerator none, the job's internet setting and inputs, the state dataset),
   its output parsed strictly (`kchain-probe/1`) and compared with this laptop; with internet and the
   Secrets, the probe pushes the next version of its kernel from inside itself (a CPU session), and the
   doctor reads whether that kernel-pushed version still saw the Secrets (`hop` in doctor.json);
5. publishing: in-kernel publish or the laptop relay, said plainly.

Everything learned goes to `doctor.json` next to the run log, atomically; no credential ever goes
there (the key is never read here: the client reads it). `kchain push` reads the file back and
suggests `kchain doctor` when it is missing or stale (`_push_hint`).
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import kchain
from kchain.common import atomic, kernelauth
from kchain.common.sendonce import NotLanded, send_and_settle
from kchain.common.sessionstate import TERMINAL, SessionState
from kchain.errors import (
    ChainStop,
    CredentialsError,
    DoctorFailed,
    KaggleError,
    KchainError,
    ProbeFormatError,
    SpecError,
)
from kchain.job import extras, kagglepip
from kchain.job.render import METADATA_FILE, Rendered, code_files, render_job, render_probe
from kchain.job.spec import Job, load_job
from kchain.kaggle import credentials
from kchain.kaggle.client import MISSING_CREDENTIALS, KaggleClient, lost_answer, new_kernel_version
from kchain.kaggle.models import model_problem
from kchain.store.ledger import DOCTOR_FILE, Ledger, iso, now_utc, state_dir
from kchain.store.names import doctor_kernel, state_dataset

Echo = Callable[[str], None]

FORMAT = 1
PROBE_FORMAT = "kchain-probe/1"
PROBE_OUTPUT = "kchain-probe.json"
HOP_OUTPUT, HOP_FORMAT = "kchain-hop.json", "kchain-hop/1"  # the probe's kernel-pushed version (kchain_probe.py)
SECRET_LABELS = kernelauth.LABELS  # the Secrets the kernel reads (common/kernelauth.py)
# What the probe must report, with the type each key holds (the format is parsed strictly).
PROBE_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": str, "job": str, "python": str, "torch": dict, "numpy": dict, "kaggle_client": (str, type(None)),
    "mounts": dict, "state_dataset": (str, type(None)), "runtime": dict, "disk_free_working": int, "ram": dict,
    "kaggle_env": list, "secrets": dict, "internet": bool,
}
# What a probe may add: an older one has none of them; pip only for a job with kaggle.pip.
PROBE_OPTIONAL = ("kernel_push", "packages", "platform", "pip")


@dataclass
class Check:
    level: str  # ok | warn | FAIL
    name: str
    text: str

    def line(self) -> str:
        return f"{self.level:<4}  {self.name:<12} {self.text}"


@dataclass
class Report:
    job: str
    path: Path
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.level == "FAIL"]

    def verdict(self) -> str:
        """The closing line; DoctorFailed (exit 9, or 6 for credentials) when a check failed."""
        if self.failed:
            error = DoctorFailed(f"kchain doctor: {len(self.failed)} check(s) failed: {self.failed[0].text}")
            error.exit_code = self.exit_code or DoctorFailed.exit_code
            raise error
        warned = any(c.level == "warn" for c in self.checks)
        return "kchain doctor: all checks passed" + (" (warnings above)" if warned else "")


class _Checklist:
    """Collects checks and prints each as it is made (a probe can take minutes on Kaggle)."""

    def __init__(self, report: Report, echo: Echo) -> None:
        self.report, self.echo = report, echo

    def __call__(self, level: str, name: str, text: str) -> None:
        check = Check(level, name, text)
        self.report.checks.append(check)
        self.echo(check.line())


# -- laptop side --------------------------------------------------------------------------------


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _laptop_versions() -> dict[str, str | None]:
    import platform

    return {"python": platform.python_version(), "torch": _installed("torch"), "numpy": _installed("numpy"),
            "kaggle": _installed("kaggle"), "kchain": kchain.__version__}


def _job_packages(job: Job) -> dict[str, dict[str, str | None]]:
    """Each package the job's code imports (not torch or numpy, compared on their own): its distribution
    and version on this laptop (None: not installed here)."""
    out = {}
    for module in extras.imported(code_files(job)[0]):
        if module in ("torch", "numpy"):
            continue
        dist = extras.distribution(module)
        out[module] = {"distribution": dist, "version": extras.version(dist)}
    return out


def _laptop(job: Job, check: _Checklist, report: Report) -> Any:
    owner = job.kaggle.owner or credentials.configured_username()
    rendered = render_job(job, owner=owner)
    report.facts["fingerprint"] = rendered.fingerprint
    check("ok", "job", f"{job.path} loads and renders (fingerprint {rendered.fingerprint[:12]})")
    smoked = Ledger(state_dir(job.path)).smoke_passed(rendered.fingerprint)
    if smoked:
        check("ok", "smoke", f"this code passed smoke run {smoked['run_id']}")
    else:
        check("warn", "smoke", f"this code never passed a smoke run: run `kchain smoke {job.path}` before pushing")
    laptop = _laptop_versions()
    report.facts["laptop"] = laptop
    report.facts["packages"] = _job_packages(job)
    check("ok", "laptop", f"python {laptop['python']}, torch {laptop['torch'] or 'not installed'}, "
                          f"numpy {laptop['numpy'] or 'not installed'}, kaggle client {laptop['kaggle']}")
    found = credentials.find()
    report.facts["credentials"] = found.record() if found else None
    if found is None:
        check("FAIL", "credentials", MISSING_CREDENTIALS)
        report.exit_code = CredentialsError.exit_code
    else:
        check("ok", "credentials", f"the client will use {found.source}")
    return rendered


# -- account and sources ------------------------------------------------------------------------


def _account(client: KaggleClient, check: _Checklist, report: Report) -> str | None:
    try:
        user = client.username
        quota = client.quota()
    except CredentialsError as exc:
        check("FAIL", "credentials", str(exc))
        report.exit_code = CredentialsError.exit_code
        return None
    if quota is None:  # an answer without GPU figures (Kaggle may send none)
        quota = {"used_s": 0.0, "total_s": 0.0, "refresh": 0.0}
    report.facts["user"] = user
    left_h = (quota["total_s"] - quota["used_s"]) / 3600
    report.facts["quota"] = quota if quota["total_s"] else None
    if quota["total_s"]:
        check("ok", "account", f"user {user}; GPU quota left this week {left_h:.1f} of "
                               f"{quota['total_s'] / 3600:.1f} h")
    else:
        check("warn", "account", f"user {user}; GPU quota not reported by Kaggle: kchain counts hours from "
                                 "its own session ledger")
    tag = secrets.token_hex(4)
    missing = {"kernel": client.lookup_code("kernel", f"{user}/kchain-doctor-missing-{tag}"),
               "dataset": client.lookup_code("dataset", f"{user}/kchain-doctor-missing-{tag}")}
    report.facts["missing"] = missing
    if all(code in (403, 404) for code in missing.values()):
        check("ok", "missing", f"Kaggle answers a lookup of a missing kernel with {missing['kernel']}, of a "
                               f"missing dataset with {missing['dataset']} (recorded)")
    else:
        check("warn", "missing", f"a lookup of a kernel and a dataset that cannot exist answered {missing}; "
                                 "expected 403 or 404")
    return user


def _sources(client: KaggleClient, job: Job, owner: str, check: _Checklist, report: Report) -> list[str]:
    """Look every source up by name before anything is saved; return those that can be attached."""
    good = []
    for source in job.kaggle.datasets:
        parts = source.split("/")
        ref = "/".join(parts[:2])
        code = client.lookup_code("dataset", ref)
        if code != 200:
            check("FAIL", "sources", f"dataset {source} does not exist or {owner} cannot see it (HTTP {code}): "
                                     f"fix kaggle.datasets in {job.path}")
            continue
        if len(parts) == 3:
            newest = client.dataset_version_number(ref)
            if int(parts[2]) > newest:
                check("FAIL", "sources", f"dataset {source}: version {parts[2]} does not exist (newest is "
                                         f"{newest}): fix kaggle.datasets in {job.path}")
                continue
        status = client.dataset_status(ref)
        if status != "ready":
            check("warn", "sources", f"dataset {source} exists but is {status}, not ready: a session started now may "
                                     "run without it; wait until `kaggle datasets status` says ready")
        else:
            check("ok", "sources", f"dataset {source} exists and is ready")
        good.append(source)
    for source in job.kaggle.models:
        problem = model_problem(client, source)
        if problem is None:
            check("ok", "sources", f"model {source} exists")
            good.append(source)  # attached to the probe as a model source: its mount is checked there
        else:
            check("FAIL", "sources", f"{problem[0]}: {problem[1]} (kaggle.models in {job.path})")
    if job.kaggle.competition:
        check("ok", "sources", f"competition {job.kaggle.competition}: no lookup can tell whether its rules were "
                               "accepted; the save below names it if Kaggle refuses it")
    state = state_dataset(owner, job.name)
    state_there = client.lookup_code("dataset", state) == 200
    report.facts["state_dataset"] = {"ref": state, "exists": state_there}
    if state_there:
        check("ok", "state", f"state dataset {state} exists (attached to the probe)")
        good.append(state)
    else:
        check("ok", "state", f"state dataset {state} does not exist yet: `kchain push` creates it")
    return good


def _doctor_slug(job: Job) -> str:
    """The doctor's own kernel, never the job's: `<name>-doctor` within Kaggle's 50 characters."""
    return doctor_kernel("", job.name).split("/", 1)[1]


def _kernel_folder(folder: Path, notebook: str, metadata: dict[str, Any], slug: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    metadata = {**metadata, "title": slug, "code_file": f"{slug}.ipynb"}
    (folder / f"{slug}.ipynb").write_text(notebook, encoding="utf-8")
    (folder / METADATA_FILE).write_text(json.dumps(metadata, indent=1, sort_keys=True) + "\n")
    return folder


def _save_once(client: KaggleClient, ref: str, folder: Path, attempts: int = 3, settle_s: float = 6.0,
               poll_s: float = 1.0) -> dict[str, Any]:
    """The quick save, exactly once, settled as `push` settles a push: after a lost answer the
    kernel's version is polled for a while; a new one means the save landed (Kaggle's answer, and with
    it the sources it calls invalid, is lost: `answer_lost`), none means it may be sent again."""
    before = client.kernel_version(ref)
    try:
        answer, version = send_and_settle(lambda: client.save_without_running(folder),
                                          lambda: new_kernel_version(client, ref, before), lost=lost_answer,
                                          attempts=attempts, settle_s=settle_s, poll_s=poll_s)
    except NotLanded as exc:
        raise exc.last from None
    if answer is not None:
        return answer
    return {"version": version, "url": client.kernel_url(ref), "error": "", "invalid": {}, "answer_lost": True}


def _quick_save(client: KaggleClient, job: Job, rendered: Rendered, ref: str, check: _Checklist,
                report: Report) -> None:
    slug = ref.split("/", 1)[1]
    metadata = {**json.loads(rendered.metadata), "id": ref}
    folder = Path(tempfile.mkdtemp(prefix="kchain-doctor-"))
    try:
        _kernel_folder(folder, rendered.notebook, metadata, slug)
        answer = _save_once(client, ref, folder)
    except KaggleError as exc:
        check("FAIL", "metadata", f"saving the job's notebook as {ref} (no run) failed: {exc}")
        return
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report.facts["quick_save"] = answer
    size_kb = len(rendered.notebook.encode()) / 1024
    if answer.get("answer_lost"):
        check("warn", "metadata", f"the job's notebook was saved as {ref} version {answer['version']} without "
                                  "running, but Kaggle's answer was lost: which sources it calls invalid is "
                                  f"unknown; run `kchain doctor {job.path}` again to see them")
        return
    if answer["error"]:
        check("FAIL", "metadata", f"Kaggle refused the job's kernel-metadata.json (saved as {ref}, no run): "
                                  f"{answer['error']}")
    for kind, names in answer["invalid"].items():
        for name in names:
            check("FAIL", "metadata", f"Kaggle calls {kind} source {name} invalid: it would be dropped from the "
                                      f"session; fix the job's kaggle section in {job.path}")
    if not answer["error"] and not answer["invalid"]:
        check("ok", "metadata", f"notebook ({size_kb:.0f} KB) and kernel-metadata.json accepted: saved as {ref} "
                                f"version {answer['version']} without running")


# -- the probe ----------------------------------------------------------------------------------


def parse_probe(text: str) -> dict[str, Any]:
    """The probe's output, checked key by key; ProbeFormatError names what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProbeFormatError(f"{PROBE_OUTPUT} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProbeFormatError(f"{PROBE_OUTPUT} is not a JSON object")
    if data.get("format") != PROBE_FORMAT:
        raise ProbeFormatError(f"{PROBE_OUTPUT} has format {data.get('format')!r}, this kchain reads {PROBE_FORMAT}")
    for key, kind in PROBE_KEYS.items():
        if key not in data:
            raise ProbeFormatError(f"{PROBE_OUTPUT} has no {key!r}")
        if not isinstance(data[key], kind) or (kind is int and isinstance(data[key], bool)):
            raise ProbeFormatError(f"{PROBE_OUTPUT}: {key!r} is a {type(data[key]).__name__}")
    extra = sorted(set(data) - set(PROBE_KEYS) - set(PROBE_OPTIONAL))
    if extra:
        raise ProbeFormatError(f"{PROBE_OUTPUT} has unknown keys {extra}")
    for name in ("torch", "numpy"):
        if not isinstance(data[name].get("version"), (str, type(None))):
            raise ProbeFormatError(f"{PROBE_OUTPUT}: {name}.version is not a string")
    packages = data.get("packages", {})
    if not isinstance(packages, dict) or not all(
            isinstance(p, dict) and isinstance(p.get("version"), (str, type(None))) for p in packages.values()):
        raise ProbeFormatError(f"{PROBE_OUTPUT}: packages is not a map of module to {{version, distribution}}")
    if not isinstance(data["runtime"].get("imports"), bool) or not isinstance(data["secrets"].get("visible"), dict):
        raise ProbeFormatError(f"{PROBE_OUTPUT}: runtime.imports or secrets.visible is missing")
    return data


def _wait(client: KaggleClient, ref: str, number: int, timeout_s: float) -> tuple[SessionState, str]:
    """Poll the probe's session until it ends: quick at first (the emulator), then every 10 s."""
    deadline, delay = time.monotonic() + timeout_s, 0.5
    while True:
        status, message = client.status(ref, number)
        if status in TERMINAL or time.monotonic() >= deadline:
            return status, message
        time.sleep(delay)
        delay = min(10.0, delay * 1.5)


def _run_probe(client: KaggleClient, job: Job, ref: str, sources: list[str], state: str | None,
               out: Path, timeout_s: float, check: _Checklist, packages: list[str]) -> dict[str, Any] | None:
    notebook, metadata = render_probe(job, ref, sources, state, SECRET_LABELS, packages)
    folder = Path(tempfile.mkdtemp(prefix="kchain-probe-"))
    try:
        _kernel_folder(folder, notebook, metadata, ref.split("/", 1)[1])
        number, _url = client.push(folder)
    except KaggleError as exc:
        check("FAIL", "probe", f"the probe kernel {ref} was not started: {exc}")
        return None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    check.echo(f"      probe        {ref} version {number}: a CPU session (accelerator none); waiting for it")
    status, message = _wait(client, ref, number, timeout_s)
    if status not in TERMINAL:
        check("warn", "probe", f"{ref} version {number} still {status} after {timeout_s:.0f} s: run `kchain "
                               "doctor` again later (its CPU session costs no GPU quota)")
        return None
    dest = out / "doctor-probe" / job.name
    shutil.rmtree(dest, ignore_errors=True)
    try:
        files, log = client.output(ref, number, dest)
    except KaggleError as exc:
        check("FAIL", "probe", f"the probe's output could not be fetched: {exc}")
        return None
    found = [f for f in files if f.name == PROBE_OUTPUT]
    if status != SessionState.COMPLETE or not found:
        check("FAIL", "probe", f"the probe session ended {status} without {PROBE_OUTPUT} ({message or 'no message'}); "
                               f"its log is in {dest}")
        return None
    try:
        return parse_probe(found[0].read_text(encoding="utf-8"))
    except ProbeFormatError as exc:
        check("FAIL", "probe", str(exc))
        return None


def _major_minor(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2])
    except ValueError:
        return None


def _compare_image(probe: dict[str, Any], laptop: dict[str, str | None], check: _Checklist) -> None:
    """The image against this laptop, each difference with what it means."""
    torch, numpy = probe["torch"], probe["numpy"]
    switched = [f"{name} from {probe[name]['source']}" for name in ("torch", "numpy")
                if probe[name].get("source", "import") != "import"]
    check("ok", "image", f"python {probe['python']}, torch {torch['version']} (CUDA build {torch.get('cuda_build') or 'none: a CPU build'}), "
                         f"numpy {numpy['version']}, kaggle client {probe['kaggle_client']}"
                         + (f" [test switch: {', '.join(switched)}]" if switched else ""))
    image_t, laptop_t = _major_minor(torch["version"]), _major_minor(laptop["torch"])
    if image_t is None:
        check("FAIL", "torch", f"the image cannot import torch ({torch.get('error')}): the runtime needs it")
    elif laptop_t is None:
        check("warn", "torch", f"the image has torch {torch['version']}, this laptop none: smoke runs cannot prove it")
    elif image_t[0] != laptop_t[0]:
        check("warn", "torch", f"the image has torch {torch['version']}, your laptop {laptop['torch']}: a different "
                               "major version, so a checkpoint written by one may not load in the other and the "
                               f"smoke run proved another torch; install torch {image_t[0]}.{image_t[1]} here")
    elif image_t != laptop_t:
        check("warn", "torch", f"the image has torch {torch['version']}, your laptop {laptop['torch']}: checkpoints "
                               "load both ways, but numerics and defaults may differ from the smoke run")
    else:
        check("ok", "torch", f"torch {image_t[0]}.{image_t[1]} on both: checkpoints load both ways")
    image_n, laptop_n = _major_minor(numpy["version"]), _major_minor(laptop["numpy"])
    if image_n and laptop_n and image_n[0] != laptop_n[0]:
        check("warn", "numpy", f"the image has numpy {numpy['version']}, your laptop {laptop['numpy']}: the major "
                               "version differs, so pickled caches (object arrays, pickles staged with run.stage) "
                               "made on one may not load on the other; stage them on Kaggle")
    elif image_n and laptop_n:
        check("ok", "numpy", f"numpy {image_n[0]}.x on both")


def compare_packages(image: dict[str, Any], laptop: dict[str, dict[str, str | None]], check: _Checklist,
                     pins: tuple[str, ...] = ()) -> None:
    """Each package the job imports, in the image against this laptop, with what a difference means; one that
    kaggle.pip pins is the same wheel on both (the smoke and the session install it alike)."""
    pinned = extras.pinned(pins)
    for module, here in sorted(laptop.items()):
        there = image.get(module) or {}
        dist, mine, theirs = here["distribution"] or module, here["version"], there.get("version")
        pin = pinned.get(extras.distribution(dist))
        if pin:
            check("ok", "packages", f"{pin} from kaggle.pip, in the image and in the smoke alike")
            continue
        found = extras.extra(dist)
        floor = (f"; kchain[{found.name}] asks for {dist}{found.specifier}, which the image's {theirs} does not meet"
                 if found and theirs and extras.admits(dist, theirs) is False else "")
        if theirs is None:
            check("FAIL", "packages", f"the job's code imports {module}, which Kaggle's image does not have: the session "
                                      f"would stop at that import. Pin it in the job (kaggle.pip: ['{dist}=={mine or 'VERSION'}']): "
                                      f"kchain builds a dataset of its wheels that each session installs with no index")
        elif mine is None:
            check("warn", "packages", f"the image has {dist} {theirs}, this laptop none: the smoke cannot run the code "
                                      f"that imports {module}; {extras.install_hint(module)}" + floor)
        elif _major_minor(mine) != _major_minor(theirs):
            check("warn", "packages", f"the image has {dist} {theirs}, your laptop {mine}: the smoke proved another "
                                      f"{dist}, whose defaults and behaviour may differ; pip install '{dist}=={theirs}' "
                                      f"here to smoke what Kaggle runs" + floor)
        else:
            check("ok", "packages", f"{dist} {theirs} in the image, {mine} here: the same minor version" + floor)


def _image(probe: dict[str, Any], report: Report, check: _Checklist, pins: list[str]) -> None:
    _compare_image(probe, report.facts["laptop"], check)
    compare_packages(probe.get("packages", {}), report.facts.get("packages", {}), check, tuple(pins))
    pip = probe.get("pip")
    if pip and pip.get("ok"):
        check("ok", "kaggle.pip", f"{', '.join(pip['pins'])} installed in the image's Python from the job's wheels "
                                  "dataset, with no index, as each session installs them")
    elif pip:
        check("FAIL", "kaggle.pip", f"the image could not install the job's wheels: {pip.get('error')}")
    for source, path in probe["mounts"].items():
        if path:
            check("ok", "mounts", f"{source} is mounted at {path}")
        else:
            check("FAIL", "mounts", f"{source} was attached but is not under the input folder: check that Kaggle "
                                    "accepted it (metadata line above)")
    runtime = probe["runtime"]
    if not runtime["imports"]:
        check("FAIL", "runtime", f"the embedded kchain runtime does not import in the image: {runtime.get('error')}")
    elif runtime.get("checkpoint"):
        ckpt = runtime["checkpoint"]
        check("ok", "runtime", f"the embedded runtime imports and would resume from step {ckpt['step']} "
                               f"({ckpt['path']})")
    else:
        check("ok", "runtime", "the embedded runtime imports; no checkpoint attached yet (a fresh start)")
    ram = probe["ram"].get("total")
    check("ok", "resources", f"free disk in working {probe['disk_free_working'] / 2**30:.1f} GiB (Kaggle keeps at "
                             "most 20 GiB of it as output), RAM " + (f"{ram / 2**30:.1f} GiB" if ram else "not reported"))
    seen = [label for label in SECRET_LABELS if probe["secrets"]["visible"].get(label)]
    check("ok", "environment", f"KAGGLE_* names seen: {', '.join(probe['kaggle_env']) or 'none'}; Secret labels "
                               f"visible: {', '.join(seen) or 'none'}")


def _publishing(job: Job, probe: dict[str, Any] | None, owner: str, report: Report, check: _Checklist) -> None:
    state = state_dataset(owner, job.name)
    relay = (f"laptop relay: `kchain continue` downloads each session's output and versions {state} from "
             "this machine")
    if probe is None:
        report.facts["publish"] = "relay" if not job.kaggle.internet else "not checked"
        if job.kaggle.internet:
            check("warn", "publishing", f"not probed: the kernel publishes {state} itself only if Secrets "
                                        f"{' and '.join(SECRET_LABELS)} are attached to {job.name}; else the {relay}")
        else:
            check("ok", "publishing", f"{relay} (kaggle.internet is false)")
        return
    missing = [label for label in SECRET_LABELS if not probe["secrets"]["visible"].get(label)]
    if probe["internet"] and not missing and probe["kaggle_client"] is None:
        report.facts["publish"] = "relay"
        check("warn", "publishing", f"{relay}: the image has no kaggle client, so the kernel cannot publish even "
                                    "with internet and Secrets")
    elif probe["internet"] and not missing:
        report.facts["publish"] = "kernel"
        check("ok", "publishing", f"in-kernel publish: internet on and Secrets {' and '.join(SECRET_LABELS)} "
                                  f"visible, so the kernel versions {state} itself (Secrets are attached per "
                                  f"notebook: attach them to {job.name} too)")
    elif probe["internet"]:
        report.facts["publish"] = "relay"
        check("warn", "publishing", f"{relay}: Secrets {', '.join(missing)} are not attached to the kernel; attach "
                                    "them in the notebook's Add-ons > Secrets to publish from the kernel")
    else:
        report.facts["publish"] = "relay"
        check("ok", "publishing", f"{relay} (kaggle.internet is false)")


# -- the whole run and its record ---------------------------------------------------------------


def doctor_file(job: Job) -> Path:
    return state_dir(job.path) / DOCTOR_FILE


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default


def _record(job: Job, report: Report, offline: bool, probed: bool) -> Path:
    path = doctor_file(job)
    data = _read_json(path, None)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        data = {"format": FORMAT, "jobs": {}}
    data["jobs"][job.name] = {
        **report.facts, "time": iso(now_utc()), "checked": time.time(), "kchain_version": kchain.__version__,
        "offline": offline, "probed": probed,
        "checks": [{"level": c.level, "name": c.name, "text": c.text} for c in report.checks],
    }
    atomic.write_json(path, data)
    return path


def _wheels(client: KaggleClient, job: Job, owner: str, check: _Checklist) -> list[str]:
    """kaggle.pip: the wheels dataset made current (built once, uploaded when the pins or the image's Python
    changed), so the probe installs from it as a session would; [] when it cannot be."""
    try:
        return [kagglepip.ensure(client, job, owner, check.echo)]
    except SpecError as exc:
        check("FAIL", "kaggle.pip", str(exc).removeprefix(f"{job.path}: kaggle.pip: "))
    except KaggleError:
        raise
    except KchainError as exc:
        check("FAIL", "kaggle.pip", str(exc).removeprefix("kaggle.pip: "))
    return []


def _online(job: Job, probe: bool, probe_timeout_s: float, check: _Checklist, report: Report) -> bool:
    """Account, sources, the quick save, the probe and the publishing path; True if the probe ran."""
    client = KaggleClient()
    user = _account(client, check, report)
    if user is None:
        return False
    owner = job.kaggle.owner or user
    sources = _sources(client, job, owner, check, report)
    if job.kaggle.pip:
        sources += _wheels(client, job, owner, check)
    ref = f"{owner}/{_doctor_slug(job)}"
    _quick_save(client, job, render_job(job, owner=owner), ref, check, report)
    result = None
    if probe:
        state = report.facts["state_dataset"]["ref"] if report.facts["state_dataset"]["exists"] else None
        result = _run_probe(client, job, ref, sources, state, state_dir(job.path), probe_timeout_s, check,
                            packages=list(report.facts["packages"]))
        if result is not None:
            report.facts["probe"] = result
            _image(result, report, check, job.kaggle.pip)
            check("ok", "image", f"the probe ran on its own kernel, {ref}, whose image need not be the one the job's "
                                 "kernel gets (Kaggle updates its images about every two weeks): `kchain status` "
                                 "names each session's image and warns when one differs from session 1's")
    _publishing(job, result, owner, report, check)
    if result is not None and result.get("kernel_push"):
        _kernel_push(result["kernel_push"], ref, check)
        _hop(client, job, ref, result["kernel_push"], probe_timeout_s, check, report)
    return result is not None


def _kernel_push(answer: dict[str, Any], ref: str, check: _Checklist) -> None:
    """The probe's try at a kernel push from inside a kernel: what `kchain push --unattended` needs."""
    if answer.get("ok"):
        check("ok", "unattended", f"a kernel may push a kernel on this account: the probe pushed {ref} from inside "
                                  "itself; `kchain push --unattended` can chain sessions with the laptop shut")
    else:
        check("warn", "unattended", f"the probe could not push a kernel from inside itself ({answer.get('error')}): "
                                    "`kchain push --unattended` is refused; chains go on through `kchain continue`")


def _hop_secrets(client: KaggleClient, job: Job, ref: str, number: int, timeout_s: float) -> tuple[str, bool | None]:
    """The status of the version the probe pushed, and whether it saw both Secret labels (None: unknown)."""
    status, _message = _wait(client, ref, number, timeout_s)
    if status not in TERMINAL:
        return status, None
    dest = state_dir(job.path) / "doctor-probe" / f"{job.name}-hop"
    shutil.rmtree(dest, ignore_errors=True)
    try:
        files, _log = client.output(ref, number, dest)
        data = json.loads(next(f for f in files if f.name == HOP_OUTPUT).read_text(encoding="utf-8"))
        seen = data["secrets"]["visible"] if data.get("format") == HOP_FORMAT else None
    except (KaggleError, StopIteration, OSError, ValueError, KeyError, TypeError):
        seen = None
    return status, None if not isinstance(seen, dict) else all(seen.get(label) is True for label in SECRET_LABELS)


def _hop(client: KaggleClient, job: Job, ref: str, answer: dict[str, Any], timeout_s: float, check: _Checklist,
         report: Report) -> None:
    """The version the probe pushed from inside itself: did it keep its Secrets? Every kernel-pushed session of
    an unattended chain, and its relay, need them (a report says a push resets them: kaggle-api.md 6.5)."""
    number = answer.get("version")
    if not (answer.get("ok") and number):
        return
    status, kept = _hop_secrets(client, job, ref, int(number), timeout_s)
    report.facts["hop"] = {"version": number, "status": status, "secrets_kept": kept}
    pushed = f"{ref} version {number}, pushed from inside the probe,"
    if kept:
        check("ok", "secrets", f"{pushed} still saw Secrets {' and '.join(SECRET_LABELS)}: a kernel-pushed kernel "
                               "keeps them, so an unattended chain's relays and sessions can push")
    elif kept is False:
        check("warn", "secrets", f"{pushed} saw no Secrets: Kaggle reset them at the push (as a report says "
                                 "`kaggle kernels push` does), so an unattended chain hands over to the laptop on "
                                 "its first hop (`kchain continue` pushes each session after the first)")
    else:
        check("warn", "secrets", f"whether a kernel-pushed kernel keeps its Secrets is unknown: {ref} version "
                                 f"{number} ended {status} without {HOP_OUTPUT}; run `kchain doctor {job.path}` again")


def unattended_note(job: Job) -> str | None:
    """For `kchain push --unattended`: one line when the doctor saw a kernel-pushed kernel lose its Secrets (the
    chain hands over to the laptop on its first hop), or could not tell; None when it saw them kept."""
    entry = Ledger(state_dir(job.path)).doctor_entry(job.name)
    kept = (entry.get("hop") or {}).get("secrets_kept")
    if kept:
        return None
    if kept is False:
        return (f"  hand-over: kchain doctor saw a kernel-pushed kernel lose its Secrets on this account, so no kernel "
                f"can push the next session: session 1 publishes its state, then the laptop takes the chain over "
                f"(run `kchain continue --watch {job.path}`)")
    return (f"  note: kchain doctor did not see whether a kernel-pushed kernel keeps its Secrets; if it does not, the "
            f"laptop takes the chain over after session 1 (`kchain doctor {job.path}` checks it)")


def refuse_unattended(job: Job) -> None:
    """`kchain push --unattended` only once the doctor's probe saw a kernel push a kernel on this account."""
    entry = Ledger(state_dir(job.path)).doctor_entry(job.name)
    answer = (entry.get("probe") or {}).get("kernel_push") or {}
    if not answer.get("ok"):
        seen = f" (its probe said: {answer['error']})" if answer.get("error") else ""
        raise ChainStop(f"--unattended: kchain doctor has not seen a kernel push a kernel on this account{seen}; "
                        f"set kaggle.internet: true, attach the Secrets KAGGLE_USERNAME and KAGGLE_KEY to "
                        f"{job.name}-doctor, and run `kchain doctor {job.path}`")


def run_doctor(job_file: Path, offline: bool = False, probe: bool = True, echo: Echo = print,
               probe_timeout_s: float = 900.0) -> Report:
    """Print the checklist as it is made, write doctor.json, and return the report."""
    job = load_job(job_file)
    report = Report(job=job.name, path=doctor_file(job))
    check = _Checklist(report, echo)
    echo(f"kchain doctor {job_file}" + (" (offline: laptop-side checks only)" if offline else ""))
    rendered = _laptop(job, check, report)
    probed = False
    if not offline and not report.failed:
        try:
            probed = _online(job, probe, probe_timeout_s, check, report)
        except KaggleError as exc:  # retries exhausted: say it in the checklist and keep what was learned
            check("FAIL", "kaggle", str(exc))
            report.exit_code = report.exit_code or KaggleError.exit_code
    report.facts.setdefault("fingerprint", rendered.fingerprint)
    path = _record(job, report, offline, probed)
    echo(f"wrote {path}")
    return report


def _push_hint(job: Job, fingerprint: str) -> str | None:
    """One line for `kchain push` when doctor.json is missing or older than this code or these
    credentials, or when the doctor's last check of exactly this found a problem; else None."""
    entry = Ledger(state_dir(job.path)).doctor_entry(job.name)
    advice = f"run `kchain doctor {job.path}` (free: no GPU session) to check the account and the image first"
    if not entry:
        return f"  hint: kchain doctor never checked {job.name} on Kaggle; {advice}"
    found = credentials.find()
    source = found.record() if found else None
    creds = entry.get("credentials") or {}
    stale_creds = (source is None or source["source"] != creds.get("source")
                   or (source["mtime"] or 0) > entry.get("checked", 0)
                   or (credentials.configured_username() or entry.get("user")) != entry.get("user"))
    if entry.get("offline") or entry.get("fingerprint") != fingerprint or stale_creds:
        return f"  hint: the last kchain doctor ({entry.get('time')}) checked other code or credentials; {advice}"
    failed = [c["text"] for c in entry.get("checks", []) if c.get("level") == "FAIL"]
    if failed:
        return f"  hint: the last kchain doctor found {len(failed)} problem(s), first: {failed[0]}"
    return None


def suggest_doctor(job: Job, echo: Echo) -> None:
    """`kchain push` calls this: it prints the hint and never blocks (the fingerprint does not
    depend on the owner, so no Kaggle call is needed)."""
    line = _push_hint(job, render_job(job).fingerprint)
    if line:
        echo(line)
