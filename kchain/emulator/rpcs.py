"""The Kaggle RPCs the emulator serves, on the emulator's store.

Each handler takes the authenticated user name and the JSON request body (camelCase, defaults
omitted, as the client sends it) and returns the JSON response body, or raises ApiError. Enums go
out by name. Shapes follow docs/reference kaggle-api.md section 3.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import tarfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TypeVar

from kchain.common.outputfiles import name_problem
from kchain.common.sessionstate import LIVE, SessionState
from kchain.emulator.faults import Faults
from kchain.emulator.sessions import SessionRunner, log_entries, remove_tree
from kchain.emulator.state import Store, framework_enum, iso, model_key, new_secret
from kchain.emulator.switches import Limits, Switches

GPU_SHAPE_PREFIXES = ("Nvidia",)
TPU_SHAPE_PREFIXES = ("Tpu",)
SESSION_ID_BASE = 100_000_000
# Kaggle's images are named by digest (the SDK's ApiSaveKernelRequest.docker_image docstring).
# A new model's slug and an instance (variation) slug: the client's own check for a new model's slug
# (kaggle 2.2.5 `_validate_slug_syntax`, no underscores); the length range is an assumption (docs/emulator.md).
MODEL_SLUG_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
MODEL_SLUG_LEN = (3, 50)
INSTANCE_SLUG_RE = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*")  # variations such as 2b or 1.1-it exist
IMAGE_REPOSITORY = "gcr.io/kaggle-images/python"
# ListKernels' sortBy (the SDK's KernelsListSortType, by name) -> the kernel record's field, newest or most
# first. HOTNESS (the default) and the rest are Kaggle's own scores, unknown here: by last run (assumption).
KERNEL_SORTS = {"DATE_CREATED": "created", "DATE_RUN": "last_run", "VOTE_COUNT": "votes", "VIEW_COUNT": "views"}
VISUAL_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".html")  # outputType "visualization" (assumption)
KERNEL_FILES_PAGE_MAX = 200  # `kaggle kernels files --page-size`: "default: 20, max: 200" (docs/kernels.md)
# ListModels' sortBy (ListModelsOrderBy without its prefix) -> the card's field, most first (HOTNESS, Kaggle's own
# score: by votes, assumption).
MODEL_SORTS = {"HOTNESS": "votes", "VOTE_COUNT": "votes", "DOWNLOAD_COUNT": "downloads", "NOTEBOOK_COUNT": "notebooks",
               "PUBLISH_TIME": "created", "CREATE_TIME": "created", "UPDATE_TIME": "updated"}
# A variation's fields as the client sends and reads them (ApiModelInstance), with their defaults.
INSTANCE_FIELDS: dict[str, Any] = {"overview": "", "usage": "", "fineTunable": False, "trainingData": [],
                                   "modelInstanceType": "MODEL_INSTANCE_TYPE_UNSPECIFIED", "externalBaseModelUrl": ""}
# ListDatasets: the groups served (the others, a user's upvotes, bookmarks or collaborations, list nothing:
# the emulator has none); sortBy (DatasetSortBy without its prefix) -> the field, most first (HOTTEST: the
# newest); fileType -> the name endings of its files (BIG_QUERY: a catalogue dataset marked bigQuery).
DATASET_GROUPS = ("", "DATASET_SELECTION_GROUP_PUBLIC", "DATASET_SELECTION_GROUP_MY", "DATASET_SELECTION_GROUP_USER")
DATASET_SORTS = {"VOTES": "votes", "UPDATED": "updated", "ACTIVE": "updated", "PUBLISHED": "created",
                 "USABILITY": "usability"}
FILE_TYPE_SUFFIXES = {"CSV": (".csv",), "SQLITE": (".sqlite", ".sqlite3", ".db"), "JSON": (".json",),
                      "PARQUET": (".parquet",)}


def _image_name(release: int) -> str:
    """The digest of the emulator's release N of Kaggle's image (the same N, the same name)."""
    return f"{IMAGE_REPOSITORY}@sha256:{hashlib.sha256(f'kaggle image release {release}'.encode()).hexdigest()}"


def _flag(value: Any) -> bool:
    """A bool of a metadata file, which the client writes as a bool or as "true"/"false"."""
    return value is True or str(value).lower() == "true"


def license_group(name: str) -> str:
    """ListDatasets' license group (DatasetLicenseGroup without its prefix) of a license name, over the names the
    client's docs/datasets_metadata.md lists: Creative Commons, the GNU licenses, Open Data Commons, the rest."""
    upper = name.upper()
    if upper.startswith("CC"):
        return "CC"
    if "GPL" in upper or upper.startswith("FDL"):
        return "GPL"
    if upper.startswith(("ODBL", "DBCL", "ODC", "PDDL")):
        return "ODB"
    return "OTHER"


class ApiError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ResetConnection(Exception):
    """A creating call acted, and the server resets the connection instead of answering (a fault)."""


class Redirect(Exception):
    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.location = location


