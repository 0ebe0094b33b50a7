"""`python -m kchain.emulator serve --state DIR [--port N] [--user NAME:KEY] ...`

The same options `kchain emulator serve` offers; prints the `export` lines a shell needs.
"""

from __future__ import annotations

import argparse
import sys

from kchain.emulator.app import serve
from kchain.emulator.faults import Faults


def _pairs(values: list[str], sep: str, what: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        left, found, right = value.partition(sep)
        if not found or not left or not right:
            raise SystemExit(f"{what} {value!r}: write it as A{sep}B")
        pairs.append((left, right))
    return pairs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kchain.emulator", description=__doc__.splitlines()[0])
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
    f.add_argument("--seed", type=int, default=0)
    return p


def faults_from(args: argparse.Namespace) -> Faults:
    return Faults(rate_429=args.rate_429, rate_500=args.rate_500, kill_after_s=args.kill_after,
                  kill_random_s=tuple(args.kill_random) if args.kill_random else None,
                  drop_upload_every=args.drop_upload_every, processing_s=args.processing,
                  lose_output=args.lose_output, seed=args.seed)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    secrets: dict[str, dict[str, str]] = {}
    for user, assignment in _pairs(args.secret, ":", "--secret"):
        label, _, value = assignment.partition("=")
        secrets.setdefault(user, {})[label] = value
    serve(args.state, port=args.port, users=dict(_pairs(args.user, ":", "--user")),
          tokens=dict(_pairs(args.token, "=", "--token")), faults=faults_from(args), secrets=secrets,
          session_limit_s=args.session_limit, gpu_quota_s=args.gpu_quota, max_gpu_sessions=args.max_gpu_sessions)


if __name__ == "__main__":
    sys.exit(main())
