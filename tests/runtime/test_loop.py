"""The loop driver on its own (no Run): saves between steps, the stops, run.epochs over a loader."""

from __future__ import annotations

import time

import pytest
import torch
from test_checkpointer import parts

from kchain.common.faults import Faults
from kchain.runtime.clock import SessionClock
from kchain.runtime.loader import Loader
from kchain.runtime.loop import Loop, SessionStopped


def driver(tmp_path, faults="", every=None, limit_s=3600.0):
    ckpt, progress, trace = parts(tmp_path, every=every)
    ckpt.track("model", torch.nn.Linear(2, 2))
    clock = SessionClock(time.time(), limit_s, margin_s=0.0, publish=None)
    loop = Loop(progress, clock, ckpt, trace, ckpt.ranks, Faults.parse(faults), {}, heartbeat_s=0, hang_s=None,
                on_hang=lambda waited, limit: None, cap=None)
    return loop, ckpt, progress, trace


def saved_steps(ckpt):
    ckpt.writer.wait()
    return sorted(int(p.name.split("-")[1]) for p in ckpt.where.checkpoints.glob("step-*"))


def test_steps_save_on_the_cadence_and_at_the_end(tmp_path, capsys):
    loop, ckpt, progress, trace = driver(tmp_path, every={"steps": 4})
    assert list(loop.steps(6)) == [1, 2, 3, 4, 5, 6]
    assert progress.status == "finished" and progress.saved_step == 6 and saved_steps(ckpt) == [4, 6]
    assert "finished at step 6/6" in capsys.readouterr().out
    trace.close()


def test_a_break_is_an_early_stop_that_counts_and_saves_the_step_reached(tmp_path):
    loop, ckpt, progress, trace = driver(tmp_path, every={"steps": 100})
    for step in loop.steps(10):
        if step == 3:
            break
    assert progress.status == "stopped" and progress.step == 3 and saved_steps(ckpt) == [3]
    trace.close()


def test_a_deadline_saves_the_stop_and_raises_out_of_the_loop_so_no_later_code_runs(tmp_path):
    loop, ckpt, progress, trace = driver(tmp_path, faults="deadline_after_steps=2", every={"steps": 100})
    ran = []
    with pytest.raises(SessionStopped):
        for step in loop.steps(10):
            ran.append(step)
    assert ran == [1, 2] and progress.status == "deadline" and progress.stopped and saved_steps(ckpt) == [2]
    trace.close()


def test_the_session_clock_stops_the_loop_when_a_step_no_longer_fits(tmp_path):
    # How many steps fit depends on the machine (a loaded one may fit none): only the stop is asserted.
    loop, ckpt, progress, trace = driver(tmp_path, every={"steps": 100}, limit_s=1.0)
    with pytest.raises(SessionStopped):
        for _ in loop.steps(10**6):
            time.sleep(0.05)
    assert progress.status == "deadline" and progress.step < 10**6 and saved_steps(ckpt) == [progress.step]
    trace.close()


def test_epochs_make_each_batch_a_step_and_a_stop_mid_epoch_skips_the_rest_of_it(tmp_path):
    loop, ckpt, progress, trace = driver(tmp_path, faults="deadline_after_steps=5", every={"steps": 100})
    lo = Loader(torch.arange(8), batch_size=2, shuffle=False)  # 4 batches an epoch
    loop.loaders.append(lo)
    ckpt.track("loader", lo)
    after_epoch = []
    with pytest.raises(SessionStopped):
        for epoch in loop.epochs(3, lo):
            for _ in lo:
                pass
            after_epoch.append(epoch)  # a scheduler step, an evaluation: only for whole epochs
    assert after_epoch == [0] and progress.step == 5 and progress.total == 12
    assert (lo.epoch, lo.position) == (1, 1) and saved_steps(ckpt) == [5]
    trace.close()


def test_should_stop_for_a_loop_of_the_users_own_then_its_save_ends_main(tmp_path):
    loop, ckpt, progress, trace = driver(tmp_path, faults="deadline_after_steps=3")
    stops = [loop.should_stop(step) for step in (1, 2, 3)]
    assert stops == [False, False, True]
    with pytest.raises(SessionStopped):
        loop.save(3)
    assert progress.status == "deadline" and saved_steps(ckpt) == [3]
    loop.restore_signals()
    trace.close()
