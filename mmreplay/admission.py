"""Inserts admitted without the rate limiter's lock: its leases.

A *lease* is a number of steps (`limit`) that one *holder* may insert without asking the
limiter, because under its lock the limiter found that they surely fit below its upper
edge (`RateLimiter.lease` in `rate_limit.py` owns the rule). The holder is a writer that
serializes its own inserts under a lock of its own (`ReplayStore.add` under the store's
lock), and it follows this protocol there (`LimiterSlot.insert` is that code)::

    lease.busy = True                    # from here until its count, in flight
    if lease.used + n <= lease.limit:    # admitted
        try:
            ...record the n steps...     # a refused record counts nothing
            lease.used += n              # counted: the limiter reads `used` when it folds
        finally:
            lease.busy = False
        if lease.wake:                   # someone waits on the limiter: let it look
            limiter.settle()
    else:                                # spent or revoked: the locked path decides
        lease.busy = False
        limiter.await_insert(n); lease = limiter.lease(cap)

Only the holder writes `used` and `busy`; only the limiter writes `limit` and `wake`. With
one writer per field and the GIL, a fold that reads `busy` and then `used` misses no count.
The limiter *revokes* the live lease (``limit = REVOKED``) whenever something may raise
`diff` or change the rules. A revoked lease whose holder is not busy admits nothing more
and is dropped after its last fold; one whose holder is busy may still add one insert of at
most `cap` steps, so it is folded again and `cap` steps are reserved for it until its
holder is done. Samples only lower `diff`, so they leave the lease alone.

`LimiterSlot` is a store's side of the limiter: its inserts (`insert`, one per ``add``,
the protocol above) and its waits for samples (`sampling`). This module knows no band,
only counts: the limiter is anything with `Limiter`'s methods (`rate_limit.RateLimiter`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from mmreplay.errors import InvalidInputError

ENDLESS = sys.maxsize  # a limit this large is never reached
REVOKED = -1  # a limit that admits nothing: `used + n <= REVOKED` never holds


class StepLease:
    """`limit` steps one holder may insert without the limiter's lock (see the module)."""

    __slots__ = ("busy", "cap", "folded", "limit", "used", "wake")

    def __init__(self, limit: int, cap: int, wake: bool) -> None:
        self.limit = limit  # written by the limiter only (REVOKED when revoked)
        self.cap = cap  # the most steps one insert of the holder brings
        self.wake = wake  # written by the limiter only: someone waits, call `settle`
        self.used = 0  # written by the holder only, after each insert it recorded
        self.busy = False  # written by the holder only: between its check and its count
        self.folded = 0  # the limiter's: `used` as of its last fold


NO_LEASE = StepLease(REVOKED, 1, False)  # a holder's lease before its first: admits nothing


class Leases:
    """The live lease and the revoked ones whose holders may still be busy; the limiter
    calls it under its lock only."""

    def __init__(self) -> None:
        self.live: StepLease | None = None
        self.revoked: list[StepLease] = []

    def revoke(self) -> None:
        """Revoke the live lease (folded until its holder is seen not busy)."""
        live = self.live
        if live is not None:
            live.limit = REVOKED
            self.revoked.append(live)
            self.live = None

    def issue(self, limit: int, cap: int, wake: bool) -> StepLease:
        """Revoke the live lease, then hand out a new one of `limit` steps."""
        self.revoke()
        self.live = StepLease(limit, cap, wake)
        return self.live

    def reserved_steps(self) -> int:
        """Steps that revoked leases may still add (after a `take`: each was busy then):
        one insert of `cap` steps each."""
        return sum(lease.cap for lease in self.revoked)

    def take(self) -> int:
        """The steps recorded under every lease since the last take. Revoked leases whose
        holder was not busy before their count was read are dropped."""
        steps, kept = 0, []
        for lease in self.revoked:
            busy = lease.busy  # before `used`: the holder counts, then is done
            steps += _fold(lease)
            if busy:
                kept.append(lease)
        self.revoked = kept
        if self.live is not None:
            steps += _fold(self.live)
        return steps

    def set_wake(self, wake: bool) -> None:
        """Tell every holder whether someone waits on the limiter."""
        for lease in self.revoked:
            lease.wake = wake
        if self.live is not None:
            self.live.wake = wake

    def check_valid(self) -> None:
        """Internal invariants (tests call it through the limiter's)."""
        for lease in self.revoked:
            assert lease.limit == REVOKED and 0 <= lease.folded <= lease.used
        live = self.live
        assert live is None or 0 <= live.folded <= live.used <= max(live.limit, 0)


def _fold(lease: StepLease) -> int:
    """The steps `lease`'s holder counted since its last fold (now folded)."""
    used = lease.used
    steps, lease.folded = used - lease.folded, used
    return steps


