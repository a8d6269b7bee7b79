"""Inserts admitted without the rate limiter's lock: its leases.

A *lease* is a number of steps (`limit`) that one *holder* may insert without asking the
limiter, because under its lock the limiter found that they surely fit below its upper
edge (`RateLimiter.lease` in `rate_limit.py` owns the rule). The holder is a writer that
serializes its own inserts under a lock of its own (`ReplayStore.add` under the store's
lock), and it follows this protocol there::

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
holder is done. Samples only lower `diff`, so they leave the lease alone. This module
knows no band, only counts.
"""

from __future__ import annotations

import sys

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
