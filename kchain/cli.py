"""The kchain command line: each command parses options, calls one library function, prints.

Library code raises KchainError subclasses; `main` turns them into one `Error:` line and the
class's exit code (listed in the README). No YAML, Jinja, kaggle or torch imports here.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import click

import kchain
from kchain.errors import KchainError


class Seconds(click.FloatRange):
    """A number of seconds in a range; unlike FloatRange, nan is refused (it compares false to both ends)."""

    def convert(self, value, param, ctx):  # type: ignore[no-untyped-def]
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return number


JOB = click.argument("job", type=click.Path(path_type=Path), default="job.yaml", required=False)


class KchainGroup(click.Group):
    """Converts KchainError into a click error with the class's exit code, in one place."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KchainError as exc:
            error = click.ClickException(str(exc))
            error.exit_code = exc.exit_code
            raise error from None


@click.group(cls=KchainGroup)
@click.version_option(kchain.__version__, prog_name="kchain")
def cli() -> None:
    """Train on free, session-limited Kaggle GPUs without losing the run or the week.

    \b
    Example:
      kchain smoke jobs/tinygpt/job.yaml     # prove the notebook on this CPU
      kchain push jobs/tinygpt/job.yaml      # start session 1 on Kaggle
      kchain continue jobs/tinygpt/job.yaml  # chain the next session
    """


@cli.command()
@click.argument("folder", type=click.Path(path_type=Path), default=".")
def init(folder: Path) -> None:
    """Write a commented job.yaml and a train.py skeleton that pass `kchain smoke` (never overwrites).

    \b
    Example:
      kchain init jobs/my-model && kchain smoke jobs/my-model/job.yaml
    """
    from kchain.init import init_job

    for path in init_job(folder):
        click.echo(f"wrote {path}")


@cli.command()
@JOB
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, help="Output folder (default: build/<name>).")
def render(job: Path, out: Path | None) -> None:
    """Write the notebook and kernel-metadata.json exactly as a push would send them.

    \b
    Example:
      kchain render jobs/tinygpt/job.yaml -o build/tinygpt
    """
    from kchain.kaggle_api import configured_username
    from kchain.render import payload_lines, render_job, write_rendered
    from kchain.spec import load_job

    spec = load_job(job)
    rendered = render_job(spec, owner=spec.kaggle.owner or configured_username())
    paths = write_rendered(rendered, out or Path("build") / spec.name)
    for line in payload_lines(rendered):
        click.echo(line)
    for path in paths:
        click.echo(f"wrote {path}")
    click.echo(f"fingerprint {rendered.fingerprint}")


@cli.command()
@JOB
@click.option("--quiet", is_flag=True, help="Hide the training output; show stages and the verdict.")
@click.option("--download", is_flag=True, help="Fetch attached datasets that have no kaggle.local copy (cached).")
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE",
              help="A param for this smoke, over params and smoke.params (repeatable).")
@click.option("--ranks", type=click.IntRange(1, 2), default=None,
              help="Ranks to run (default: as many as the job gets on Kaggle, as gloo ranks on the CPU).")
def smoke(job: Path, quiet: bool, download: bool, sets: tuple[str, ...], ranks: int | None) -> None:
    """Run the rendered notebook on this CPU: checks, steps, a stop, checkpoint, kill, exact resume.

    \b
    Example:
      kchain smoke jobs/tinygpt/job.yaml
      kchain smoke jobs/nanogpt/job.yaml --set n_layer=2 --set eval_iters=2
    """
    from kchain.smoke import smoke as run_smoke
    from kchain.spec import parse_overrides

    click.echo(f"kchain smoke {job}")
    report = run_smoke(job, echo=click.echo, quiet_training=quiet, download=download,
                       sets=parse_overrides(sets), ranks_asked=ranks)
    click.echo(f"smoke passed: {report.run_id} (fingerprint {report.fingerprint[:12]}) recorded in the run log")


