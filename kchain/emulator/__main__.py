"""`python -m kchain.emulator serve --state DIR [--port N] [--user NAME:KEY] ...`

The same options `kchain emulator serve` offers; prints the `export` lines a shell needs.
"""

from __future__ import annotations

import argparse
import sys

from kchain.emulator.app import serve
from kchain.emulator.faults import Faults
from kchain.emulator.switches import KEPT, LOST, Switches


def _pairs(values: list[str], sep: str, what: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        left, found, right = value.partition(sep)
        if not found or not left or not right:
            raise SystemExit(f"{what} {value!r}: write it as A{sep}B")
        pairs.append((left, right))
    return pairs


def parser(prog: str = "python -m kchain.emulator") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run a local Kaggle until interrupted")
    s.add_argument("--state", required=True, help="folder holding the emulator's state")
    s.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free one)")
    s.add_argument("--user", action="append", default=[], metavar="NAME:KEY")
    s.add_argument("--token", action="append", default=[], metavar="TOKEN=NAME")
    s.add_argument("--secret", action="append", default=[], metavar="NAME:LABEL=VALUE")
    s.add_argument("--session-limit", type=float, default=12 * 3600, metavar="SECONDS")
    s.add_argument("--gpu-quota", type=float, default=30 * 3600, metavar="SECONDS")
    s.add_argument("--max-gpu-sessions", type=int, default=2)
    f = s.add_argument_group("fault injection")
    f.add_argument("--rate-429", type=float, default=0.0)
    f.add_argument("--rate-500", type=float, default=0.0)
    f.add_argument("--kill-after", type=float, default=None, metavar="SECONDS")
    f.add_argument("--kill-random", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"))
    f.add_argument("--drop-upload-every", type=int, default=0, metavar="N")
    f.add_argument("--processing", type=float, default=0.0, metavar="SECONDS")
    f.add_argument("--lose-output", action="store_true")
    f.add_argument("--kill-on-output", default=None, metavar="TEXT",
                   help="kill a session as soon as its log shows TEXT")
    f.add_argument("--kill-after-checkpoint", action="store_true",
                   help="kill a session as soon as it saved a checkpoint past the state it resumed from")
    f.add_argument("--fail-after-save", type=int, default=0, metavar="N",
                   help="the next N SaveKernel calls act, then answer 500 (a lost answer)")
    f.add_argument("--rate-lost-answer", type=float, default=0.0, metavar="P",
                   help="that fraction of creating calls act, then answer 500")
    f.add_argument("--seed", type=int, default=0)
    s.add_argument("--competition", action="append", default=[], metavar="SLUG:USER",
                   help="USER accepted the rules of competition SLUG (else it is an invalid source)")
    add_switch_options(s)
    return p


def add_switch_options(p: argparse.ArgumentParser) -> None:
    """Kaggle's strict behaviour, one option per switch (defaults: the strict case; docs/emulator.md)."""
    d = Switches()
    g = p.add_argument_group("strictness switches (default: strict; see docs/emulator.md for sources)")
    g.add_argument("--lenient", action="store_true",
                   help="start from the kind set (404s, no lag, pins honoured, no queue, output kept, "
                        "secrets attached, GPU quota answered); the options below still override it")
    g.add_argument("--missing-status", type=int, choices=(403, 404), default=None,
                   help=f"answer for a missing or invisible kernel/dataset (default {d.missing_status})")
    g.add_argument("--version-lag", type=float, default=None, metavar="SECONDS",
                   help=f"a new dataset version is invisible this long (default {d.version_lag_s:g})")
    g.add_argument("--lag-status", type=int, choices=(403, 404), default=None,
                   help=f"status answer while a new version is invisible (default {d.lag_status})")
    g.add_argument("--ignore-version-pin", action=argparse.BooleanOptionalAction, default=None,
                   help=f"mount the latest version whatever owner/slug/N says (default {d.ignore_version_pin})")
    g.add_argument("--log-stream", action=argparse.BooleanOptionalAction, default=None,
                   help=f"serve kernels_logs_stream live (default {d.log_stream})")
    g.add_argument("--secrets-need-attaching", action=argparse.BooleanOptionalAction, default=None,
                   help=f"Secrets reach a kernel only once attached (default {d.secrets_need_attaching})")
    g.add_argument("--output-at-limit", choices=(KEPT, LOST), default=None,
                   help=f"output of a session killed at its limit or cancelled (default {d.output_at_limit})")
    g.add_argument("--queue", type=float, default=None, metavar="SECONDS",
                   help=f"time a session waits QUEUED (default {d.queue_s:g})")
    g.add_argument("--boot", type=float, default=None, metavar="SECONDS",
                   help=f"session time spent before the first cell runs (default {d.boot_s:g})")
    g.add_argument("--tpu-session-limit", type=float, default=None, metavar="SECONDS",
                   help=f"limit of TPU sessions (default {d.tpu_session_limit_s:g})")
    g.add_argument("--quota-has-gpu", action=argparse.BooleanOptionalAction, default=None,
                   help=f"GetAcceleratorQuotaStatistics answers gpuQuota (default {d.quota_has_gpu})")


SWITCH_OPTIONS = {"missing_status": "missing_status", "version_lag": "version_lag_s", "lag_status": "lag_status",
                  "ignore_version_pin": "ignore_version_pin", "log_stream": "log_stream",
                  "secrets_need_attaching": "secrets_need_attaching", "output_at_limit": "output_at_limit",
                  "queue": "queue_s", "boot": "boot_s", "tpu_session_limit": "tpu_session_limit_s",
                  "quota_has_gpu": "quota_has_gpu"}


def switches_from(args: argparse.Namespace) -> Switches:
    given = {field: getattr(args, option) for option, field in SWITCH_OPTIONS.items()
             if getattr(args, option) is not None}
    return Switches.lenient(**given) if args.lenient else Switches(**given)


def faults_from(args: argparse.Namespace) -> Faults:
    return Faults(rate_429=args.rate_429, rate_500=args.rate_500, kill_after_s=args.kill_after,
                  kill_random_s=tuple(args.kill_random) if args.kill_random else None,
                  drop_upload_every=args.drop_upload_every, processing_s=args.processing,
                  lose_output=args.lose_output, kill_on_output=args.kill_on_output,
                  kill_after_checkpoint=args.kill_after_checkpoint,
                  fail_after_save=args.fail_after_save, rate_lost_answer=args.rate_lost_answer, seed=args.seed)


def serve_command(args: list[str]) -> None:
    """`kchain emulator serve ARGS`: the same options (and the same --help) under kchain's name."""
    main(["serve", *args], prog="kchain emulator")


def main(argv: list[str] | None = None, prog: str = "python -m kchain.emulator") -> None:
    args = parser(prog).parse_args(argv)
    secrets: dict[str, dict[str, str]] = {}
    for user, assignment in _pairs(args.secret, ":", "--secret"):
        label, _, value = assignment.partition("=")
        secrets.setdefault(user, {})[label] = value
    competitions: dict[str, list[str]] = {}
    for slug, user in _pairs(args.competition, ":", "--competition"):
        competitions.setdefault(slug, []).append(user)
    serve(args.state, port=args.port, users=dict(_pairs(args.user, ":", "--user")),
          tokens=dict(_pairs(args.token, "=", "--token")), faults=faults_from(args), secrets=secrets,
          switches=switches_from(args), competitions=competitions,
          session_limit_s=args.session_limit, gpu_quota_s=args.gpu_quota, max_gpu_sessions=args.max_gpu_sessions)


if __name__ == "__main__":
    sys.exit(main())
