"""Atomic commit at every fault point, in real processes killed with SIGKILL.

A store is created with a prefix of a fixed stream and flushed; a forked child reopens it,
records a segment of the stream and flushes once. The child carries the fault layer of
`test_io_errors` in kill mode: just before the K-th ``open`` (for writing), ``write``,
``os.fsync``, ``os.replace`` or ``os.unlink`` of the segment (on any thread: chunk writes run
on the store's writer thread; give-up commits during the adds; the flush's blocks, tail,
manifest, fsyncs and deletions) it SIGKILLs itself. K runs over every point (N counted by a
fault-free run in this process). After each kill:

* ``open(path, "r")`` and ``open(path)`` succeed; the writable open leaves ``tmp/`` empty and
  no ``.npy`` file the manifest does not name;
* the store is exactly the previous commit or exactly the new one (counts, ``valid_ids()`` and
  ``get(valid_ids())`` bit-identical to a reference store); where the segment wraps the ring,
  the previous commit may have given up old transitions since (a bit-identical subset);
* where nothing was given up, the reopened store records the segment again and then equals the
  new reference.

With ``strace`` and ptrace allowed, a second variant lets strace itself kill a child
interpreter at the K-th ``rename(2)`` of a thread (``-e inject=rename:signal=SIGKILL:when=K``;
strace counts per thread, so K runs up to the busiest thread's count).
``MMREPLAY_LONG=1``: more scenarios, every point everywhere.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_io_errors import (
    FaultLayer,
    References,
    Scenario,
    assert_committed,
    assert_same,
    snapshot,
    start,
    step,
    temp_files,
)

from mmreplay import ReplayStore
from mmreplay.storage.manifest import read_manifest

pytestmark = pytest.mark.integration  # crash loops: processes killed at every fault point

LONG = os.environ.get("MMREPLAY_LONG") == "1"
SCENARIOS = {
    "plain": Scenario(prefix=10, segment=14),
    "durable": Scenario(prefix=10, segment=14, durable=True),
    "give_up": Scenario(prefix=10, segment=70),
    "prioritized_durable": Scenario(prefix=10, segment=14, sampler="prioritized", durable=True),
    "give_up_prioritized_durable": Scenario(prefix=6, segment=66, sampler="prioritized",
                                            durable=True),
}
CI = ("plain", "durable", "give_up")
STATS: Counter[str] = Counter()
STORE_DIRS = ("steps", "tail", "prio")


def prepare(root: Path, scenario: Scenario) -> None:
    start(root, scenario).close()


def record_segment(root: Path, scenario: Scenario) -> ReplayStore:
    store = ReplayStore.open(root, durable=scenario.durable)
    for i in range(scenario.segment):
        step(store, scenario.prefix + i)
    store.flush()
    return store


def _child(root: Path, scenario: Scenario, k: int) -> None:
    store = ReplayStore.open(root, durable=scenario.durable)
    layer = FaultLayer(pytest.MonkeyPatch(), fail_at=k, kill=True)
    layer.armed = True
    for i in range(scenario.segment):
        step(store, scenario.prefix + i)
    store.flush()
    os._exit(3)  # not killed: K is past the last fault point


def count_points(root: Path, scenario: Scenario) -> list[tuple[str, str]]:
    prepare(root, scenario)
    mp = pytest.MonkeyPatch()
    try:
        layer = FaultLayer(mp)
        store = ReplayStore.open(root, durable=scenario.durable)
        layer.armed = True
        for i in range(scenario.segment):
            step(store, scenario.prefix + i)
        store.flush()
        layer.armed = False
        store.close()
    finally:
        mp.undo()
    return layer.events


def check_reopened(root: Path, scenario: Scenario, refs: References, where: str) -> str:
    """Check a killed writer's store; returns "old" or "new" (the commit it holds)."""
    with ReplayStore.open(root, "r") as reader:
        read_only = snapshot(reader)
    with ReplayStore.open(root, durable=scenario.durable) as store:
        assert temp_files(root) == [], where
        named = set(read_manifest(root)["files"])
        on_disk = {f"{d}/{p.name}" for d in STORE_DIRS if (root / d).is_dir()
                   for p in (root / d).iterdir() if p.name.endswith(".npy")}
        assert on_disk == named, f"{where}: unnamed files {sorted(on_disk - named)}"
        got = snapshot(store)
        assert_same(read_only, got, f"{where}: read-only view")
        old, new = refs.after(0), refs.after(scenario.segment)
        written = got["counts"].frames_written
        if written == new["counts"].frames_written:
            assert_same(got, new, f"{where}: new commit")
            return "new"
        assert written == old["counts"].frames_written, f"{where}: neither commit"
        assert_committed(got, old, gave_up=scenario.gives_up, where=f"{where}: old commit")
        STATS["given_up"] += old["ids"].size - got["ids"].size
        if not scenario.gives_up:  # the survivor carries on as if nothing happened
            for i in range(scenario.segment):
                step(store, scenario.prefix + i)
            store.flush()
            assert_same(snapshot(store), new, f"{where}: recorded again")
        return "old"


