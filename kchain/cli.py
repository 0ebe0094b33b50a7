"""The kchain command line: each command parses options, calls one library function, prints.

Library code raises KchainError subclasses; `main` turns them into one `Error:` line and the
class's exit code (listed in the README). No YAML, Jinja, kaggle or torch imports here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

import kchain
from kchain.errors import KchainError, MachineError, exit_code_lines


class Seconds(click.FloatRange):
    """A number of seconds in a range; unlike FloatRange, nan is refused (it compares false to both ends)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return number


JOB = click.argument("job", type=click.Path(path_type=Path), default="job.yaml", required=False)
AS_JSON = click.option("--json", "as_json", is_flag=True,
                       help="One JSON document instead of the table (its shape: README, Machine-readable output).")
# The engines other than Kaggle a job can be smoked, rehearsed or rendered for (kchain/targets/).
TARGET = click.option("--target", type=click.Choice(["skypilot", "slurm"]), default=None,
                      help="Run the engine's rendered script here (SkyPilot's run or the sbatch file), with its "
                           "environment, a local folder as the bucket, a SIGKILL before a publish, a fresh machine.")


def _params(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    """--set NAME=VALUE, each read as one YAML value; a malformed one is a usage error (exit 2), not the job file's."""
    from kchain.errors import SpecError
    from kchain.job.spec import parse_overrides

    try:
        return parse_overrides(values)
    except SpecError as exc:
        raise click.UsageError(str(exc), ctx) from None


def _usage(ctx: click.Context, check: Callable[[str], object], value: str) -> str:
    """The value, checked by the library's own parse: its KchainError is a usage error (exit 2), as click's are."""
    try:
        check(value)
    except KchainError as exc:
        raise click.UsageError(str(exc), ctx) from None
    return value


def _template(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from kchain.job.init import check_template

    return _usage(ctx, check_template, value)


def _template_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """`kchain init --template <TAB>`: the template names (the shell's completion, click's shell_complete)."""
    from kchain.job.init import templates

    return [name for name in templates() if name.startswith(incomplete)]


def _fault_spec(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from kchain.local.rehearse import parse_fault_spec

    return _usage(ctx, parse_fault_spec, value) if value else value


def _job_target(job: Path) -> str:
    """The job file's target (kaggle, skypilot or slurm): push, status, logs and stop act on its engine."""
    from kchain.job.spec import load_job

    return load_job(job).target


class KchainGroup(click.Group):
    """Converts KchainError into a click error with the class's exit code, in one place."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KchainError as exc:
            raise _click_error(exc) from None
        except OSError as exc:  # the machine's refusal (permissions, a full or read-only disk): one line
            if exc.errno is None or isinstance(exc, (ConnectionError, TimeoutError)):
                raise
            raise _click_error(MachineError.of(exc)) from None


def _click_error(exc: KchainError) -> click.ClickException:
    error = click.ClickException(str(exc))
    # click types exit_code as a ClassVar; click exits with the instance's (Command.main)
    error.exit_code = exc.exit_code  # type: ignore[misc]
    return error


@click.group(cls=KchainGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\nExit codes:\n" + "\n".join(f"  {line}" for line in exit_code_lines()))
@click.version_option(kchain.__version__, prog_name="kchain")
def cli() -> None:
    """Train on free, session-limited Kaggle GPUs without losing the run or the week.

    \b
    Example:
      kchain init myjob                # a job folder that passes smoke as written
      kchain smoke myjob/job.yaml      # prove the notebook on this CPU
      kchain push myjob/job.yaml       # start session 1 on Kaggle
      kchain continue myjob/job.yaml   # chain the next session
    """


class TemplatesHelp(click.Command):
    """init's help, whose Example block lists the templates present (the folders of
    kchain/init_templates/), read when the help is shown: importing cli lists no folder."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from kchain.job.init import DEFAULT, templates

        others = [f"  kchain init --template {name} jobs/my-{name}" for name in templates() if name != DEFAULT]
        formatter.write_paragraph()
        with formatter.indentation():
            formatter.write_text("\n".join([
                self.help or "",
                "",
                f"The default template, {DEFAULT}, is a commented job.yaml and a train.py skeleton; notebook is",
                "a job.yaml and a train.ipynb written as on Kaggle. The job's name is made from the folder's.",
                "",
                "\b",
                "Example:",
                "  kchain init jobs/my-model && kchain smoke jobs/my-model/job.yaml",
                *others,
            ]))


@cli.command(cls=TemplatesHelp)
@click.argument("folder", type=click.Path(path_type=Path), default=".")
@click.option("--template", "-t", default="loop", metavar="NAME", show_default=True, callback=_template,
              shell_complete=_template_names, help="The template to copy (the Example lists them all).")
def init(folder: Path, template: str) -> None:
    """Write a job folder from a template that passes `kchain smoke` as written (never overwrites)."""
    from kchain.job.init import init_job

    for path in init_job(folder, template):
        click.echo(f"wrote {path}")


@cli.command()
@JOB
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, help="Output folder (default: build/<name>).")
@click.option("--target", type=click.Choice(["kaggle", "skypilot", "slurm"]), default=None,
              help="Render for this engine (default: the job's target): a work folder with task.yaml or job.sbatch.")
def render(job: Path, out: Path | None, target: str | None) -> None:
    """Write the notebook and kernel-metadata.json exactly as a push would send them.

    \b
    Example:
      kchain render myjob/job.yaml -o build/myjob
      kchain render myjob/job.yaml --target skypilot   # with a skypilot: section (docs/targets.md)
    """
    from kchain.job.render import payload_lines, render_job, write_rendered
    from kchain.job.spec import load_job
    from kchain.kaggle.credentials import configured_username

    spec = load_job(job)
    if (target or spec.target) != "kaggle":
        from kchain.targets.commands import render_lines

        for line in render_lines(spec, target or spec.target, out):
            click.echo(line)
        return
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
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", callback=_params,
              help="A param for this smoke, over params and smoke.params (repeatable).")
