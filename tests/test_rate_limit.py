"""mmreplay.rate_limit.RateLimiter: Reverb's samples-per-insert band, on its own.

Parameter checks; admission at the band's edges, min size, `min_size`/`queue`; timeouts,
cancels, close, enable/disable (rebase), state/restore; threads that wait on each other
finish with the counts they made; and a hypothesis state machine that interleaves
inserts, samples, switches and restarts against a naive model of the band, checking that
the two never disagree and that an insert and a sample never both wait.
"""

from __future__ import annotations

import threading
import time

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mmreplay.admission import steps_in_call
from mmreplay.errors import (
    InvalidInputError,
    MmreplayError,
    RateLimiterClosedError,
    RateLimitTimeoutError,
)
from mmreplay.rate_limit import RateLimiter


def test_parameter_checks_say_why() -> None:
    with pytest.raises(InvalidInputError, match="block each other forever"):
        RateLimiter.sample_to_insert_ratio(8, 100, 7.9)  # band 15.8 < 2 * 8
    RateLimiter.sample_to_insert_ratio(8, 100, 8)  # band 16: the smallest allowed
    with pytest.raises(InvalidInputError, match="block each other forever"):
        RateLimiter(0.5, 1, 0, 1.9)  # band < 2 * max(1, spi)
    with pytest.raises(InvalidInputError, match="min_size_to_sample must be an int >= 1"):
        RateLimiter.sample_to_insert_ratio(1, 0, 10)
    with pytest.raises(InvalidInputError, match="samples_per_insert must be > 0"):
        RateLimiter(0.0, 1, -10, 10)
    with pytest.raises(InvalidInputError, match="finite"):
        RateLimiter(float("nan"), 1, -10, 10)
    with pytest.raises(InvalidInputError, match="block for good"):
        RateLimiter.sample_to_insert_ratio(2, 10, (30.0, 60.0))  # min_diff above the offset
    with pytest.warns(UserWarning, match="concurrent learner"):
        RateLimiter.sample_to_insert_ratio(2, 10, (-10.0, 10.0))
    with pytest.raises(InvalidInputError, match="size must be an int >= 2"):
        RateLimiter.queue(1)
    assert issubclass(RateLimitTimeoutError, (MmreplayError, TimeoutError))


def test_band_edges_min_size_and_reverb_offset() -> None:
    lim = RateLimiter.sample_to_insert_ratio(2.0, 5, 4.0)  # band [6, 14] around 10
    with pytest.raises(RateLimitTimeoutError, match="writers are not inserting"):
        lim.await_sample(1, timeout=0)  # below min size
    for _ in range(5):
        lim.await_insert(1, timeout=0)  # free until min size
    lim.await_insert(1, timeout=0)  # diff 12: room for one more insert (14)
    lim.await_insert(1, timeout=0)
    with pytest.raises(RateLimitTimeoutError, match="an insert of 1 .*learner is not sampling"):
        lim.await_insert(1, timeout=0.05)  # diff would be 16 > 14
    assert lim.state()["inserts"] == 7 and lim.stats()["error"] == 4.0
    for _ in range(8):
        lim.await_sample(1, timeout=0)  # 14 -> 6
    with pytest.raises(RateLimitTimeoutError):
        lim.await_sample(1, timeout=0)  # 5 < 6
    assert lim.stats()["achieved_samples_per_insert"] == 4.0  # 8 samples / 2 past min size
    state = lim.state()
    assert state["inserts_blocked"] == 1 and state["samples_blocked"] == 2
    assert state["insert_wait_s"] >= 0.05


def test_a_call_is_admitted_when_its_first_item_fits() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 4, 2.0)  # band [2, 6]
    lim.await_insert(10, timeout=0)  # within min size: the whole call goes
    with pytest.raises(RateLimitTimeoutError):
        lim.await_insert(1, timeout=0)
    lim.await_sample(32, timeout=0)  # diff 10 - 1 >= 2: goes, and overshoots to -22
    with pytest.raises(RateLimitTimeoutError):
        lim.await_sample(1, timeout=0)
    assert lim.state()["samples"] == 32


