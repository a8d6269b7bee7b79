"""I/O errors fail loudly and lose nothing.

An in-process fault layer counts every low-level write operation mmreplay makes (``open``
for writing, ``write``, ``os.fsync``, ``os.replace``, ``os.unlink``), on the main thread and on
the chunk-writer thread alike, and makes the k-th one raise ``OSError(ENOSPC)`` or
``OSError(EIO)``. One *segment* (some steps recorded after a flush, then a flush) is run with a
fault at every k = 1..N, N counted by a fault-free run. For each k:

* the error reaches the caller: the flush raises, or the ``add`` whose chunk write (or
  give-up commit) failed raises (recording then stops and the segment flushes);
* ``store.generation`` is the generation of ``manifest.json`` on disk, and a flush that raised
  before its manifest's rename did not advance it;
* *recover*: with the fault gone, a new flush succeeds and the store, live and reopened, is
  bit-identical to a fault-free reference fed the same steps with the same flushes;
* *abandon*: dropped like a dead process instead and reopened, the store is exactly the
  committed state (the previous one, or the new one if the error hit after the rename), and the
  writable open leaves no temp file.
"""

from __future__ import annotations

import builtins
import errno
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import numbered_frame

import mmreplay.storage.chunk_writer
import mmreplay.storage.safe_io
from mmreplay import ReplayStore
from mmreplay.storage.manifest import read_manifest

LONG = os.environ.get("MMREPLAY_LONG") == "1"
OBS = (8, 8)
FIELDS = ("obs", "next_obs", "action", "reward", "discount", "terminated", "truncated", "ids")
STATS: dict[str, int] = {}


# ----------------------------------------------------------------------------- the stream


@dataclass(frozen=True)
class Scenario:
    """`prefix` steps and a flush, then the segment under test: `segment` steps and a flush."""

    prefix: int
    segment: int
    sampler: str = "uniform"
    durable: bool = False

    @property
    def gives_up(self) -> bool:
        """Whether the segment wraps the 64-slot ring (and so commits give-ups)."""
        return self.prefix + self.segment > 64

    def store_kwargs(self) -> dict[str, Any]:
        return {"capacity": 64, "obs_shape": OBS, "chunk_frames": 4, "frame_stack": 4,
                "n_step": 3, "gamma": 0.9, "block_slots": 16, "sampler": self.sampler,
                "seed": 7, "durable": self.durable}


SCENARIOS = {
    "uniform": Scenario(prefix=10, segment=14),
    "prioritized": Scenario(prefix=10, segment=14, sampler="prioritized"),
    "durable": Scenario(prefix=10, segment=14, durable=True),
    # 70 steps without a flush on a 64-slot ring: every chunk write first commits a give-up
    "give_up": Scenario(prefix=10, segment=70),
    "give_up_prioritized_durable": Scenario(prefix=6, segment=66, sampler="prioritized",
                                            durable=True),
}


def step(store: ReplayStore, t: int) -> None:
    """Record step `t` of a fixed stream (episodes of 5-11 steps); prioritized stores also get
    new priorities for the newest ids every 3 steps."""
    ends = t % 11 == 10 or t % 7 == 6
    store.add(t % 4, (t % 5) * 0.5, numbered_frame(t, OBS), ends and t % 2 == 0,
              ends and t % 2 == 1, autoreset=t == 0 or (t - 1) % 11 == 10 or (t - 1) % 7 == 6)
    if store.spec.sampler == "prioritized" and t % 3 == 2:
        ids = store.valid_ids()[-3:]
        store.update_priorities(ids, 0.5 + (ids % 5))


def snapshot(store: ReplayStore) -> dict[str, Any]:
    ids = store.valid_ids()
    out: dict[str, Any] = {"counts": store.counts, "ids": ids}
    if ids.size:
        batch = store.get(ids)
        out.update({name: getattr(batch, name).numpy() for name in FIELDS})
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert got["counts"] == want["counts"], where
    np.testing.assert_array_equal(got["ids"], want["ids"], err_msg=where)
    for name in FIELDS:
        if name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{where}: {name}")


def abandon(store: ReplayStore) -> None:
    """Drop a writable store as process death would: no flush, just release the lock."""
    try:
        os.close(store._lock_fd)
    except (OSError, TypeError):
        pass
    store._lock_fd = None
    store._closed = True
    try:
        store._frames.close()
    except OSError:
        pass  # a chunk write that fails again: as if the process died before it


def temp_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tmp").iterdir())


