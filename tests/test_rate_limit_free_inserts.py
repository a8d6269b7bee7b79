"""RateLimiter's lock-free inserts with no upper edge: `min_size` admits every insert by
a ticket of an endless gate, whose counts every locked operation folds in first (finite
bands: tests/test_rate_limit_gates.py).

Counts are exact with many writers racing folds; a waiting sample is woken by lock-free
inserts (no lost wakeup); cancel, restore, disable/enable and close see the queued
inserts; the counters and the error range equal those of the same band admitted under
the lock (hypothesis); and a store's writers on several threads count every step once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from mmreplay import InvalidInputError, ReplayStore, rate_limit
from mmreplay.errors import RateLimiterClosedError
from mmreplay.rate_limit import RateLimiter

BIG = sys.float_info.max


class LockedOnly(RateLimiter):
    """The reference: every gate it opens has no budget, so every insert takes the lock
    (Reverb's rule, exactly)."""

    def _open(self) -> None:
        self._gates.open(0, self._cap)


def locked_twin(min_size: int) -> RateLimiter:
    """`RateLimiter.min_size`'s band, every insert under the lock."""
    return LockedOnly(1.0, min_size, -BIG, BIG)


def test_min_size_admits_by_ticket_and_the_reference_takes_the_lock() -> None:
    free, locked = RateLimiter.min_size(3), locked_twin(3)
    for lim in (free, locked):
        lim.await_insert(5)  # more than the cap of 1 seen so far: the locked path
        lim.await_insert(4)
    assert list(free._gates.live.slots) == [4]  # noqa: SLF001 - the path taken
    assert not locked._gates.live.slots and locked._gates.live.budget == 0  # noqa: SLF001
    assert free.state() == locked.state()
    assert not free._gates.live.slots  # noqa: SLF001 - state folded the count in


def race(lim: RateLimiter, writers: int, calls: int, work: Callable[[], None]) -> int:
    """`writers` threads insert `calls` seeded counts of 0..4 each while `work` runs in a
    loop on another thread; the steps they inserted."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(seed: int) -> None:
        for n in np.random.default_rng(seed).integers(0, 5, calls).tolist():
            lim.await_insert(n)

    def loop() -> None:
        try:
            while not stop.is_set():
                work()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    other = threading.Thread(target=loop)
    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    other.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    stop.set()
    other.join(timeout=60)
    assert not errors, errors
    return sum(int(np.random.default_rng(i).integers(0, 5, calls).sum())
               for i in range(writers))


def test_writers_racing_folds_count_exactly(fast_switches: None) -> None:
    lim = RateLimiter.min_size(10, timeout_s=30)

    def fold() -> None:  # every locked operation folds the queue
        lim.await_sample(1)
        lim.stats()
        lim.cancel_sample(1)

    want = race(lim, 4, 3000, fold)
    assert lim.state()["inserts"] == want and lim.state()["samples"] == 0
    lim.check_valid()


def check_one_insert_wakes_a_waiting_sample(make: Callable[[], RateLimiter]) -> None:
    """200 times, a sample of `make()` waits (it starts waiting before, during or after the
    insert) and one insert must wake it at once: a lost wakeup sleeps the limiter's 120 s."""
    for _ in range(200):
        lim = make()
        errors: list[BaseException] = []

        def sample(lim: RateLimiter = lim, errors: list[BaseException] = errors) -> None:
            try:
                lim.await_sample(1)
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        thread = threading.Thread(target=sample)
        thread.start()
        lim.await_insert(1)
        thread.join(timeout=30)
        asleep = thread.is_alive()
        lim.close()  # wakes it if it slept
        thread.join()
        assert not asleep, "the insert went in and the waiting sample slept on"
        assert not errors, errors
        assert lim.state()["samples"] == 1


def test_a_waiting_sample_is_woken_by_lock_free_inserts(fast_switches: None) -> None:
    check_one_insert_wakes_a_waiting_sample(lambda: RateLimiter.min_size(1, timeout_s=120))


def test_an_insert_queued_while_a_sample_starts_waiting_is_seen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The race that a waiter closes by registering before it folds: an insert queued after
    the sample found too few inserts, but before it registered (so it woke no one)."""
    lim = RateLimiter.min_size(1, timeout_s=5)
    wait = rate_limit._wait  # noqa: SLF001 - the window is inside the locked path

    def racing_wait(*args: object) -> None:
        gate = lim._gates.live  # noqa: SLF001 - what the insert's await_insert does
        next(gate.tickets)
        gate.slots.append(1)
        wait(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(rate_limit, "_wait", racing_wait)
    lim.await_sample(1)  # else it sleeps its 5 s (nothing wakes it) and counts as blocked
    assert lim.state()["samples"] == 1 and lim.state()["samples_blocked"] == 0


def test_cancel_restore_switches_and_close_see_queued_inserts() -> None:
    lim = RateLimiter.min_size(4)
    lim.await_insert(3)
    lim.cancel_insert(3)
    assert lim.state()["inserts"] == 0
    lim.await_insert(5)
    lim.restore({"inserts": 2, "samples": 1})  # the gated 5 are replaced with the rest
    assert (lim.state()["inserts"], lim.state()["samples"]) == (2, 1)
    lim.await_insert(2)
    lim.disable()  # counts go on
    lim.await_insert(1)
    lim.await_sample(9, timeout=0)
    lim.enable()  # no upper edge: nothing to rebase for inserts
    lim.await_insert(1)
    assert (lim.state()["inserts"], lim.state()["samples"]) == (6, 10)
    lim.await_insert(7)
    lim.close()
    assert lim.state()["inserts"] == 13  # counted before the close
    with pytest.raises(RateLimiterClosedError):
        lim.await_insert(1)
    with pytest.raises(RateLimiterClosedError):
        lim.await_sample(1)
    assert lim.state()["inserts"] == 13
    lim.check_valid()


OPS = st.lists(st.tuples(st.sampled_from(["insert", "sample", "cancel_insert",
                                          "cancel_sample", "off", "on", "restore"]),
                         st.integers(0, 12)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(min_size=st.integers(1, 15), ops=OPS)
def test_free_inserts_match_the_locked_band(min_size: int, ops: list[tuple[str, int]]) -> None:
    free, locked = RateLimiter.min_size(min_size), locked_twin(min_size)
    for op, n in ops:
        for lim in (free, locked):
            apply(lim, op, n)
        assert free.stats() == locked.stats(), (op, n)
    free.check_valid()


def apply(lim: RateLimiter, op: str, n: int) -> None:
    """One operation, admitted at once or refused at once (timeout 0)."""
    state = lim.state()
    if op == "insert":
        lim.await_insert(n, timeout=0)
    elif op == "sample" and state["inserts"] >= lim.min_size_to_sample:
        lim.await_sample(n, timeout=0)
    elif op == "cancel_insert":
        lim.cancel_insert(min(n, state["inserts"]))
    elif op == "cancel_sample":
        lim.cancel_sample(min(n, state["samples"]))
    elif op in ("off", "on"):
        lim.disable() if op == "off" else lim.enable()
    elif op == "restore":
        lim.restore({**state, "inserts": n, "samples": n // 2})


def test_store_writers_on_threads_count_every_step_once(tmp_path: Path,
                                                        fast_switches: None) -> None:
    lim = RateLimiter.min_size(1)
    store = ReplayStore.create(tmp_path / "s", capacity=5000, obs_shape=(2, 2), seed=0,
                               rate_limiter=lim)
    store.reset(np.zeros((2, 2), np.uint8))
    frame = np.ones((2, 2), np.uint8)

    def write() -> None:
        for i in range(300):
            store.add(i % 3, 1.0, frame, False, False)

    threads = [threading.Thread(target=write) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    with pytest.raises(InvalidInputError):
        store.add(0, 1.0, np.ones((3, 3), np.uint8), False, False)  # refused: not counted
    assert lim.state()["inserts"] == store.counts.transitions == 900
    store.close()
