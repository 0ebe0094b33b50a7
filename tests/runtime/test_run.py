"""The Run in-process: smoke caps and run.every, late tracking, an evaluation in the deadline plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_run
from torch.utils.data import TensorDataset

from kchain.common import layout
from kchain.runtime.run import Run


def test_smoke_caps_steps_subsets_evenly_and_every_fires_on_the_last_step(tmp_path):
    config = {"job": "unit", "params": {}, "smoke": {"fraction": 0.05, "steps": 20},
              "train": {"heartbeat_s": 0, "checkpoint_every": {"steps": 100}}}
    run = Run(config, {layout.ROOT_ENV: str(tmp_path), layout.SMOKE_ENV: "1"})
    assert run.smoke and run.fraction == 0.05
    labels = np.repeat(np.arange(10), 100)  # sorted by class: the first rows are all class 0
    assert set(run.subset(labels)) == set(range(10)) and len(run.subset(labels)) == 50
    assert len(run.subset(list(range(3)))) == 1 and len(run.subset(TensorDataset(torch.zeros(40)))) == 2
    hits = [step for step in run.steps(1000) if run.every(7)]
    assert hits == [7, 14, 20] and run.step == 20 and run.finished
    run.close()
    assert make_run(tmp_path).subset(labels) is labels


def test_the_heartbeat_of_the_smokes_run_to_kill_names_its_planned_stop(tmp_path, capsys):
    # That run saves only at its deadline stop: its cadence is a placeholder (NO_CADENCE) the heartbeat never shows.
    from kchain.local.smoke import NO_CADENCE
    from kchain.runtime.run import SessionStopped

    run = make_run(tmp_path, env={layout.FAULT_ENV: "deadline_at_step=3", layout.CHECKPOINT_EVERY_ENV: NO_CADENCE})
    with pytest.raises(SessionStopped):
        for _ in run.steps(6):
            pass
    run.close()
    beats = [line.rsplit(" | ", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("[kchain] step ")]
    assert beats == [f"ckpt in {n} steps (the planned stop)" for n in (2, 1, 0)]


def test_tracking_after_the_loop_started_is_refused(tmp_path):
    run = Run({"job": "late-track", "params": {}, "train": {"checkpoint_every": {"steps": 100}}},
              env={"KCHAIN_ROOT": str(tmp_path)})
    model = torch.nn.Linear(2, 2)
    for _ in run.steps(1):
        with pytest.raises(RuntimeError, match=r"run.track\(model=...\) after run.steps started"):
            run.track(model=model)
    run.close()


def test_a_long_evaluation_in_run_every_stays_in_the_deadline_plan(tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace

    from kchain.runtime import loop
    from kchain.runtime import run as run_module
    from kchain.runtime.clock import SessionClock

    # The loop's step timer reads a clock this test moves: a step takes 0.01 s and the evaluation
    # 0.3 s more, however busy the machine is.
    now = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: now[0], time=time.time))
    made: list[SessionClock] = []  # the session clock the Run builds and hands to its loop

    class Seen(SessionClock):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(run_module, "SessionClock", Seen)
    run = make_run(tmp_path, checkpoint_every={"steps": 1000})
    for step in run.steps(16):
        now[0] += 0.01
        if run.every(5) and step <= 10:
            now[0] += 0.3  # the evaluation at steps 5 and 10
    run.close()
    # The loop tells the session clock which steps evaluated; tests/runtime/test_clock.py shows the
    # clock then plans the next evaluation's step with it, long after it left the window.
    [clock] = made
    assert clock.every_n == 5 and clock.eval_s == pytest.approx(0.31)
    assert clock.step_times == pytest.approx([0.01] * 5)  # steps 12-16: step 15 did not evaluate
