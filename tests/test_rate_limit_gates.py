"""RateLimiter's gates on a finite band: inserts that surely fit below the upper edge are
admitted by a ticket, without the lock (mmreplay/admission.py).

A gate admits exactly the calls of at most `cap` steps that fit, then the lock decides by
Reverb's rule; a ticket taken but not yet written is reserved as `cap` steps until it is
(deterministic: the pieces called in a chosen order); whatever may raise `diff` or change
the rules retires the gate; counts are exact with writers racing folds, a reached band
still holds (`error_high`), waiting samples are woken by gated inserts, a store's writers
on threads count every step once, and the decisions, counters and error range equal those
of the same band admitted under the lock only (hypothesis).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from test_rate_limit_free_inserts import (
    LockedOnly,
    check_one_insert_wakes_a_waiting_sample,
    race,
)

from mmreplay import InvalidInputError, ReplayStore
from mmreplay.errors import RateLimiterClosedError, RateLimitTimeoutError
from mmreplay.rate_limit import RateLimiter


def refused(lim: RateLimiter, n: int) -> bool:
    """Whether an insert of `n` would wait (tried with timeout 0)."""
    try:
        lim.await_insert(n, timeout=0)
    except RateLimitTimeoutError:
        return True
    return False


def test_a_gate_admits_the_calls_that_surely_fit_then_the_lock_decides() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-10.0, 20.0))  # spi 1, band [-10, 20]
    lim.await_insert(4)  # more than the cap of 1 seen so far: locked; diff 4
    gate = lim._gates.live  # noqa: SLF001 - the path taken
    assert (gate.budget, gate.cap) == (4, 4)  # (20 - 4) / 4 calls of at most 4 steps
    for _ in range(4):
        lim.await_insert(4)
    assert list(gate.slots) == [4, 4, 4, 4]  # by ticket: not yet counted
    assert refused(lim, 1)  # diff 20: Reverb's rule (20 + 1 > 20), decided under the lock
    assert lim.state()["inserts"] == 20 and lim.stats()["error_high"] == 19.0
    lim.await_sample(3)  # diff 17
    assert not refused(lim, 3)  # 17 + 1 <= 20: goes (locked: no gate opened since)
    assert refused(lim, 1) and lim.stats()["error_high"] == 19.0
    lim.check_valid()


def test_a_ticket_taken_but_not_written_is_reserved_as_cap_steps() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-20.0, 20.0))
    lim.await_insert(4)  # locked: cap 4, diff 4, a gate of (20 - 4) / 4 = 4 calls
    gate = lim._gates.live  # noqa: SLF001 - a writer's steps, one at a time
    stalled = next(gate.tickets)  # writer A is admitted, and stops before its write
    assert stalled < gate.budget
    for _ in range(3):
        lim.await_insert(4)  # writers B: tickets 1..3
    assert lim.state()["inserts"] == 16  # folded past A's unwritten slot
    # the next call is past the budget: locked; A may still add 4 steps (16 + 4 + 1 > 20),
    # where Reverb's rule without A's count (16 + 1 <= 20) would let it through
    assert refused(lim, 1)
    assert gate.budget == 0 and lim._gates.reserved_steps() == 4  # noqa: SLF001
    late = next(gate.tickets)  # a writer still holding the retired gate: refused
    assert late >= gate.budget
    gate.slots.append(~late)
    gate.slots.append(2)  # A writes its 2 steps
    assert lim.state()["inserts"] == 18 and not lim._gates.retired  # noqa: SLF001
    assert not refused(lim, 1) and not refused(lim, 1)  # 18 -> 20 by Reverb's rule
    assert refused(lim, 1) and lim.stats()["error_high"] == 19.0
    lim.check_valid()


def test_a_retired_gates_late_write_is_counted_once_and_wakes_a_waiter() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-20.0, 20.0), timeout_s=30)
    gate = lim._gates.live  # noqa: SLF001 - a writer's steps, one at a time
    stalled = next(gate.tickets)
    lim.cancel_sample(0)  # retires the gate: A's ticket is owed
    assert lim._gates.live is not gate and lim._gates.retired == [gate]  # noqa: SLF001
    done = threading.Event()

    def sample() -> None:
        lim.await_sample(1)  # waits: nothing inserted yet (min size 1)
        done.set()

    thread = threading.Thread(target=sample)
    thread.start()
    while not lim.state()["samples_blocked"]:
        time.sleep(0.001)
    assert stalled < gate.end
    gate.slots.append(1)  # what A's await_insert does next: write, then wake
    lim._settle()  # noqa: SLF001 - the waiter is registered: A's await_insert settles
    assert done.wait(10)
    thread.join()
    assert (lim.state()["inserts"], lim.state()["samples"]) == (1, 1)
    assert not lim._gates.retired  # noqa: SLF001
    lim.check_valid()


def test_cancel_sample_retires_the_gate() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-10.0, 10.0))
    lim.await_insert(2)  # cap 2, diff 2
    lim.await_sample(6)  # diff -4: samples leave the gate open
    lim.await_insert(3)  # locked (3 > cap): diff -1, a gate of (10 + 1) / 3 = 3 calls
    lim.cancel_sample(6)  # diff 5: the next gate has room for 1 call of 3
    admitted = 0
    while not refused(lim, 3):
        admitted += 1
    assert admitted == 2  # 5 -> 8 by ticket, 8 -> 11 by Reverb's rule (8 + 1 <= 10)
    assert lim.stats()["error_high"] == 10.0  # 11 less the offset 1: one call past
    lim.check_valid()


@pytest.mark.parametrize("change", ["enable", "restore", "attach", "close"])
def test_switches_restore_and_close_retire_the_gate(change: str) -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-10.0, 10.0))
    lim.disable()  # preloading: an endless gate
    for _ in range(100):
        lim.await_insert(1)
    gate = lim._gates.live  # noqa: SLF001
    moves: dict[str, Callable[[], None]] = {
        "enable": lim.enable,  # diff 100 moves to the edge 10
        "restore": lambda: lim.restore({"inserts": 10, "samples": 0, "offset": 0.0}),
        "attach": lambda: lim.attach(None, inserts=10_000),  # starts at the edge
        "close": lim.close}
    moves[change]()
    assert gate.budget == 0 and lim._gates.live is not gate  # noqa: SLF001
    if change == "close":
        with pytest.raises(RateLimiterClosedError):
            lim.await_insert(1)
        return
    lim.enable()
    assert refused(lim, 1) and lim.stats()["error"] == pytest.approx(9.0)


def test_writers_racing_folds_and_retirements_count_exactly(fast_switches: None) -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 10, 1e9, timeout_s=30)

    def fold_and_retire() -> None:  # every locked operation folds; cancel_sample retires
        lim.await_sample(1)
        lim.stats()
        lim.cancel_sample(1)

    want = race(lim, 4, 3000, fold_and_retire)
    assert lim.state()["inserts"] == want and lim.state()["samples"] == 0
    assert not lim._gates.retired  # noqa: SLF001 - every owed ticket was written
    lim.check_valid()


def test_a_reached_band_holds_with_writers_on_threads(fast_switches: None) -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 10, 8.0, timeout_s=60)

    def learn() -> None:
        try:
            lim.await_sample(1, timeout=0.05)
        except RateLimitTimeoutError:
            pass

    want = race(lim, 3, 400, learn)
    stats = lim.stats()
    assert stats["inserts"] == want and stats["inserts_blocked"] > 0
    assert stats["error_high"] <= 8.0 + 3  # a call of 4 steps goes when its first fits
    lim.check_valid()


def test_a_waiting_sample_is_woken_by_gated_inserts(fast_switches: None) -> None:
    def make() -> RateLimiter:
        lim = RateLimiter.sample_to_insert_ratio(1.0, 1, 100.0, timeout_s=120)
        assert lim._gates.live.budget > 0  # noqa: SLF001 - the insert goes by ticket
        return lim

    check_one_insert_wakes_a_waiting_sample(make)


OPS = st.lists(st.tuples(st.sampled_from(["insert", "insert", "sample", "cancel_insert",
                                          "cancel_sample", "off", "on", "restore"]),
                         st.integers(0, 12)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(spi=st.sampled_from([0.25, 1.0, 3.0]), min_size=st.integers(1, 15),
       extra=st.sampled_from([0.0, 1.0, 5.0, 40.0, 1e6]), ops=OPS)
def test_gates_match_the_locked_band(spi: float, min_size: int, extra: float,
                                     ops: list[tuple[str, int]]) -> None:
    half = max(1.0, spi) + extra
    gated = RateLimiter.sample_to_insert_ratio(spi, min_size, half)
    locked = LockedOnly.sample_to_insert_ratio(spi, min_size, half)
    for op, n in ops:
        outcomes = [apply(lim, op, n) for lim in (gated, locked)]
        assert outcomes[0] == outcomes[1], (op, n)
        assert timeless(gated.stats()) == timeless(locked.stats()), (op, n)
    gated.check_valid()


def timeless(stats: dict[str, Any]) -> dict[str, Any]:
    """`stats` less the seconds spent waiting (a refused call waits a few microseconds)."""
    return {k: v for k, v in stats.items() if not k.endswith("_wait_s")}


def apply(lim: RateLimiter, op: str, n: int) -> str:
    """One operation, admitted at once or refused at once (timeout 0): what happened."""
    state = lim.state()
    try:
        if op in ("insert", "sample"):
            getattr(lim, f"await_{op}")(n, timeout=0)
        elif op == "cancel_insert":
            lim.cancel_insert(min(n, state["inserts"]))
        elif op == "cancel_sample":
            lim.cancel_sample(min(n, state["samples"]))
        elif op in ("off", "on"):
            lim.disable() if op == "off" else lim.enable()
        elif op == "restore":
            lim.restore({**state, "inserts": n, "samples": n // 2})
    except RateLimitTimeoutError:
        return "waits"
    return "goes"


def test_store_writers_on_threads_count_every_step_once(tmp_path: Path,
                                                        fast_switches: None) -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, 1e6)
    store = ReplayStore.create(tmp_path / "s", capacity=5000, obs_shape=(2, 2), num_envs=2,
                               seed=0, rate_limiter=lim)
    store.reset(np.zeros((2, 2, 2), np.uint8))
    frame = np.ones((2, 2, 2), np.uint8)

    def write() -> None:
        for i in range(300):
            store.add([i % 3, 0], [1.0, 0.0], frame, [False, False], [False, False])
            if i % 50 == 49:
                store.sample(4)  # folds, and lowers diff

    threads = [threading.Thread(target=write) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    with pytest.raises(InvalidInputError):
        store.add([0, 0], [1.0, 1.0], np.ones((2, 3, 3), np.uint8), [False] * 2, [False] * 2)
    assert lim.state()["inserts"] == store.counts.transitions == 1800
    assert lim.state()["samples"] == 3 * 6 * 4
    store.close()


def test_an_insert_that_waited_counts_the_tickets_of_a_gate_opened_meanwhile() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-20.0, 10.0))
    for _ in range(10):
        lim.await_insert(1)  # by ticket: diff 10, the band's edge
    errors: list[BaseException] = []

    def insert() -> None:  # A: waits under the lock's condition
        try:
            lim.await_insert(1, timeout=2)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=insert)
    thread.start()
    while not lim.state()["inserts_blocked"]:
        time.sleep(0.001)
    with lim._cond:  # noqa: SLF001 - before A can run again: a sample makes room for 5,
        lim._samples += 5  # noqa: SLF001 - another insert opens a gate of 5 calls, and
        lim._gates.retire()  # noqa: SLF001 - five writers take its tickets, not yet written
        lim._fold()  # noqa: SLF001
        lim._open()  # noqa: SLF001
        gate = lim._gates.live  # noqa: SLF001
        assert gate.budget == 5
        stalled = [next(gate.tickets) for _ in range(5)]
        lim._cond.notify_all()  # noqa: SLF001
    time.sleep(0.2)  # A wakes: the gate's 5 tickets are reserved, so it waits on
    for _ in stalled:
        gate.slots.append(1)
    lim._settle()  # noqa: SLF001 - what each writer's await_insert does with a waiter
    thread.join(timeout=10)
    assert isinstance(errors[0], RateLimitTimeoutError)  # diff 10 again: no room for A
    assert lim.state()["inserts"] == 15 and lim.stats()["error_high"] == 9.0
    assert not lim._gates.retired  # noqa: SLF001 - every ticket folded
    lim.check_valid()
