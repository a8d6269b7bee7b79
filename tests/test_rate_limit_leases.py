"""RateLimiter's leases: steps one holder (a store's `add`) inserts and counts without the
limiter's lock (mmreplay/admission.py).

A lease admits exactly the steps that surely fit, then the lock decides by Reverb's rule;
it stops short of min size; an insert admitted by a lease that was revoked meanwhile is
reserved as `cap` steps until its holder closes the lease (deterministic: the holder
stalls between its check and its count); whatever may raise `diff` or change the rules
revokes the lease; counts are exact with store writers racing folds and revocations; a
reached band still holds (`error_high`); waiting samples are woken by lease inserts; and
the decisions, counters and error range equal those of the same band admitted under the
lock only (hypothesis).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from mmreplay import InvalidInputError, ReplayStore
from mmreplay.admission import NO_LEASE, REVOKED, LimiterSlot, StepLease
from mmreplay.errors import RateLimiterClosedError, RateLimitTimeoutError
from mmreplay.rate_limit import RateLimiter

BIG = sys.float_info.max


class Holder:
    """A writer of `lim` that follows the lease protocol (mmreplay/admission.py) as
    `LimiterSlot.insert` does, without frames, telling which path an insert took and with its
    own wait `timeout`; `stall` runs between its check and its count."""

    def __init__(self, lim: RateLimiter, cap: int = 1, timeout: float | None = 0) -> None:
        self.lock, self.cap, self.timeout = threading.RLock(), cap, timeout
        self.slot = LimiterSlot(self.lock, cap)
        self.slot.limiter, self.slot.lease = lim, NO_LEASE
        self.lim = lim

    def insert(self, n: int, stall: Callable[[], None] | None = None) -> str:
        """Insert `n` steps: "lease" (by the lease), "lock" (the locked path) or "waits"."""
        with self.lock:
            lease = self.slot.lease
            assert lease is not None
            lease.busy = True
            if lease.used + n <= lease.limit:
                try:
                    if stall is not None:
                        stall()
                    lease.used += n
                finally:
                    lease.busy = False
                if lease.wake:
                    self.lim.settle()
                return "lease"
            lease.busy = False
        try:
            self.lim.await_insert(n, timeout=self.timeout)
        except RateLimitTimeoutError:
            return "waits"
        lease = self.lim.lease(self.cap)
        with self.lock:
            if self.slot.limiter is self.lim:
                self.slot.lease = lease
        return "lock"

    @property
    def lease(self) -> StepLease:
        assert self.slot.lease is not None
        return self.slot.lease

    @property
    def limit(self) -> int:
        return self.lease.limit


def refused(lim: RateLimiter, n: int) -> bool:
    """Whether an insert of `n` on the locked path would wait (tried with timeout 0)."""
    try:
        lim.await_insert(n, timeout=0)
    except RateLimitTimeoutError:
        return True
    return False


def test_a_lease_admits_the_steps_that_surely_fit_then_the_lock_decides() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-10.0, 20.0))  # spi 1, band [-10, 20]
    holder = Holder(lim, cap=4)
    assert holder.insert(4) == "lock"  # the first: diff 4, then a lease of 20 - 4 steps
    assert holder.limit == 16
    assert [holder.insert(4) for _ in range(4)] == ["lease"] * 4  # not yet counted...
    assert lim.state()["inserts"] == 20  # ...until a fold
    assert holder.insert(1) == "waits"  # diff 20: Reverb's rule (20 + 1 > 20) under the lock
    assert lim.stats()["error_high"] == 19.0
    lim.await_sample(3)  # diff 17: samples leave a lease alone
    assert holder.insert(3) == "lock"  # 17 + 1 <= 20: goes, and the next lease is empty
    assert holder.limit == 0 and holder.insert(1) == "waits"
    assert lim.stats()["error_high"] == 19.0
    lim.check_valid()


def test_a_lease_stops_short_of_min_size_and_endless_past_it() -> None:
    lim = RateLimiter.min_size(10)
    holder = Holder(lim, cap=2)
    assert holder.insert(2) == "lock" and holder.limit == 7  # 2 + 7 = 9 < 10
    assert [holder.insert(2) for _ in range(4)] == ["lease"] * 3 + ["lock"]  # 8, then 10
    assert lim.stats()["error_low"] == lim.stats()["error_high"] == 0.0  # set under the lock
    assert holder.limit == sys.maxsize and holder.insert(2) == "lease"
    assert lim.state()["inserts"] == 12
    lim.check_valid()


def test_a_lease_is_checked_in_the_locked_paths_floats() -> None:
    """Steps of 0.1: the division says 62 steps fit, Reverb's rule in floats admits 61."""
    lim, reference = (RateLimiter.sample_to_insert_ratio(0.1, 1, (-50.0, 3.7)) for _ in "ab")
    lim.restore({"inserts": 254, "samples": 28, "offset": 0.0})
    reference.restore({"inserts": 255, "samples": 28, "offset": 0.0})
    holder = Holder(lim)
    assert holder.insert(1) == "lock" and holder.limit == 61
    assert sum(not refused(reference, 1) for _ in range(70)) == 61


