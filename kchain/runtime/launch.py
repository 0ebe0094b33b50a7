"""The training child: `python -m kchain.runtime.launch CONFIG_JSON`.

Builds a Run, imports the entry (`module:function`), calls it, and writes summary.json in every
outcome but a SIGKILL. Its exit code is the contract a supervisor acts on (`exit_code`; SkyPilot's
recover_on_exit_codes, Slurm's --requeue, a shell loop, the Kaggle notebook): 0 done, 75 saved and
not done (run again to go on), 69 no accelerator, 1 anything else; and the launcher of several ranks
dies by the signal that killed one of them, as that rank alone would have (status `killed`).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

# The session clock's fallback: as close to process start as Python lets us get.
PROCESS_START = time.time()

# A fixed thread count for MKL and OpenMP: when they may shrink it at run time (their DYNAMIC default),
# a sum can run in another order and differ in its last bit, and an exact resume needs the same
# arithmetic in every process (oneMKL's reproducibility conditions). Read when torch loads MKL, so set
# before anything imports torch; a value the user set is kept.
for _knob in ("MKL_DYNAMIC", "OMP_DYNAMIC"):
    os.environ.setdefault(_knob, "FALSE")

from kchain.common import faults, layout, summary  # noqa: E402  (after the clock on purpose)
from kchain.common.config import RuntimeConfig  # noqa: E402
from kchain.common.summary import Status, StatusName, Summary  # noqa: E402
from kchain.runtime import lazydynamo  # noqa: E402

# The statuses after which another session resumes where this one saved: "saved, not done".
RESUMABLE = (Status.DEADLINE, Status.INTERRUPTED, Status.STATE_NOT_MOUNTED)
DONE = (Status.FINISHED, Status.STOPPED, Status.NO_CHECKPOINT)  # nothing for a supervisor to run again
EXIT_CODE_FLAG = "--exit-code"  # after an outer torchrun: the code from this node's summary (_after_outer_launcher)
GATE_POLL_S = 0.01  # how often a gated start looks for its release (a stat call; no measurable CPU)
GATE_NOTE = "smoke: started beside the run to resume, held until its kill before reading the working dir"


# The code __main__ exits with, set just before (None in any other process that imports this module, a
# spawned DataLoader worker's __mp_main__): _quick_teardown ends a rank with it.
_EXIT: dict[str, int | None] = {"code": None}


def _quick_teardown() -> None:
    """The last exit handler (registered first, run last): collect once, then freeze what is left;
    a rank of several leaves here instead, with its code.

    The interpreter's own teardown after torch (and torch._dynamo, where DDP or a compile imports
    it) costs about 1 s of CPU in repeated full collections; every checkpoint and the summary
    are on disk by then. One collection still finalizes the code's own garbage cycles (their
    __del__ runs, as in a plain exit); what is left is reachable (torch's modules), and the OS
    frees it at exit.

    A rank of several must not free its process group from Python at all: the collection (or the
    interpreter's own teardown) that frees a DDP model frees the gloo group with the GIL held, while
    a gloo worker thread, releasing its last collective's tensors, waits for the GIL with the lock
    the group's destructor needs. Seen here: a 2-rank resume that had finished and written its
    summary hung in `~ProcessGroupGloo` for good, its launcher waiting on it (a smoke that never
    ends; a session that does not end runs to its limit on the GPU hours). So a rank ends with
    `os._exit` once every other exit handler ran (Python has joined the code's threads before them):
    its garbage cycles' `__del__` do not run, and the OS frees the rest.
    """
    from kchain.runtime import torchrun  # standard library only

    code = _EXIT["code"]
    if code is not None and torchrun.in_ranks(os.environ) and int(os.environ.get("WORLD_SIZE") or 1) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    gc.collect()
    gc.freeze()


atexit.register(_quick_teardown)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def exit_code(status: str | None) -> int:
    """The process's exit code for a session status (docs/runtime.md, "Exit codes").

    0: finished, stopped, or main returned without a loop (nothing to run again); 75
    (layout.EXIT_SAVED_NOT_DONE, EX_TEMPFAIL): saved and not finished, another session resumes
    (deadline, SIGTERM/SIGINT, the state not mounted yet); 69 (layout.EXIT_NO_ACCELERATOR,
    EX_UNAVAILABLE): the machine lacks the GPUs asked for; 1: crashed, and anything else.
    """
    if status in DONE:
        return 0
    if status in RESUMABLE:
        return layout.EXIT_SAVED_NOT_DONE
    if status == Status.NO_ACCELERATOR:
        return layout.EXIT_NO_ACCELERATOR
    return 1


def _after_outer_launcher(launcher_code: int) -> int:
    """`python -m kchain.runtime.launch --exit-code $?` after an outer torchrun (several nodes): this
    node's exit code for a supervisor. torchrun itself returns only 0 or 1; on the node of rank 0 the
    summary this run wrote says the status (75 after a SIGTERM stop), elsewhere torchrun's code stands."""
    done = summary.read(layout.kchain_dir(os.environ) / layout.SUMMARY)
    code = launcher_code if done is None else exit_code(done.status)
    why = f"summary status {done.status}" if done is not None else "no summary on this node: the launcher's code"
    print(f"[kchain] exit code {code} ({why})", flush=True)
    return code


def released(env, argv: list[str] | None = None) -> bool:
    """Wait at the smoke's gate when there is one: True to go on, False to leave untouched.

    `kchain smoke` starts the resume's notebook while the run to be killed is still training, with
    KCHAIN_GATE=PID:PATH; this process then holds here, before it reads anything of the working
    dir, until PATH says `go` (the kill has happened) or `stop` (nothing to resume), or process
    PID (the smoke) is gone. While it waits it imports what main() imports (torch, the runtime) and
    the frameworks the job's entry module imports (transformers, peft, Lightning: `warm_frameworks`),
    which its import would pay after the kill: seconds, tens of them on a busy machine. torch._dynamo
    is not imported: the optimizers no longer need it (lazydynamo.py). The state is still read only
    after the gate, by the Run, as in a fresh session, and the session clock starts at the release
    (KCHAIN_SESSION_START). With several ranks the launcher goes on (it reads no state: the ranks'
    start) and each rank waits here, warmed up, instead.
    """
    from kchain.runtime import torchrun  # standard library only

    if not torchrun.in_ranks(env) and int(env.get(layout.RANKS_ENV) or 1) > 1:
        return True  # the launcher of several ranks: launch_ranks passes the gate on to each rank
    spec = env.pop(layout.GATE_ENV, None)  # the code's own processes (DataLoader workers, ...) never wait
    if not spec:
        return True
    pid, _, path = spec.partition(":")
    gate = Path(path)
    print(f"[kchain] {GATE_NOTE}", flush=True)
    if not gate.exists():
        from kchain.runtime import run  # noqa: F401

        warm_frameworks(argv or [])
    while not gate.exists():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        time.sleep(GATE_POLL_S)
    # The session starts at the release, as a fresh session's would: its wait at the gate is not session
    # time (the notebook's clock started before the wait, and a short train.session_limit ran out in it).
    env[layout.SESSION_START_ENV] = repr(time.time())
    return gate.read_text().strip() == "go"


# The frameworks kchain drives (runtime/frameworks/hf.py, runtime/frameworks/lightning.py) and their companions: libraries whose
# import costs seconds and reads nothing of a session's state, so a held resume may import them early.
FRAMEWORKS = ("transformers", "peft", "accelerate", "tokenizers", "datasets", "pytorch_lightning", "lightning")


def warm_frameworks(argv: list[str]) -> list[str]:
    """Import the FRAMEWORKS the entry module's top-level imports name (read with ast: none of the job's
    code runs), with the environment variables its top level sets before them (`os.environ[K] = "v"`,
    `os.environ.setdefault(K, "v")`: huggingface_hub reads HF_HUB_OFFLINE once, at its import), so the
    entry's own import after the gate finds them loaded. Returns the modules imported."""
    import ast
    import importlib.util

    try:
        config = RuntimeConfig.from_dict(json.loads(Path(argv[1]).read_text()))
        spec = importlib.util.find_spec(config.entry.partition(":")[0])
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8")) if spec and spec.origin else None
    except (IndexError, OSError, ValueError, SyntaxError, ImportError):
        return []
    warmed = []
    for node in tree.body if tree else []:
        if isinstance(node, (ast.Assign, ast.Expr)):
            _set_env(node)
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        for name in names:
            if name.split(".")[0] in FRAMEWORKS and name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the entry's own import reports it, after the gate
                    continue
                warmed.append(name)
    return warmed


def _set_env(node) -> None:
    """`os.environ["K"] = "v"` or `os.environ.setdefault("K", "v")` at the entry's top level, done here too."""
    import ast

    def environ(target) -> bool:
        return isinstance(target, ast.Attribute) and target.attr == "environ" and \
            isinstance(target.value, ast.Name) and target.value.id == "os"

    def text(value) -> str | None:
        return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None

    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript) \
            and environ(node.targets[0].value):
        key, value = text(node.targets[0].slice), text(node.value)
        if key is not None and value is not None:
            os.environ[key] = value
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and \
            isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "setdefault" and \
            environ(node.value.func.value) and len(node.value.args) == 2:
        key, value = text(node.value.args[0]), text(node.value.args[1])
        if key is not None and value is not None:
            os.environ.setdefault(key, value)


def _gate_opened(env) -> bool:
    """Whether the smoke's gate (if any) said `go`: a launcher of held ranks reports nothing otherwise."""
    spec = env.get(layout.GATE_ENV)
    if not spec:
        return True
    gate = Path(spec.partition(":")[2])
    return gate.exists() and gate.read_text().strip() == "go"


def main(argv: list[str]) -> int:
    """Plan the ranks, run the entry (retrying down the out-of-memory ladder), write the summary."""
    if len(argv) == 3 and argv[1] == EXIT_CODE_FLAG:
        return _after_outer_launcher(int(argv[2]))
    if len(argv) != 2:
        print(f"usage: python -m kchain.runtime.launch CONFIG_JSON | {EXIT_CODE_FLAG} LAUNCHER_CODE", file=sys.stderr)
        return 2
    config = RuntimeConfig.from_dict(json.loads(Path(argv[1]).read_text()))
    if faults.wanted(os.environ.get(layout.FAULT_ENV, "")):
        faults.lead()  # a kill fault takes this process's workers with it, as a session's end does
    from kchain.runtime import torchrun  # no torch yet: a launcher of spawned ranks never needs it

    if torchrun.in_ranks(os.environ) and os.environ.get("RANK") == "0":
        # An outer torchrun's rank 0 (or kchain's): a summary left from an earlier run on this disk is
        # never read as this one's (_after_outer_launcher); this run writes its own at the end.
        (layout.kchain_dir(os.environ) / layout.SUMMARY).unlink(missing_ok=True)
    if not torchrun.in_ranks(os.environ):  # kchain ddp: how many ranks, and is the GPU there?
        try:
            n, why = torchrun.plan_ranks(config, os.environ)
        except torchrun.NoAccelerator as e:
            return _no_accelerator(config, str(e))
        late = _await_state(config)
        if late is not None:
            return late
        if n > 1:
            return _run_ranks(n, why, argv[1], config)
    current = SimpleNamespace(run=None)  # the Run in use: the ladder replaces it, a crash names its stage
    error = None
    try:
        _train(config, current)
    except KeyboardInterrupt:
        if current.run is not None:
            current.run.launcher.mark(Status.INTERRUPTED)
        print("[kchain] interrupted", flush=True)
    except BaseException as e:
        error = _crashed(current.run, e)
    finally:
        error = _close(current.run, error)
    return _report(config, current.run, error)


def _train(config: RuntimeConfig, current: SimpleNamespace) -> None:
    """Build the Run, import the entry and call it; after an out-of-memory error, again one rung down."""
    from kchain.runtime import ladder
    from kchain.runtime.checkpoint.snapshot import restore_rng, rng_state, seed_globals
    from kchain.runtime.run import Run, SessionStopped

    seed_globals()  # before the code is imported: a seed of its own, set at import or later, wins
    _freeze_imports()
    current.run = Run(config, os.environ, started=PROCESS_START)
    summary.reserve(current.run.launcher.summary_path)
    module_name, _, func_name = config.entry.partition(":")
    current.run.launcher.enter("build")
    entry = getattr(importlib.import_module(module_name), func_name or "main")
    # The global RNGs as main(run) first finds them (after the code's import, which may seed them): each
    # retry down the ladder starts from here, as if the attempt that ran out of memory had never drawn
    # (its model's initial weights, its dropout), so it trains as the micro-batch set by hand would.
    first = rng_state()
    while True:  # train.micro_batch: auto retries main with a halved micro-batch (runtime/ladder.py)
        rung = None
        try:
            entry(current.run)
        except SessionStopped:
            break  # a deadline or signal stop, saved: the session's part of the run ends here
        except ladder.OutOfMemory:
            rung = current.run.launcher.next_rung()
            if rung is None:
                raise
        if rung is None:
            break
        print(f"[kchain] {rung}", flush=True)
        halvings = current.run.launcher.halvings + 1
        current.run.close()
        current.run = None
        ladder.free()
        restore_rng(first)
        current.run = Run(config, os.environ, started=PROCESS_START, halvings=halvings)
        current.run.launcher.enter("build")
    if current.run.status == Status.RUNNING:
        current.run.launcher.end_without_loop()


def _freeze_imports() -> None:
    """Set what the imports made (torch's, the runtime's, a held resume's frameworks: some 170,000
    objects) outside the garbage collector's passes, before the code is imported or a Run is built.

    The checks that look for the code's own objects walk the collector's list: the smoke's watch for
    untracked state at every step, the plain-DataLoader note, the replicas check. Frozen, that list
    holds only what was made after this point, so each walk costs a few objects instead of ~0.05 s,
    and so does every full collection while training. Everything the code makes (at its import, in
    main, in a second Run after an out-of-memory retry) comes after and is walked as before; nothing
    frozen is garbage (collected first) or the code's."""
    gc.collect()
    gc.freeze()


def _crashed(run, e: BaseException) -> dict:
    """A crash: the traceback, one line naming it, and the error for the summary."""
    from kchain.runtime import torchrun

    traceback.print_exc()
    stage = run.launcher.phase if run is not None else "build"
    error = {"type": type(e).__name__, "message": _first_line(e), "stage": stage}
    if run is not None:
        run.launcher.mark(Status.CRASHED)
    print(f"[kchain] crashed in {stage}: {type(e).__name__}: {_first_line(e)}", flush=True)
    if torchrun.in_ranks(os.environ) and os.environ.get("WORLD_SIZE") != "1":
        # kchain ddp: the others may wait in a collective this rank never joins: leave now, and
        # let torchrun end them; the launcher's parent names this error in the summary.
        rank = int(os.environ["RANK"])
        if run is not None:
            try:
                run.launcher.close_checkpoints()  # never leave rank 0's checkpoint write half done (and the sink flushed)
            except BaseException:
                pass
        torchrun.record_error(layout.kchain_dir(os.environ), rank, error)
        os._exit(1)
    return error


def _close(run, error: dict | None) -> dict | None:
    """Close the run (never exit with a checkpoint write in flight); a failed close is the crash."""
    if run is None:
        return error
    try:
        run.close()
    except BaseException as e:
        traceback.print_exc()
        if error is None:
            error = {"type": type(e).__name__, "message": _first_line(e), "stage": "checkpoint"}
            run.launcher.mark(Status.CRASHED)
    return error


def _report(config: RuntimeConfig, run, error: dict | None) -> int:
    """Write summary.json (rank 0), say its gist in one line, and return the exit code."""
    from kchain.runtime import torchrun

    if run is not None and not run.is_main:
        return 1 if run.status == Status.CRASHED else 0  # kchain ddp: rank 0 writes the summary
    if run is not None:
        done = run.launcher.summary(error)
        path = run.launcher.summary_path
    else:  # the Run was never built
        done = _launcher_summary(config, Status.CRASHED, error)
        path = layout.kchain_dir(os.environ) / layout.SUMMARY
    summary.write(path, done)
    if torchrun.in_ranks(os.environ):
        # A rank: the launcher's parent prints the final summary and exits with its code; a rank's own
        # code stays 0 or 1, so a launcher's fail-fast (any non-zero rank ends the others) means a crash.
        return 1 if done.status == Status.CRASHED else 0
    _say_summary(done)
    return exit_code(done.status)


def _say_summary(done: Summary) -> None:
    gist = {"status": done.status, "step": done.step, "total": done.total, "checkpoint": done.checkpoint}
    print(f"[kchain] summary: {json.dumps(gist)}", flush=True)


def _no_accelerator(config: RuntimeConfig, message: str) -> int:
    """The granted-accelerator check failed: one line, status no_accelerator, within seconds."""
    print(f"[kchain] no-accelerator: {message}", flush=True)
    summary.write(layout.kchain_dir(os.environ) / layout.SUMMARY, _launcher_summary(
        config, Status.NO_ACCELERATOR, {"type": "NoAccelerator", "message": message, "stage": "start"}, step=0))
    return layout.EXIT_NO_ACCELERATOR


def _await_state(config: RuntimeConfig) -> int | None:
    """A Kaggle session pushed to resume a state waits for it to be mounted (resumecheck.await_state),
    before any rank starts; the exit code of a session that stops because it never was, else None."""
    from kchain.common import resumecheck

    if os.environ.get(layout.SMOKE_ENV) == "1":
        return None
    resume = config.kaggle.resume
    try:
        resumecheck.await_state(resume, layout.input_root(os.environ), config.kaggle.mount_wait_s,
                                lambda text: print(f"[kchain] {text}", flush=True), state_slug=config.state_slug)
    except resumecheck.StateNotMounted as e:
        assert resume is not None  # await_state raises it only for an expected state
        print(f"[kchain] state-not-mounted: {e}", flush=True)
        summary.write(layout.kchain_dir(os.environ) / layout.SUMMARY, _launcher_summary(
            config, Status.STATE_NOT_MOUNTED, {"type": "StateNotMounted", "message": str(e), "stage": "start"},
            step=int(resume["step"])))
        return exit_code(Status.STATE_NOT_MOUNTED)
    return None


def _run_ranks(n: int, why: str, config_path: str, config: RuntimeConfig) -> int:
    """kchain ddp: run N ranks, then make the summary name the first rank's error."""

    from kchain.runtime import forkranks, torchrun

    kdir = layout.kchain_dir(os.environ)
    torchrun.clear_errors(kdir)
    (kdir / layout.SUMMARY).unlink(missing_ok=True)
    fork = _forkable(config_path)
    print(f"[kchain] launching {n} ranks ({why}{'; ' + forkranks.NOTE if fork else ''})", flush=True)
    env = {**os.environ, layout.SESSION_START_ENV: os.environ.get(layout.SESSION_START_ENV) or repr(PROCESS_START)}
    ended = torchrun.launch_ranks(n, config_path, env, fork=fork)
    if not _gate_opened(os.environ):
        return 0  # the smoke sent its held resume away (or is gone): the ranks left untouched, nothing to say
    if ended.killed:
        return _rank_killed(n, ended.killed[0], config)
    path = kdir / layout.SUMMARY
    done = summary.read(path) or _without_summary(kdir, n, config, f"the ranks' launcher returned {ended.code}")
    first = torchrun.first_error(kdir)
    if first is not None:
        done.status = Status.CRASHED
        done.error = {k: first[k] for k in ("type", "message", "stage", "rank") if k in first}
        print(f"[kchain] rank {first['rank']} crashed in {first.get('stage')}: {first['type']}: {first['message']}",
              flush=True)
    summary.write(path, done)
    _say_summary(done)
    return exit_code(done.status)


def _process(argv: list[str]) -> int:
    """What this process does, spawned or forked: wait at the smoke's gate if it has one, then run."""
    return main(argv) if released(os.environ, argv) else 0


def _forkable(config_path: str) -> Callable[[], None] | None:
    """What a forked rank runs, when this launcher's ranks may be forks of it (forkranks.py: local CPU
    ranks; torch is imported here then), else None: each rank is spawned."""
    from kchain.runtime import forkranks

    if not forkranks.prepare(os.environ):
        return None
    # What every rank imports before its first step. Not the job's frameworks: some read the rank from the
    # environment at their import (Lightning's rank_zero_only), and here it is still the launcher's.
    from kchain.runtime import run  # noqa: F401

    if not forkranks.alone():
        return None

    def rank() -> None:
        argv = [sys.argv[0], config_path]
        code = 1
        try:
            code = _process(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - what an uncaught error does in a spawned rank
            traceback.print_exc()
        _EXIT["code"] = code
        try:
            atexit._run_exitfuncs()  # the interpreter's exit, as a spawned rank's: _quick_teardown leaves here
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    return rank


def _without_summary(kdir: Path, n: int, config: RuntimeConfig, why: str) -> Summary:
    """Rank 0 left without a summary (it failed, or was killed): a crash at the newest checkpoint's step."""
    ckpts = sorted((kdir / layout.CHECKPOINTS_DIR).glob(f"{layout.CHECKPOINT_PREFIX}*"))
    return _launcher_summary(config, Status.CRASHED,
                             {"type": "RankFailed", "stage": "step", "message": f"rank 0 ended without a summary ({why})"},
                             step=int(ckpts[-1].name.removeprefix(layout.CHECKPOINT_PREFIX)) if ckpts else 0,
                             checkpoint=str(ckpts[-1].relative_to(kdir.parent)) if ckpts else None, world_size=n)


def _launcher_summary(config: RuntimeConfig, status: StatusName, error: dict | None, step: int | None = None,
                      checkpoint: str | None = None, world_size: int | None = None) -> Summary:
    """The summary the launcher writes itself, where no Run wrote one (a Run's is run.launcher.summary): it
    never started training, or rank 0 left without one. The session clock's start is this process's."""
    return Summary(status=status, error=error, started=PROCESS_START, ended=time.time(), step=step,
                   checkpoint=checkpoint, fingerprint=config.fingerprint, world_size=world_size)


def _rank_killed(n: int, killed: tuple[int, int], config: RuntimeConfig) -> int:
    """A rank died by a signal from outside (the OOM killer, a segfault) and its peers failed after it: the
    summary says `killed` (which rank, which signal) at the newest verified checkpoint, not a peer's broken
    connection, and the launcher then dies by the same signal, so whatever runs it (the notebook, a target's
    engine) sees what one rank's death gives (the notebook publishes and the chain goes on: docs/design.md)."""
    import signal

    from kchain.common.statefolder import newest_checkpoint
    from kchain.runtime import torchrun

    rank, signum = killed
    kdir = layout.kchain_dir(os.environ)
    path = kdir / layout.SUMMARY
    done = summary.read(path) or _without_summary(kdir, n, config, "killed")
    found = newest_checkpoint(kdir, config.job)
    done.step = int(found[1].get("step") or 0) if found is not None else done.step
    done.checkpoint = str(found[0].relative_to(kdir.parent)) if found is not None else None
    name = torchrun.signal_name(signum)
    saved = f"its newest verified checkpoint (step {done.step}) is handed on" if found else "no checkpoint was saved"
    done.status, done.ended, done.world_size = Status.KILLED, time.time(), n
    done.error = {"type": "RankKilled", "stage": "step", "rank": rank, "signal": name,
                  "message": f"rank {rank} of {n} was killed by {name} from outside the training "
                             f"(the OOM killer, a segfault, a kill): {saved}"}
    peer = torchrun.first_error(kdir)
    done.note = None if peer is None else (f"then rank {peer['rank']} failed, as a peer of a dead rank does: "
                                           f"{peer.get('type')}: {peer.get('message')}")
    print(f"[kchain] {done.error['message']}", flush=True)
    summary.write(path, done)
    _say_summary(done)
    if signum != signal.SIGKILL:  # SIGKILL has no handler to reset
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die as the rank died (the notebook reads -9 as one rank's kill)
    return 1  # a signal whose default is not to end a process


if __name__ == "__main__":
    lazydynamo.install()  # before anything imports torch: its optimizers no longer import torch._dynamo
    _EXIT["code"] = _process(sys.argv)
    sys.exit(_EXIT["code"])