@click.option("--ranks", type=click.IntRange(1, 2), default=None,
              help="Ranks to run (default: as many as the job gets on Kaggle, as gloo ranks on the CPU).")
@TARGET
def smoke(job: Path, quiet: bool, download: bool, sets: dict[str, Any], ranks: int | None,
          target: str | None) -> None:
    """Run the rendered notebook on this CPU: checks, steps, a stop, checkpoint, kill, exact resume.

    \b
    Example:
      kchain init myjob && kchain smoke myjob/job.yaml
      kchain smoke myjob/job.yaml --set batch=16 --set rows=2000
      kchain smoke myjob/job.yaml --target skypilot   # with a skypilot: section: the task's run, as SkyPilot runs it
    """
    from kchain.local.smoke import smoke as run_smoke

    click.echo(f"kchain smoke {job}" + (f" --target {target}" if target else ""))
    if target:
        from kchain.targets.rehearsal import rehearse_target

        result = rehearse_target(job, target, smoke=True, params=sets, echo=click.echo, quiet=quiet)
        click.echo(f"smoke passed for {target} (fingerprint {result.fingerprint[:12]}) recorded in the run log")
        return
    report = run_smoke(job, echo=click.echo, quiet_training=quiet, download=download,
                       sets=sets, ranks_asked=ranks)
    click.echo(f"smoke passed: {report.run_id} (fingerprint {report.fingerprint[:12]}) recorded in the run log")


@cli.command()
@JOB
@click.option("--offline", is_flag=True, help="Only the laptop-side checks; no Kaggle call.")
@click.option("--no-probe", is_flag=True, help="Skip the probe's CPU session (account, sources and metadata only).")
@click.option("--probe-timeout", type=Seconds(1.0, 24 * 3600.0), default=900.0, show_default=True, help="Seconds to wait for the probe.")
def doctor(job: Path, offline: bool, no_probe: bool, probe_timeout: float) -> None:
    """Check the account, the sources and the kernel image before the first GPU-hour, for free.

    \b
    Example:
      kchain doctor myjob/job.yaml              # all checks, the probe on a free CPU session
      kchain doctor myjob/job.yaml --offline    # laptop-side checks only
    """
    from kchain.chain.doctor import run_doctor

    report = run_doctor(job, offline=offline, probe=not no_probe, echo=click.echo, probe_timeout_s=probe_timeout)
    click.echo(report.verdict())


@cli.command()
@JOB
@click.option("--skip-smoke", is_flag=True, help="Push code that never passed a smoke run (recorded in the run log).")
@click.option("--force", is_flag=True, help="Push even if the week's GPU quota cannot cover the session.")
@click.option("--unattended", is_flag=True,
              help="Each session pushes the next itself (internet and Secrets needed; the doctor must have seen it "
                   "work): the chain goes on with the laptop shut.")
def push(job: Path, skip_smoke: bool, force: bool, unattended: bool) -> None:
    """Start session 1 on Kaggle: smoked code only, within the week's quota.

    \b
    Example:
      kchain smoke myjob/job.yaml && kchain push myjob/job.yaml
      kchain push myjob/job.yaml --unattended   # later sessions push themselves
    """
    from kchain.chain.push import push as run_push

    if _job_target(job) != "kaggle":
        from kchain.targets.commands import push_target

        if force or unattended:
            raise click.UsageError("--force and --unattended are for Kaggle; this job's target is another engine")
        push_target(job, skip_smoke=skip_smoke, echo=click.echo)
        return
    run_push(job, skip_smoke=skip_smoke, force=force, echo=click.echo, unattended=unattended)