def test_no_lease_while_diff_is_below_the_lowest_error_seen() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-10.0, 10.0))
    lim.await_insert(5)  # diff 5
    lim.await_sample(3)  # diff 2, the lowest seen
    lim.cancel_insert(2)  # diff 0: the next insert sets a new lowest, under the lock
    assert lim.lease(1).limit == REVOKED
    lim.await_insert(1)
    assert lim.stats()["error_low"] == 0.0  # diff 1, less the offset 1
    assert lim.lease(1).limit == 9


def test_an_insert_in_flight_on_a_revoked_lease_is_reserved_as_cap_steps() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-20.0, 20.0))
    holder = Holder(lim, cap=4)
    holder.insert(4)  # diff 4, a lease of 16 steps
    for _ in range(3):
        holder.insert(4)  # diff 16
    seen: list[bool] = []

    def other_writer() -> None:  # between the holder's check and its count
        # the locked path revokes the lease; the holder may still add 4 steps
        # (16 + 4 + 1 > 20), where Reverb's rule without them (16 + 1 <= 20) goes
        seen.append(refused(lim, 1))
        assert lim._leases.reserved_steps() == 4  # noqa: SLF001 - the reserve

    assert holder.insert(2, stall=other_writer) == "lease"  # its check came first
    assert seen == [True]
    assert holder.limit == REVOKED
    assert lim.state()["inserts"] == 18  # counted once, by the fold...
    assert not lim._leases.revoked  # noqa: SLF001 - ...which dropped it: not busy
    assert not refused(lim, 1) and not refused(lim, 1)  # 18 -> 20 by Reverb's rule
    assert refused(lim, 1) and lim.stats()["error_high"] == 19.0
    assert holder.insert(1) == "waits"
    lim.check_valid()


def test_a_revoked_lease_counts_once_and_wakes_a_waiting_sample() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (0.0, 20.0), timeout_s=30)
    holder = Holder(lim)
    assert holder.insert(1) == "lock"  # min size: diff 1, a lease of 19 steps
    lim.await_sample(1)  # diff 0: the next sample waits for an insert
    done = threading.Event()

    def sample() -> None:
        lim.await_sample(1)
        done.set()

    thread = threading.Thread(target=sample)
    thread.start()
    while not lim.state()["samples_blocked"]:
        time.sleep(0.001)
    assert holder.lease.wake  # the waiter told the holder

    def revoke() -> None:  # while the holder's insert is in flight
        lim.cancel_sample(0)
        assert lim._leases.revoked  # noqa: SLF001 - kept: busy

    assert holder.insert(1, stall=revoke) == "lease"  # counts on the revoked lease, wakes
    assert done.wait(10)
    thread.join()
    assert (lim.state()["inserts"], lim.state()["samples"]) == (2, 2)
    assert not lim._leases.revoked  # noqa: SLF001
    assert holder.insert(1) == "lock" and not holder.lease.wake  # nobody waits any more
    lim.check_valid()


