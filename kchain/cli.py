"""The kchain command line: each command parses options, calls one library function, prints.

Library code raises KchainError subclasses; `main` turns them into one `Error:` line and the
class's exit code (listed in the README). No YAML, Jinja, kaggle or torch imports here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

import kchain
from kchain.errors import KchainError

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
@JOB
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None, help="Output folder (default: build/<name>).")
def render(job: Path, out: Path | None) -> None:
    """Write the notebook and kernel-metadata.json exactly as a push would send them.

    \b
    Example:
      kchain render jobs/tinygpt/job.yaml -o build/tinygpt
    """
    from kchain.render import render_job, write_rendered
    from kchain.smoke import resolve_owner
    from kchain.spec import load_job

    spec = load_job(job)
    rendered = render_job(spec, owner=resolve_owner(spec))
    paths = write_rendered(rendered, out or Path("build") / spec.name)
    for path in paths:
        click.echo(f"wrote {path}")
    click.echo(f"fingerprint {rendered.fingerprint}")


@cli.command()
@JOB
@click.option("--quiet", is_flag=True, help="Hide the training output; show stages and the verdict.")
def smoke(job: Path, quiet: bool) -> None:
    """Run the rendered notebook on this CPU: checks, steps, checkpoint, kill, exact resume.

    \b
    Example:
      kchain smoke jobs/tinygpt/job.yaml
    """
    from kchain.smoke import smoke as run_smoke

    click.echo(f"kchain smoke {job}")
    report = run_smoke(job, echo=click.echo, quiet_training=quiet)
    click.echo(f"smoke passed: {report.run_id} (fingerprint {report.fingerprint[:12]}) recorded in the run log")


def main() -> None:
    cli(prog_name="kchain")


if __name__ == "__main__":
    sys.exit(main())