def test_stats_hold_the_error_range_seen_after_every_admission() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 4, 2.0)  # band [2, 6], error in [-2, 2]
    lim.await_insert(3)
    assert lim.stats()["error_low"] is None  # below min size nothing is recorded
    lim.await_insert(3)  # diff 6: error +2
    lim.await_sample(5, timeout=0)  # diff 1: error -3, one batch past the lower edge
    lim.await_insert(1)  # diff 2
    stats = lim.stats()
    assert (stats["error_low"], stats["error_high"]) == (-3.0, 2.0)
    lim.disable()
    lim.await_sample(50)  # not limiting: not recorded
    assert (lim.stats()["error_low"], lim.stats()["error_high"]) == (-3.0, 2.0)
    assert "error_low" not in lim.state()  # not committed: it covers this process's run


def test_min_size_and_queue() -> None:
    lim = RateLimiter.min_size(3)
    for _ in range(3):
        with pytest.raises(RateLimitTimeoutError):
            lim.await_sample(1, timeout=0)
        lim.await_insert(1, timeout=0)
    for _ in range(1000):
        lim.await_sample(1, timeout=0)
    lim.await_insert(100, timeout=0)
    q = RateLimiter.queue(3)
    for _ in range(3):
        q.await_insert(1, timeout=0)
    with pytest.raises(RateLimitTimeoutError):
        q.await_insert(1, timeout=0)  # 3 steps not yet sampled
    for _ in range(3):
        q.await_sample(1, timeout=0)
    with pytest.raises(RateLimitTimeoutError):
        q.await_sample(1, timeout=0)  # each step sampled once


def test_cancel_disable_enable_and_close() -> None:
    lim = RateLimiter.sample_to_insert_ratio(4.0, 10, 8.0)  # band [32, 48]
    lim.await_insert(3)
    lim.cancel_insert(3)
    assert lim.state()["inserts"] == 0
    lim.disable()
    lim.await_insert(1000, timeout=0)  # preloading: nothing waits, counts go on
    lim.await_sample(7, timeout=0)
    assert lim.state()["inserts"] == 1000 and lim.state()["samples"] == 7
    lim.enable()  # diff 3993 is moved to the band's upper edge
    assert lim.stats()["error"] == pytest.approx(8.0)
    with pytest.raises(RateLimitTimeoutError):
        lim.await_insert(1, timeout=0)
    lim.await_sample(4, timeout=0)
    lim.await_insert(1, timeout=0)  # one insert per 4 samples from here on
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            lim.await_insert(1)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    lim.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and isinstance(errors[0], RateLimiterClosedError)
    with pytest.raises(RateLimiterClosedError):
        lim.await_sample(1)


def test_state_restores_exactly_or_rebases_for_new_parameters() -> None:
    lim = RateLimiter.sample_to_insert_ratio(2.0, 5, 4.0)
    lim.await_insert(8)
    lim.await_sample(9)
    state = lim.state()
    again = RateLimiter.sample_to_insert_ratio(2.0, 5, 4.0)
    again.restore(state)
    assert again.state() == state
    other = RateLimiter.sample_to_insert_ratio(1.0, 5, 2.0)  # band [3, 7]
    other.restore(state)  # diff 8 - 9 = -1 is below the new band: moved to its lower edge
    assert other.state()["inserts"] == 8 and other.state()["samples"] == 9
    assert other.stats()["error"] == pytest.approx(-2.0)
    with pytest.raises(InvalidInputError, match="inserts must be an int >= 0"):
        again.restore({**state, "inserts": -1})
    clone = RateLimiter.from_config(lim.config())
    assert clone.config() == lim.config()
    fresh = RateLimiter.sample_to_insert_ratio(2.0, 5, 4.0)
    fresh.attach(None, inserts=100)  # a store with 100 steps and no saved counters
    assert fresh.stats()["error"] == pytest.approx(4.0)  # starts at the upper edge


def test_steps_in_call_counts_rows_that_are_steps() -> None:
    assert steps_in_call(4, None) == 4
    assert steps_in_call(4, [True, False, False, True]) == 2
    assert steps_in_call(1, True) == 0
    assert steps_in_call(3, object()) in (2, 3)  # refused later by the store's own checks


@pytest.mark.parametrize(("spi", "writer_batch", "learner_batch"),
                         [(0.25, 7, 1), (4.0, 1, 32), (1.0, 16, 16)])