@pytest.mark.parametrize("change", ["cancel_sample", "cancel_insert", "enable", "restore",
                                    "attach", "close", "insert"])
def test_what_may_raise_diff_or_change_the_rules_revokes_the_lease(change: str) -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-10.0, 10.0))
    holder = Holder(lim)
    holder.insert(1)
    lim.await_sample(5)
    lim.disable()  # preloading: an endless lease
    holder.insert(1)
    assert holder.limit == sys.maxsize
    for _ in range(100):
        assert holder.insert(1) == "lease"
    moves: dict[str, Callable[[], None]] = {
        "cancel_sample": lambda: lim.cancel_sample(1),
        "cancel_insert": lambda: lim.cancel_insert(1),
        "enable": lim.enable,  # diff 97 moves to the edge 10
        "restore": lambda: lim.restore({"inserts": 10, "samples": 0, "offset": 0.0}),
        "attach": lambda: lim.attach(None, inserts=10_000),  # starts at the edge
        "close": lim.close,
        "insert": lambda: lim.await_insert(1)}
    moves[change]()
    assert holder.limit == REVOKED
    if change == "close":
        with pytest.raises(RateLimiterClosedError):
            holder.insert(1)
        return
    lim.enable()
    assert holder.insert(1) == "waits"
    assert lim.stats()["error"] == pytest.approx(9.0)


def test_an_insert_that_waited_counts_a_lease_issued_meanwhile() -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (-20.0, 10.0))
    holder = Holder(lim)
    for _ in range(10):
        holder.insert(1)  # diff 10, the band's edge
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
    with lim._cond:  # noqa: SLF001 - a sample makes room for 1 without waking A
        lim._samples += 1  # noqa: SLF001
    lease = lim.lease(1)  # A still asleep: the holder gets a lease of 1 step...
    assert lease.limit == 1
    holder.slot.lease = lease

    def wake_a() -> None:  # ...and is in flight when A wakes: A revokes the lease, and
        with lim._cond:  # noqa: SLF001 - reserves its 1 step (9 + 1 + 1 > 10): no room
            lim._cond.notify_all()  # noqa: SLF001
        time.sleep(0.2)

    assert holder.insert(1, stall=wake_a) == "lease"
    thread.join(timeout=10)
    assert isinstance(errors[0], RateLimitTimeoutError)  # diff 10 again: no room for A
    assert lim.state()["inserts"] == 11 and lim.stats()["error_high"] == 9.0
    assert not lim._leases.revoked  # noqa: SLF001 - counted, not busy: dropped
    lim.check_valid()


def race_store(tmp_path: Path, lim: RateLimiter, writers: int, calls: int,
               work: Callable[[ReplayStore], None], num_envs: int = 2) -> ReplayStore:
    """`writers` threads each `add` `calls` steps of `num_envs` envs to one store while
    `work(store)` runs in a loop on another thread; the store, still open."""
    store = ReplayStore.create(tmp_path / "s", capacity=50_000, obs_shape=(2, 2),
                               num_envs=num_envs, seed=0, rate_limiter=lim)
    store.reset(np.zeros((num_envs, 2, 2), np.uint8))
    frame, off = np.ones((num_envs, 2, 2), np.uint8), [False] * num_envs
    errors: list[BaseException] = []
    stop = threading.Event()

    def write() -> None:
        for i in range(calls):
            store.add([i % 3] * num_envs, [1.0] * num_envs, frame, off, off)

    def loop() -> None:
        try:
            while not stop.is_set():
                work(store)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    other = threading.Thread(target=loop)
    threads = [threading.Thread(target=write) for _ in range(writers)]
    other.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    stop.set()
    other.join(timeout=60)
    assert not errors, errors
    return store