@cli.command()
@JOB
@AS_JSON
def status(job: Path, as_json: bool) -> None:
    """One table of the chain: each session's version, status, duration, steps, last words.

    \b
    Example:
      kchain status myjob/job.yaml
      kchain status myjob/job.yaml --json | jq '.sessions[-1].status'
    """
    from kchain.chain.sessions import status_document, status_for

    if _job_target(job) != "kaggle":
        from kchain.targets.commands import status_target

        if as_json:
            raise click.UsageError("--json is for Kaggle jobs; this job's target is another engine")
        return status_target(job, echo=click.echo)
    from kchain.chain import queue as queued

    held = queued.read(queued.queue_path(job))  # `kchain queue` of this job: its runs, each its own chain
    if as_json:
        doc = status_document(job)
        return click.echo(json.dumps({**doc, **({"queue": held.document()} if held else {})}, indent=2))
    if held is not None:  # the queue first; the job's own chain after it, where it has one
        for line in queued.lines(held):
            click.echo(line)
        if not queued.has_chain(job):
            return None
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
      kchain logs myjob/job.yaml --follow
    """
    from kchain.chain.sessions import logs_for

    if _job_target(job) != "kaggle":
        from kchain.targets.commands import logs_target

        return logs_target(job, follow=follow, echo=click.echo)
    logs_for(job, number, follow=follow, poll_s=poll, echo=click.echo)


@cli.command(name="continue")
@JOB
@click.option("--retry", is_flag=True, help="Run a session that crashed once again, unchanged.")
@click.option("--watch", "watch_chain", is_flag=True, help="Keep chaining until done, out of budget, or a crash.")
@click.option("--force", is_flag=True, help="Push even if the week's GPU quota cannot cover the session.")
@click.option("--skip-smoke", is_flag=True, help="Allow code that never passed a smoke run.")
@click.option("--from-state", type=click.IntRange(min=1), default=None, metavar="N",
              help="Resume from state version N when the last session's output cannot be fetched (loses its steps).")
@click.option("--delete-stale", is_flag=True,
              help="With --watch: delete a stale session's kernel (Kaggle keeps it RUNNING) once the chain's "
                   "state is safe, and chain on.")
@click.option("--notify", "notify_command", metavar="CMD",
              help="With --watch: run CMD in the shell at each event (session_ended, finished, needs_person, "
                   "failed), with KCHAIN_EVENT, KCHAIN_JOB, KCHAIN_MESSAGE and KCHAIN_SESSION set.")
def continue_(job: Path, retry: bool, watch_chain: bool, force: bool, skip_smoke: bool, from_state: int | None,
              delete_stale: bool, notify_command: str | None) -> None:
    """Chain the next session from the saved state, or say why not.

    \b
    Example:
      kchain continue myjob/job.yaml --watch
      kchain continue myjob/job.yaml --watch --notify 'notify-send kchain "$KCHAIN_EVENT: $KCHAIN_MESSAGE"'
      kchain continue myjob/job.yaml --watch --notify 'echo "$KCHAIN_EVENT $KCHAIN_MESSAGE" >> ~/kchain-events.log'
    """
    from kchain.chain.advance import continue_chain

    if notify_command and not watch_chain:
        raise click.UsageError("--notify tells of a watched chain's events; give it with --watch")
    decision = continue_chain(job, retry=retry, force=force, skip_smoke=skip_smoke, watch_chain=watch_chain,
                              echo=click.echo, from_state=from_state, delete_stale=delete_stale,
                              notify_command=notify_command)
    if not watch_chain:  # the watch printed each decision as it came, the last one too
        click.echo(decision.message)


@cli.command()
@JOB
@click.option("--wait", "wait_s", type=Seconds(0.0, 7 * 24 * 3600.0), default=3600.0, show_default=True,
              help="Seconds to wait for the session to end once you stopped it on its page.")
@click.option("--poll", "poll_s", type=Seconds(0.1, 3600.0), default=10.0, show_default=True, help="Seconds between status checks.")
@click.option("--delete", is_flag=True,
              help="Delete the kernel instead: the stop Kaggle honours, also for a session it keeps RUNNING "
                   "(`kchain status` says stale); only when the chain's state is safe, and it asks first.")
@click.option("--yes", is_flag=True, help="With --delete: delete without asking (for scripts).")
def stop(job: Path, wait_s: float, poll_s: float, delete: bool, yes: bool) -> None:
    """Stop the running session and record it; `continue` resumes from the last saved state.

    Kaggle's API cannot cancel a session, so kchain names its page to stop it on and waits for the
    end. --delete deletes the kernel instead, with every version's output on Kaggle.

    \b
    Example:
      kchain stop myjob/job.yaml
      kchain stop myjob/job.yaml --delete      # a stale session: Kaggle keeps it RUNNING
    """
    from kchain.chain.advance import stop_chain

    if _job_target(job) != "kaggle":
        from kchain.targets.commands import stop_target

        return stop_target(job, echo=click.echo)
    if yes and not delete:
        raise click.UsageError("--yes answers the question --delete asks; give it with --delete")
    confirm = (lambda _question: True) if yes else (lambda question: click.confirm(question, default=False))
    stop_chain(job, wait_s=wait_s, poll_s=poll_s, echo=click.echo, delete=delete, confirm=confirm)


@cli.command()
@JOB
@AS_JSON
def budget(job: Path, as_json: bool) -> None:
    """This quota week's GPU-hours, session by session, and what the remaining steps need.

    \b
    Example:
      kchain budget myjob/job.yaml
      kchain budget myjob/job.yaml --json | jq .left
    """
    from kchain.chain.budget import budget_document_for, budget_for

    if as_json:
        return click.echo(json.dumps(budget_document_for(job), indent=2))
    for line in budget_for(job):
        click.echo(line)


@cli.command()
@JOB
@AS_JSON
def runs(job: Path, as_json: bool) -> None:
    """The run log, and the chain's kept best and final weights (the ones pull and release bring).

    \b
    Example:
      kchain runs myjob/job.yaml
      kchain runs myjob/job.yaml --json | jq -r .best
    """
    from kchain.chain.sessions import runs_document, runs_for

    if as_json:
        return click.echo(json.dumps(runs_document(job), indent=2))
    for line in runs_for(job):
        click.echo(line)


JOBS = click.argument("jobs", nargs=-1, type=click.Path(path_type=Path))


def _variant_sets(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> list[tuple[str, Any]]:
    """--set NAME=VALUE, each kept (a key given twice is two variants), each read as one YAML value."""
    from kchain.errors import SpecError
    from kchain.job.spec import parse_overrides

    try:
        return [next(iter(parse_overrides([value]).items())) for value in values]
    except SpecError as exc:
        raise click.UsageError(str(exc), ctx) from None


def _seeds(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int]:
    try:
        return [int(part) for part in value.split(",")] if value else []
    except ValueError:
        raise click.BadParameter(f"{value!r}: write whole numbers with commas, e.g. --seeds 1,2,3") from None


def _factor(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"{value!r}: write a positive number, e.g. --factor 0.05 (Kaggle's seconds per "
                                 "step over this laptop's)")
    return value


def RUNS(command: Callable[..., Any]) -> Callable[..., Any]:  # noqa: N802  (a decorator, as JOB and AS_JSON are)
    """The week's runs as `kchain plan` and `kchain queue` take them: --set, --seeds, --steps and --factor."""
    for option in reversed([
        click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", callback=_variant_sets,
                     help="A param for the runs; a name given again is another run (--set lr=3e-4 --set lr=1e-3: two)."),
        click.option("--seeds", callback=_seeds, metavar="1,2,3", help="Repeat each run with each params.seed."),
        click.option("--steps", type=click.IntRange(min=1), default=None,
                     help="Each run's steps, where the measured loop total does not say them."),
        click.option("--factor", type=float, default=None, callback=_factor,
                     help="Kaggle's seconds per step over this laptop's smoke (default: measured by a chain, else 1)."),
    ]):
        command = option(command)
    return command


