"""A kernel that pushes the next session of its chain itself (`kchain push --unattended`).

The laptop renders, beside the notebook, the notebook's template (`NEXT_FILE` in the payload): the
notebook with the few values that change from session to session left as placeholders (the session
number, the state it resumes, the config, the payload). `render.render_job` makes every unattended
notebook by `fill_notebook` from that template, and the kernel fills the same template with the next
session's values, so the next notebook is, byte for byte, what the laptop would render for it.

At the end of a session (in the publish process, the only one that holds the credential):
its state version is published (kchain.common.publish), then `chain_on` waits until that version is ready
(bounded by the session's time left), decides with `nextsession.decide` (the table `continue` uses)
and `nextsession.afford`, and pushes the next kernel version exactly once (a lost answer is settled by
the kernel's version number). What it decided and why goes into summary.json (`NEXT_KEY`) and the log,
so the laptop rebuilds the chain from Kaggle's outputs alone (`sessions.adopt_pushed`).

Standard library only; the kaggle client is the one the publish process authenticated.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kchain.common import layout, sendonce, summary

NEXT_FILE = "kchain_next.json"  # in the payload: the next session's template (its presence: unattended)
PAYLOAD_FILE = "kchain_payload.b64"  # written by the notebook's unpack cell beside the config
NEXT_KEY = "next"  # summary.json: what this session decided about the next one (a NextRecord)
FORMAT = "kchain-next/1"
SESSION, STATES, CONFIG, PAYLOAD = "@@kchain-session@@", "@@kchain-states@@", "@@kchain-config@@", "@@kchain-payload@@"
FRESH = "none (a fresh start)"
SETTLE_S = 20.0  # how long a push whose answer was lost is settled by the kernel's version number
ATTEMPTS = 4  # sends of one push at most, each after the kernel's version showed the last did not land
Say = Callable[[str], None]


def tojson(value: Any) -> str:
    """Jinja's `tojson` filter (htmlsafe_json_dumps with sort_keys), which the template used."""
    return (json.dumps(value, sort_keys=True).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026").replace("'", "\\u0027"))


def canonical(data: Any) -> str:
    """render._canonical's form: what a rendered notebook or metadata file is, byte for byte."""
    return json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def state_text(sources: list[str]) -> str:
    return ", ".join(sources) or FRESH


def fill_notebook(template: str, session: int, sources: list[str], config: dict[str, Any], payload: str) -> str:
    """The notebook for one session from the template: its number, attached sources, config and payload."""
    notebook = json.loads(template)
    values = {SESSION: str(session), STATES: state_text(sources),
              tojson(CONFIG): tojson(json.dumps(config, sort_keys=True)), tojson(PAYLOAD): tojson(payload)}
    for cell in notebook["cells"]:
        text = cell["source"]
        for token, value in values.items():
            text = text.replace(token, value)
        cell["source"] = text
    return canonical(notebook)


def fill_metadata(template: str, sources: list[str], image: str | None) -> str:
    """kernel-metadata.json for one session: the job's own sources plus the chain's, pinned to image."""
    metadata = json.loads(template)
    metadata["dataset_sources"] = list(metadata["dataset_sources"]) + list(sources)
    if image:
        metadata["docker_image"] = image
    return canonical(metadata)


def _next_config(config: dict[str, Any], resume: dict[str, Any], publish: dict | None,
                week: dict | None = None) -> dict[str, Any]:
    """This session's config (as the notebook embedded it) with the next session's resume, figures and week."""
    kaggle = {k: v for k, v in config["kaggle"].items() if k not in ("resume", "publish", "week")}
    kaggle["resume"] = resume
    if publish:
        kaggle["publish"] = publish
    if week:
        kaggle["week"] = week
    return {**config, "kaggle": kaggle}


def resume_for(session: int, step: int, version: int | None, attempt: int = 1) -> dict[str, Any]:
    """config.kaggle.resume for a session (the laptop's chain.session_facts and the kernel alike)."""
    resume: dict[str, Any] = {"step": step, "state_version": version, "session": session}
    if attempt > 1:
        resume["attempt"] = attempt
    return resume


def load_template(src: Path) -> dict[str, Any] | None:
    """The next session's template in this kernel's unpacked sources; None: the chain is not unattended."""
    try:
        template = json.loads((src / NEXT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return template if isinstance(template, dict) and template.get("format") == FORMAT else None


def record(kchain_dir: Path, next_record: dict[str, Any], say: Say) -> None:
    """The decision into summary.json (atomic) and one line of the log."""
    path = kchain_dir / layout.SUMMARY
    ended = summary.read(path) or summary.Summary()
    ended.extra[NEXT_KEY] = next_record
    summary.write(path, ended)
    say(f"next: {next_record['decision']}: {next_record['why']}")


def kernel_version(api: Any, ref: str) -> int | None:
    """The kernel's newest version number (GetKernel): 0 when Kaggle says there is no such kernel (403, 404:
    kaggle-api.md 8), None when no answer came (the caller asks again: `read_version`)."""
    from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest

    owner, slug = ref.split("/", 1)
    try:
        with api.build_kaggle_client() as kaggle:
            request = ApiGetKernelRequest()
            request.user_name, request.kernel_slug = owner, slug
            return int(kaggle.kernels.kernels_api_client.get_kernel(request).metadata.current_version_number or 0)
    except Exception as exc:  # noqa: BLE001 - unknown: the caller settles by looking again
        return 0 if sendonce.status_code(exc) in (403, 404) else None


def read_version(api: Any, ref: str, until: float | None = None, attempts: int = 4) -> int | None:
    """kernel_version, asked again after no answer (a 429, a 500, a reset): `attempts` times, and more while the
    caller's time allows when `until` (a monotonic deadline) is given. A push is settled against this number, so
    an unknown one must not pass for "no version yet", and giving up leaves the chain to the laptop."""
    attempt = 0
    while True:
        version = kernel_version(api, ref)
        wait = min(2.0 ** attempt, 8.0)
        more = attempt < attempts - 1 or (until is not None and time.monotonic() + wait < until)
        if version is not None or not more:
            return version
        time.sleep(wait)
        attempt += 1


def push_once(api: Any, folder: Path, ref: str, timeout_s: int, until: float) -> dict[str, Any]:
    """The next kernel version, sent once: a failed send is settled by the kernel's version number (a
    new one: it landed); sent again only when the version says it did not land and time is left.
    Returns {version | refused | unknown, version_before}."""
    before = read_version(api, ref, until)
    out: dict[str, Any] = {"version_before": before}

    def landed() -> int | None:
        now = kernel_version(api, ref)
        return now if now is not None and now != before else None

    def send() -> Any:  # a 429 acted on nothing: sent again in place (the client does not retry a push)
        return sendonce.again_after_429(lambda: api.kernels_push(str(folder), timeout=str(int(timeout_s))),
                                        until=until)

    try:  # whatever broke but a refusal (a 4xx other than 429), the kernel's versions say what happened
        answer, seen = sendonce.send_and_settle(
            send, landed, lost=_not_refused,
            attempts=ATTEMPTS, settle_s=max(0.0, min(SETTLE_S, until - time.monotonic())),
            may_resend=lambda: before is not None and time.monotonic() + SETTLE_S <= until)
    except sendonce.NotLanded as exc:
        return {**out, "unknown": f"{type(exc.last).__name__}: {str(exc.last)[:160]}"}
    except Exception as exc:  # noqa: BLE001 - a refusal: Kaggle acted on nothing
        return {**out, "refused": f"HTTP {sendonce.status_code(exc)}: {str(exc)[:160]}"}
    if seen:
        return {**out, "version": seen}
    error = getattr(answer, "error", None)
    if error:
        return {**out, "refused": str(error)[:200]}
    return {**out, "version": int(getattr(answer, "version_number", 0) or 0) or None}


def _not_refused(exc: BaseException) -> bool:
    code = sendonce.status_code(exc)
    return not (code is not None and 400 <= code < 500 and code != 429)


def write_kernel(folder: Path, name: str, notebook: str, metadata: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.ipynb").write_text(notebook, encoding="utf-8")
    (folder / "kernel-metadata.json").write_text(metadata, encoding="utf-8")


def write_next(folder: Path, template: dict[str, Any], src: Path, config: dict[str, Any], plan: dict[str, Any]) -> None:
    """The next session's kernel folder from the template (plan: session, sources, resume, publish)."""
    payload = (src / PAYLOAD_FILE).read_text(encoding="ascii")
    notebook = fill_notebook(template["notebook"], plan["session"], plan["sources"],
                             _next_config(config, plan["resume"], plan["publish"], plan.get("week")), payload)
    metadata = fill_metadata(template["metadata"], plan["sources"], template["chain"].get("image"))
    write_kernel(folder, config["job"], notebook, metadata)


def send_next(api: Any, template: dict[str, Any], src: Path, config: dict[str, Any], plan: dict[str, Any],
              until: float) -> dict[str, Any]:
    """Render the next session from the template and push it once."""
    chain = template["chain"]
    work = Path(tempfile.mkdtemp(prefix="kchain-next-"))
    try:
        write_next(work, template, src, config, plan)
        return push_once(api, work, chain["kernel"], int(chain["session_limit_s"]), until)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def used_s(api: Any, chain_gpu_s: float) -> tuple[float, float | None, str]:
    """GPU time used this week and the allowance: Kaggle's quota_view when it reports them, else the
    chain's own sessions (what this kernel knows; other use of the account is not in it)."""
    try:
        gpu = getattr(api.quota_view(), "gpu_quota", None)
    except Exception:  # noqa: BLE001 - no answer: the chain's own count
        gpu = None
    used, total = getattr(gpu, "time_used", None), getattr(gpu, "total_time_allowed", None)
    if used is not None:
        return used.total_seconds(), (total.total_seconds() if total is not None else None), "Kaggle's quota_view"
    return chain_gpu_s, None, "this chain's own sessions this week (Kaggle's quota answer has no GPU figures)"