class Limiter(Protocol):
    """What a `LimiterSlot` needs of its limiter (`rate_limit.RateLimiter`)."""

    min_size_to_sample: int

    def await_insert(self, n: int = ...) -> None: ...

    def cancel_insert(self, n: int) -> None: ...

    def lease(self, cap: int) -> StepLease: ...

    def settle(self) -> None: ...

    def await_sample(self, n: int = ...) -> None: ...

    def cancel_sample(self, n: int) -> None: ...

    def attach(self, saved: dict[str, Any] | None, *, inserts: int) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class LimiterSlot:
    """The rate limiter a store may hold, and the waits its calls make on it.

    `insert` runs one ``add`` under the store's `lock` once the limiter lets its steps in:
    on the holder's `lease` (the protocol above; None with no limiter) without the
    limiter's lock, else after `Limiter.await_insert` outside the store's lock, taking a
    new lease. `sampling(n)` is a context manager: it waits until the limiter lets `n`
    samples through, runs the body, and gives the count back if the body raises (a refused
    call was never a sample). With no limiter either costs next to nothing.
    """

    def __init__(self, lock: threading.RLock, num_envs: int) -> None:
        self.lock, self.num_envs = lock, num_envs  # the holder's lock; steps of a full add
        self.limiter: Limiter | None = None
        self.lease: StepLease | None = None  # the holder's: under `lock` only

    def insert(self, record: Callable[[tuple[Any, ...]], None], step: tuple[Any, ...],
               env_ids: Any, autoreset: Any) -> None:
        """``record(step)`` under the lock once admitted: the steps of an ``add`` of
        `env_ids` (None: every env) less its `autoreset` rows are inserts, counted once
        recorded (a refused record never is). The hot path: no calls besides `record`."""
        steps = self.num_envs
        if self.limiter is not None and (env_ids is not None or autoreset is not None):
            steps = steps_in_call(self.num_envs if env_ids is None else int(np.size(env_ids)),
                                  autoreset)  # fewer steps than envs
        with self.lock:
            lease = self.lease
            if lease is None:  # no rate limiter
                record(step)
                return
            lease.busy = True
            if lease.used + steps <= lease.limit:  # admitted without the limiter's lock
                try:
                    record(step)
                    lease.used += steps
                finally:
                    lease.busy = False
                if lease.wake:  # someone waits on the limiter
                    self.limiter.settle()  # type: ignore[union-attr]  # held with the lease
                return
            lease.busy = False  # spent or revoked: the limiter's lock decides
            limiter = self.limiter  # held with the lease (both set under the lock)
        assert limiter is not None
        self._insert_waited(limiter, steps, record, step)

    def _insert_waited(self, limiter: Limiter, steps: int,
                       record: Callable[[tuple[Any, ...]], None], step: tuple[Any, ...]) -> None:
        """`insert` once `limiter` let these steps in under its lock (counted there, taken
        back if the store refuses them); the holder uses a new lease from then on."""
        limiter.await_insert(steps)
        try:
            lease = limiter.lease(self.num_envs)
            with self.lock:
                if self.limiter is limiter:  # else unused: the limiter drops it on revoke
                    self.lease = lease
                record(step)
        except BaseException:
            limiter.cancel_insert(steps)  # refused: these steps were never inserts
            raise

    def attach(self, limiter: Limiter | None, saved: dict[str, Any] | None, *,
               inserts: int, capacity: int) -> None:
        """Hold `limiter` (None removes it), counting from a store's committed counters
        `saved` and its `inserts` recorded steps; refused if samples could never start."""
        if limiter is not None:
            if limiter.min_size_to_sample > capacity:
                raise InvalidInputError(
                    f"rate limiter min_size_to_sample {limiter.min_size_to_sample} > store "
                    f"capacity {capacity}: samples would wait forever")
            limiter.attach(saved, inserts=inserts)
        self.limiter = limiter
        self.lease = None if limiter is None else NO_LEASE

    def state(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        """The limiter's counters if one is held, else the committed ones (`saved`)."""
        if self.limiter is not None:
            return self.limiter.state()
        return None if saved is None else dict(saved)

    def sampling(self, n: int) -> contextlib.AbstractContextManager[None]:
        """Wait for `n` samples, then run the body (count given back if it raises)."""
        limiter = self.limiter
        if limiter is None:
            return _NOTHING
        return _Admitted(limiter.await_sample, limiter.cancel_sample, n)

    def close(self) -> None:
        """Close the held limiter, waking its waiters."""
        if self.limiter is not None:
            self.limiter.close()


def steps_in_call(count: int, autoreset: Any) -> int:
    """How many of `count` env rows of an ``add`` are steps (not autoreset rows); a value
    the store's own checks will refuse counts as `count` (the refusal cancels it)."""
    if autoreset is None:
        return count
    try:
        resets = int(np.count_nonzero(np.asarray(autoreset)))
    except (TypeError, ValueError, RuntimeError):
        return count
    return max(0, count - resets)


class _Admitted:
    """`wait(n)` on entering; `cancel(n)` if the body raises (it was never counted). A
    plain class, not a generator context manager: this is on every `sample`."""

    __slots__ = ("cancel", "n", "wait")

    def __init__(self, wait: Callable[[int], None], cancel: Callable[[int], None],
                 n: int) -> None:
        self.wait, self.cancel, self.n = wait, cancel, n

    def __enter__(self) -> None:
        self.wait(self.n)

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None:
            self.cancel(self.n)  # and the exception goes on


_NOTHING = contextlib.nullcontext()  # stateless: one for every call without a limiter