@cli.command()
@JOBS
@RUNS
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for plan.json (default: the first job's .kchain/).")
@AS_JSON
def plan(jobs: tuple[Path, ...], sets: list[tuple[str, Any]], seeds: list[int], steps: int | None,
         factor: float | None, out: Path | None, as_json: bool) -> None:
    """The week's runs sized from measured speed on Kaggle's two GPU slots, a slack held back.

    Each run's seconds per step (its chain's Kaggle pace, else the smoke's times a device factor), its
    sessions, GPU-hours, slot and end, against this quota week's allowance; budget.slack (default one
    session) is never planned into. A plan that does not fit is refused (exit 5), naming the run to drop
    or shorten; one that fits is written to plan.json.

    \b
    Example:
      kchain plan myjob/job.yaml --set lr=3e-4 --set lr=1e-3 --seeds 1,2
      kchain init wide && kchain plan myjob/job.yaml wide/job.yaml --json | jq .spare
    """
    from kchain.chain.plan import plan_jobs

    if seeds and any(key == "seed" for key, _ in sets):
        raise click.UsageError("--seeds and --set seed=... both give the seed; give one of them")
    doc, lines, path = plan_jobs(list(jobs or (Path("job.yaml"),)), sets, seeds, steps, factor, out)
    if as_json:
        return click.echo(json.dumps(doc, indent=2))
    for line in lines:
        click.echo(line)
    click.echo(f"written {path}")


@cli.command()
@JOBS
@RUNS
@click.option("--use-slack", is_flag=True, help="Let the runs spend the slack (budget.slack) the plan holds back.")
@click.option("--skip-smoke", is_flag=True, help="Push runs whose code and params never passed a smoke run.")
@click.option("--poll", type=Seconds(1.0, 3600.0), default=30.0, show_default=True, help="Seconds between looks.")
@click.option("--notify", "notify_command", metavar="CMD",
              help="Run CMD in the shell at each event (session_ended, finished and needs_person of a run, with "
                   "KCHAIN_JOB its chain; queue_ended once), as `continue --watch --notify` does.")
@click.option("--rehearse", is_flag=True,
              help="Run the queue here, against a private local Kaggle with two GPU slots, before any quota.")
@click.option("--crash", metavar="RUN", default=None,
              help="With --rehearse: that run (r2) crashes at its first step, to see the queue stop it alone.")
@click.option("--sessions", "spans", type=click.IntRange(min=1, max=20), default=2, show_default=True,
              help="With --rehearse: each run's total in this many sessions (planned in steps).")
@click.option("--faults", "fault_spec", default="", metavar="SPEC", callback=_fault_spec,
              help="With --rehearse: the local Kaggle's faults, as for `kchain rehearse` (429=0.15,500=0.10,...).")
def queue(jobs: tuple[Path, ...], sets: list[tuple[str, Any]], seeds: list[int], steps: int | None,
          factor: float | None, use_slack: bool, skip_smoke: bool, poll: float,
          notify_command: str | None, rehearse: bool, crash: str | None, spans: int, fault_spec: str) -> None:
    """Run the week's plan without a person: each run its own chain, on Kaggle's two GPU slots.

    The plan is `kchain plan`'s (refused before any push when the week cannot hold it). Runs start in
    order in the free slots while their planned hours fit beside the slack; a session that ends is
    followed by the next of its run in the same slot; a run that crashes is stopped (never pushed
    again as it is) and its hours go back to the queue. Every run is smoked first (its own kernel).
    Stopped, the queue goes on where it was when run again with the same jobs and --set.

    \b
    Example:
      kchain queue myjob/job.yaml --set lr=3e-4 --set lr=1e-3 --seeds 1,2 --notify 'notify-send "$KCHAIN_MESSAGE"'
      kchain queue myjob/job.yaml --seeds 1,2,3 --rehearse --crash r2   # the week seen first, here
      kchain status myjob/job.yaml   # the queue's runs, slots and hours
    """
    from kchain.chain import queue as queued
    from kchain.chain.notify import Notify, nobody, notifier
    from kchain.errors import SmokeFailed
    from kchain.kaggle.client import KaggleClient
    from kchain.local.smoke import smoke

    if seeds and any(key == "seed" for key, _ in sets):
        raise click.UsageError("--seeds and --set seed=... both give the seed; give one of them")
    job_files = list(jobs or (Path("job.yaml"),))
    if (crash is not None or fault_spec) and not rehearse:
        raise click.UsageError("--crash and --faults are for --rehearse: a real queue meets Kaggle's own")
    if rehearse:
        from kchain.errors import KchainError
        from kchain.local.rehearse import parse_fault_spec, rehearse_queue

        if notify_command:
            raise click.UsageError("--notify is for the real queue; leave it out with --rehearse")
        result = rehearse_queue(job_files, sets, seeds, steps, factor, use_slack, crash, spans, click.echo,
                                min(poll, 0.5), parse_fault_spec(fault_spec))
        if not result.passed:
            raise KchainError(result.line())
        return None
    held, path, lines = queued.open_queue(job_files, sets, seeds, steps, factor, use_slack)
    for line in lines:
        click.echo(line)
    for run, job in ([] if skip_smoke else queued.unsmoked(held)):
        click.echo(f"queue: smoke of {run.label} ({run.chain}) before any push")
        try:
            smoke(Path(run.job_file), echo=click.echo, quiet_training=True, job=job)
        except SmokeFailed as exc:
            raise SmokeFailed(f"{run.label} ({run.chain}): {exc}; nothing was pushed: fix it and run `kchain queue` "
                              "again") from None

    def notify_for(chain: str) -> Notify:
        return notifier(notify_command, chain, click.echo) if notify_command else nobody

    loop = queued.Loop(path, KaggleClient(progress=True), click.echo, notify_for, skip_smoke, poll)
    queued.run(held, loop)


@cli.command()
@JOBS
@click.option("--plan", "plan_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The plan.json to compare with (default: the first job's .kchain/plan.json).")
@AS_JSON
def week(jobs: tuple[Path, ...], plan_file: Path | None, as_json: bool) -> None:
    """The week's run log: one row per run, what it changed, its best, GPU-hours planned and spent.

    \b
    Example:
      kchain week myjob/job.yaml
      kchain week myjob/job.yaml --json | jq .spare_after_plan
    """
    from kchain.result.week import document, table, week_of

    rows, totals = week_of(list(jobs or (Path("job.yaml"),)), plan_file)
    if as_json:
        return click.echo(json.dumps(document(rows, totals), indent=2))
    for line in table(rows, totals):
        click.echo(line)


@cli.command()
@JOB
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, help="PNG path (default: .kchain/<name>-loss.png).")
def plot(job: Path, out: Path | None) -> None:
    """A PNG of training and validation loss across the whole chain, sessions marked (matplotlib, an
    extra: pip install 'kchain[plot]').

    \b
    Example:
      kchain plot myjob/job.yaml -o loss.png
    """
    from kchain.result.plot import plot_for

    click.echo(f"wrote {plot_for(job, out)}")


