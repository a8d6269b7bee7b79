"""Mirroring a writable store into object storage in the background.

`Mirror` owns one thread and one `Pusher`. The store calls `notify(generation)` after each
flush and returns at once; the thread pushes the newest committed generation (skipping
any the network was too slow for), renews the writer lease while idle, and retries
failed pushes with backoff. The training loop waits only when the mirror falls more than
`max_lag` generations behind, or when it asks to (`wait`)::

    flush g7 ─ notify ─┐          flush g8 ─ notify ─┐
                       └─ push g7 (thread) ────────────┴─ push g8 ─ ...

A lost lease (another writer took the prefix over) stops the mirror; the next `notify`
or `wait` raises it. A writer that restarts in a new process (a Ray store actor) passes
the same `writer_id`, so it renews its own lease instead of waiting for it to expire.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from mmreplay.errors import InvalidStoreError, ObjectStoreError, StoreLockedError
from mmreplay.storage.lease import LEASE_TTL_S, Lease
from mmreplay.storage.manifest import read_manifest
from mmreplay.storage.objects import Objects
from mmreplay.storage.push import Pusher, PushReport

MAX_LAG = 2  # generations the bucket may trail the directory before a flush waits
RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)
KEEP_REPORTS = 256  # push reports kept (the newest): a long run pushes thousands of times
GIVE_UP_AFTER = 4  # consecutive failed pushes after which a waiting caller gets the error


@dataclass(frozen=True)
class MirrorInfo:
    """Where a mirror stands: the newest generation in the bucket, how many committed
    generations it trails by, the pushes made so far and the last push error (None when
    the last push succeeded)."""

    url: str
    pushed: int
    lag: int
    pushes: int
    error: str | None


class Mirror:
    """Pushes every committed generation of `root` into `objects`, off the caller's thread."""

    def __init__(self, root: Path, objects: Objects, *, max_lag: int = MAX_LAG,
                 take_over: bool = False, writer_id: str | None = None) -> None:
        self.objects, self.max_lag = objects, max_lag
        self._pusher = Pusher(root, objects, lease=Lease(objects, writer_id=writer_id))
        self._pusher.lease.acquire(take_over=take_over)  # refuse a second writer now
        self._take_over = take_over
        self._cond = threading.Condition()
        self._wanted = 0  # newest committed generation
        self.pushed = 0  # newest generation in the bucket
        self.reports: deque[PushReport] = deque(maxlen=KEEP_REPORTS)  # the newest pushes
        self.pushes = 0  # pushes that succeeded, all of them
        self.error: BaseException | None = None
        self.failures = 0  # consecutive failed pushes
        self._fatal: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mmreplay-mirror", daemon=True)
        self._thread.start()

    @property
    def lag(self) -> int:
        """Generations committed locally and not yet in the bucket."""
        return self._wanted - self.pushed

    def info(self) -> MirrorInfo:
        """A snapshot of `pushed`, `lag`, the number of pushes and the last error."""
        with self._cond:
            error = None if self.error is None else str(self.error)
            return MirrorInfo(self.objects.url, self.pushed, self.lag, self.pushes, error)

    def notify(self, generation: int, *, wait: bool = False) -> None:
        """A generation was committed; waits only while the mirror lags by > `max_lag`, or
        (`wait`) until it is in the bucket."""
        with self._cond:
            self._raise_fatal()
            self._wanted = max(self._wanted, generation)
            self._cond.notify_all()
            while self._wanted - self.pushed > self.max_lag and self._fatal is None:
                self._raise_failing()
                self._cond.wait(0.5)
            self._raise_fatal()
        if wait:
            self.wait()

    def sync(self, *, wait: bool = False) -> int:
        """`notify` of the generation the directory commits now (for a store another
        process writes, such as a Ray store actor); returns it."""
        generation = int(read_manifest(self._pusher.root)["generation"])
        self.notify(generation, wait=wait)
        return generation

    def wait(self, timeout: float | None = None) -> None:
        """Block until the newest committed generation is in the bucket; raises the last
        push error if it is not there by `timeout` (or ever, for a lost lease)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.pushed < self._wanted and self._fatal is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise ObjectStoreError(f"mirror to {self.objects.url} is {self.lag} "
                                           f"generations behind: {self.error}")
                self._raise_failing()
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            self._raise_fatal()

    def close(self, *, wait: bool = True) -> None:
        """Push what is committed (if `wait`), stop the thread, release the lease."""
        try:
            if wait and self._fatal is None:
                self.wait()
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()
            if self._fatal is None:
                try:
                    self._pusher.close()
                except ObjectStoreError:
                    pass  # the bucket is unreachable: the lease expires by itself

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _raise_failing(self) -> None:
        """A waiting caller gets the push error once pushes keep failing (the thread goes
        on retrying: a later wait may succeed)."""
        if self.failures >= GIVE_UP_AFTER and self.error is not None:
            raise ObjectStoreError(f"mirror to {self.objects.url} is {self.lag} generations "
                                   f"behind after {self.failures} failed pushes: "
                                   f"{self.error}") from self.error

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._stop and self.pushed >= self._wanted:
                    if not self._cond.wait(LEASE_TTL_S / 3):
                        break  # idle: renew the lease below
                if self._stop:
                    return
                target = self._wanted
            failures = self._push_once(target, failures)

    def _push_once(self, target: int, failures: int) -> int:
        """One push (or lease renewal); returns the count of consecutive failures."""
        try:
            if target <= self.pushed:
                self._pusher.lease.acquire()
                return 0
            report = self._pusher.push()
        except (StoreLockedError, InvalidStoreError) as exc:  # retrying cannot help
            with self._cond:
                self._fatal = exc
                self._cond.notify_all()
            return failures
        except Exception as exc:  # noqa: BLE001 -- any failure: keep the error, retry later
            with self._cond:
                self.error, self.failures = exc, failures + 1
                self._cond.notify_all()
            time.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
            return failures + 1
        with self._cond:
            self.pushed = max(self.pushed, report.generation)
            self.reports.append(report)
            self.pushes += 1
            self.error, self.failures = None, 0
            self._cond.notify_all()
        return 0
