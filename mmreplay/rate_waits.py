"""The waits of a rate limiter: its condition, who waits, timeouts, close, wait statistics.

`rate_limit.RateLimiter` decides *whether* a call may go (Reverb's band, its leases); this
module makes a call that may not go *wait* until it may, under the limiter's lock::

    closed?  -> RateLimiterClosedError
    register (waiters + 1, leases told to wake us)  -> fold -> may go? -> return
    sleep on the condition until woken or timed out (RateLimitTimeoutError), closed
    (RateLimiterClosedError), or folded and allowed to go; the time slept is counted

A waiter registers before it folds the leases' inserts: an insert counted by a lease
after that fold finds `wake` set and wakes it (`admission`). This module knows no band.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mmreplay.admission import Leases
from mmreplay.errors import RateLimiterClosedError, RateLimitTimeoutError

# (kind, n, timeout) -> what a timed-out wait says: the limiter's counts and band
Describe = Callable[[str, int, "float | None"], str]


class Waits:
    """Blocking and waking for one limiter (see the module doc); every method but `wake`
    runs under the limiter's lock, the condition's."""

    def __init__(self, lock: threading.Lock, leases: Leases) -> None:
        self.cond = threading.Condition(lock)
        self.leases = leases  # told whether someone waits (`Leases.set_wake`)
        self.waiters = 0
        self.closed = False  # once set, every wait now and later raises
        self.seconds = {"insert": 0.0, "sample": 0.0}  # time waited, by kind
        self.blocked = {"insert": 0, "sample": 0}  # calls that had to wait, by kind

    def wake(self) -> None:
        """Wake the waiters (they look again), if any."""
        if self.waiters:
            self.cond.notify_all()

    def wait(self, kind: str, n: int, fold: Callable[[], None], go: Callable[[], bool],
             timeout: float | None, describe: Describe) -> None:
        """Return once `go()` holds after `fold()`; raise on timeout or close."""
        if self.closed:
            raise RateLimiterClosedError(f"{kind} of {n} on a rate limiter that was closed")
        self.waiters += 1  # before the fold: an insert of a lease from now on wakes us
        self.leases.set_wake(True)
        try:
            fold()
            if not go():
                self._sleep(kind, n, fold, go, timeout, describe)
        finally:
            self.waiters -= 1
            if not self.waiters:
                self.leases.set_wake(False)

    def _sleep(self, kind: str, n: int, fold: Callable[[], None], go: Callable[[], bool],
               timeout: float | None, describe: Describe) -> None:
        start = time.monotonic()
        self.blocked[kind] += 1
        try:
            while True:
                left = None if timeout is None else start + timeout - time.monotonic()
                if left is not None and left <= 0:
                    raise RateLimitTimeoutError(describe(kind, n, timeout))
                self.cond.wait(left)
                if self.closed:
                    raise RateLimiterClosedError(f"the rate limiter was closed while a "
                                                 f"{kind} of {n} waited")
                fold()
                if go():
                    return
        finally:
            self.seconds[kind] += time.monotonic() - start
