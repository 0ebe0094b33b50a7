"""Fault injection for the emulator: the ways real Kaggle misbehaves, on demand.

One `Faults` object hangs off a running emulator (`emu.faults`); tests change its attributes while
the emulator runs and the next request or session sees the new values. Every random choice comes
from a seeded RNG so a failing run can be replayed: one RNG a kind of draw (an RPC's 429/500s by its name,
the creating calls' lost answers, their resets, the kills), each seeded from `seed` and its name. So the
faults a push meets do not shift with how many status polls came before it, a number that grows on a
slower machine: with one RNG for every call, a seed's outcome depended on the machine's speed.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from kchain.emulator.switches import opt


@dataclass
class Faults:
    # Fraction of API calls (POST /api/v1/...) answered 429 with Retry-After: 1, then 500.
    rate_429: float = opt(0.0, 'that fraction of API calls is answered 429 (Retry-After: 1).', metavar='P')
    rate_500: float = opt(0.0, 'that fraction of API calls is answered 500.', metavar='P')
    # Kill every session pushed from now on this many seconds after it starts.
    kill_after_s: float | None = opt(None, 'kill every session pushed from now on this long after it starts.', metavar='SECONDS')
    # Or at a time drawn uniformly from (low, high) seconds after it starts.
    kill_random_s: tuple[float, float] | None = opt(None, 'kill every session at a time drawn from LOW..HIGH seconds after it starts.', metavar='LOW HIGH')
    # Or as soon as the session's log shows this text (a marker the notebook prints): a kill that
    # never races the machine's speed.
    kill_on_output: str | None = opt(None, 'kill a session as soon as its log shows TEXT.', metavar='TEXT')
    # Or as soon as the session has saved a checkpoint past the state it resumed from (a complete
    # step-N folder in working/kchain/checkpoints, N above the attached state's step): a kill after
    # real progress, whatever the job's loop prints (an explicit run.save loop prints no heartbeat).
    kill_after_checkpoint: bool = opt(False, 'kill a session as soon as it saved a checkpoint past the state it resumed from.')
    # With kill_after_checkpoint: SIGKILL the training process tree alone (the OOM killer, a segfault), not the
    # session: the notebook lives on, and an unattended kernel publishes that checkpoint and pushes the next.
    kill_training_only: bool = opt(False, '--kill-after-checkpoint kills the training process alone (the OOM killer); the notebook lives on.')
    # The notebook's runner crashes as soon as the session's log shows this text: its process tree dies
    # (SIGKILL) with no word to Kaggle, and the session then shows what `switches.crashed_runner` says.
    crash_runner_on_output: str | None = opt(None, 'the notebook runner crashes as soon as the log shows TEXT (see --crashed-runner).', metavar='TEXT')
    # Only in the Nth session the account pushes to run (1-based, counted over every kernel, so a
    # kernel deleted and pushed again keeps counting); None: in every session pushed while it is set.
    crash_runner_in: int | None = opt(None, '--crash-runner-on-output only in the Nth session the account pushes to run.', metavar='N')
    # Upload PUTs that carry bytes are cut off after reading half their body: the 1st, the
    # (N+1)th, ... (1 = every one).
    drop_upload_every: int = opt(0, 'cut off the 1st, (N+1)th, ... upload half-way through its body.', metavar='N')
    # The next N upload PUTs that carry bytes stall half-way: the first half of the body is stored, the
    # rest is read and thrown away, and no answer comes until the client goes away (a hung link; the
    # official client sets no timeout on its PUT, so it waits until it is killed).
    stall_upload: int = opt(0, 'the next N uploads store half their body, then hang until the client goes away.', metavar='N')
    # New dataset versions stay "processing" (BLOBS_RECEIVED) for this many seconds.
    processing_s: float = opt(0.0, 'a new dataset version stays processing (BLOBS_RECEIVED) this long.', metavar='SECONDS')
    # A session killed by its limit or by a fault leaves no output, like a lost VM.
    lose_output: bool = opt(False, 'a session killed by its limit or by a fault leaves no output, like a lost VM.')
    # The next N SaveKernel calls create the version (and start its session), then answer 500:
    # a push whose answer is lost after Kaggle acted on it.
    fail_after_save: int = opt(0, 'the next N SaveKernel calls act, then answer 500 (a lost answer).', metavar='N')
    # The next SaveKernel calls are answered these HTTP codes, one each, before acting (a comma-separated list
    # such as "429,429,500"; a 429 carries Retry-After: 1): a push Kaggle turned away, in an order no draw of
    # the rates can change.
    refuse_save: str = opt('', 'the next SaveKernel calls are answered these codes before acting, one each (e.g. 429,500).', metavar='CODES')
    # Sessions get no GPU though the kernel asked for one (quota spent): the runtime's granted-
    # accelerator check sees what a real GPU-less session shows it.
    no_gpu: bool = False
    # That fraction of creating calls (SaveKernel, CreateDataset, CreateDatasetVersion[ById]) act, then
    # answer 500: a lost answer, drawn from the seeded RNG.
    rate_lost_answer: float = opt(0.0, 'that fraction of creating calls act, then answer 500.', metavar='P')
    # The next N creating calls act, then reset the connection (a TCP reset, no HTTP answer at all): the
    # lost answer the official client's own `with_retry` re-sends (it retries connection errors, never a 500).
    reset_after_acting: int = opt(0, 'the next N creating calls act, then reset the connection (no answer).', metavar='N')
    # That fraction of creating calls act, then reset the connection, drawn from the seeded RNG.
    rate_reset_after_acting: float = opt(0.0, 'that fraction of creating calls act, then reset the connection (no answer).', metavar='P')
    seed: int = opt(0, 'Seed of the random faults.', metavar='N')
    _rngs: dict[str, random.Random] = field(default_factory=dict, init=False, repr=False)  # by stream
    _rng_seed: int | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _uploads_seen: int = field(default=0, init=False, repr=False)
    _resets: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if any(not c.isdigit() or not 400 <= int(c) <= 599 for c in self._refusals()):
            raise ValueError(f"refuse_save is HTTP error codes separated by commas (429,500), not {self.refuse_save!r}")

    def _refusals(self) -> list[str]:
        """refuse_save's codes still to answer, in order."""
        return [c.strip() for c in self.refuse_save.split(",") if c.strip()]

    @property
    def resets(self) -> int:
        """How many creating calls acted and then reset the connection (so a test knows the fault fired)."""
        return self._resets

    def _random(self, stream: str) -> float:
        """The next draw of one stream's RNG (seeded from `seed` and the stream's name; a new seed starts
        every stream again)."""
        with self._lock:
            if self._rng_seed != self.seed:
                self._rngs, self._rng_seed = {}, self.seed
            rng = self._rngs.get(stream)
            if rng is None:
                rng = self._rngs[stream] = random.Random(f"{self.seed}/{stream}")
            return rng.random()

    def api_fault(self, rpc: str) -> int | None:
        """The HTTP status to answer this call of `rpc` with instead of serving it, or None."""
        if self.rate_429 <= 0 and self.rate_500 <= 0:
            return None
        draw = self._random(f"api/{rpc}")
        if draw < self.rate_429:
            return 429
        if draw < self.rate_429 + self.rate_500:
            return 500
        return None

    def _take_one(self, name: str) -> bool:
        """Whether the countdown fault `name` (the next N ...) fires now; it counts one down if so."""
        with self._lock:
            left = getattr(self, name)
            if left > 0:
                setattr(self, name, left - 1)
            return left > 0

    def save_refusal(self) -> int | None:
        """The HTTP code to turn this SaveKernel away with before it acts (refuse_save's next one), or None."""
        with self._lock:
            codes = self._refusals()
            if not codes:
                return None
            self.refuse_save = ",".join(codes[1:])
            return int(codes[0])

    def lose_save_answer(self) -> bool:
        """Whether this SaveKernel, which has acted, answers 500 (fail_after_save, then the rate)."""
        return self._take_one("fail_after_save") or self.lose_answer()

    def lose_answer(self) -> bool:
        """Whether this creating call, which has acted, answers 500 (rate_lost_answer)."""
        return self.rate_lost_answer > 0 and self._random("lost") < self.rate_lost_answer

    def reset_answer(self) -> bool:
        """Whether this creating call, which has acted, resets the connection instead of answering
        (reset_after_acting, then the rate)."""
        reset = self._take_one("reset_after_acting") or (self.rate_reset_after_acting > 0 and self._random("reset") < self.rate_reset_after_acting)
        if reset:
            with self._lock:
                self._resets += 1
        return reset

    def drop_this_upload(self) -> bool:
        if self.drop_upload_every <= 0:
            return False
        with self._lock:
            self._uploads_seen += 1
            return (self._uploads_seen - 1) % self.drop_upload_every == 0

    def stall_this_upload(self) -> bool:
        return self._take_one("stall_upload")

    def kill_at(self) -> float | None:
        """Seconds after start at which a session starting now is killed, or None."""
        if self.kill_after_s is not None:
            return float(self.kill_after_s)
        if self.kill_random_s is not None:
            low, high = self.kill_random_s
            return low + (high - low) * self._random("kill")
        return None
