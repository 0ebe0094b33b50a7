"""An unattended chain (`kchain push --unattended`): each session pushes the next from inside its kernel.

The laptop side does nothing after session 1 but watch; the records are rebuilt from Kaggle's outputs
alone (each session's summary says what it decided and which kernel version it pushed). Sessions are
real notebook processes against the local Kaggle with the unmodified client, its kernel_may_push switch on;
a GPU job's sessions hand each push to a CPU relay (kchain/common/relay.py), so the chain holds one GPU slot.
"""

import secrets

import pytest
from helpers import GENEROUS_S, STALL

from kchain.chain.sessions import waiting
from kchain.common import layout
from kchain.emulator import Faults, Switches
from kchain.local.rehearse import rehearse


def trained_at_once(emulator_sessions: list[dict]) -> int:
    """Pairs of sessions whose training (first cell to the summary's end) overlapped, from the emulator's records."""
    spans = sorted((s["first_cell"], (s.get("summary") or {}).get("ended") or s["ended"])
                   for s in emulator_sessions if s.get("first_cell"))
    return sum(1 for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1])


def ours(result) -> list[dict]:
    """The emulator's sessions of the chain's own kernel (not its relays, nor another kernel's)."""
    return [s for s in result.emulator_sessions if s["kernel"] == result.sessions[0]["kernel"]]


@pytest.mark.slow
def test_an_unattended_chain_under_the_fault_set_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    # Session 2's training process alone is SIGKILLed right after its checkpoint at step 40 (the OOM killer: the
    # notebook lives on); its launch cell publishes that checkpoint and pushes session 3 as after a deadline.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=20,kill_training_at_step=30")
    from helpers import copy_job

    job = copy_job("tinygpt", tmp_path, params={"steps": 60, "eval_every": 20, "batch": 8, "accumulate": 1})
    faults = Faults(rate_429=0.15, rate_500=0.10, rate_lost_answer=0.1, drop_upload_every=4, processing_s=2.0,
                    rate_reset_after_acting=0.1, seed=5)
    result = rehearse(job, sessions=None, session_limit_s=GENEROUS_S,
                      kills=0, seed=2, faults=faults, echo=lambda _: None, ranks=1,
                      key=secrets.token_hex(16), unattended=True, switches=Switches(new_image_every=1))
    assert result.passed, result.verdict
    chain = result.sessions
    assert len(chain) >= 3
    # After session 1 every session was pushed by the kernel before it, none by the laptop.
    assert [s.get("pushed_by") for s in chain[1:]] == ["kernel"] * (len(chain) - 1), chain
    for before, after in zip(chain, chain[1:], strict=False):
        # A GPU job: each session handed the push to a CPU relay, which pushed the next once it had ended.
        assert before["summary"] is not None and before["version"] is not None
        told = before["summary"]["next"]
        assert told["decision"] == "relayed" and told["relay"] == chain[0]["kernel"] + "-doctor", told
        assert after["version"] == before["version"] + 1 and "pushed session" in after["relay_said"], after
        assert after["resumes_at"] == before["summary"]["published_step"]
    assert chain[-1]["summary"] is not None
    assert chain[-1]["summary"]["next"]["decision"] == "finished"
    ended = {s["version"]: s for s in ours(result)}
    killed = [r["session"] for r in chain if "(killed)" in (ended[r["version"]].get("failure_message") or "")]
    assert chain[1]["summary"] is not None
    assert killed == [2] and chain[1]["summary"]["published_step"] == 40, [ended[r["version"]] for r in chain]
    # An empty ledger (another laptop) rebuilds the same chain from Kaggle's versions and outputs alone.
    keys = ("session", "version", "resumes_at", "state_version", "status")
    assert result.rebuilt == [{k: r.get(k) for k in keys} for r in chain], result.rebuilt
    # Zero double sessions, zero duplicate versions (kernel and state), from the emulator's records.
    assert trained_at_once(ours(result)) == 0
    assert sorted(s["version"] for s in ours(result)) == [r["version"] for r in chain]
    published = [v["notes"] for v in result.dataset_versions if "step" in (v.get("notes") or "")]
    assert len(published) == len(set(published)), published