def _chosen(best: bool, final: bool, step: int | None = None) -> str:
    """--best, --final or --step N: at most one of them, a usage error naming them otherwise (as flag_value
    options sharing one name, the last given would win silently); --final when none is given."""
    given = [flag for flag, on in (("--best", best), ("--final", final), ("--step", step is not None)) if on]
    if len(given) > 1:
        raise click.UsageError(f"{', '.join(given[:-1])} and {given[-1]} cannot be given together: choose one",
                               click.get_current_context())
    return "best" if best else "step" if step is not None else "final"


@cli.command()
@JOB
@click.option("--best", is_flag=True, help="The kept best checkpoint's weights (train.keep_best).")
@click.option("--final", is_flag=True, help="The finished chain's final weights (default).")
@click.option("--step", type=click.IntRange(min=0), default=None, metavar="N", help="The weights of step N, if kept.")
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None,
              help="Folder to write (default: <name>-best, -final or -step-N beside the job file): a new one, or "
                   "one an earlier pull wrote.")
@click.option("--logs", is_flag=True, help="The chain's TensorBoard run instead of the weights (run.tensorboard_dir).")
@click.option("--force", is_flag=True, help="Replace an earlier pull's folder (never a job's folder or other files).")
@click.option("--from", "source", type=click.Path(path_type=Path), default=None, metavar="FOLDER",
              help="A SkyPilot or Slurm job's state folder to read instead (the bucket's <name>/ folder, mounted or "
                   "copied here; a Slurm job's state_dir/<name> is the default).")
@click.option("--run", "run_label", metavar="RUN", default=None,
              help="A run of the job's `kchain queue` (r2): that run's chain instead of the job's own.")
def pull(job: Path, best: bool, final: bool, step: int | None, logs: bool, out: Path | None, force: bool,
         source: Path | None, run_label: str | None) -> None:
    """Bring the chain's weights home from its newest state version, verified, as a plain folder:
    model.safetensors, metrics.json, and (--final) what the last session wrote under run.export_dir.
    A SkyPilot or Slurm job's come from its state folder (--from; Slurm's state_dir by default).

    \b
    Example:
      kchain pull myjob/job.yaml --best -o myjob-best
      kchain pull myjob/job.yaml --step 1200
      kchain pull myjob/job.yaml --logs -o runs/myjob && tensorboard --logdir runs/myjob
      kchain pull myjob/job.yaml --best --from my-state   # a SkyPilot job's bucket folder, copied here
    """
    from kchain.result.pull import Want, pull_for, pull_logs

    which = _chosen(best, final, step)
    if logs and source is not None:
        raise click.UsageError("--logs reads the chain's Kaggle state, not a state folder: leave out --from",
                               click.get_current_context())
    if run_label is not None and (logs or source is not None):
        raise click.UsageError("--run pulls a queued run's weights from Kaggle: leave out --logs and --from")
    if run_label is not None:
        from kchain.chain.queue import job_of_run

        lines = pull_for(job, Want(which, step), out, force, click.echo, None, job_of_run(job, run_label))
    else:
        lines = pull_logs(job, out, force, click.echo) if logs else \
            pull_for(job, Want(which, step), out, force, click.echo, source)
    for line in lines:
        click.echo(line)


