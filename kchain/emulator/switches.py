"""How strict the emulator is: Kaggle's known (or feared) behaviour, one switch each.

One `Switches` object hangs off a running emulator (`emu.switches`); like `emu.faults`, a test may
change it while the emulator runs. The defaults are the strict case: what Kaggle is documented or
reported to do, or, where that is unknown, the worse case for a client. `Switches.lenient()` is the
kind set (the emulator as it was before these switches). docs/emulator.md gives each switch's source.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def opt(default: Any, help: str, metavar: str | None = None, choices: tuple[Any, ...] | None = None) -> Any:
    """A field that is also an option of `kchain emulator serve`, spelled once: the option is the field's
    name without its `_s` unit and with dashes (`version_lag_s`: --version-lag); a bool is a --x/--no-x
    pair; `help` is its line (cli.py puts "Switch:" or "Fault:" before it)."""
    return field(default=default, metadata={"help": help, "metavar": metavar, "choices": choices})


KEPT, LOST = "kept", "lost"
RUNNING, ERROR = "running", "error"  # what a session whose runner crashed shows


@dataclass
class Limits:
    """The account's limits: a session's time limit, the weekly GPU quota, the GPU concurrency cap, and
    when the account's quota week starts (this long after Saturday 00:00 UTC; accounts may differ)."""
    session_limit_s: float = opt(12 * 3600, "A session's time limit.", metavar='SECONDS')
    gpu_quota_s: float = opt(30 * 3600, 'The weekly GPU quota of each user.', metavar='SECONDS')
    max_gpu_sessions: int = opt(2, 'GPU sessions a user may run at once.', metavar='N')
    quota_week_offset_s: float = opt(0.0, "When the quota week starts, this long after Saturday 00:00 UTC.", metavar="SECONDS")
    # CPU sessions (no accelerator) a user may run at once. They never count against the GPU cap or quota.
    # [UNCERTAIN] No source found states Kaggle's CPU cap (shared/reference/kaggle-api.md 6.1 names only
    # the 12 h limit): 2 is the worse case kchain can still work under (the doctor's probe beside the
    # version it pushes; an unattended chain's relay beside one CPU notebook of the user's).
    max_cpu_sessions: int = opt(2, "CPU sessions a user may run at once.", metavar="N")