def week_start(now: float, offset_s: float = 0.0) -> float:
    """Epoch seconds at which the GPU quota week holding `now` began: the last Saturday 00:00 UTC, or
    offset_s after one for an account whose week starts later (Limits.quota_week_offset_s)."""
    shifted = now - offset_s
    day = datetime.fromtimestamp(shifted, timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    return (day - timedelta(days=(day.weekday() - 5) % 7)).timestamp() + offset_s


def _refresh_words(refresh: float) -> str:
    """A refresh time as the quota refusal says it ("Saturday 00:00 UTC")."""
    return datetime.fromtimestamp(refresh, timezone.utc).strftime("%A %H:%M UTC")


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _version_label(body: dict[str, Any]) -> int | None:
    label = body.get("versionLabel")
    if not label:
        return None
    if not (label.startswith("v") and label[1:].isdigit()):
        raise ApiError(404, f"Version {label!r} not found; versions are labelled vN")
    return int(label[1:])


F = TypeVar("F", bound=Callable[..., Any])


def _stale_log(log_jsonl: Path, until: str | None) -> str:
    """The persisted log of a running session under switches.stale_log_at: its entries up to the first that
    shows `until` (none before it shows), as Kaggle's JSON log; "" when the switch is unset."""
    if until is None:
        return ""
    entries = log_entries(log_jsonl)
    first = next((n for n, entry in enumerate(entries) if until in str(entry["data"])), None)
    return json.dumps(entries[:first + 1]) if first is not None else "[]"


def _through_link(output: Path, name: str) -> bool:
    """Whether the output file `name` is a link, or sits in a linked folder, inside the kept output."""
    here = output
    for part in name.split("/"):
        here = here / part
        if here.is_symlink():
            return True
    return False


def _locked(method: F) -> F:
    """Run the whole RPC under the store's lock (for the ones that only read and write the store)."""
    @functools.wraps(method)
    def run(self: Rpcs, *args: Any, **kwargs: Any) -> Any:
        with self.store.lock:
            return method(self, *args, **kwargs)
    return run  # type: ignore[return-value]


@dataclass
class SaveRequest:
    """A SaveKernel request after its checks: where it goes, what it runs on, which sources are valid."""
    owner: str
    slug: str
    kernel: dict[str, Any] | None
    shape: str
    gpu: bool
    tpu: bool
    run: bool
    sources: dict[str, list[str]] = field(default_factory=dict)  # requested / valid / invalid, per kind

    @property
    def ref(self) -> str:
        return f"{self.owner}/{self.slug}"


class Rpcs:
    """The RPC handlers, given what they use: the store, the session runner, the fault and strictness
    switches, the account limits and the emulator's base URL (known once it listens)."""

    def __init__(self, store: Store, runner: SessionRunner, faults: Faults, switches: Switches, limits: Limits,
                 url: Callable[[], str], secrets: dict[str, dict[str, str]],
                 competitions: dict[str, list[str]]) -> None:
        self.store = store
        self.runner = runner
        self.faults = faults
        self.switches = switches
        self.limits = limits
        self.url = url
        self.secrets = secrets  # user -> label -> value
        self.competitions = competitions  # competition slug -> users who accepted its rules

    # -- helpers ------------------------------------------------------------------------------

    def _missing(self, what: str) -> ApiError:
        """Missing and not visible read the same (403 on Kaggle, so the namespace cannot be probed)."""
        code = self.switches.missing_status
        if code == 403:
            return ApiError(403, f"Permission denied: {what} does not exist or you cannot see it")
        return ApiError(404, f"{what} not found")

    def _own(self, user: str, owner: str, what: str) -> None:
        if owner != user:
            raise ApiError(403, f"Permission denied: {user} cannot write {what} owned by {owner}")

    def _kernel(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        ref = f"{body.get('userName') or user}/{body.get('kernelSlug', '')}"
        kernel = self.store.kernels.get(ref)
        if kernel is None or (kernel["is_private"] and kernel["owner"] != user):
            raise self._missing(f"kernel {ref}")
        return kernel

    def _kernel_version(self, kernel: dict[str, Any], number: int | None) -> dict[str, Any]:
        versions = kernel["versions"]
        if not versions:
            raise self._missing(f"kernel {kernel['ref']} (no versions)")
        if number is None:
            return versions[-1]
        for version in versions:
            if version["number"] == number:
                return version
        raise self._missing(f"version {number} of kernel {kernel['ref']}")

    def _dataset(self, user: str, owner: str | None, slug: str | None) -> dict[str, Any]:
        """A dataset the caller may see and that has a visible version (a new one is invisible a while)."""
        ref = f"{owner or user}/{slug or ''}"
        dataset = self.store.datasets.get(ref)
        if dataset is None or (dataset["is_private"] and dataset["owner"] != user):
            raise self._missing(f"dataset {ref}")
        if not self.store.visible_versions(dataset):
            raise ApiError(self.switches.lag_status, f"Dataset {ref} not found (a new dataset is not visible yet)")
        return dataset

    def _ready_version(self, dataset: dict[str, Any], number: int | None) -> dict[str, Any]:
        """The version to read: the one asked for if it is ready, else the latest ready one."""
        versions = self.store.ready_versions(dataset)
        if number is not None:
            versions = [v for v in versions if v["number"] == number]
        if not versions:
            which = f"version {number}" if number is not None else "a ready version"
            raise ApiError(404, f"Dataset {dataset['ref']} has no {which}")
        return versions[-1]

    def _gpu_used_s(self, user: str, now: float) -> float:
        start = week_start(now, self.limits.quota_week_offset_s)
        used = 0.0
        for s in self.store.sessions.values():
            if s["owner"] != user or not s["gpu"] or not s.get("started"):
                continue
            end = s.get("ended") or now
            used += max(0.0, end - max(s["started"], start))
        return used

    # -- kernels ------------------------------------------------------------------------------

    def _dataset_source_ok(self, user: str, source: str) -> bool:
        """owner/slug (or owner/slug/N): visible to user, with a ready version (the pinned one if pinned)."""
        parts = source.split("/")
        if len(parts) not in (2, 3):
            return False
        dataset = self.store.datasets.get("/".join(parts[:2]))
        if dataset is None or (dataset["is_private"] and dataset["owner"] != user):
            return False
        ready = self.store.ready_versions(dataset)
        if len(parts) == 3:
            ready = [v for v in ready if parts[2].isdigit() and v["number"] == int(parts[2])]
        return bool(ready)

    def _model(self, user: str, key: str) -> dict[str, Any] | None:
        """A model variation the caller may see (public, or their own); versions whose processing window
        has passed become versions (mountable, listed) here."""
        model = self.store.models.get(key)
        if model is not None and model.get("pending"):
            now = time.time()
            done = [n for n, ready_at in model["pending"].items() if now >= ready_at]
            for n in done:
                del model["pending"][n]
            model["versions"] = sorted({*model["versions"], *(int(n) for n in done)})
        return None if model is None or (model["is_private"] and model["owner"] != user) else model

    def _model_source_ok(self, user: str, source: str) -> bool:
        """owner/model/framework/variation/N: visible to user, and that version exists."""
        parts = source.split("/")
        if len(parts) != 5 or not parts[4].isdigit():
            return False
        model = self._model(user, model_key(*parts[:4]))
        return model is not None and int(parts[4]) in model["versions"]

    def SaveKernel(self, user: str, body: dict[str, Any], from_kernel: bool = False) -> dict[str, Any]:
        """Checks, then the kernel's upsert, then its new version's session; invalid sources are
        answered and left out, and the session starts all the same (as on Kaggle). from_kernel: the
        call came from inside a session (its proxy token), kept as the session's `pushed_from`."""
        with self.store.lock:
            save = self._check_save(user, body)
            refusal = self._refusal(user, save) or self._unknown_image(body)
            if refusal:
                return {"error": refusal}
            image = self._image(save, body)
            self._reset_secrets(save.ref, from_kernel)
            now = time.time()
            kernel = self._upsert_kernel(save, body, now)
            number, session_id = self._add_session(save, kernel, body, now)
            self.store.session(session_id).update(image=image, pushed_from="kernel" if from_kernel else "laptop")
            self.store.save()
        if save.run:
            self.runner.launch(session_id)
        if self.faults.lose_save_answer():
            raise ApiError(500, "Internal error after the version was saved (injected)")
        if self.faults.reset_answer():
            raise ResetConnection("SaveKernel acted")
        return {"ref": f"/code/{save.ref}", "url": f"{self.url()}/code/{save.ref}", "versionNumber": number,
                "kernelId": kernel["id"], "invalidDatasetSources": save.sources["invalid_datasets"],
                "invalidKernelSources": save.sources["invalid_kernels"],
                "invalidCompetitionSources": save.sources["invalid_competitions"],
                "invalidModelSources": save.sources["invalid_models"]}

    def _check_save(self, user: str, body: dict[str, Any]) -> SaveRequest:
        """Which kernel (by id or slug, owned by the caller), on what machine, with which valid sources."""
        kernel = None
        if body.get("id"):
            kernel = next((k for k in self.store.kernels.values() if k["id"] == body["id"]), None)
            if kernel is None:
                raise self._missing(f"kernel id {body['id']}")
            owner, slug = kernel["owner"], kernel["slug"]
        else:
            raw = body.get("slug") or ""
            owner, slug = raw.split("/", 1) if "/" in raw else (user, raw)
            if not slug:
                raise ApiError(400, "A kernel slug (metadata id) is required")
            kernel = self.store.kernels.get(f"{owner}/{slug}")
        self._own(user, owner, "kernels")
        if not body.get("text"):
            raise ApiError(400, "The kernel has no source text")
        shape = body.get("machineShape") or ""
        save = SaveRequest(owner=owner, slug=slug, kernel=kernel, shape=shape,
                           gpu=bool(body.get("enableGpu")) or shape.startswith(GPU_SHAPE_PREFIXES),
                           tpu=bool(body.get("enableTpu")) or shape.startswith(TPU_SHAPE_PREFIXES),
                           run=body.get("kernelExecutionType") != "QUICK_SAVE")
        save.sources = self._check_sources(user, save.ref, body)
        return save

    def _check_sources(self, user: str, ref: str, body: dict[str, Any]) -> dict[str, list[str]]:
        datasets = list(body.get("datasetDataSources", []))
        kernels = list(body.get("kernelDataSources", []))
        competitions = list(body.get("competitionDataSources", []))
        valid_ds = [s for s in datasets if self._dataset_source_ok(user, s)]
        valid_ks = [s for s in kernels if "/".join(s.split("/")[:2]) in self.store.kernels
                    or "/".join(s.split("/")[:2]) == ref]
        valid_cs = [c for c in competitions if user in self.competitions.get(c, ())]
        # [UNCERTAIN] What Kaggle does with an unknown model source is not documented anywhere found; it is
        # modelled as its unknown dataset source (shared/reference/kaggle-api.md 8, kaggle-cli #433): named
        # in the answer, dropped, and the session runs without it, the worse case for a client that does
        # not read the answer.
        models = list(body.get("modelDataSources", []))
        valid_ms = [m for m in models if self._model_source_ok(user, m)]
        return {"datasets": datasets, "valid_datasets": valid_ds,
                "invalid_datasets": [s for s in datasets if s not in valid_ds],
                "valid_kernels": valid_ks, "invalid_kernels": [s for s in kernels if s not in valid_ks],
                "valid_competitions": valid_cs, "invalid_competitions": [c for c in competitions if c not in valid_cs],
                "valid_models": valid_ms, "invalid_models": [m for m in models if m not in valid_ms]}

    def _refusal(self, user: str, save: SaveRequest) -> str | None:
        """Kaggle's refusal in SaveKernel's `error` for a GPU run over the concurrency cap or the quota."""
        if not save.run or save.tpu:
            return None
        # CPU sessions have a cap of their own and never count against the GPU cap (switches.Limits).
        cap = self.limits.max_gpu_sessions if save.gpu else self.limits.max_cpu_sessions
        live = [s for s in self.store.sessions.values() if s["owner"] == user and s["gpu"] == save.gpu
                and not s.get("tpu") and s["status"] in LIVE]
        if len(live) >= cap:
            return f"Maximum batch {'GPU' if save.gpu else 'CPU'} session count of {cap} reached"
        if not save.gpu:
            return None
        used, quota = self._gpu_used_s(user, time.time()), self.limits.gpu_quota_s
        if used >= quota:
            refresh = week_start(time.time(), self.limits.quota_week_offset_s) + 7 * 86400
            return (f"GPU quota exceeded: {used / 3600:.2f} of {quota / 3600:.2f} hours "
                    f"used this week; the quota resets {_refresh_words(refresh)}")
        return None

    def _reset_secrets(self, ref: str, from_kernel: bool) -> None:
        """switches.secrets_reset_on_push: a push resets the kernel's Secret attachments; under the lock. The
        user re-attaches them after each push of their own (emu.attach_secrets); after a push from inside a
        kernel nobody does, so that version and those after it see none until the user's next push."""
        if not self.switches.secrets_reset_on_push:
            return
        reset = self.store.secrets_reset
        if from_kernel and ref not in reset:
            reset.append(ref)
        elif not from_kernel and ref in reset:
            reset.remove(ref)

    def _unknown_image(self, body: dict[str, Any]) -> str | None:
        """The refusal of a `dockerImage` that is not one of Kaggle's images ("must be one of the
        Kaggle-provided, known images": the SDK's docstring; the wording is the emulator's)."""
        asked = body.get("dockerImage")
        if asked and asked not in self.store.images:
            return f"docker_image {asked} is not one of Kaggle's images"
        return None

    def _image(self, save: SaveRequest, body: dict[str, Any]) -> str:
        """The image the new version runs on; under the lock. Kaggle releases a new image every
        `new_image_every` run pushes; a push runs on the newest unless it pins one: by digest
        (`dockerImage`) or with pinning type `original` (the image of the kernel's first version).
        `ignore_image_pin`: pins have no effect."""
        images, every = self.store.images, self.switches.new_image_every
        if not images or (save.run and every and self.store.data["runs_pushed"] % every == 0):
            images.append(_image_name(len(images) + 1))
        self.store.data["runs_pushed"] += int(save.run)
        newest, versions = images[-1], save.kernel["versions"] if save.kernel else []
        if self.switches.ignore_image_pin:
            return newest
        if body.get("dockerImage"):
            return str(body["dockerImage"])
        if body.get("dockerImagePinningType") == "original" and versions:
            return self.store.session(versions[0]["session"]).get("image") or newest
        return newest

    def _upsert_kernel(self, save: SaveRequest, body: dict[str, Any], now: float) -> dict[str, Any]:
        kernel = save.kernel
        if kernel is None:
            kernel = {"id": self.store.next_id(), "ref": save.ref, "owner": save.owner, "slug": save.slug,
                      "title": body.get("newTitle") or save.slug, "versions": [], "created": now}
            self.store.kernels[save.ref] = kernel
        elif body.get("newTitle"):
            kernel["title"] = body["newTitle"]
        kernel.update({
            "language": body.get("language", "python"), "kernel_type": body.get("kernelType", "notebook"),
            "is_private": body.get("isPrivate", False), "enable_gpu": bool(body.get("enableGpu")),
            "enable_tpu": bool(body.get("enableTpu")), "enable_internet": bool(body.get("enableInternet", False)),
            "machine_shape": save.shape, "dataset_sources": save.sources["valid_datasets"],
            "kernel_sources": save.sources["valid_kernels"], "competition_sources": save.sources["valid_competitions"],
            "model_sources": save.sources["valid_models"], "category_ids": body.get("categoryIds", []),
            "docker_image": body.get("dockerImage", ""), "last_run": now,
        })
        return kernel

    def _add_session(self, save: SaveRequest, kernel: dict[str, Any], body: dict[str, Any],
                     now: float) -> tuple[int, str]:
        """The new version and its session record (QUEUED, or COMPLETE for a quick save); (number, id)."""
        number = len(kernel["versions"]) + 1
        # Session ids are internal, like a PID: not the version number, not the kernel id.
        session_id = str(SESSION_ID_BASE + self.store.next_id())
        limit = self.limits.session_limit_s
        if save.tpu:
            limit = min(limit, self.switches.tpu_session_limit_s)
        if body.get("sessionTimeoutSeconds"):
            limit = min(limit, int(body["sessionTimeoutSeconds"]))
        run, faults, switches, sources = save.run, self.faults, self.switches, save.sources
        self.store.sessions[session_id] = {
            "id": session_id, "kernel": kernel["ref"], "owner": save.owner, "version": number, "gpu": save.gpu,
            "tpu": save.tpu, "kernel_type": kernel["kernel_type"], "requested_sources": sources["datasets"],
            "dataset_sources": sources["valid_datasets"], "invalid_sources": sources["invalid_datasets"],
            "competition_sources": sources["valid_competitions"],
            "invalid_competition_sources": sources["invalid_competitions"], "model_sources": sources["valid_models"],
            "invalid_model_sources": sources["invalid_models"], "mounted": [], "limit_s": limit,
            "status": SessionState.QUEUED if run else SessionState.COMPLETE, "failure_message": "", "queued": now,
            "started": None, "ended": None if run else now, "output_sig": new_secret(), "run": run,
            # Faults and switches are fixed at push time so a test can change them right after a push.
            "kill_at": faults.kill_at() if run else None, "lose_output": faults.lose_output,
            "kill_on_output": faults.kill_on_output if run else None,
            "kill_after_checkpoint": faults.kill_after_checkpoint if run else False,
            "kill_training_only": faults.kill_training_only,
            "queue_s": switches.queue_s, "boot_s": switches.boot_s, "output_at_limit": switches.output_at_limit,
            "ignore_version_pin": switches.ignore_version_pin, "no_gpu": faults.no_gpu,
            "crash_runner_on_output": faults.crash_runner_on_output if run and faults.crash_runner_in in (
                None, self.store.data["runs_pushed"]) else None,
            "crashed_runner": switches.crashed_runner, "mount_lag_s": switches.mount_lag_s,
        }
        sdir = self.store.session_dir(session_id)
        sdir.mkdir(parents=True)
        (sdir / "source").write_text(body["text"], encoding="utf-8")
        if not run:
            (sdir / "output").mkdir()
        kernel["versions"].append({"number": number, "session": session_id, "created": now})
        return number, session_id

    @_locked
    def GetKernelSessionStatus(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        kernel = self._kernel(user, body)
        version = self._kernel_version(kernel, _version_label(body))
        session = self.store.session(version["session"])
        answer = {"status": session["status"]}
        if session["failure_message"]:
            answer["failureMessage"] = session["failure_message"]
        return answer

    def ListKernelSessionOutput(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.lock:
            kernel = self._kernel(user, body)
            session = dict(self.store.session(self._kernel_version(kernel, _version_label(body))["session"]))
        sdir = self.store.session_dir(session["id"])
        output = sdir / "output"
        live = session["status"] in LIVE  # Kaggle persists output and log when the session ends
        names = [] if live or not output.exists() else sorted(
            str(p.relative_to(output)) for p in output.rglob("*") if p.is_file())
        size = int(body.get("pageSize") or 0) or len(names) or 1
        start = int(body.get("pageToken") or 0)
        page = names[start:start + size]
        base = f"{self.url()}/out/{session['output_sig']}"
        answer: dict[str, Any] = {"files": [{"url": f"{base}/{name}", "fileName": name} for name in page]}
        if start + size < len(names):
            answer["nextPageToken"] = str(start + size)
        if not body.get("pageToken"):
            log = sdir / "log.json"
            answer["log"] = log.read_text(encoding="utf-8") if log.exists() and not live else \
                _stale_log(sdir / "log.jsonl", self.switches.stale_log_at) if live else ""
        return answer

    def GetKernel(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.lock:
            kernel = self._kernel(user, body)
            session_id = self._kernel_version(kernel, _version_label(body))["session"]
            metadata = self._kernel_metadata(kernel, session_id)
        source = (self.store.session_dir(session_id) / "source").read_text(encoding="utf-8")
        return {"metadata": metadata, "blob": {"source": source, "language": metadata["language"],
                                               "kernelType": metadata["kernelType"], "slug": metadata["slug"]}}

    @_locked
    def GetAcceleratorQuotaStatistics(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        answer = {
            "quotaRefreshTime": iso(week_start(now, self.limits.quota_week_offset_s) + 7 * 86400),
            "tpuQuota": {"timeUsed": _duration(0), "totalTimeAllowed": _duration(20 * 3600)},
        }
        if self.switches.quota_has_gpu:
            answer["gpuQuota"] = {"timeUsed": _duration(self._gpu_used_s(user, now)),
                                  "totalTimeAllowed": _duration(self.limits.gpu_quota_s)}
        return answer

    @_locked
    def CancelKernelSession(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """Cancel by the internal session id (Kaggle exposes it to no client; tests read emu.sessions())."""
        session = self.store.sessions.get(str(body.get("kernelSessionId") or ""))
        if session is None or session["owner"] != user:
            raise self._missing(f"kernel session {body.get('kernelSessionId')}")
        if session["status"] not in LIVE:
            return {"errorMessage": f"Kernel session {session['id']} is not running (status {session['status']})"}
        self.runner.cancel(session["id"], by="api")
        return {}

    @_locked
    def DeleteKernel(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle kernels delete owner/slug`: the kernel and every version's output go; a live session
        is ended (its GPU time stops counting), as Unsloth's CI measured; its Secrets attachment goes too."""
        kernel = self._kernel(user, body)
        self._own(user, kernel["owner"], "kernels")
        del self.store.kernels[kernel["ref"]]
        if kernel["ref"] in self.store.secrets_attached:
            self.store.secrets_attached.remove(kernel["ref"])
        now = time.time()
        for version in kernel["versions"]:
            session = self.store.session(version["session"])
            session["kernel_deleted"] = now
            if session["status"] in LIVE:
                self.runner.delete(session["id"])  # its watcher ends it within 50 ms, output lost
            else:
                remove_tree(self.store.session_dir(session["id"]) / "output")
                session["output_lost"] = True
        self.store.save()
        return {}

    def _kernel_metadata(self, kernel: dict[str, Any], session_id: str | None = None) -> dict[str, Any]:
        """ApiKernelMetadata of a kernel; its dockerImage is the image the session (default: the newest
        version's) ran on, as `kernels pull -m` reports it."""
        metadata = {
            "id": kernel["id"], "ref": kernel["ref"], "title": kernel["title"], "author": kernel["owner"],
            "slug": kernel["slug"], "language": kernel["language"], "kernelType": kernel["kernel_type"],
            "isPrivate": kernel["is_private"], "enableGpu": kernel["enable_gpu"], "enableTpu": kernel["enable_tpu"],
            "enableInternet": kernel["enable_internet"], "categoryIds": kernel["category_ids"],
            "datasetDataSources": kernel["dataset_sources"], "kernelDataSources": kernel["kernel_sources"],
            "competitionDataSources": kernel["competition_sources"], "modelDataSources": kernel["model_sources"],
            "currentVersionNumber": kernel["versions"][-1]["number"], "lastRunTime": iso(kernel["last_run"]),
        }
        if kernel["machine_shape"]:
            metadata["machineShape"] = kernel["machine_shape"]
        image = self.store.session(session_id or kernel["versions"][-1]["session"]).get("image")
        if image or kernel["docker_image"]:
            metadata["dockerImage"] = image or kernel["docker_image"]
        return metadata

    @_locked
    def ListKernels(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle kernels list [--mine] [--user U] [-s TERM] [--language L] [--kernel-type T] [--output-type O]
        [--dataset D] [--competition C] [--parent P] [--sort-by S]`: the caller's own (group PROFILE) or public
        ones, filtered and sorted as asked (KERNEL_SORTS), paged."""
        mine = "PROFILE" in str(body.get("group") or "").upper()
        owner, search = body.get("user") or (user if mine else ""), str(body.get("search") or "").lower()
        kernels = [k for k in self.store.kernels.values() if k["versions"]
                   and (not owner or k["owner"] == owner) and (not k["is_private"] or k["owner"] == user)
                   and (not mine or k["owner"] == user)
                   and (search in k["title"].lower() or search in k["slug"]) and self._kernel_matches(k, body)]
        order = KERNEL_SORTS.get(str(body.get("sortBy") or ""), "last_run")
        kernels.sort(key=lambda k: k.get(order) or 0, reverse=True)
        return self._page(body, [dict(self._kernel_metadata(k), totalVotes=k.get("votes", 0)) for k in kernels],
                          "kernels")

    def _kernel_matches(self, kernel: dict[str, Any], body: dict[str, Any]) -> bool:
        """ListKernels' filters: language, kernelType, outputType (data: its newest output has a file;
        visualization: an image or page), a dataset or competition it reads, a parent it was forked from."""
        for key, field_ in (("language", "language"), ("kernelType", "kernel_type")):
            if body.get(key) not in (None, "", "all") and kernel.get(field_) != body[key]:
                return False
        output = str(body.get("outputType") or "all")
        if output != "all":
            names = [name for name, _ in self._output_files(self.store.session(kernel["versions"][-1]["session"]))]
            if output == "data" and not names:
                return False
            if output == "visualization" and not any(n.lower().endswith(VISUAL_SUFFIXES) for n in names):
                return False
        read = {"/".join(source.split("/")[:2]) for source in kernel["dataset_sources"]}
        if body.get("dataset") and body["dataset"] not in read:
            return False
        if body.get("competition") and body["competition"] not in kernel["competition_sources"]:
            return False
        return not body.get("parentKernel") or kernel.get("parent") == body["parentKernel"]

    def _output_files(self, session: dict[str, Any]) -> list[tuple[str, int]]:
        """(name, size) of each file a session's version kept, none while it runs (Kaggle persists the output
        when the session ends)."""
        output = self.store.session_dir(session["id"]) / "output"
        if session["status"] in LIVE or not output.exists():
            return []
        return sorted((str(p.relative_to(output)), p.stat().st_size) for p in output.rglob("*") if p.is_file())

    def ListKernelFiles(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle kernels files owner/slug[/N]`: the output files of the version (default: the newest), with
        sizes, paged (20 by default, at most 200 a page: the client's docs/kernels.md)."""
        with self.store.lock:
            kernel = self._kernel(user, body)
            session = dict(self.store.session(self._kernel_version(kernel, _version_label(body))["session"]))
        created = iso(session.get("ended") or session["queued"])
        items = [{"name": name, "size": size, "creationDate": created} for name, size in self._output_files(session)]
        return self._page(dict(body, pageSize=min(int(body.get("pageSize") or 20), KERNEL_FILES_PAGE_MAX)),
                          items, "files")

    def _page(self, body: dict[str, Any], items: list[dict[str, Any]], key: str) -> dict[str, Any]:
        size = int(body.get("pageSize") or 20)
        start = int(body.get("pageToken") or 0) or (max(int(body.get("page") or 1), 1) - 1) * size
        answer: dict[str, Any] = {key: items[start:start + size]}
        if start + size < len(items):
            answer["nextPageToken"] = str(start + size)
        return answer

    # -- models -------------------------------------------------------------------------------

    def _instance(self, user: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """(key, entry) of the variation a request names (ownerSlug, modelSlug, framework, instanceSlug) that
        the caller may see; a missing or hidden one answers as a missing dataset does."""
        parts = [str(body.get(k) or "") for k in ("ownerSlug", "modelSlug", "framework", "instanceSlug")]
        key = model_key(*parts)
        model = self._model(user, key)
        if model is None:
            raise self._missing(f"model instance {'/'.join(parts)}")
        return key, model

    def _listed_version(self, model: dict[str, Any], number: int | None) -> int:
        """The version a request names (default: the newest listed); one still processing reads as missing."""
        number = int(number or max(model["versions"], default=0))
        if number not in model["versions"]:
            raise self._missing(f"version {number} of model instance {model['ref']}")
        return number

    @_locked
    def ListModelInstanceVersions(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models variations versions list owner/model/framework/variation`, newest first."""
        _, model = self._instance(user, body)
        owner, slug, framework, variation = (str(body.get(k) or "") for k in
                                             ("ownerSlug", "modelSlug", "framework", "instanceSlug"))
        items = [{"versionNumber": n, "ownerSlug": owner, "modelSlug": slug, "variationSlug": variation,
                  "isPrivate": model["is_private"], "url": f"{self.url()}/models/{model['ref']}/{n}",
                  "versionNotes": model.get("notes", {}).get(str(n), "")}
                 for n in sorted(model["versions"], reverse=True)]
        if framework:
            for item in items:
                item["framework"] = framework  # as the caller named it: an SDK enum name
        page = self._page(body, items, "versions")
        return {"versionList": {"versions": page["versions"]},
                **({"nextPageToken": page["nextPageToken"]} if "nextPageToken" in page else {})}

    @_locked
    def ListModelInstanceVersionFiles(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models variations files` (the newest listed version) and `... versions files .../N`: the
        version's files with sizes, paged (nextPageToken "" on the last page, as the client reads it)."""
        key, model = self._instance(user, body)
        number = self._listed_version(model, body.get("versionNumber"))
        folder, created = self.store.model_files_dir(key, number), iso(self._version_created(model, number))
        items = [{"name": str(p.relative_to(folder)), "size": p.stat().st_size, "creationDate": created}
                 for p in sorted(folder.rglob("*")) if p.is_file()]
        page = self._page(body, items, "files")
        return {"files": page["files"], "nextPageToken": page.get("nextPageToken", "")}

    @_locked
    def DownloadModelInstanceVersion(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models variations versions download`: a redirect to the version's files as one .tar.gz
        (the client saves it as <model>.tar.gz and untars it with --untar)."""
        key, model = self._instance(user, body)
        number = self._listed_version(model, body.get("versionNumber"))
        sig = model.setdefault("sigs", {}).setdefault(str(number), new_secret())
        self.store.save()
        raise Redirect(f"{self.url()}/mdl/{sig}/{body.get('modelSlug')}.tar.gz")

    def _version_created(self, model: dict[str, Any], number: int) -> float:
        return float(model.get("created", {}).get(str(number)) or 0.0)

    def model_archive(self, sig: str) -> tuple[Path, float] | None:
        """(tar.gz path, version time) for a model download signature; built once (outside the lock), cached."""
        with self.store.lock:
            found = next(((key, int(n), m) for key, m in self.store.models.items()
                          for n, s in m.get("sigs", {}).items() if s == sig and int(n) in m["versions"]), None)
            if found is None:
                return None
            key, number, model = found
            files, created = self.store.model_files_dir(key, number), self._version_created(model, number)
        path = files.parent / "download.tar.gz"
        if not path.exists():
            tmp = files.parent / f".download.tar.gz.{new_secret()}.tmp"
            with tarfile.open(tmp, "w:gz") as tar:
                for item in sorted(files.rglob("*")):
                    if item.is_file():
                        tar.add(item, str(item.relative_to(files)))
            tmp.replace(path)
        return path, created

    # -- models: the card (kchain release, and Kaggle's own backend tests) -----------------------

    def _cards(self) -> dict[str, Any]:
        return self.store.data.setdefault("model_cards", {})

    def _card(self, user: str, owner: str, slug: str) -> dict[str, Any]:
        card = self._cards().get(f"{owner}/{slug}")
        if card is None or (card["is_private"] and card["owner"] != user):
            raise self._missing(f"model {owner}/{slug}")
        return card

    def _instances_of(self, owner: str, slug: str) -> list[tuple[str, dict[str, Any]]]:
        """(key, entry) of each variation of model owner/slug, in the order they were made."""
        return [(k, m) for k, m in self.store.models.items() if k.startswith(f"{owner}/{slug}/")]

    def CreateModel(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """A model (the card instances hang under): a slug taken answers an error, not a second model."""
        owner, slug = body.get("ownerSlug") or user, body.get("slug") or ""
        self._own(user, owner, "models")
        if not MODEL_SLUG_RE.fullmatch(slug) or not MODEL_SLUG_LEN[0] <= len(slug) <= MODEL_SLUG_LEN[1]:
            return {"error": f"Invalid model slug {slug!r}", "errorCode": 400}
        with self.store.lock:
            if f"{owner}/{slug}" in self._cards():
                # "already used": the words Kaggle's own backend test looks for before it deletes the model
                # and makes it again (kaggle 2.2.5 sdist, tests/backend/backend_tests.py, test_model_c_create_new).
                return {"error": f'The model slug "{slug}" is already used by another model of {owner}.',
                        "errorCode": 409}
            now = time.time()
            card = {"id": self.store.next_id(), "owner": owner, "slug": slug, "title": body.get("title") or slug,
                    "subtitle": body.get("subtitle") or "", "is_private": bool(body.get("isPrivate", True)),
                    "description": body.get("description") or "", "created": now, "updated": now,
                    "publish_time": body.get("publishTime") or "",
                    "provenance_sources": body.get("provenanceSources") or ""}
            self._cards()[f"{owner}/{slug}"] = card
            self.store.save()
        self._maybe_lose_answer()
        return {"id": card["id"], "ref": f"{owner}/{slug}", "url": f"{self.url()}/models/{owner}/{slug}"}

    def _model_info(self, card: dict[str, Any], user: str) -> dict[str, Any]:
        """ApiModel of a card, with the variations the caller may see."""
        ref = f"{card['owner']}/{card['slug']}"
        info = {"id": card["id"], "ref": ref, "title": card["title"], "subtitle": card.get("subtitle", ""),
                "slug": card["slug"], "author": card["owner"], "isPrivate": card["is_private"],
                "description": card["description"], "url": f"{self.url()}/models/{ref}",
                "voteCount": card.get("votes", 0), "updateTime": iso(card.get("updated") or card["created"]),
                "provenanceSources": card.get("provenance_sources", ""),
                "instances": [self._instance_info(k, m) for k, m in self._instances_of(card["owner"], card["slug"])
                              if self._model(user, k) is not None]}
        if card.get("publish_time"):
            info["publishTime"] = card["publish_time"]
        return info

    @_locked
    def GetModel(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._model_info(self._card(user, body.get("ownerSlug") or "", body.get("modelSlug") or ""), user)

    @_locked
    def ListModels(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models list [--owner O] [-s TERM] [--sort-by S]`: the public models (and, with --owner
        naming the caller, their private ones too), sorted (MODEL_SORTS), paged."""
        owner, search = str(body.get("owner") or ""), str(body.get("search") or "").lower()
        cards = [c for c in self._cards().values() if (not owner or c["owner"] == owner)
                 and (not c["is_private"] or owner == user == c["owner"])
                 and (search in c["title"].lower() or search in c["slug"])]
        order = MODEL_SORTS.get(str(body.get("sortBy") or "").removeprefix("LIST_MODELS_ORDER_BY_"), "votes")
        cards.sort(key=lambda c: (c.get(order) or 0, c["created"]), reverse=True)
        page = self._page(body, [self._model_info(c, user) for c in cards], "models")
        return {"models": page["models"], "nextPageToken": page.get("nextPageToken", ""), "totalResults": len(cards)}

    @_locked
    def UpdateModel(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models update`: the fields its updateMask names (camelCase paths, comma-joined); without a
        mask nothing changes (assumption: Kaggle's update RPCs are mask-driven). Privacy reaches the variations."""
        card = self._card(user, body.get("ownerSlug") or "", body.get("modelSlug") or "")
        self._own(user, card["owner"], "models")
        paths = {p.strip() for p in str(body.get("updateMask") or "").split(",") if p.strip()}
        for path, field_ in (("title", "title"), ("subtitle", "subtitle"), ("description", "description"),
                             ("isPrivate", "is_private"), ("publishTime", "publish_time"),
                             ("provenanceSources", "provenance_sources")):
            if path in paths:
                card[field_] = body.get(path) or (False if field_ == "is_private" else "")
        for _, entry in self._instances_of(card["owner"], card["slug"]):
            entry["is_private"] = card["is_private"]
        card["updated"] = time.time()
        self.store.save()
        ref = f"{card['owner']}/{card['slug']}"
        return {"id": card["id"], "ref": ref, "url": f"{self.url()}/models/{ref}", "error": ""}

    @_locked
    def DeleteModel(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models delete owner/model`: the card and every variation and version go; the slug is free
        again (Kaggle's own backend test deletes a model and makes it again under the same slug)."""
        card = self._card(user, body.get("ownerSlug") or "", body.get("modelSlug") or "")
        self._own(user, card["owner"], "models")
        for key, _ in self._instances_of(card["owner"], card["slug"]):
            del self.store.models[key]
        del self._cards()[f"{card['owner']}/{card['slug']}"]
        remove_tree(self.store.root / "models" / card["owner"] / card["slug"])
        self.store.save()
        return {"error": ""}

    # -- models: variations and versions ---------------------------------------------------------

    def _add_model_version(self, key: str, entry: dict[str, Any], staging: Path, notes: str = "") -> int:
        """The staged files as the variation's next version, processing until its window passes; locked. A
        number is never given twice, not even after its version was deleted."""
        pending = entry.setdefault("pending", {})
        number = max([*entry["versions"], *(int(n) for n in pending), entry.get("last", 0)], default=0) + 1
        dest = self.store.model_files_dir(key, number)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.replace(dest)
        now = time.time()
        pending[str(number)] = now + self.switches.version_lag_s + self.faults.processing_s
        entry["last"] = number
        entry.setdefault("created", {})[str(number)] = now
        entry.setdefault("notes", {})[str(number)] = notes
        return number

    def CreateModelInstance(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """A variation of the caller's model with its first version (the uploaded files)."""
        owner, slug = body.get("ownerSlug") or user, body.get("modelSlug") or ""
        inner = body.get("body") or {}
        self._own(user, owner, "models")
        variation, framework = inner.get("instanceSlug") or "", str(inner.get("framework") or "")
        if not INSTANCE_SLUG_RE.fullmatch(variation) or len(variation) > MODEL_SLUG_LEN[1] \
                or not inner.get("licenseName"):
            return {"error": f"Invalid instance slug {variation!r} or no license", "errorCode": 400}
        key = model_key(owner, slug, framework, variation)
        with self.store.lock:
            card = self._card(user, owner, slug)
            if key in self.store.models:
                return {"error": f"Instance {variation!r} already exists", "errorCode": 409}
            blobs = self._blobs(user, inner.get("files", []))
        staging = self._stage(blobs)
        with self.store.lock:
            if key in self.store.models:  # made by a concurrent call while this one unpacked
                shutil.rmtree(staging, ignore_errors=True)
                return {"error": f"Instance {variation!r} already exists", "errorCode": 409}
            entry = {"ref": key, "owner": owner, "is_private": card["is_private"], "versions": [], "pending": {},
                     "id": self.store.next_id(), "model": slug, "slug": variation,
                     "framework": framework_enum(framework), "license": inner["licenseName"],
                     **{k: inner.get(k) or d for k, d in INSTANCE_FIELDS.items()}}
            self._add_model_version(key, entry, staging, "Initial version")
            self.store.models[key] = entry
            self.store.save()
        self._maybe_lose_answer()
        return {"id": entry["id"], "ref": key, "url": f"{self.url()}/models/{key}/1"}

    def _instance_info(self, key: str, model: dict[str, Any]) -> dict[str, Any]:
        """ApiModelInstance of a variation: its newest listed version, its license and card fields."""
        newest = max(model["versions"], default=0)
        folder = self.store.model_files_dir(key, newest)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if newest else 0
        framework, variation = model.get("ref", key).split("/")[2:]
        return {"id": model.get("id", 0), "slug": model.get("slug", variation),
                "framework": model.get("framework") or framework_enum(framework), "versionId": newest,
                "versionNumber": newest, "licenseName": model.get("license", ""),
                "url": f"{self.url()}/models/{model['ref']}/{newest}", "totalUncompressedBytes": size,
                **{k: model.get(k, d) for k, d in INSTANCE_FIELDS.items()}}

    @_locked
    def GetModelInstance(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        key, model = self._instance(user, body)
        return self._instance_info(key, model)

    @_locked
    def ListModelInstances(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models variations list owner/model`: each variation the caller may see (ModelInstance: its
        newest listed version, READY), paged."""
        card = self._card(user, body.get("ownerSlug") or "", body.get("modelSlug") or "")
        items = []
        for key, model in self._instances_of(card["owner"], card["slug"]):
            if self._model(user, key) is None:
                continue
            info = self._instance_info(key, model)
            newest = info["versionNumber"]
            items.append({**{k: info[k] for k in ("id", "slug", "framework", "versionId", "versionNumber",
                                                     "totalUncompressedBytes", *INSTANCE_FIELDS)},
                          "ownerSlug": card["owner"], "modelSlug": card["slug"], "modelId": card["id"],
                          "versionNotes": model.get("notes", {}).get(str(newest), ""), "status": "READY",
                          "creationStatus": {"status": "READY", "versionNumber": newest}})
        page = self._page(body, items, "instances")
        return {"instances": page["instances"], "nextPageToken": page.get("nextPageToken", "")}

    @_locked
    def UpdateModelInstance(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models variations update`: the fields its updateMask names, as UpdateModel does."""
        key, model = self._instance(user, body)
        self._own(user, model["owner"], "models")
        paths = {p.strip() for p in str(body.get("updateMask") or "").split(",") if p.strip()}
        for path in INSTANCE_FIELDS:
            if path in paths:
                model[path] = body.get(path) if body.get(path) is not None else INSTANCE_FIELDS[path]
        if "licenseName" in paths and body.get("licenseName"):
            model["license"] = body["licenseName"]
        self.store.save()
        return {"id": model.get("id", 0), "ref": key, "url": f"{self.url()}/models/{key}", "error": ""}

    @_locked
    def DeleteModelInstance(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models variations delete`: the variation and every version go."""
        key, model = self._instance(user, body)
        self._own(user, model["owner"], "models")
        del self.store.models[key]
        remove_tree(self.store.root / "models" / key)
        self.store.save()
        return {"error": ""}

    @_locked
    def DeleteModelInstanceVersion(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle models variations versions delete .../N`: that version goes (its number is not given again).
        Deleting the last one leaves a variation with no version (assumption: Kaggle's rule is not known)."""
        key, model = self._instance(user, body)
        self._own(user, model["owner"], "models")
        number = int(body.get("versionNumber") or 0)
        if number not in model["versions"] and str(number) not in model.get("pending", {}):
            raise self._missing(f"version {number} of model instance {model['ref']}")
        model["versions"] = [n for n in model["versions"] if n != number]
        model.get("pending", {}).pop(str(number), None)
        remove_tree(self.store.model_files_dir(key, number).parent)
        self.store.save()
        return {"error": ""}

    def CreateModelInstanceVersion(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        parts = [str(body.get(k) or "") for k in ("ownerSlug", "modelSlug", "framework", "instanceSlug")]
        self._own(user, parts[0], "models")
        key = model_key(*parts)
        inner = body.get("body") or {}
        with self.store.lock:
            entry = self._model(user, key)
            if entry is None:
                raise self._missing(f"model instance {'/'.join(parts)}")
            blobs = self._blobs(user, inner.get("files", []))
        staging = self._stage(blobs)
        with self.store.lock:
            number = self._add_model_version(key, entry, staging, inner.get("versionNotes") or "")
            self.store.save()
        self._maybe_lose_answer()
        return {"id": self.store.next_id(), "ref": key, "url": f"{self.url()}/models/{key}/{number}"}

    # -- the public catalogue (Emulator.add_catalogue): objects a workflow reads but does not own -----

    def seed_kernel(self, ref: str, meta: dict[str, Any], source: str, output: Path | None, log: str | None,
                    created: float) -> None:
        """Kernel ref with one version that ran on Kaggle: meta as `kaggle kernels pull -m` writes it (plus
        `totalVotes`), the version's kept output copied from `output`, its log `log`; under the lock."""
        owner, slug = ref.split("/")
        sources = {kind: list(meta.get(f"{kind}_sources") or []) for kind in ("dataset", "kernel", "competition", "model")}
        save = SaveRequest(owner=owner, slug=slug, kernel=None, shape=str(meta.get("machine_shape") or ""),
                           gpu=_flag(meta.get("enable_gpu")), tpu=_flag(meta.get("enable_tpu")), run=False,
                           sources={"datasets": sources["dataset"], "valid_datasets": sources["dataset"],
                                    "valid_kernels": sources["kernel"], "valid_competitions": sources["competition"],
                                    "valid_models": sources["model"], "invalid_datasets": [], "invalid_kernels": [],
                                    "invalid_competitions": [], "invalid_models": []})
        body = {"newTitle": meta.get("title") or slug, "text": source, "language": meta.get("language") or "python",
                "kernelType": meta.get("kernel_type") or "notebook", "isPrivate": _flag(meta.get("is_private")),
                "enableGpu": save.gpu, "enableTpu": save.tpu, "enableInternet": _flag(meta.get("enable_internet")),
                "categoryIds": list(meta.get("keywords") or []), "dockerImage": meta.get("docker_image") or ""}
        kernel = self._upsert_kernel(save, body, created)
        kernel.update(id=int(meta.get("id_no") or kernel["id"]), votes=int(meta.get("totalVotes") or 0))
        _, session_id = self._add_session(save, kernel, body, created)
        self.store.session(session_id).update(image=body["dockerImage"] or None, pushed_from="catalogue")
        sdir = self.store.session_dir(session_id)
        if output is not None:
            shutil.copytree(output, sdir / "output", dirs_exist_ok=True)
        if log is not None:
            (sdir / "log.json").write_text(log, encoding="utf-8")

    def seed_dataset(self, ref: str, info: dict[str, Any], versions: list[Path | None], created: float) -> None:
        """Public dataset ref: info as `kaggle datasets metadata` writes it (DatasetInfo, plus `bigQuery`),
        versions 1..N with the files of each folder (None: no files, as a BigQuery dataset has), every one ready
        long ago; under the lock."""
        owner, slug = ref.split("/")
        licenses = info.get("licenses") or [{"name": "unknown"}]
        dataset: dict[str, Any] = {
            "id": int(info.get("datasetId") or info.get("id_no") or self.store.next_id()), "ref": ref, "owner": owner,
            "slug": slug, "title": info.get("title") or slug, "subtitle": info.get("subtitle") or "",
            "license": licenses[0].get("name") or "unknown", "is_private": _flag(info.get("isPrivate")),
            "description": info.get("description") or "", "keywords": list(info.get("keywords") or []),
            "votes": int(info.get("totalVotes") or 0), "views": int(info.get("totalViews") or 0),
            "downloads": int(info.get("totalDownloads") or 0), "usability": float(info.get("usabilityRating") or 0),
            "bigquery": _flag(info.get("bigQuery")), "created": created, "updated": created, "versions": []}
        for number, folder in enumerate(versions, start=1):
            dest = self.store.version_files_dir(ref, number)
            if folder is not None:
                shutil.copytree(folder, dest, dirs_exist_ok=True)
            dest.mkdir(parents=True, exist_ok=True)
            listing = [{"name": str(p.relative_to(dest)), "size": p.stat().st_size}
                       for p in sorted(dest.rglob("*")) if p.is_file()]
            dataset["versions"].append({"number": number, "created": created, "visible_at": created,
                                        "ready_at": created, "notes": "", "files": listing, "sig": new_secret()})
        self.store.datasets[ref] = dataset

    def seed_model(self, owner: str, slug: str, meta: dict[str, Any], created: float) -> None:
        """Model owner/slug's card: meta as `kaggle models get -p` writes it (plus `voteCount`); under the lock.
        A card already there (a variation seeded before it) keeps its id unless meta names one."""
        card = self._cards().setdefault(f"{owner}/{slug}", {"id": self.store.next_id(), "owner": owner, "slug": slug})
        card.update({"title": meta.get("title") or slug, "subtitle": meta.get("subtitle") or "",
                     "is_private": _flag(meta.get("isPrivate")), "description": meta.get("description") or "",
                     "created": created, "updated": created, "publish_time": meta.get("publishTime") or "",
                     "votes": int(meta.get("voteCount") or 0)})
        card["id"] = int(meta.get("id") or card["id"])
        for _, entry in self._instances_of(owner, slug):
            entry["is_private"] = card["is_private"]

    def seed_model_version(self, ref: str, files: Path | dict[str, bytes | str], meta: dict[str, Any] | None = None,
                           created: float | None = None, private: bool = False) -> None:
        """Model version ref (owner/model/framework/variation/N) with these files (a folder, or name -> content),
        published and processed; its variation (meta as `kaggle models variations get -p` writes it) and card
        made when missing, private as the card is; under the lock."""
        owner, model, framework, variation, version = ref.split("/")
        key, created = model_key(owner, model, framework, variation), created or time.time()
        dest = self.store.model_files_dir(key, int(version))
        if isinstance(files, Path):
            shutil.copytree(files, dest, dirs_exist_ok=True)
        for name, content in files.items() if isinstance(files, dict) else ():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        dest.mkdir(parents=True, exist_ok=True)
        card = self._cards().setdefault(f"{owner}/{model}", {
            "id": self.store.next_id(), "owner": owner, "slug": model, "title": model, "subtitle": "",
            "is_private": private, "description": "", "created": created, "updated": created})
        entry = self.store.models.setdefault(key, {
            "ref": f"{owner}/{model}/{framework}/{variation}", "owner": owner, "is_private": card["is_private"],
            "versions": [], "id": self.store.next_id(), "model": model, "slug": variation,
            "framework": framework_enum(framework), "license": "Apache 2.0"})
        meta = meta or {}
        entry.update({k: meta[k] for k in INSTANCE_FIELDS if k in meta})
        entry.update({"id": int(meta.get("id") or entry["id"]), "license": meta.get("licenseName") or entry["license"]})
        entry["versions"] = sorted({*entry["versions"], int(version)})
        entry["last"] = max(entry.get("last", 0), int(version))
        entry.setdefault("created", {})[version] = created

    # -- blobs --------------------------------------------------------------------------------

    def StartBlobUpload(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("name") or ""
        if not name or "/" in name or name in (".", ".."):
            raise ApiError(400, f"Invalid blob name {name!r}")
        token, upload_id = f"blob-{new_secret()}", new_secret()
        with self.store.lock:
            self.store.blobs[token] = {"owner": user, "name": name, "size": int(body.get("contentLength") or 0),
                                       "upload_id": upload_id, "received": 0, "complete": False,
                                       "created": time.time()}
            self.store.blob_path(token).write_bytes(b"")
            self.store.save()
        return {"token": token, "createUrl": f"{self.url()}/upload/{upload_id}"}

    # -- datasets -----------------------------------------------------------------------------

    @_locked
    def GetDatasetStatus(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        dataset = self._dataset(user, body.get("ownerSlug"), body.get("datasetSlug"))
        if not self.store.version_visible(dataset["versions"][-1]):
            raise ApiError(self.switches.lag_status, f"Dataset {dataset['ref']} not found (its new version is not visible yet)")
        latest = dataset["versions"][-1]
        return {"status": "READY" if self.store.version_ready(latest) else "BLOBS_RECEIVED"}

    @_locked
    def GetDataset(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._dataset_info(self._dataset(user, body.get("ownerSlug"), body.get("datasetSlug")))

    def _dataset_info(self, dataset: dict[str, Any]) -> dict[str, Any]:
        latest = self.store.visible_versions(dataset)[-1]  # the version number lags while a new one is invisible
        return {"id": dataset["id"], "ref": dataset["ref"], "title": dataset["title"],
                "subtitle": dataset.get("subtitle", ""), "url": f"{self.url()}/datasets/{dataset['ref']}",
                "ownerName": dataset["owner"], "ownerRef": dataset["owner"], "isPrivate": dataset["is_private"],
                "licenseName": dataset["license"], "currentVersionNumber": latest["number"],
                "totalBytes": sum(f["size"] for f in latest["files"]), "lastUpdated": iso(latest["created"]),
                "downloadCount": dataset.get("downloads", 0), "voteCount": dataset.get("votes", 0),
                "viewCount": dataset.get("views", 0), "usabilityRating": dataset.get("usability", 0.0),
                "description": dataset.get("description", "")}

    @_locked
    def ListDatasets(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle datasets list [--mine] [--user U] [-s TERM] [--file-type T] [--license L] [--sort-by S]
        [--min-size B] [--max-size B]`: group MY (the caller's), USER or PUBLIC; filtered, sorted, paged."""
        group = str(body.get("group") or "").upper()
        owner = user if group.endswith("_MY") else (body.get("user") or "" if group.endswith("_USER") else "")
        search = str(body.get("search") or "").lower()
        datasets = [d for d in self.store.datasets.values() if self.store.visible_versions(d)
                    and (not owner or d["owner"] == owner) and (not d["is_private"] or d["owner"] == user)
                    and (owner == user or not d["is_private"]) and group in DATASET_GROUPS
                    and (search in d["title"].lower() or search in d["slug"]) and self._dataset_matches(d, body)]
        order = DATASET_SORTS.get(str(body.get("sortBy") or "").removeprefix("DATASET_SORT_BY_"))
        if order:
            datasets.sort(key=lambda d: d.get(order) or 0, reverse=True)
        else:  # HOTTEST, Kaggle's own score: the newest first (assumption)
            datasets.sort(key=lambda d: self.store.visible_versions(d)[-1]["created"], reverse=True)
        return self._page(body, [self._dataset_info(d) for d in datasets], "datasets")

    def _dataset_matches(self, dataset: dict[str, Any], body: dict[str, Any]) -> bool:
        """ListDatasets' filters: fileType (a file of that type in the newest version, or a BigQuery dataset),
        license (the group its license name is in), minSize and maxSize (its newest version's bytes)."""
        files = self.store.visible_versions(dataset)[-1]["files"]
        kind = str(body.get("fileType") or "").removeprefix("DATASET_FILE_TYPE_GROUP_")
        if kind == "BIG_QUERY" and not dataset.get("bigquery"):
            return False
        if kind in FILE_TYPE_SUFFIXES and not any(f["name"].lower().endswith(FILE_TYPE_SUFFIXES[kind]) for f in files):
            return False
        wanted = str(body.get("license") or "").removeprefix("DATASET_LICENSE_GROUP_")
        if wanted not in ("", "ALL") and license_group(dataset["license"]) != wanted:
            return False
        size = sum(f["size"] for f in files)
        return size >= int(body.get("minSize") or 0) and (not body.get("maxSize") or size <= int(body["maxSize"]))

    @_locked
    def GetDatasetMetadata(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle datasets metadata owner/slug`: the dataset's settings and counts (DatasetInfo), which the
        client writes as dataset-metadata.json."""
        dataset = self._dataset(user, body.get("ownerSlug"), body.get("datasetSlug"))
        files, described = self.store.visible_versions(dataset)[-1]["files"], dataset.get("data", {})
        return {"info": {
            "datasetId": dataset["id"], "datasetSlug": dataset["slug"], "ownerUser": dataset["owner"],
            "usabilityRating": dataset.get("usability", 0.0), "totalViews": dataset.get("views", 0),
            "totalVotes": dataset.get("votes", 0), "totalDownloads": dataset.get("downloads", 0),
            "title": dataset["title"], "subtitle": dataset.get("subtitle", ""),
            "description": dataset.get("description", ""), "isPrivate": dataset["is_private"],
            "keywords": dataset.get("keywords", []), "licenses": [{"name": dataset["license"]}], "collaborators": [],
            "data": [dict(described.get(f["name"], {}), name=f["name"], totalBytes=f["size"]) for f in files],
            **{k: dataset[k] for k in ("expectedUpdateFrequency", "userSpecifiedSources") if dataset.get(k)}}}

    @_locked
    def UpdateDatasetMetadata(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle datasets metadata --update`: the owner's new settings. `isPrivate` is a plain bool that the
        client leaves out when false, so an update that does not say private makes the dataset public
        (switches.metadata_sets_privacy)."""
        dataset = self._dataset(user, body.get("ownerSlug"), body.get("datasetSlug"))
        self._own(user, dataset["owner"], "datasets")
        settings = body.get("settings") or {}
        for key in ("title", "subtitle", "description", "expectedUpdateFrequency", "userSpecifiedSources"):
            if settings.get(key) is not None:
                dataset[key] = settings[key]
        if settings.get("keywords"):
            dataset["keywords"] = list(settings["keywords"])
        if settings.get("licenses"):
            dataset["license"] = settings["licenses"][0].get("name") or dataset["license"]
        if settings.get("data"):
            dataset["data"] = {f["name"]: {k: f[k] for k in ("description", "columns") if k in f}
                               for f in settings["data"] if f.get("name")}
        if self.switches.metadata_sets_privacy or settings.get("isPrivate"):
            dataset["is_private"] = bool(settings.get("isPrivate"))  # off: only a "true" is heard
        self.store.save()
        return {"errors": []}

    @_locked
    def DeleteDataset(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """`kaggle datasets delete owner/slug`: the owner's dataset and every version go; its slug is free again
        (kaggle-cli #187 re-creates a deleted one). Sessions that mounted it keep their copies."""
        dataset = self._dataset(user, body.get("ownerSlug"), body.get("datasetSlug"))
        self._own(user, dataset["owner"], "datasets")
        del self.store.datasets[dataset["ref"]]
        remove_tree(self.store.root / "datasets" / dataset["ref"])
        self.store.save()
        return {"error": ""}

    def _maybe_lose_answer(self) -> None:
        if self.faults.lose_answer():
            raise ApiError(500, "Internal error after the version was created (injected)")
        if self.faults.reset_answer():
            raise ResetConnection("the dataset call acted")

    def _blobs(self, user: str, files: list[dict[str, Any]]) -> list[tuple[Path, str]]:
        """(bytes on disk, file name) of each complete upload the request names; under the lock."""
        blobs = []
        for token in [f.get("token", "") for f in files]:
            blob = self.store.blobs.get(token)
            if blob is None or blob["owner"] != user:
                raise ApiError(400, f"Unknown upload token {token!r}")
            if not blob["complete"]:
                raise ApiError(400, f"Upload {blob['name']!r} is incomplete")
            blobs.append((self.store.blob_path(token), blob["name"]))
        return blobs

    def _stage(self, blobs: list[tuple[Path, str]]) -> Path:
        """A version's files in a staging folder, uploaded zips unpacked into folders as on Kaggle.
        Disk work only, so no lock: other calls go on while a big version is unpacked."""
        staging = self.store.root / "staging" / new_secret()
        staging.mkdir(parents=True)
        try:
            for src, name in blobs:
                if name.lower().endswith(".zip") and zipfile.is_zipfile(src):
                    folder = staging / name[:-4]
                    with zipfile.ZipFile(src) as zf:
                        for member in zf.infolist():
                            target = (folder / member.filename).resolve()
                            if not str(target).startswith(str(folder.resolve())):
                                raise ApiError(400, f"Zip {name!r} has an unsafe member {member.filename!r}")
                        zf.extractall(folder)
                else:
                    shutil.copyfile(src, staging / name)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    def _add_version(self, dataset: dict[str, Any], staging: Path, notes: str) -> None:
        """Move the staged files in as the dataset's next version; under the lock."""
        number = len(dataset["versions"]) + 1
        dest = self.store.version_files_dir(dataset["ref"], number)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.replace(dest)
        now = time.time()
        listing = [{"name": str(p.relative_to(dest)), "size": p.stat().st_size}
                   for p in sorted(dest.rglob("*")) if p.is_file()]
        visible = now + self.switches.version_lag_s
        dataset.setdefault("created", now)
        dataset["updated"] = now
        dataset["versions"].append({"number": number, "created": now, "visible_at": visible,
                                    "ready_at": visible + self.faults.processing_s,
                                    "notes": notes, "files": listing, "sig": new_secret()})

    def CreateDataset(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        owner, slug = body.get("ownerSlug") or user, body.get("slug") or ""
        self._own(user, owner, "datasets")
        ref = f"{owner}/{slug}"
        taken = {"status": "error", "error": f'The requested slug "{slug}" is already in use by a dataset.'}
        with self.store.lock:
            if ref in self.store.datasets:
                return taken
            blobs = self._blobs(user, body.get("files", []))
        staging = self._stage(blobs)
        with self.store.lock:
            if ref in self.store.datasets:  # made by a concurrent call while this one unpacked
                shutil.rmtree(staging, ignore_errors=True)
                return taken
            dataset = {"id": self.store.next_id(), "ref": ref, "owner": owner, "slug": slug,
                       "title": body.get("title") or slug, "subtitle": body.get("subtitle", ""),
                       "license": body.get("licenseName", "unknown"), "is_private": bool(body.get("isPrivate")),
                       "description": body.get("description") or "", "keywords": list(body.get("categoryIds", [])),
                       "versions": []}
            self._add_version(dataset, staging, "Initial release")
            self.store.datasets[ref] = dataset
            self.store.save()
        self._maybe_lose_answer()
        return {"ref": ref, "url": f"{self.url()}/datasets/{ref}", "status": "ok"}

    def _create_version(self, user: str, dataset: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        self._own(user, dataset["owner"], "datasets")
        inner = body.get("body") or {}
        with self.store.lock:
            if not self.store.version_ready(dataset["versions"][0]):
                raise ApiError(403, f"Dataset {dataset['ref']} is still processing its first version; "
                                    "try again when its status is ready")
            blobs = self._blobs(user, inner.get("files", []))
        staging = self._stage(blobs)
        with self.store.lock:
            self._add_version(dataset, staging, inner.get("versionNotes", ""))
            if inner.get("subtitle"):
                dataset["subtitle"] = inner["subtitle"]
            self.store.save()
        self._maybe_lose_answer()
        return {"ref": dataset["ref"], "url": f"{self.url()}/datasets/{dataset['ref']}", "status": "ok"}

    def CreateDatasetVersion(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.lock:
            dataset = self._dataset(user, body.get("ownerSlug"), body.get("datasetSlug"))
        return self._create_version(user, dataset, body)

    def CreateDatasetVersionById(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        with self.store.lock:
            dataset = next((d for d in self.store.datasets.values() if d["id"] == body.get("id")), None)
            if dataset is None or (dataset["is_private"] and dataset["owner"] != user):
                raise self._missing(f"dataset id {body.get('id')}")
        return self._create_version(user, dataset, body)

    @_locked
    def DownloadDataset(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        dataset = self._dataset(user, body.get("ownerSlug"), body.get("datasetSlug"))
        version = self._ready_version(dataset, body.get("datasetVersionNumber"))
        base = f"{self.url()}/dl/{version['sig']}"
        name = body.get("fileName")
        if name:
            if not any(f["name"] == name for f in version["files"]):
                raise ApiError(404, f"File {name!r} not found in {dataset['ref']}")
            raise Redirect(f"{base}/file/{name}")
        raise Redirect(f"{base}/{dataset['slug']}.zip")

    @_locked
    def ListDatasetFiles(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        dataset = self._dataset(user, body.get("ownerSlug"), body.get("datasetSlug"))
        version = self._ready_version(dataset, body.get("datasetVersionNumber"))
        size = int(body.get("pageSize") or 20)
        start = int(body.get("pageToken") or 0)
        page = version["files"][start:start + size]
        answer: dict[str, Any] = {"datasetFiles": [
            {"ref": f"{dataset['ref']}/{f['name']}", "name": f["name"], "totalBytes": f["size"],
             "creationDate": iso(version["created"]), "datasetRef": dataset["ref"], "ownerRef": dataset["owner"]}
            for f in page]}
        if start + size < len(version["files"]):
            answer["nextPageToken"] = str(start + size)
        return answer

    # -- file serving (pre-signed URLs) --------------------------------------------------------

    def dataset_zip(self, sig: str) -> tuple[Path, float] | None:
        """(zip path, version time) for a download signature; the zip is built once (outside the
        lock) and cached."""
        with self.store.lock:
            found = next(((d, v) for d in self.store.datasets.values() for v in d["versions"] if v["sig"] == sig), None)
            if found is None:
                return None
            dataset, version = found
            files = self.store.version_files_dir(dataset["ref"], version["number"])
            names, created = [f["name"] for f in version["files"]], version["created"]
        path = files.parent / "download.zip"
        if not path.exists():
            tmp = files.parent / f".download.zip.{new_secret()}.tmp"
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
                for name in names:
                    zf.write(files / name, name)
            tmp.replace(path)
        return path, created

    @_locked
    def dataset_file(self, sig: str, name: str) -> tuple[Path, float] | None:
        for dataset in self.store.datasets.values():
            for version in dataset["versions"]:
                if version["sig"] == sig and any(f["name"] == name for f in version["files"]):
                    return self.store.version_files_dir(dataset["ref"], version["number"]) / name, version["created"]
        return None

    @_locked
    def output_file(self, sig: str, name: str) -> tuple[Path, float] | None:
        for session in self.store.sessions.values():
            if session["output_sig"] == sig:
                kept = self.store.session_dir(session["id"]) / "output"
                if self.switches.unservable_output and (name_problem(name) is not None or _through_link(kept, name)):
                    return None  # listed, never served (switches.unservable_output)
                output = kept.resolve()
                path = (output / name).resolve()
                if path.is_file() and str(path).startswith(str(output) + "/"):
                    return path, session.get("ended") or time.time()
        return None

    @_locked
    def live_log(self, user: str, owner: str, slug: str, label: str) -> tuple[str, bool]:
        """(session id, whether it is live) of the kernel version a log-stream GET names."""
        kernel = self._kernel(user, {"userName": owner, "kernelSlug": slug})
        session_id = self._kernel_version(kernel, _version_label({"versionLabel": label}))["session"]
        return session_id, self.store.session(session_id)["status"] in LIVE

    @_locked
    def session_live(self, session_id: str) -> bool:
        return self.store.session(session_id)["status"] in LIVE

    @_locked
    def user_secret(self, token: str, label: str) -> str | None:
        """A Secret for a session's token: only once the user attached Secrets to that kernel."""
        found = self.runner.secret_tokens.get(token)
        if found is None:
            return None
        user, kernel_ref = found
        if self.switches.secrets_need_attaching and kernel_ref not in self.store.secrets_attached:
            return None
        if self.switches.secrets_reset_on_push and kernel_ref in self.store.secrets_reset:
            return None  # a push from inside a kernel reset them, and nobody attached them again
        return self.secrets.get(user, {}).get(label)