@pytest.mark.parametrize("band", ["min_size", "wide"])
def test_store_writers_racing_folds_and_revocations_count_every_step_once(
        tmp_path: Path, fast_switches: None, band: str) -> None:
    lim = RateLimiter.min_size(10, timeout_s=30) if band == "min_size" else \
        RateLimiter.sample_to_insert_ratio(1.0, 10, 1e9, timeout_s=30)

    def fold_and_revoke(store: ReplayStore) -> None:
        lim.await_sample(1)  # folds
        lim.stats()
        lim.cancel_sample(1)  # revokes

    store = race_store(tmp_path, lim, 3, 400, fold_and_revoke)
    with pytest.raises(InvalidInputError):
        store.add([0, 0], [1.0, 1.0], np.ones((2, 3, 3), np.uint8), [False] * 2, [False] * 2)
    assert lim.state()["inserts"] == store.counts.transitions == 3 * 400 * 2
    assert lim.state()["samples"] == 0
    store.close()
    lim.check_valid()


def test_a_reached_band_holds_with_store_writers_on_threads(tmp_path: Path,
                                                            fast_switches: None) -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 10, 8.0, timeout_s=60)

    def learn(store: ReplayStore) -> None:
        try:
            lim.await_sample(1, timeout=0.05)
        except RateLimitTimeoutError:
            pass

    store = race_store(tmp_path, lim, 3, 300, learn, num_envs=4)
    stats = lim.stats()
    assert stats["inserts"] == store.counts.transitions == 3 * 300 * 4
    assert stats["inserts_blocked"] > 0
    assert stats["error_high"] <= 8.0 + 3  # a call of 4 steps goes when its first fits
    store.close()
    lim.check_valid()


def check_one_insert_wakes_a_waiting_sample(make: Callable[[], RateLimiter],
                                            insert: Callable[[RateLimiter], Any]) -> None:
    """200 times, a sample of `make()` waits (it starts waiting before, during or after the
    insert) and one `insert` must wake it at once: a lost wakeup sleeps the limiter's 120 s."""
    for _ in range(200):
        lim = make()
        before = lim.state()["samples"]
        errors: list[BaseException] = []

        def sample(lim: RateLimiter = lim, errors: list[BaseException] = errors) -> None:
            try:
                lim.await_sample(1)
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        thread = threading.Thread(target=sample)
        thread.start()
        insert(lim)
        thread.join(timeout=30)
        asleep = thread.is_alive()
        lim.close()  # wakes it if it slept
        thread.join()
        assert not asleep, "the insert went in and the waiting sample slept on"
        assert not errors, errors
        assert lim.state()["samples"] == before + 1


def test_a_waiting_sample_is_woken_by_a_lease_insert(fast_switches: None) -> None:
    made: dict[int, Holder] = {}

    def make() -> RateLimiter:
        lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (0.0, 100.0), timeout_s=120)
        holder = made[id(lim)] = Holder(lim, timeout=None)
        holder.insert(1)  # min size, under the lock: diff 1, then a lease of 99 steps
        lim.await_sample(1)  # diff 0: the next sample waits for an insert
        return lim

    def insert(lim: RateLimiter) -> None:
        assert made[id(lim)].insert(1) == "lease"

    check_one_insert_wakes_a_waiting_sample(make, insert)


def test_a_store_add_by_lease_wakes_a_waiting_sample(tmp_path: Path,
                                                      fast_switches: None) -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (0.0, 100.0), timeout_s=60)
    store = ReplayStore.create(tmp_path / "s", capacity=1000, obs_shape=(2, 2), seed=0,
                               rate_limiter=lim)
    store.reset(np.zeros((2, 2), np.uint8))
    frame = np.ones((2, 2), np.uint8)
    store.add(0, 1.0, frame, False, False)  # min size, under the lock; then a lease
    lim.await_sample(1)  # diff 0: each sample below waits for the add that follows it
    for i in range(50):
        thread = threading.Thread(target=lim.await_sample, args=(1,))
        thread.start()
        store.add(i % 3, 1.0, frame, False, False)
        thread.join(timeout=20)
        assert not thread.is_alive(), f"round {i}: the add went in, the sample slept on"
    assert lim._leases.live is not None and lim._leases.live.used == 50  # noqa: SLF001
    assert (lim.state()["inserts"], lim.state()["samples"]) == (51, 51)
    store.close()