class References:
    """Fault-free stores of a scenario, flushed after the prefix and after `n` segment steps."""

    def __init__(self, scenario: Scenario, root: Path) -> None:
        self.scenario, self.root, self.cache = scenario, root, {}

    def after(self, n: int) -> dict[str, Any]:
        if n not in self.cache:
            s = self.scenario
            with ReplayStore.create(self.root / f"ref{n}", **s.store_kwargs()) as store:
                for t in range(s.prefix):
                    step(store, t)
                store.flush()
                for t in range(s.prefix, s.prefix + n):
                    step(store, t)
                store.flush()
                self.cache[n] = snapshot(store)
        return self.cache[n]


# ----------------------------------------------------------------------------- the fault layer


class _File:
    """A file opened for writing whose ``write`` calls go through the fault layer."""

    def __init__(self, f: Any, layer: FaultLayer) -> None:
        self._f, self._layer = f, layer

    def write(self, data: Any) -> int:
        self._layer.tick("write", "")
        return int(self._f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.__exit__(*exc)


class FaultLayer:
    """Counts mmreplay's write operations while armed and fails the `fail_at`-th one.

    ``events`` lists (kind, target name) of every counted call, in order (calls on the
    chunk-writer thread included; the lock makes the numbering consistent).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, fail_at: int = 0,
                 code: int = errno.ENOSPC, kill: bool = False) -> None:
        self.fail_at, self.code, self.kill = fail_at, code, kill
        self.armed = False
        self.events: list[tuple[str, str]] = []
        self.fault: tuple[str, str] | None = None
        self._lock = threading.Lock()
        real_open, real_fsync = builtins.open, os.fsync
        real_replace, real_unlink = os.replace, os.unlink

        def fault_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            self.tick("open", os.fspath(file))
            f = real_open(file, mode, *args, **kwargs)
            return _File(f, self) if "w" in mode else f

        def fsync(fd: int) -> None:
            self.tick("fsync", "")
            real_fsync(fd)

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            self.tick("replace", Path(dst).name)
            real_replace(src, dst, **kwargs)

        def unlink(path: Any, **kwargs: Any) -> None:
            self.tick("unlink", Path(path).name)
            real_unlink(path, **kwargs)

        for module in (mmreplay.storage.safe_io, mmreplay.storage.chunk_writer):
            monkeypatch.setattr(module, "open", fault_open, raising=False)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "unlink", unlink)

    def tick(self, kind: str, target: str) -> None:
        if not self.armed:
            return
        with self._lock:
            self.events.append((kind, target))
            if len(self.events) != self.fail_at:
                return
            self.fault = (kind, target)
        if self.kill:  # a process death just before this call (any thread)
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(self.code, f"injected {os.strerror(self.code)} at {kind} #{self.fail_at}")

    def manifest_renamed_before_fault(self, since: int) -> bool:
        """Whether a ``manifest.json`` rename at or after event index `since` preceded the fault."""
        done = self.events[since:self.fail_at - 1]
        return ("replace", "manifest.json") in done


@dataclass
class Outcome:
    raised: list[str]  # "add" and/or "flush"
    recorded: int  # segment steps recorded (an add that raised still recorded its step)
    flush_start: int  # index of the flush's first event
    generation_before_flush: int


def run_segment(store: ReplayStore, scenario: Scenario, layer: FaultLayer) -> Outcome:
    raised: list[str] = []
    recorded = scenario.segment
    layer.armed = True
    try:
        for i in range(scenario.segment):
            try:
                step(store, scenario.prefix + i)
            except OSError:
                raised.append("add")
                recorded = i + 1
                break
        flush_start, before = len(layer.events), store.generation
        try:
            store.flush()
        except OSError:
            raised.append("flush")
    finally:
        layer.armed = False
    return Outcome(raised, recorded, flush_start, before)


def start(root: Path, scenario: Scenario) -> ReplayStore:
    store = ReplayStore.create(root, **scenario.store_kwargs())
    for t in range(scenario.prefix):
        step(store, t)
    store.flush()
    return store


def count_fault_points(tmp_path: Path, scenario: Scenario,
                       monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    layer = FaultLayer(monkeypatch)
    store = start(tmp_path / "count", scenario)
    outcome = run_segment(store, scenario, layer)
    store.close()
    assert outcome.raised == []
    return layer.events


# ----------------------------------------------------------------------------- the tests


def check_fault(tmp_path: Path, scenario: Scenario, refs: References, k: int, code: int,
                mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / f"{mode}{k}.{code}"
    layer = FaultLayer(monkeypatch, fail_at=k, code=code)
    store = start(root, scenario)
    committed = store.generation
    outcome = run_segment(store, scenario, layer)
    where = f"fault {layer.fault} #{k} ({errno.errorcode[code]}, {mode}): {outcome}"
    # (a) loud: the error reached the caller
    assert outcome.raised, f"{where}: no call raised"
    assert layer.fault is not None
    # (b) the in-memory generation is the one on disk; a failed flush advanced it only if its
    # manifest had already been renamed into place
    on_disk = read_manifest(root)["generation"]
    assert store.generation == on_disk, where
    # A flush may commit a give-up manifest before it writes a shard file, so a manifest
    # renamed before the fault is the flush's own only if it holds every recorded frame.
    written = sum(read_manifest(root)["written"])
    landed = "flush" not in outcome.raised or (
        layer.manifest_renamed_before_fault(outcome.flush_start)
        and written == refs.after(outcome.recorded)["counts"].frames_written)
    if "flush" in outcome.raised:
        assert store.generation >= outcome.generation_before_flush + landed, where
    assert store.generation >= committed, where
    if mode == "recover":  # (c)
        store.flush()
        want = refs.after(outcome.recorded)
        assert_same(snapshot(store), want, f"{where}: live")
        store.close()
        with ReplayStore.open(root) as again:
            assert temp_files(root) == [], where
            assert_same(snapshot(again), want, f"{where}: reopened")
        return
    # (d) a crash instead: the committed state, nothing else
    abandon(store)
    with ReplayStore.open(root) as again:
        assert temp_files(root) == [], where
        got = snapshot(again)
    want = refs.after(outcome.recorded if landed else 0)
    assert got["counts"].frames_written == want["counts"].frames_written, where
    assert_committed(got, want, gave_up=scenario.gives_up and not landed, where=where)


def assert_committed(got: dict[str, Any], want: dict[str, Any], *, gave_up: bool,
                     where: str) -> None:
    """`got` is the committed state `want`; with `gave_up`, a give-up commit may have dropped
    old transitions since: then `got` holds a subset of them, bit-identical."""
    if not gave_up:
        assert_same(got, want, where)
        return
    assert got["counts"].transitions == want["counts"].transitions, where
    assert got["counts"].frames_written == want["counts"].frames_written, where
    keep = np.isin(want["ids"], got["ids"])
    assert keep.sum() == got["ids"].size, f"{where}: ids the reference never had"
    for name in FIELDS:
        if name in got:
            np.testing.assert_array_equal(got[name], want[name][keep], err_msg=where)


@pytest.mark.integration  # a loop over every write fault
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_write_fault_is_loud_and_loses_nothing(name: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = SCENARIOS[name]
    events = count_fault_points(tmp_path, scenario, monkeypatch)
    kinds = {kind: sum(1 for e in events if e[0] == kind) for kind, _ in events}
    print(f"\n{name}: {len(events)} fault points in one segment {kinds}")
    assert len(events) > 0
    refs = References(scenario, tmp_path)
    points = range(1, len(events) + 1)
    if not LONG and len(events) > 40:  # give-up segments: a stride, both ends included
        stride = 3 if len(events) <= 100 else 5
        points = sorted({*range(1, len(events) + 1, stride), len(events)})
    trials = 0
    for k in points:
        for code, mode in ((errno.ENOSPC, "recover"), (errno.EIO, "abandon")):
            check_fault(tmp_path, scenario, refs, k, code, mode, monkeypatch)
            trials += 1
            if LONG:
                other = errno.EIO if code == errno.ENOSPC else errno.ENOSPC
                check_fault(tmp_path, scenario, refs, k, other, mode, monkeypatch)
                trials += 1
    STATS[name] = trials
    print(f"{name}: {trials} faulted runs passed")


def test_fault_layer_sees_the_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer is wired to what mmreplay calls: a flush alone opens, writes and renames."""
    scenario = Scenario(prefix=5, segment=0)
    events = count_fault_points(tmp_path, scenario, monkeypatch)
    kinds = [kind for kind, _ in events]
    assert {"open", "write", "replace"} <= set(kinds)
    assert ("replace", "manifest.json") in events
    durable = count_fault_points(tmp_path / "d", Scenario(prefix=5, segment=0, durable=True),
                                 monkeypatch)
    assert "fsync" in {kind for kind, _ in durable}
    print(f"\nplain flush: {len(events)} fault points, durable flush: {len(durable)}")