@cli.command()
@JOB
@click.option("--to", "to", type=click.Choice(["tensorboard", "mlflow", "wandb"]), required=True,
              help="The tracker to make the chain's one run in.")
@click.option("--dir", "folder", type=click.Path(path_type=Path), default=None,
              help="Where the run goes (default .kchain/trackers/<name>): the TensorBoard log dir, W&B's offline "
                   "runs, MLflow's file store (mlruns/) unless MLFLOW_TRACKING_URI is set.")
def sync(job: Path, to: str, folder: Path | None) -> None:
    """The whole chain as one run in TensorBoard, MLflow or W&B (offline), from kchain's metrics trace.

    Every run.log value at its step, each step once; run it again after more sessions and only the
    new steps are sent. The run is the chain's run.id.

    \b
    Example:
      kchain sync myjob/job.yaml --to tensorboard --dir runs/myjob && tensorboard --logdir runs
      kchain sync myjob/job.yaml --to wandb && wandb sync myjob/.kchain/trackers/myjob/wandb/offline-run-*
    """
    from kchain.result.sync import sync_for

    done = sync_for(job, to, folder)
    click.echo(f"{done.target}: run {done.run_id} in {done.where}: {done.sent} values sent, "
               f"{done.held} held already")


@cli.command()
@JOB
@click.option("--best", is_flag=True, help="Release the kept best checkpoint's weights.")
@click.option("--final", is_flag=True, help="Release the final weights (default).")
@click.option("--model", default=None, metavar="OWNER/MODEL/FRAMEWORK/VARIATION", help="The Kaggle Model variation.")
@click.option("--dataset", default=None, metavar="OWNER/SLUG", help="A dataset instead of a model.")
@click.option("--public", is_flag=True, help="Make a new model public (default: private).")
@click.option("--license", "license_name", default="Apache 2.0", show_default=True, help="A new variation's licence.")
@click.option("--new", "again", is_flag=True,
              help="Publish a new version even where an earlier release made one of these same weights.")
@click.option("--from", "source", type=click.Path(path_type=Path), default=None, metavar="FOLDER",
              help="A SkyPilot or Slurm job's state folder to release from (as pull --from).")
def release(job: Path, best: bool, final: bool, model: str | None, dataset: str | None, public: bool,
            license_name: str, again: bool, source: Path | None) -> None:
    """Publish the pulled weights (model.safetensors, metrics.json, export/) as a new Kaggle Model
    version, sent exactly once, with a card in its description; prints the model_sources line. Run
    again (after a kill or a finish), it names the version that holds these weights instead of sending
    them again; never to the chain's own state, cache or pip dataset.

    \b
    Example:
      kchain release myjob/job.yaml --best --model alice/tiny-gpt/pytorch/default
      kchain release myjob/job.yaml --dataset alice/tiny-gpt-weights
      kchain release myjob/job.yaml --best --model alice/tiny-gpt/pytorch/default --from my-state  # SkyPilot's
    """
    from kchain.result.pull import Want
    from kchain.result.release import release as run_release

    for line in run_release(job, Want(_chosen(best, final)), model, dataset, public, license_name, click.echo,
                            new=again, source=source):
        click.echo(line)


@cli.command()
@JOB
@click.option("--sessions", type=click.IntRange(1, 100), default=3, show_default=True,
              help="The run's total cut into this many spans: each session stops at a planned step, the same on any "
                   "machine (more with the kills).")
@click.option("--by-time", is_flag=True, help="Plan the sessions in seconds instead (--session-limit each).")
@click.option("--session-limit", type=Seconds(1.0, 12 * 3600.0), default=None,
              help="Seconds per emulated session: with --by-time their length (default 20, longer when session 1 "
                   "shows the chain would need many); else only a safety net (default 3600).")
@click.option("--kills", type=click.IntRange(0, 100), default=1, show_default=True,
              help="Sessions killed (a SIGKILL right after their first checkpoint past their resume), exactly.")
@click.option("--unattended", is_flag=True,
              help="Rehearse `push --unattended`: each session pushes the next; passes only with zero laptop pushes "
                   "after session 1, zero overlapping sessions and zero duplicate state versions.")
@click.option("--busy-gpu", is_flag=True,
              help="With --unattended: another GPU session of the account runs throughout (a notebook in the browser), "
                   "so the chain has one of Kaggle's two GPU slots to hold.")
@click.option("--ranks", type=click.IntRange(1, 2), default=None,
              help="Ranks per session and in the uninterrupted run (default: as many as the job gets on Kaggle, "
                   "as gloo ranks on the CPU).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--set", "sets", multiple=True, metavar="NAME=VALUE", callback=_params,
              help="Override a param, e.g. --set steps=300.")
@click.option("--faults", "fault_spec", default="", metavar="SPEC", callback=_fault_spec,
              help="A flaky Kaggle, rates per call: e.g. 429=0.15,500=0.10,lost_answer=0.1,reset_after_acting=0.1,drop_upload=0.1.")
@click.option("--strict/--lenient", default=True, show_default=True,
              help="Kaggle's strict behaviour (403s, lagging versions, ignored pins, lost output) or a kind one.")
@click.option("--notify", "notify_command", metavar="CMD",
              help="Run CMD in the shell when the rehearsal ends (finished: passed; needs_person: the chain stopped "
                   "for a decision; failed), with KCHAIN_EVENT, KCHAIN_JOB, KCHAIN_MESSAGE and KCHAIN_SESSION set.")