def test_a_lease_insert_counted_while_a_sample_starts_waiting_is_seen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The race that a waiter closes by registering before it folds: a lease insert
    counted after the sample found too few inserts, but before it registered (so the
    holder saw no `wake` and woke no one)."""
    lim = RateLimiter.sample_to_insert_ratio(1.0, 1, (0.0, 100.0), timeout_s=5)
    holder = Holder(lim)
    holder.insert(1)  # diff 1, a lease of 99 steps
    lim.await_sample(1)  # diff 0
    wait = lim._wait  # noqa: SLF001 - the window is inside the locked path

    def racing_wait(*args: object) -> None:
        assert holder.insert(1) == "lease" and not holder.lease.wake
        wait(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(lim, "_wait", racing_wait)
    lim.await_sample(1)  # else it sleeps its 5 s (nothing wakes it) and counts as blocked
    assert lim.state()["samples"] == 2 and lim.state()["samples_blocked"] == 0


OPS = st.lists(st.tuples(st.sampled_from(["hold", "hold", "hold", "insert", "sample",
                                          "cancel_insert", "cancel_sample", "off", "on",
                                          "restore"]),
                         st.integers(0, 12)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(spi=st.sampled_from([0.25, 1.0, 3.0]), min_size=st.integers(1, 15),
       extra=st.sampled_from([0.0, 1.0, 5.0, 40.0, 1e6, BIG]), cap=st.integers(1, 4), ops=OPS)
def test_leases_match_the_locked_band(spi: float, min_size: int, extra: float, cap: int,
                                      ops: list[tuple[str, int]]) -> None:
    """A holder's inserts (by lease or lock) and the locked path's, against one limiter
    that admits every insert under the lock: same decisions, counters and error range."""
    half = max(1.0, spi) + extra if extra < BIG else BIG
    leased = RateLimiter.sample_to_insert_ratio(spi, min_size, half)
    locked = RateLimiter.sample_to_insert_ratio(spi, min_size, half)
    holder = Holder(leased, cap=cap)
    for op, n in ops:
        if op == "hold":
            n = min(n, cap)
            outcomes = [holder.insert(n) != "waits", apply(locked, "insert", n) == "goes"]
        else:
            outcomes = [apply(lim, op, n) for lim in (leased, locked)]
        assert outcomes[0] == outcomes[1], (op, n)
        assert timeless(leased.stats()) == timeless(locked.stats()), (op, n)
    leased.check_valid()


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


def test_store_add_takes_a_lease_and_a_new_limiter_replaces_it(tmp_path: Path) -> None:
    lim = RateLimiter.min_size(1)
    store = ReplayStore.create(tmp_path / "s", capacity=100, obs_shape=(2, 2), seed=0,
                               rate_limiter=lim)
    store.reset(np.zeros((2, 2), np.uint8))
    frame = np.ones((2, 2), np.uint8)
    for i in range(5):
        store.add(i % 3, 1.0, frame, False, False)
    lease = lim._leases.live  # noqa: SLF001 - the store's
    assert lease is not None and lease.used == 4 and not lease.busy  # the first: locked
    store.set_rate_limiter(None)  # the store drops its lease (left live, unused)
    store.add(0, 1.0, frame, False, False)  # no limiter: not counted
    assert lim.state()["inserts"] == 5 and lease.used == 4
    other = RateLimiter.min_size(1)
    store.set_rate_limiter(other)
    store.add(0, 1.0, frame, False, False)
    store.add(0, 1.0, frame, False, False)
    assert lim.state()["inserts"] == 5 and other.state()["inserts"] == 8
    with pytest.raises(InvalidInputError):
        store.add(0, 1.0, np.ones((3, 3), np.uint8), False, False)  # by lease: not counted
    assert other.state()["inserts"] == 8 and not other._leases.live.busy  # noqa: SLF001
    store.close()