@dataclass
class Switches:
    # HTTP status for a kernel or dataset that does not exist or that the caller may not see
    # (Kaggle answers 403 so the namespace cannot be probed); 404 is the kind alternative.
    missing_status: int = opt(403, 'the answer for a missing or invisible kernel or dataset.', choices=(403, 404))
    # A new dataset version stays invisible this long after it was created: the dataset's status
    # call answers `lag_status` and GetDataset still names the previous version number.
    version_lag_s: float = opt(2.0, 'a new dataset version stays invisible this long.', metavar='SECONDS')
    lag_status: int = opt(404, "the status call's answer while a new version is invisible.", choices=(403, 404))
    # The version pin in `dataset_sources: [owner/slug/N]` is ignored: the latest ready version is
    # mounted. (The pin is still checked at SaveKernel: a pin to a missing version is invalid.)
    ignore_version_pin: bool = opt(True, 'mount the latest version whatever owner/slug/N says.')
    # `GET /api/v1/kernels/logs/stream/<owner>/<slug>` (kernels_logs_stream) streams live lines.
    # Off: it answers 404, and the log exists only once the session has ended.
    log_stream: bool = opt(True, 'serve kernels_logs_stream live.')
    # What Kaggle's persisted log (kernels_logs, ListKernelSessionOutput's `log`) holds while the session runs:
    # unset, nothing until the end; TEXT, the log up to the first line showing TEXT, never newer until the end (a
    # persisted blob that lags the live stream). Which Kaggle does is not known.
    stale_log_at: str | None = opt(None, "while a session runs, its persisted log holds the log up to the first "
                                         "line showing TEXT and no more (unset: an empty log).", metavar="TEXT")
    # A kernel sees the user's Secrets only after `emu.attach_secrets(ref)` ("attached in the web UI").
    secrets_need_attaching: bool = opt(True, 'Secrets reach a kernel only once attached to it.')
    # What a session killed at its time limit (or cancelled) leaves behind: "kept" or "lost".
    output_at_limit: str = opt(LOST, 'the output of a session killed at its limit or cancelled.', choices=('kept', 'lost'))
    # A session waits QUEUED this long; then its clock starts (RUNNING), and the notebook's first
    # cell runs `boot_s` later (the container starts on the session's time).
    queue_s: float = opt(1.0, 'the time a session waits QUEUED.', metavar='SECONDS')
    boot_s: float = opt(1.0, 'session time spent before the first cell runs.', metavar='SECONDS')
    # TPU sessions (enableTpu, or a machineShape starting with "Tpu") end after this many seconds.
    tpu_session_limit_s: float = opt(9 * 3600, 'the time limit of TPU sessions.', metavar='SECONDS')
    # GetAcceleratorQuotaStatistics answers with a `gpuQuota` (False: no GPU figures at all).
    quota_has_gpu: bool = opt(False, 'GetAcceleratorQuotaStatistics answers with a gpuQuota.')
    # What a session whose notebook runner crashed (faults.crash_runner_on_output) shows: "running" stays
    # RUNNING, its time limit ignored and its GPU time counted, until its kernel is deleted; "error" ends ERROR.
    crashed_runner: str = opt(RUNNING, 'a session whose runner crashed stays RUNNING until its kernel is deleted, or ends ERROR.', choices=('running', 'error'))
    # Kaggle releases a new image every N sessions the account pushes to run (0: never). A session runs on
    # the newest one unless its push pins another (`docker_image`, or `docker_image_pinning_type: original`:
    # the image of the kernel's first version).
    new_image_every: int = opt(1, 'Kaggle releases a new image every N pushed sessions (0: never).', metavar='N')
    # A push's image pins (`docker_image`, pinning type `original`) are ignored: every session gets the newest.
    ignore_image_pin: bool = opt(False, 'docker_image and pinning type original have no effect: every session gets the newest image.')
    # "Ready" is not "mounted": a dataset version that became ready less than this long before a session
    # started appears in the session's input only this long after it became ready (until then the
    # dataset's folder is absent). A 2026 measurement saw 138 s once (docs/emulator.md); in the
    # emulator's compressed time, seconds.
    mount_lag_s: float = opt(3.0, 'a dataset version ready less than this long ago is mounted in a session only this long after ready.', metavar='SECONDS')
    # A kernel may push a kernel (SaveKernel sent from inside a running session, with the user's key from
    # Secrets). Kaggle documents neither way: False, the worse case, answers such a SaveKernel 403.
    kernel_may_push: bool = opt(False, "A kernel may push a kernel (SaveKernel from inside a session); off answers it 403.")
    # A push resets the pushed kernel's Secret attachments (kaggle-notebook-deploy's README: "`kaggle kernels
    # push` resets Kaggle Secrets bindings; re-attach ... via the web UI after each push"; kaggle-api.md 6.5,
    # [3RD, unverified]). On: a version pushed from inside a kernel sees no Secret (nobody re-attaches them);
    # the user re-attaches after each push of their own (`emu.attach_secrets`, `serve --attach-secret`).
    secrets_reset_on_push: bool = opt(True, "A push resets the kernel's Secrets; a version pushed from inside a kernel "
                                            "sees none.")
    # A file of a session's output that is a link, or whose name kchain.common.outputfiles.name_problem refuses,
    # is listed and answers 404 (issue #61: a W&B link; what Kaggle does with either is not known: the worse case).
    unservable_output: bool = opt(True, "A link in a session's output, or a name the listing cannot serve, is listed "
                                        "and answers 404.")
    # UpdateDatasetMetadata sets isPrivate as sent. DatasetSettings.is_private is a plain bool (default false) that
    # the client leaves out when false, so an update whose metadata does not say "isPrivate": true makes the
    # dataset public. Whether Kaggle keeps the privacy instead is not known: the worse case. Off: only a true is heard.
    metadata_sets_privacy: bool = opt(True, "An UpdateDatasetMetadata that does not say isPrivate makes the dataset "
                                            "public.")

    def __post_init__(self) -> None:
        if self.missing_status not in (403, 404) or self.lag_status not in (403, 404):
            raise ValueError("missing_status and lag_status are 403 or 404")
        if self.output_at_limit not in (KEPT, LOST):
            raise ValueError(f"output_at_limit is {KEPT!r} or {LOST!r}, not {self.output_at_limit!r}")
        if self.crashed_runner not in (RUNNING, ERROR):
            raise ValueError(f"crashed_runner is {RUNNING!r} or {ERROR!r}, not {self.crashed_runner!r}")
        if self.mount_lag_s < 0:
            raise ValueError("mount_lag_s is 0 (mounted once ready) or a number of seconds")
        if self.new_image_every < 0:
            raise ValueError("new_image_every is 0 (never) or a number of sessions")

    @classmethod
    def lenient(cls, **overrides: Any) -> Switches:
        """The kind emulator: 404s, instant versions, pins honoured, no queue, output kept, secrets
        attached and kept across pushes, a GPU quota in every answer, a crashed runner ends its session, one image for ever,
        every output file served as the file system allows, privacy kept by a metadata update."""
        kind = {"missing_status": 404, "version_lag_s": 0.0, "ignore_version_pin": False,
                "secrets_need_attaching": False, "output_at_limit": KEPT, "queue_s": 0.0, "boot_s": 0.0,
                "quota_has_gpu": True, "crashed_runner": ERROR, "new_image_every": 0, "mount_lag_s": 0.0, "kernel_may_push": True,
                "secrets_reset_on_push": False, "unservable_output": False, "metadata_sets_privacy": False}
        return cls(**{**kind, **overrides})

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
