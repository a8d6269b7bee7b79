"""Arms timed in turn, for A/B comparisons inside one process.

Every round times a few calls of each arm, one arm after the other, so a change in the
machine's load (it is shared) hits all arms alike. Per call: the wall time and the page
faults of the calling thread (minor: a page mapped from the page cache; major: read from
disk), from `getrusage`.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# per thread where the OS counts so (Linux), else per process
_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def faults() -> tuple[int, int]:
    """(minor, major) page faults of this thread so far."""
    use = resource.getrusage(_WHO)
    return use.ru_minflt, use.ru_majflt


def mappings() -> int | None:
    """Memory mappings this process holds now (lines of /proc/self/maps; None off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def max_mappings() -> int | None:
    """The kernel's limit on mappings per process (`vm.max_map_count`; None off Linux)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def summary(ms: list[float], minor: list[int], major: list[int]) -> dict[str, float]:
    """Median, p90 and mean in ms, and mean page faults per call."""
    times = np.asarray(ms)
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "mean_ms": float(times.mean()), "reps": int(times.size),
            "minflt_per_call": float(np.mean(minor)), "majflt_per_call": float(np.mean(major))}


def timed_calls(fn: Callable[[], object], n: int,
                got: tuple[list[float], list[int], list[int]]) -> None:
    """Call `fn` `n` times, appending each call's ms, minor and major faults to `got`."""
    ms, minor, major = got
    clock = time.perf_counter_ns
    for _ in range(n):
        f0, t0 = faults(), clock()
        fn()
        t1, f1 = clock(), faults()
        ms.append((t1 - t0) / 1e6)
        minor.append(f1[0] - f0[0])
        major.append(f1[1] - f0[1])


def alternate(arms: dict[str, Callable[[], object]], *, rounds: int, reps: int,
              warmup: int) -> dict[str, dict[str, Any]]:
    """`summary` of each arm over `reps` calls, timed `reps // rounds` calls at a time in
    turn, after `warmup` calls of each (their `summary` is ``first_calls``: a store maps
    its shard files on first touch, so the first calls show that cost)."""
    first = {name: ([], [], []) for name in arms}
    for name, fn in arms.items():
        timed_calls(fn, warmup, first[name])
    per = max(1, reps // max(1, rounds))
    got: dict[str, tuple[list[float], list[int], list[int]]] = {
        name: ([], [], []) for name in arms}
    for _ in range(max(1, rounds)):
        for name, fn in arms.items():
            timed_calls(fn, per, got[name])
    return {name: {**summary(*got[name]),
                   "first_calls": summary(*first[name]) if warmup else None}
            for name in arms}


def ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """a / b of the median and of the p90."""
    return {"median": a["median_ms"] / b["median_ms"], "p90": a["p90_ms"] / b["p90_ms"]}