@cli.command()
@JOB
@click.option("--offline", is_flag=True, help="Only the laptop-side checks; no Kaggle call.")
@click.option("--no-probe", is_flag=True, help="Skip the probe's CPU session (account, sources and metadata only).")
@click.option("--probe-timeout", type=float, default=900.0, show_default=True, help="Seconds to wait for the probe.")
def doctor(job: Path, offline: bool, no_probe: bool, probe_timeout: float) -> None:
    """Check the account, the sources and the kernel image before the first GPU-hour, for free.

    \b
    Example:
      kchain doctor jobs/tinygpt/job.yaml              # all checks, the probe on a free CPU session
      kchain doctor jobs/tinygpt/job.yaml --offline    # laptop-side checks only
    """
    from kchain.doctor import run_doctor

    report = run_doctor(job, offline=offline, probe=not no_probe, echo=click.echo, probe_timeout_s=probe_timeout)
    click.echo(report.verdict())


@cli.command()
@JOB
@click.option("--skip-smoke", is_flag=True, help="Push code that never passed a smoke run (recorded in the run log).")
@click.option("--force", is_flag=True, help="Push even if the week's GPU quota cannot cover the session.")
def push(job: Path, skip_smoke: bool, force: bool) -> None:
    """Start session 1 on Kaggle: smoked code only, within the week's quota.

    \b
    Example:
      kchain smoke jobs/tinygpt/job.yaml && kchain push jobs/tinygpt/job.yaml
    """
    from kchain.push import push as run_push

    run_push(job, skip_smoke=skip_smoke, force=force, echo=click.echo)


@cli.command()
@JOB
def status(job: Path) -> None:
    """One table of the chain: each session's version, status, duration, steps, last words.

    \b
    Example:
      kchain status jobs/tinygpt/job.yaml
    """
    from kchain.sessions import status_for

    for line in status_for(job):
        click.echo(line)


@cli.command()
@JOB
@click.option("--session", "number", type=click.IntRange(min=1), default=None, help="Session number (default: the last).")
@click.option("--follow", is_flag=True, help="Keep polling until the session ends.")
@click.option("--poll", type=Seconds(1.0, 3600.0), default=30.0, show_default=True, help="Seconds between polls with --follow.")
def logs(job: Path, number: int | None, follow: bool, poll: float) -> None:
    """A session's log: heartbeat lines and, for a failure, its class, first line and a hint.

    \b
    Example:
      kchain logs jobs/tinygpt/job.yaml --follow
    """
    from kchain.sessions import logs_for

    logs_for(job, number, follow=follow, poll_s=poll, echo=click.echo)


@cli.command(name="continue")
@JOB
@click.option("--retry", is_flag=True, help="Run a session that crashed once again, unchanged.")
@click.option("--watch", "watch_chain", is_flag=True, help="Keep chaining until done, out of budget, or a crash.")
@click.option("--force", is_flag=True, help="Push even if the week's GPU quota cannot cover the session.")
@click.option("--skip-smoke", is_flag=True, help="Allow code that never passed a smoke run.")
@click.option("--from-state", type=int, default=None, metavar="N",
              help="Resume from state version N when the last session's output cannot be fetched (loses its steps).")
def continue_(job: Path, retry: bool, watch_chain: bool, force: bool, skip_smoke: bool, from_state: int | None) -> None:
    """Chain the next session from the saved state, or say why not.

    \b
    Example:
      kchain continue jobs/tinygpt/job.yaml --watch
    """
    from kchain.chain import continue_chain

    decision = continue_chain(job, retry=retry, force=force, skip_smoke=skip_smoke, watch_chain=watch_chain,
                              echo=click.echo, from_state=from_state)
    click.echo(decision.message)


@cli.command()
@JOB
@click.option("--wait", "wait_s", type=float, default=3600.0, show_default=True,
              help="Seconds to wait for the session to end once you stopped it on its page.")
@click.option("--poll", "poll_s", type=float, default=10.0, show_default=True, help="Seconds between status checks.")
def stop(job: Path, wait_s: float, poll_s: float) -> None:
    """Stop the running session and record it; `continue` resumes from the last saved state.

    \b
    Example:
      kchain stop jobs/tinygpt/job.yaml
    """
    from kchain.chain import stop_chain

    stop_chain(job, wait_s=wait_s, poll_s=poll_s, echo=click.echo)


