"""Samples per insert under control: Reverb's rate limiter, for writers and learners.

The store counts every step it records as an *insert* and every transition it hands out
as a *sample* (a batch of B transitions is B samples; B sequences of length L are B*L).
The limiter keeps the difference ::

    diff = inserts * samples_per_insert - samples              (minus a rebase offset)

between `min_diff` and `max_diff`: an insert waits while one more would push `diff`
above `max_diff`, a sample waits while one more would pull it below `min_diff` or while
fewer than `min_size_to_sample` steps were inserted::

        samples wait        both proceed          inserts wait
    ---------------|==========================|---------------->  diff
               min_diff                   max_diff

`SampleToInsertRatio(spi, min_size, error_buffer)` centres the band on
``spi * min_size`` (Reverb's offset); `min_size` only holds samples back until the
store has enough steps; `queue` lets each step be sampled about once. A call of n
items is admitted when its first item would be (as Reverb admits items one at a time),
so `diff` may pass an edge by at most n - 1 items: this is what makes a band of
``2 * max(1, spi)`` deadlock-free for any batch size.

Waits are bounded by `timeout_s` (`RateLimitTimeoutError`), `close` wakes every
waiter (`RateLimiterClosedError`), `disable`/`enable` switch limiting off and on at run
time (preloading: counts go on, and enabling moves the band's reference so that the
run resumes at its edge instead of paying back the preload). `state` is a flat dict of
JSON numbers that the store commits with its manifest, and `restore` takes it back.

`await_insert` and `await_sample` take the lock. A writer that serializes its own inserts
(a store's `add`) may instead hold a *lease* (`lease`, `mmreplay.admission`): steps that
surely fit below the upper edge, which it inserts and counts without the lock; every
locked operation folds their counts in first (`_fold`). Samples only lower `diff`, so they
leave the lease alone; whatever may raise it or change the rules (an insert on the locked
path, a cancel, `restore`, the switches, `close`) revokes it. With no upper edge
(`min_size`) or limiting off, a lease is endless. Waiting itself (the condition, timeouts,
close, wait statistics) is `rate_waits.Waits`; a store's side of the protocol is
`admission.LimiterSlot`. This module knows no store, frames or files.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from mmreplay.admission import ENDLESS, REVOKED, Leases, StepLease
from mmreplay.errors import InvalidInputError
from mmreplay.rate_waits import Waits

CONFIG_KEYS = ("samples_per_insert", "min_size_to_sample", "min_diff", "max_diff")
COUNTER_KEYS = ("inserts", "samples", "offset", "insert_wait_s", "sample_wait_s",
                "inserts_blocked", "samples_blocked")
_DEFAULT: Any = object()  # "the limiter's own timeout_s"
_NO_EDGE = sys.float_info.max  # a max_diff this high is never reached: inserts never wait


def _number(name: str, value: Any, *, low: float = -math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < low:
        raise InvalidInputError(f"{name} must be a finite number >= {low}, got {value!r:.40}")
    return float(value)


def _count(name: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidInputError(f"{name} must be an int >= {low}, got {value!r:.40}")
    return value


class RateLimiter:
    """Reverb's rate limiter (see the module docstring); thread-safe, one lock (that the
    inserts of a lease skip).

    `samples_per_insert` > 0, `min_size_to_sample` >= 1, and the band
    ``max_diff - min_diff`` must be at least ``2 * max(1, samples_per_insert)``:
    narrower, a blocked insert and a blocked sample could wait for each other forever.
    `timeout_s` (None: forever) bounds every wait that does not give its own.
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float,
                 max_diff: float, *, timeout_s: float | None = None) -> None:
        self.samples_per_insert = _number("samples_per_insert", samples_per_insert, low=0.0)
        self.min_size_to_sample = _count("min_size_to_sample", min_size_to_sample, low=1)
        self.min_diff = _number("min_diff", min_diff)
        self.max_diff = _number("max_diff", max_diff)
        _check_band(self.samples_per_insert, self.min_diff, self.max_diff)
        self.timeout_s = None if timeout_s is None else _number("timeout_s", timeout_s, low=0)
        self._lock = threading.Lock()
        self._inserts = self._samples = 0
        self._offset = 0.0
        self._enabled = True
        self._leases = Leases()  # inserts admitted without the lock, not yet counted
        self._waits = Waits(self._lock, self._leases)  # who waits, how long; closed
        self._cond = self._waits.cond
        # the lowest and highest diff after any admission while limiting past min size
        # (what "the error stayed in its band at every moment" checks; see stats)
        self._low, self._high = math.inf, -math.inf

    # -- Reverb's constructors ----------------------------------------------------------
    @classmethod
    def sample_to_insert_ratio(cls, samples_per_insert: float, min_size_to_sample: int,
                               error_buffer: float | tuple[float, float], *,
                               timeout_s: float | None = None) -> RateLimiter:
        """Reverb's ``SampleToInsertRatio``: a number `error_buffer` is a band of that half
        width around ``samples_per_insert * min_size_to_sample``; a pair is used as is."""
        spi = _number("samples_per_insert", samples_per_insert, low=0.0)
        min_diff, max_diff = _ratio_band(spi, min_size_to_sample, error_buffer)
        return cls(spi, min_size_to_sample, min_diff, max_diff, timeout_s=timeout_s)

    @classmethod
    def min_size(cls, min_size_to_sample: int, *,
                 timeout_s: float | None = None) -> RateLimiter:
        """Reverb's ``MinSize``: samples wait until `min_size_to_sample` steps are in."""
        big = sys.float_info.max
        return cls(1.0, min_size_to_sample, -big, big, timeout_s=timeout_s)

    @classmethod
    def queue(cls, size: int, *, timeout_s: float | None = None) -> RateLimiter:
        """Reverb's ``Queue`` band: each step sampled about once, at most `size` steps ahead
        of the learner. (The store samples uniformly, not in FIFO order; `size` >= 2.)"""
        return cls(1.0, 1, 0.0, float(_count("size", size, low=2)), timeout_s=timeout_s)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RateLimiter:
        """A limiter from `config` (its `config()` dict, e.g. sent to another process)."""
        missing = sorted(set(CONFIG_KEYS) - set(config))
        if missing:
            raise InvalidInputError(f"rate limiter config lacks {missing}")
        return cls(*(config[k] for k in CONFIG_KEYS), timeout_s=config.get("timeout_s"))

    def config(self) -> dict[str, Any]:
        """The parameters, as plain numbers (`from_config` takes them)."""
        return {"samples_per_insert": self.samples_per_insert,
                "min_size_to_sample": self.min_size_to_sample, "min_diff": self.min_diff,
                "max_diff": self.max_diff, "timeout_s": self.timeout_s}

    # -- admission ----------------------------------------------------------------------
    def await_insert(self, n: int = 1, timeout: float | None = _DEFAULT) -> None:
        """Wait until an insert may go, then count `n` inserts (`cancel_insert` undoes)."""
        with self._lock:  # no Condition, no call unless it waits
            self._leases.revoke()  # this raises diff: the lease's steps may no longer fit
            self._fold()
            if n > 0 and (self._waits.closed or self._enabled and not self._can_insert()):
                self._wait("insert", n, self._can_insert, timeout)
            inserts = self._inserts = self._inserts + n
            if self._enabled and inserts >= self.min_size_to_sample:
                diff = self._diff()
                self._high, self._low = max(self._high, diff), min(self._low, diff)
            if self._waits.waiters:
                self._cond.notify_all()

    def lease(self, cap: int) -> StepLease:
        """A new lease for one holder whose inserts bring at most `cap` steps each: the steps
        it may insert and count without this lock (the protocol: `mmreplay.admission`).
        The lease handed out before is revoked. Its limit is what surely fits below the
        upper edge (endless with none or limiting off; nothing when closed); it stops short
        of `min_size_to_sample` and admits nothing while `diff` is below the lowest error
        seen, so that the insert that sets `error_low` takes the lock. A holder that gets a
        lease while another limiter is attached just never uses it."""
        with self._lock:
            self._leases.revoke()
            self._fold()
            return self._leases.issue(self._lease_limit(), max(1, cap), self._waits.waiters > 0)

    def await_sample(self, n: int = 1, timeout: float | None = _DEFAULT) -> None:
        """Wait until a sample may go, then count `n` samples (`cancel_sample` undoes)."""
        with self._lock:  # self._can_sample() written out: this is on every batch
            self._fold()
            inserts, spi = self._inserts, self.samples_per_insert
            if n > 0 and (self._waits.closed or self._enabled and not (
                    inserts >= self.min_size_to_sample
                    and inserts * spi - self._samples - self._offset - 1 >= self.min_diff)):
                self._wait("sample", n, self._can_sample, timeout)
            samples = self._samples = self._samples + n
            inserts = self._inserts
            if self._enabled and inserts >= self.min_size_to_sample:
                diff = inserts * spi - samples - self._offset
                if diff < self._low:
                    self._low = diff
                if diff > self._high:
                    self._high = diff
            if self._waits.waiters:
                self._cond.notify_all()

    def cancel_insert(self, n: int) -> None:
        """Take back `n` counted inserts that did not happen (the store refused them)."""
        with self._changing():  # diff may drop below the lowest seen: no lease then
            self._inserts -= n

    def cancel_sample(self, n: int) -> None:
        """Take back `n` counted samples that were not drawn."""
        with self._changing():
            self._samples -= n

    def settle(self) -> None:
        """Fold the inserts of leases in and wake the waiters (they may go now): what a
        lease's holder calls after an insert while its lease says `wake`."""
        with self._cond:
            self._fold()
            self._waits.wake()

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Under the lock: revoke the lease and fold, run the body (which may raise `diff`
        or change the rules), then wake (holders come back for a new lease)."""
        with self._cond:
            self._leases.revoke()
            self._fold()
            yield
            self._waits.wake()

    def _fits(self, more: int) -> bool:
        """Would one insert go (past min size) after `more` inserts besides the counted?"""
        spi = self.samples_per_insert
        return (self._inserts + more) * spi - self._samples - self._offset + spi <= self.max_diff

    def _fold(self) -> None:
        """Under the lock: count the inserts of leases, and widen the error range by the
        highest diff they made (the last; a lease never crosses min size nor starts below
        the lowest error seen, so no lowest is missed: see `lease`)."""
        steps = self._leases.take()
        if steps:
            self._inserts += steps
            if self._enabled and self._inserts >= self.min_size_to_sample:
                self._high = max(self._high, self._diff())

    def _diff(self) -> float:
        return self._inserts * self.samples_per_insert - self._samples - self._offset

    def _can_insert(self) -> bool:
        """Reverb's rule, counting each revoked lease whose holder is busy as `cap` steps
        (none: exactly Reverb's). A lease issued while this insert waited is revoked first."""
        if self._leases.live is not None:
            self._leases.revoke()
            self._fold()
        more = self._leases.reserved_steps()
        return self._inserts + more + 1 <= self.min_size_to_sample or self._fits(more)

    def _can_sample(self) -> bool:
        return self._inserts >= self.min_size_to_sample and self._diff() - 1 >= self.min_diff

    def _wait(self, kind: str, n: int, can: Callable[[], bool], timeout: float | None) -> None:
        """Under the lock: return once `can()` (or limiting is off); raise on timeout or
        close (`Waits.wait`)."""
        self._waits.wait(kind, n, self._fold, lambda: not self._enabled or can(),
                         self.timeout_s if timeout is _DEFAULT else timeout,
                         lambda kind, n, limit: _timeout_message(
                             self, kind, n, limit, self._inserts, self._samples, self._diff()))

    def _lease_limit(self) -> int:
        """How many steps a lease may admit (see `lease`; under the lock, the live lease
        revoked and folded): every insert it admits starts at a count Reverb's rule admits,
        besides what revoked leases may still add."""
        if self._waits.closed:
            return REVOKED
        if not self._enabled:
            return ENDLESS
        reserved = self._leases.reserved_steps()
        below = self.min_size_to_sample - self._inserts - reserved - 1
        if below >= 0 or self._inserts < self.min_size_to_sample:
            return max(below, REVOKED)  # the insert that reaches min size takes the lock
        diff = self._diff()
        if diff < self._low:
            return REVOKED  # the next insert may set the lowest error: the lock records it
        return _steps_below(self.max_diff, self.samples_per_insert, diff, reserved, self._fits)

    # -- switches -----------------------------------------------------------------------
    def disable(self) -> None:
        """Stop limiting (nothing waits; counts go on), e.g. while preloading offline data."""
        with self._changing():
            self._enabled = False

    def enable(self) -> None:
        """Limit again, from where the counts are: if `diff` left the band meanwhile, the
        band's reference moves so that it sits at the nearest edge (`rebase`)."""
        with self._changing():
            self._enabled = True
            self._rebase()

    @property
    def enabled(self) -> bool:
        return self._enabled

    def _rebase(self) -> None:
        """Move `diff` into the band (below min size: to what it is with no samples)."""
        if self._inserts < self.min_size_to_sample:
            self._offset = float(-self._samples)
            return
        diff = self._diff()
        self._offset += diff - min(max(diff, self.min_diff), self.max_diff)

    def close(self) -> None:
        """Shut down: every waiter, now and later, raises `RateLimiterClosedError`."""
        with self._changing():
            self._waits.closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._waits.closed

    # -- counters -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Config and counters as a flat dict of JSON numbers (what a store commits)."""
        with self._cond:
            self._fold()
            waits = self._waits
            return {**{k: v for k, v in self.config().items() if k != "timeout_s"},
                    "inserts": self._inserts, "samples": self._samples,
                    "offset": self._offset, "insert_wait_s": waits.seconds["insert"],
                    "sample_wait_s": waits.seconds["sample"],
                    "inserts_blocked": waits.blocked["insert"],
                    "samples_blocked": waits.blocked["sample"], "enabled": self._enabled}

    def restore(self, state: dict[str, Any]) -> None:
        """Take counters back from a `state` dict (not ``enabled``: this limiter's own switch
        stands). If it was saved with other parameters, `diff` is moved into this limiter's
        band (`rebase`); else it is kept exactly."""
        counts, floats = _counters(state)
        with self._changing():  # folded inserts are replaced with the rest
            self._inserts = counts.get("inserts", 0)
            self._samples = counts.get("samples", 0)
            self._waits.blocked = {"insert": counts.get("inserts_blocked", 0),
                                   "sample": counts.get("samples_blocked", 0)}
            self._offset = floats.get("offset", 0.0)
            self._waits.seconds = {"insert": floats.get("insert_wait_s", 0.0),
                                   "sample": floats.get("sample_wait_s", 0.0)}
            same = all(state.get(k) == v for k, v in self.config().items() if k != "timeout_s")
            if not same and self._enabled:
                self._rebase()

    def attach(self, saved: dict[str, Any] | None, *, inserts: int) -> None:
        """Start counting for a store that has recorded `inserts` steps, from the counters
        it committed (`saved`) if any; without them the run starts at the band's edge."""
        self.restore({**(saved or {}), "inserts": inserts})
        if saved is None:
            with self._changing():
                self._rebase()

    def stats(self) -> dict[str, Any]:
        """`state` with what a person reads added (see `summary`), and the lowest and highest
        error after any admission while limiting past min size (`error_low`, `error_high`;
        None before; not committed, they cover this process's run)."""
        with self._cond:
            self._fold()
            low, high = self._low, self._high
        out = summary(self.state())
        offset = self.samples_per_insert * self.min_size_to_sample
        seen = low <= high
        out["error_low"] = low - offset if seen else None
        out["error_high"] = high - offset if seen else None
        return out

    def check_valid(self) -> None:
        """Internal invariants (tests call it after operations)."""
        with self._cond:
            self._fold()
            self._leases.check_valid()
            live = self._leases.live
            assert not self._waits.closed or live is None or live.limit == REVOKED
            assert self._inserts >= 0 and self._samples >= 0, (self._inserts, self._samples)
            assert self._waits.waiters >= 0 and min(self._waits.seconds.values()) >= 0

    def __repr__(self) -> str:
        return (f"RateLimiter(samples_per_insert={self.samples_per_insert:g}, "
                f"min_size_to_sample={self.min_size_to_sample}, min_diff={self.min_diff:g}, "
                f"max_diff={self.max_diff:g})")


def _steps_below(max_diff: float, spi: float, diff: float, reserved: int,
                 fits: Callable[[int], bool]) -> int:
    """Steps that surely fit between `diff` and `max_diff`, besides `reserved` ones: an
    insert at `used` goes if one step fits after ``reserved + used``, so the last start is
    ``limit - 1``, checked with `fits` (the locked path's own floats: the division may round
    up)."""
    if max_diff >= _NO_EDGE:
        return ENDLESS
    steps = (max_diff - diff) / spi - reserved
    limit = ENDLESS if steps >= ENDLESS else max(0, math.floor(steps))
    if limit and not fits(reserved + limit - 1):
        limit -= 1
    if limit and not fits(reserved + limit - 1):
        limit = 0  # too large for floats to tell: the locked path decides
    return limit


def _check_band(spi: float, min_diff: float, max_diff: float) -> None:
    if spi == 0:
        raise InvalidInputError("samples_per_insert must be > 0 (use min_size to only "
                                "hold samples back until the store has enough steps)")
    width = 2 * max(1.0, spi)
    if max_diff - min_diff < width:
        raise InvalidInputError(
            f"max_diff - min_diff = {max_diff - min_diff:g} must be >= "
            f"2 * max(1, samples_per_insert) = {width:g}: a narrower band lets a waiting "
            f"insert and a waiting sample block each other forever")


def _ratio_band(spi: float, min_size_to_sample: int,
                error_buffer: float | tuple[float, float]) -> tuple[float, float]:
    """`sample_to_insert_ratio`'s (min_diff, max_diff), checked."""
    offset = spi * _count("min_size_to_sample", min_size_to_sample, low=1)
    if isinstance(error_buffer, tuple):
        min_diff, max_diff = (_number("error_buffer", v) for v in error_buffer)
    else:
        half = _number("error_buffer", error_buffer, low=0.0)
        min_diff, max_diff = offset - half, offset + half
    if min_diff > offset:
        raise InvalidInputError(
            f"min_diff {min_diff:g} > samples_per_insert * min_size_to_sample = "
            f"{offset:g}: samples would block for good once min_size_to_sample steps "
            f"are in")
    if max_diff < offset:
        warnings.warn(f"max_diff {max_diff:g} < samples_per_insert * min_size_to_sample "
                      f"= {offset:g}: inserts block once min_size_to_sample steps are in "
                      f"until a concurrent learner samples", stacklevel=3)
    return min_diff, max_diff


def _counters(state: dict[str, Any]) -> tuple[dict[str, int], dict[str, float]]:
    """The counters of a `state` dict that `restore` takes, checked."""
    counts = {k: _count(k, state[k]) for k in ("inserts", "samples", "inserts_blocked",
                                               "samples_blocked") if k in state}
    floats = {k: _number(k, state[k], low=0.0 if k != "offset" else -math.inf)
              for k in ("offset", "insert_wait_s", "sample_wait_s") if k in state}
    return counts, floats


def _timeout_message(lim: RateLimiter, kind: str, n: int, limit: float | None,
                     inserts: int, samples: int, diff: float) -> str:
    """What a wait that timed out says: `lim`'s band and its counts at that time."""
    other = "the learner is not sampling" if kind == "insert" else \
        "the writers are not inserting"
    article = "an" if kind == "insert" else "a"
    return (f"rate limiter: {article} {kind} of {n} waited {limit} s ({other}): inserts "
            f"{inserts}, samples {samples}, samples_per_insert "
            f"{lim.samples_per_insert:g}, diff {diff:g} in band "
            f"[{lim.min_diff:g}, {lim.max_diff:g}], min_size_to_sample "
            f"{lim.min_size_to_sample}; raise timeout_s or check the other side")


def summary(state: dict[str, Any]) -> dict[str, Any]:
    """A `state` dict plus the achieved samples per insert since `min_size_to_sample`
    (None before) and Reverb's error: `diff` less its value at min size."""
    spi, min_size = state["samples_per_insert"], state["min_size_to_sample"]
    past = state["inserts"] - min_size
    diff = state["inserts"] * spi - state["samples"] - state.get("offset", 0.0)
    return {**state, "achieved_samples_per_insert": state["samples"] / past if past > 0
            else None, "error": diff - spi * min_size}