@pytest.mark.slow
def test_an_unattended_chain_holds_one_gpu_slot_beside_another_gpu_session(tmp_path, monkeypatch):
    # Another GPU session of the account runs all along (a notebook open in the browser). Under Kaggle's cap of
    # two, a session that pushed the next while it still ran would be refused; each hands the push to a CPU
    # relay that pushes it once the session has ended, so the chain goes on with no laptop.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=10")
    from helpers import copy_job

    job = copy_job("tinygpt", tmp_path, params={"steps": 20, "eval_every": 10, "batch": 8, "accumulate": 1})
    result = rehearse(job, sessions=None, session_limit_s=GENEROUS_S, kills=0, seed=3, echo=lambda _: None,
                      ranks=1, key=secrets.token_hex(16), unattended=True, busy_gpu=True)
    assert result.passed, result.verdict
    assert result.unattended is not None
    assert len(result.sessions) == 2 and result.unattended.laptop_pushes == 0, result.sessions
    busy = [s for s in result.emulator_sessions if s["gpu"] and s["kernel"] != result.sessions[0]["kernel"]]
    relays = [s for s in result.emulator_sessions if s["kernel"] == result.sessions[0]["kernel"] + "-doctor"]
    assert len(busy) == 1 and busy[0]["status"] == "RUNNING", busy  # it held its slot to the end
    assert len(relays) == 1 and not relays[0]["gpu"] and relays[0]["pushed_from"] == "kernel", relays


@pytest.mark.slow
def test_when_a_kernel_cannot_push_the_laptop_takes_the_chain_over_from_kaggles_records(tmp_path, monkeypatch):
    # Session 2's kernel finds no Secret: it cannot publish or push, and says so in its summary; the
    # laptop's `continue` (its records rebuilt from Kaggle's outputs: it pushed only session 1) relays and
    # pushes session 3, once, and the kernels chain on from there.
    monkeypatch.setenv(layout.FAULT_ENV, f"{STALL},deadline_after_steps=15")
    from helpers import copy_job

    job = copy_job("tinygpt", tmp_path, params={"steps": 60, "eval_every": 20, "batch": 8, "accumulate": 1})
    result = rehearse(job, sessions=None, session_limit_s=GENEROUS_S,
                      kills=0, seed=1, echo=lambda _: None, ranks=1,
                      key=secrets.token_hex(16), unattended=True, no_secret_in=2)
    assert result.passed, result.verdict
    chain = result.sessions
    assert chain[1]["summary"] is not None
    told = chain[1]["summary"]["next"]
    assert told["decision"] == "left to the laptop" and "no credential" in told["why"], told
    # Until the laptop looked, `kchain status` said that nothing ran, and the kernel's reason.
    assert waiting(chain[:2], "job.yaml") == {"for": "continue", "why": "session 2's kernel did not push the next "
                                              f"session: {told['why']}"}
    assert chain[1]["pushed_by"] == "kernel" and chain[1]["publish"]["published"] == "relay"
    assert "pushed_by" not in chain[2] and all(s.get("pushed_by") == "kernel" for s in chain[3:])
    # An empty ledger rebuilds the whole chain from Kaggle alone, session 3 too, which a laptop pushed (the step
    # it resumed at is its summary's).
    keys = ("session", "version", "status", "resumes_at")
    assert isinstance(result.rebuilt, list), result.rebuilt
    assert [{k: r[k] for k in keys} for r in result.rebuilt] == [{k: r.get(k) for k in keys} for r in chain]
    assert trained_at_once(ours(result)) == 0
    assert sorted(s["version"] for s in ours(result)) == [r["version"] for r in chain]


def test_unattended_is_refused_in_one_line_until_the_doctor_saw_a_kernel_push_a_kernel(tmp_path):
    from helpers import copy_job, error_line, invoke

    path = copy_job("tinygpt", tmp_path, params={"steps": 10}, kaggle={"internet": True})
    refused = invoke("push", path, "--unattended", "--skip-smoke")
    assert refused.exit_code == 8
    assert error_line(refused) == (
        "Error: --unattended: kchain doctor has not seen a kernel push a kernel on this account; set "
        "kaggle.internet: true, attach the Secrets KAGGLE_USERNAME and KAGGLE_KEY to tinygpt-notes-doctor, "
        f"and run `kchain doctor {path}`")


def test_unattended_refuses_a_session_too_short_for_its_kernel_to_publish_and_push(tmp_path):
    from helpers import copy_job, error_line, invoke

    # 300 s with a 2-minute margin keeps 90 s for the hand-over; the assumed figures need 110 s (95 s of publish
    # and push, 15 s from the stop's save to the publisher's own check).
    path = copy_job("tinygpt", tmp_path, params={"steps": 10}, kaggle={"internet": True},
                    train={"session_limit": "300s", "margin": "2m"})
    refused = invoke("push", path, "--unattended", "--skip-smoke")
    assert refused.exit_code == 10
    assert error_line(refused) == (
        f"Error: {path}: train.session_limit: 300s is too short for an unattended chain: after its last save each "
        "kernel needs about 110s to publish the state and push the next session (assumed figures), and a session "
        "keeps at most half of the 180s left after train.margin for that; raise train.session_limit to at least "
        "340s, or push without --unattended (the laptop relays each session)")
    roomy = copy_job("tinygpt", tmp_path / "roomy", params={"steps": 10}, kaggle={"internet": True},
                     train={"session_limit": "300s", "margin": "1m"})
    assert "kchain doctor has not seen a kernel push a kernel" in error_line(invoke("push", roomy, "--unattended"))