@TARGET
def rehearse(job: Path, sessions: int, by_time: bool, session_limit: float | None, kills: int, unattended: bool,
             busy_gpu: bool, ranks: int | None, seed: int, sets: dict[str, Any], fault_spec: str, strict: bool,
             notify_command: str | None, target: str | None) -> None:
    """The whole chain on this machine against a local Kaggle, compared with one uninterrupted run.

    Sessions are planned in steps, so a slow or busy machine gives the same chain and verdict. It
    passes only when the traces are identical, a session resumed from a saved state, the kills
    asked for happened, and the chain trained every step it asked for.

    \b
    Example:
      kchain rehearse myjob/job.yaml
      kchain rehearse myjob/job.yaml --sessions 4 --kills 2 --faults 429=0.15,500=0.10
      kchain rehearse myjob/job.yaml --unattended      # each session pushes the next
      kchain rehearse myjob/job.yaml --unattended --busy-gpu   # beside another GPU session
      kchain rehearse myjob/job.yaml --by-time --session-limit 60 --set steps=300
      kchain rehearse myjob/job.yaml --target slurm    # with a slurm: section: the sbatch script
      kchain rehearse myjob/job.yaml --notify 'notify-send kchain "$KCHAIN_EVENT: $KCHAIN_MESSAGE"'
    """
    from kchain.errors import KchainError
    from kchain.local.rehearse import emulator_switches, parse_fault_spec, rehearse_told

    if busy_gpu and not unattended:
        raise click.UsageError("--busy-gpu is for --unattended: an attended chain pushes each session after the last "
                               "one ended, so it never holds more than one GPU slot")
    if target:
        from kchain.targets.rehearsal import rehearse_target

        if notify_command:
            raise click.UsageError("--notify tells of a rehearsal against the local Kaggle; leave out --target")
        rehearse_target(job, target, smoke=False, params=sets, echo=click.echo)
        return

    result = rehearse_told(job, notify_command, echo=click.echo, sessions=None if by_time else sessions,
                           session_limit_s=session_limit, kills=kills, seed=seed, params=sets,
                           faults=parse_fault_spec(fault_spec, seed), switches=emulator_switches(strict),
                           ranks=ranks, unattended=unattended, busy_gpu=busy_gpu)
    if not result.passed:
        raise KchainError(result.line())


@cli.group()
def emulator() -> None:
    """The local Kaggle that kchain is tested against."""


class EmulatorOption(click.Option):
    """An option of `kchain emulator serve` named after a field of the emulator's Limits, Switches or
    Faults. Unset it is None, and the emulator keeps its own default: the help shows it, read from
    those classes only when help is asked for (importing the emulator would slow every command)."""

    def default_text(self) -> str | None:
        from kchain.emulator import Faults, Switches
        from kchain.emulator.switches import Limits

        default = next((getattr(d, self.name) for d in (Limits(), Switches(), Faults()) if hasattr(d, self.name)), None)
        if isinstance(default, bool) and self.secondary_opts:
            return (self.opts if default else self.secondary_opts)[0].lstrip("-")
        if default is not None and not isinstance(default, bool):
            return f"{default:g}" if isinstance(default, float) else str(default)
        return None

    def get_help_extra(self, ctx: click.Context) -> Any:  # click 8.2 and later
        extra = super().get_help_extra(ctx)
        if (text := self.default_text()) is not None:
            extra["default"] = text
        return extra

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        record = super().get_help_record(ctx)
        if record is None or hasattr(click.Option, "get_help_extra"):
            return record
        # click 8.1 has no get_help_extra: the default goes where 8.2 puts it.
        text = self.default_text()
        return record if text is None else (record[0], f"{record[1]}  [default: {text}]")