@cli.command()
@JOB
def budget(job: Path) -> None:
    """This quota week's GPU-hours, session by session, and what the remaining steps need.

    \b
    Example:
      kchain budget jobs/tinygpt/job.yaml
    """
    from kchain.ledger import budget_for

    for line in budget_for(job):
        click.echo(line)


@cli.command()
@JOB
def runs(job: Path) -> None:
    """The run log, with the best row by validation metric and its checkpoint.

    \b
    Example:
      kchain runs jobs/tinygpt/job.yaml
    """
    from kchain.ledger import runs_for

    for line in runs_for(job):
        click.echo(line)


@cli.command()
@JOB
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, help="PNG path (default: .kchain/<name>-loss.png).")
def plot(job: Path, out: Path | None) -> None:
    """A PNG of training and validation loss across the whole chain, sessions marked.

    \b
    Example:
      kchain plot jobs/tinygpt/job.yaml -o loss.png
    """
    from kchain.plot import plot_for

    click.echo(f"wrote {plot_for(job, out)}")


@cli.command()
@JOB
@click.option("--session-limit", type=Seconds(1.0, 12 * 3600.0), default=20.0, show_default=True,
              help="Seconds per emulated session (longer when session 1 shows the chain would need many).")
@click.option("--kills", type=click.IntRange(0, 100), default=1, show_default=True,
              help="Sessions killed (a SIGKILL once they saved a checkpoint past their resume), exactly.")
@click.option("--ranks", type=click.IntRange(1, 2), default=None,
              help="Ranks per session and in the uninterrupted run (default: as many as the job gets on Kaggle, "
                   "as gloo ranks on the CPU).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", help="Override a param, e.g. --set steps=300.")
@click.option("--faults", "fault_spec", default="", metavar="SPEC",
              help="A flaky Kaggle, rates per call: e.g. 429=0.15,500=0.10,lost_answer=0.1,drop_upload=0.1.")
@click.option("--strict/--lenient", default=True, show_default=True,
              help="Kaggle's strict behaviour (403s, lagging versions, ignored pins, lost output) or a kind one.")
def rehearse(job: Path, session_limit: float, kills: int, ranks: int | None, seed: int, sets: tuple[str, ...],
             fault_spec: str, strict: bool) -> None:
    """The whole chain on this machine against a local Kaggle, compared with one uninterrupted run.

    It passes only when the traces are identical, a session resumed from a saved state, the kills
    asked for happened, and the chain trained every step it asked for.

    \b
    Example:
      kchain rehearse jobs/tinygpt/job.yaml --set steps=300
      kchain rehearse jobs/tinygpt/job.yaml --set steps=300 --faults 429=0.15,500=0.10 --kills 2
      kchain rehearse jobs/tinygpt/job.yaml --set steps=300 --ranks 1
    """
    from kchain.errors import KchainError
    from kchain.rehearse import emulator_switches, parse_fault_spec, parse_sets
    from kchain.rehearse import rehearse as run_rehearse

    result = run_rehearse(job, session_limit_s=session_limit, kills=kills, seed=seed, params=parse_sets(sets),
                          faults=parse_fault_spec(fault_spec, seed), switches=emulator_switches(strict),
                          echo=click.echo, ranks=ranks)
    if not result.passed:
        raise KchainError(f"rehearsal: the chained run {result.verdict}")


@cli.group()
def emulator() -> None:
    """The local Kaggle that kchain is tested against."""


@emulator.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                    "help_option_names": []})
@click.pass_context
def serve(ctx: click.Context) -> None:
    """Run a local Kaggle until interrupted; prints the environment to export. --help lists every switch."""
    from kchain.emulator.__main__ import serve_command

    serve_command(ctx.args)


def main() -> None:
    if os.name == "nt":
        # kchain kills sessions with SIGKILL and locks its state files: POSIX only.
        click.echo("Error: kchain runs on Linux and macOS only (it needs POSIX signals and file locks); on Windows, use WSL",
                   err=True)
        sys.exit(1)
    cli(prog_name="kchain")


if __name__ == "__main__":
    sys.exit(main())