def points_for(n: int) -> list[int]:
    if LONG or n <= 45:
        return list(range(1, n + 1))
    return sorted({*range(1, n + 1, 3), n})


@pytest.mark.parametrize("name", [n for n in SCENARIOS if LONG or n in CI])
def test_sigkill_at_every_fault_point(name: str, tmp_path: Path) -> None:
    scenario = SCENARIOS[name]
    events = count_points(tmp_path / "count", scenario)
    kinds = Counter(kind for kind, _ in events)
    refs = References(scenario, tmp_path)
    ctx = multiprocessing.get_context("fork")
    outcomes: Counter[str] = Counter()
    for k in points_for(len(events)):
        root = tmp_path / f"k{k}"
        prepare(root, scenario)
        child = ctx.Process(target=_child, args=(root, scenario, k))
        child.start()
        child.join(60)
        where = f"{name}: SIGKILL before {events[k - 1]} #{k}/{len(events)}"
        assert child.exitcode == -signal.SIGKILL, f"{where}: exit {child.exitcode}"
        outcomes[check_reopened(root, scenario, refs, where)] += 1
        shutil.rmtree(root)
    assert outcomes["old"] and outcomes["new"], outcomes  # both sides of the commit point
    STATS["trials"] += sum(outcomes.values())
    print(f"\n{name}: {len(events)} fault points {dict(kinds)}; "
          f"{sum(outcomes.values())} kills: {dict(outcomes)}; lost committed transitions 0, "
          f"corrupted frames 0, temp files left 0; given up (allowed) {STATS['given_up']}")


# ----------------------------------------------------------------------------- strace variant

STRACE_SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_fault_points import SCENARIOS, record_segment
record_segment(Path({root!r}), SCENARIOS[{name!r}])
"""


def _ptrace_reason() -> str | None:
    """Why the strace variant cannot run here, or None."""
    strace = shutil.which("strace")
    if strace is None:
        return "strace is not installed"
    probe = subprocess.run([strace, "-f", "-qq", "-o", os.devnull, "true"], capture_output=True,
                           timeout=30, check=False)
    if probe.returncode != 0:
        return f"ptrace not allowed: {probe.stderr.decode(errors='replace').strip()[:120]}"
    return None


def _run_traced(root: Path, name: str, extra: list[str]) -> subprocess.CompletedProcess[Any]:
    script = STRACE_SCRIPT.format(tests=str(Path(__file__).parent), root=str(root), name=name)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(["strace", "-f", "-qq", *extra, sys.executable, "-c", script],
                          capture_output=True, timeout=120, env=env, check=False)


@pytest.mark.parametrize("name", ["durable"])
def test_strace_kills_at_renames(name: str, tmp_path: Path) -> None:
    reason = _ptrace_reason()
    if reason is not None:
        print(f"\nstrace variant skipped: {reason}")
        pytest.skip(reason)
    scenario = SCENARIOS[name]
    refs = References(scenario, tmp_path)
    prepare(tmp_path / "count", scenario)
    log = tmp_path / "trace.txt"
    done = _run_traced(tmp_path / "count", name, ["-e", "trace=rename", "-o", str(log)])
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    per_thread = Counter(line.split()[0] for line in log.read_text().splitlines()
                         if " rename(" in line)
    renames = max(per_thread.values())  # strace counts `when` per thread (tracee)
    ks = range(1, renames + 1) if LONG else sorted({1, renames // 2, renames})
    outcomes: Counter[str] = Counter()
    for k in ks:
        root = tmp_path / f"k{k}"
        prepare(root, scenario)
        run = _run_traced(root, name, ["-o", os.devnull, "-e", "trace=rename",
                                       "-e", f"inject=rename:signal=SIGKILL:when={k}"])
        assert run.returncode != 0, f"rename #{k}: the child was not killed"
        outcomes[check_reopened(root, scenario, refs, f"strace rename #{k}/{renames}")] += 1
    print(f"\nstrace: renames per thread {sorted(per_thread.values())}; "
          f"{sum(outcomes.values())} kills: {dict(outcomes)}")
    assert np.sum(list(outcomes.values())) == len(ks)