def test_threads_waiting_on_each_other_finish_at_the_ratio(
        spi: float, writer_batch: int, learner_batch: int) -> None:
    lim = RateLimiter.sample_to_insert_ratio(spi, 50, max(2 * spi, 8.0), timeout_s=20)
    inserts = 3000 // writer_batch * writer_batch
    samples = -(-int((inserts - 50) * spi) // learner_batch) * learner_batch  # enough for
    errors: list[BaseException] = []  # the writer's last insert, within the band

    def run(wait: object, n: int, calls: int) -> None:
        try:
            for _ in range(calls):
                wait(n)  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(lim.await_insert, writer_batch,
                                                  inserts // writer_batch)),
               threading.Thread(target=run, args=(lim.await_sample, learner_batch,
                                                  samples // learner_batch))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert (lim.state()["inserts"], lim.state()["samples"]) == (inserts, samples)
    assert lim.state()["insert_wait_s"] + lim.state()["sample_wait_s"] > 0
    lim.check_valid()


class Band:
    """The naive model: Reverb's two predicates on plain counters."""

    def __init__(self, spi: float, min_size: int, lo: float, hi: float) -> None:
        self.spi, self.min_size, self.lo, self.hi = spi, min_size, lo, hi
        self.inserts = self.samples = 0
        self.offset = 0.0
        self.enabled = True

    def diff(self) -> float:
        return self.inserts * self.spi - self.samples - self.offset

    def can_insert(self) -> bool:
        return (not self.enabled or self.inserts + 1 <= self.min_size
                or self.diff() + self.spi <= self.hi)

    def can_sample(self) -> bool:
        return not self.enabled or (self.inserts >= self.min_size and self.diff() - 1 >= self.lo)

    def rebase(self) -> None:
        if self.inserts < self.min_size:
            self.offset = float(-self.samples)
        else:
            d = self.diff()
            self.offset += d - min(max(d, self.lo), self.hi)


class LimiterMachine(RuleBasedStateMachine):
    """Inserts, samples (never waiting: timeout 0), cancels, switches and restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.lim: RateLimiter | None = None
        self.band: Band | None = None

    @rule(spi=st.sampled_from([0.25, 1.0, 3.0, 8.0]), min_size=st.integers(1, 20),
          extra=st.sampled_from([0.0, 0.25, 1.0, 3.0, 10.0]))
    def start(self, spi: float, min_size: int, extra: float) -> None:
        half = max(1.0, spi) + extra
        self.lim = RateLimiter.sample_to_insert_ratio(spi, min_size, half)
        offset = spi * min_size
        self.band = Band(spi, min_size, offset - half, offset + half)

    def _try(self, kind: str, n: int) -> None:
        if self.lim is None or self.band is None:
            return
        band, can = self.band, getattr(self.band, f"can_{kind}")()
        try:
            getattr(self.lim, f"await_{kind}")(n, timeout=0)
            assert can, f"{kind} admitted where the model says wait"
            setattr(band, f"{kind}s", getattr(band, f"{kind}s") + n)
        except RateLimitTimeoutError:
            assert not can, f"{kind} refused where the model admits it"

    @rule(n=st.integers(1, 9))
    def insert(self, n: int) -> None:
        self._try("insert", n)

    @rule(n=st.integers(1, 40))
    def sample(self, n: int) -> None:
        self._try("sample", n)

    @rule(n=st.integers(1, 5))
    def cancelled_insert(self, n: int) -> None:
        if self.lim is None or self.band is None or not self.band.can_insert():
            return
        self.lim.await_insert(n, timeout=0)
        self.lim.cancel_insert(n)

    @rule(on=st.booleans())
    def switch(self, on: bool) -> None:
        if self.lim is None or self.band is None:
            return
        if on:
            self.lim.enable()
            self.band.enabled = True
            self.band.rebase()
        else:
            self.lim.disable()
            self.band.enabled = False

    @rule()
    def restart(self) -> None:
        if self.lim is None:
            return
        state, enabled = self.lim.state(), self.lim.enabled
        self.lim.close()
        self.lim = RateLimiter.from_config(self.lim.config())
        if not enabled:
            self.lim.disable()
        self.lim.restore(state)
        assert self.lim.state() == state, "a restart changed the counters"

    @invariant()
    def agrees_and_never_both_wait(self) -> None:
        if self.lim is None or self.band is None:
            return
        state = self.lim.state()
        assert (state["inserts"], state["samples"]) == (self.band.inserts, self.band.samples)
        assert state["offset"] == pytest.approx(self.band.offset)
        assert self.band.can_insert() or self.band.can_sample(), "an insert and a sample " \
            "would both wait: deadlock"
        self.lim.check_valid()


LimiterMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60,
                                            deadline=None)
test_limiter_state_machine = LimiterMachine.TestCase