def _field(*decls: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An option that sets one field of the emulator (see EmulatorOption)."""
    return click.option(*decls, cls=EmulatorOption, default=None, **kwargs)


def _pairs(sep: str) -> Callable[[click.Context, click.Parameter, tuple[str, ...]], list[tuple[str, str]]]:
    """A callback: each value 'A<sep>B' as (A, B); anything else is a usage error naming the shape."""
    def parse(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> list[tuple[str, str]]:
        pairs = []
        for value in values:
            left, found, right = value.partition(sep)
            if not (found and left and right):
                raise click.BadParameter(f"{value!r}: write it as {param.metavar}")
            pairs.append((left, right))
        return pairs
    return parse


def _as_int(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A number chosen as text (click 8.1's Choice holds only strings), as the emulator's int."""
    return None if value is None else int(value)


FAULT = "Fault: "


def _emulator_fields(command: Callable[..., Any]) -> Callable[..., Any]:
    """`emulator serve`'s options made from the emulator's own fields (Limits, Faults, Switches; each
    spelled once, with its help, by switches.opt): `version_lag_s` is --version-lag, a bool a --x/--no-x pair."""
    from kchain.emulator.faults import Faults
    from kchain.emulator.switches import Limits, Switches

    for cls, kind in ((Switches, "Switch: "), (Faults, FAULT), (Limits, "")):
        hints = typing.get_type_hints(cls)
        for f in reversed(dataclasses.fields(cls)):
            if f.init and "help" in f.metadata:
                command = _field(*_option_decls(f.name, hints[f.name], kind),
                                 **_option_kwargs(f, hints[f.name], kind))(command)
    return command


def _option_decls(name: str, hint: Any, kind: str) -> tuple[str, str]:
    """A switch's bool is a --x/--no-x pair; a fault's is a flag that turns it on."""
    flag = _flag(name)
    return (f"--{flag}/--no-{flag}" if hint is bool and kind != FAULT else f"--{flag}"), name


def _flag(name: str) -> str:
    """A field's option, without its dashes: the name without its `_s` unit, `_` as `-`."""
    return name.removesuffix("_s").replace("_", "-")


def _option_kwargs(f: Any, hint: Any, kind: str) -> dict[str, Any]:
    meta = f.metadata
    kwargs: dict[str, Any] = {"help": kind + meta["help"], "metavar": meta["metavar"]}
    inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if meta["choices"]:
        kwargs.update(type=click.Choice([str(c) for c in meta["choices"]]), metavar=None)
        if all(isinstance(c, int) for c in meta["choices"]):
            kwargs["callback"] = _as_int
    elif typing.get_args(inner[0]):  # a tuple: (low, high)
        kwargs.update(type=typing.get_args(inner[0])[0], nargs=len(typing.get_args(inner[0])))
    elif inner[0] is bool:
        if kind == FAULT:
            kwargs["is_flag"] = True
    else:
        kwargs["type"] = inner[0]
    return kwargs


@emulator.command()
@click.option("--state", "state_dir", type=click.Path(path_type=Path), required=True,
              help="Folder holding the emulator's kernels, datasets and sessions (kept between runs).")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Port on 127.0.0.1 (0: any free one).")
@click.option("--user", "users", multiple=True, metavar="NAME:KEY", callback=_pairs(":"),
              help="An account and its API key; repeat for more (default: one user `kchain`, a fresh key).")
@click.option("--token", "tokens", multiple=True, metavar="TOKEN=NAME", callback=_pairs("="),
              help="An access token (as KAGGLE_API_TOKEN holds it) and the user it belongs to; repeatable.")
@click.option("--secret", "secrets", multiple=True, metavar="NAME:LABEL=VALUE", callback=_pairs(":"),
              help="A Kaggle Secret of user NAME, readable in that user's kernels; repeatable.")
@click.option("--attach-secret", "attached", multiple=True, metavar="OWNER/SLUG",
              help="The user attached their Secrets to kernel OWNER/SLUG in the web UI (and attaches them again after "
                   "each push of their own: see --secrets-reset-on-push); repeatable.")
@click.option("--competition", "competitions", multiple=True, metavar="SLUG:USER", callback=_pairs(":"),
              help="USER accepted the rules of competition SLUG (else it is an invalid source); repeatable.")
@click.option("--lenient", is_flag=True,
              help="Start from the kind switches (404s, no lag, pins honoured, no queue, output kept, secrets "
                   "attached, GPU quota answered, a crashed runner ends, one image); the switch options below "
                   "still override it.")
@click.option("--catalogue", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A folder of public kernels, datasets and models to seed, in the files Kaggle's client writes "
                   "(docs/emulator.md); default: the state folder's catalogue/, if any.")
@_emulator_fields
def serve(state_dir: Path, port: int, users: list[tuple[str, str]], tokens: list[tuple[str, str]],
          secrets: list[tuple[str, str]], attached: tuple[str, ...], competitions: list[tuple[str, str]],
          lenient: bool, catalogue: Path | None, **fields: Any) -> None:
    """Run a local Kaggle for the unmodified `kaggle` client until interrupted; prints the `export`
    lines a shell needs. Switches default to Kaggle's strict behaviour; faults to none
    (docs/emulator.md gives each one's source).

    \b
    Example:
      kchain emulator serve --state /tmp/kaggle --session-limit 60
      kchain emulator serve --state /tmp/kaggle --user alice:0123abcd --missing-status 404
      kchain emulator serve --state /tmp/kaggle --lenient --version-lag 5 --rate-429 0.1
      kchain emulator serve --state /tmp/kaggle --catalogue tests/fixtures/kaggle-catalogue
      kchain emulator serve --state /tmp/kaggle --user kchain:0123abcd --secret kchain:KAGGLE_USERNAME=kchain \\
        --secret kchain:KAGGLE_KEY=0123abcd --attach-secret kchain/myjob --attach-secret kchain/myjob-doctor \\
        --kernel-may-push --no-secrets-reset-on-push     # what `kchain push --unattended` needs
    """
    from kchain.emulator.app import emulator_options
    from kchain.emulator.app import serve as run_emulator

    labels: dict[str, dict[str, str]] = {}
    for user, assignment in secrets:
        label, _, value = assignment.partition("=")
        labels.setdefault(user, {})[label] = value
    accepted: dict[str, list[str]] = {}
    for slug, user in competitions:
        accepted.setdefault(slug, []).append(user)
    given = {name: value for name, value in fields.items() if value is not None}
    try:
        options = emulator_options(lenient, **given)
    except ValueError as exc:  # a switch's or a fault's own check (Switches/Faults.__post_init__), by option
        said = str(exc)
        for name in given:
            said = re.sub(rf"\b{name}\b", f"--{_flag(name)}", said)
        raise click.UsageError(said) from None
    run_emulator(state_dir, port=port, users=dict(users), tokens=dict(tokens), secrets=labels, competitions=accepted,
                 attached=list(attached), catalogue=catalogue, **options)


def _terminated(signum: int, _frame: object) -> None:
    """SIGTERM or SIGHUP (a `kill`, a closed terminal): end as Ctrl-C does, through every `finally`, so what
    kchain started in process groups of their own (sessions, the reference run, the emulator) is stopped with
    it. A second signal ends kchain at once."""
    signal.signal(signum, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def main() -> None:
    if os.name == "nt":
        # kchain kills sessions with SIGKILL and locks its state files: POSIX only.
        click.echo("Error: kchain runs on Linux and macOS only (it needs POSIX signals and file locks); on Windows, use WSL",
                   err=True)
        sys.exit(1)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminated)
    cli(prog_name="kchain")


if __name__ == "__main__":
    main()
