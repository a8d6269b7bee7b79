"""A deterministic recording stream, and the writer process that `test_crash.py` kills.

`Stream` turns a `StreamConfig` into an endless, reproducible list of ops. Every op writes at
least one frame, so a store's ``counts.frames_written`` names the op it stopped after::

    op i:   reset(some envs) | add(every env; autoreset where ended)   [+ sample(8)]  [+ flush]

Frames are 16x16 uint8. Row 0 starts with ``env + 1`` and the env's frame number (8 bytes,
little-endian); the rest is a pattern of both, so a frame read from the wrong slot or env never
compares equal, and a test can read back where a frame came from.

`run_writer` is the body of the child process: open the store, skip the stream to the store's
position, then record and flush until killed. Its side file gets, per flush, a line
``flushing <ops> <rng state>`` as the flush begins and ``flushed <ops> <generation>`` (fsynced)
once it returns. With ``crash_at`` it kills itself with SIGKILL just before or after the n-th
``os.replace`` onto a chosen kind of file (which may run on the store's chunk-writer thread).
"""

from __future__ import annotations

import bisect
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay import ReplayStore

OBS_SHAPE = (16, 16)
SAMPLE_BATCH = 8


@dataclass(frozen=True)
class StreamConfig:
    """A store spec plus the odds of each event; `seed` fixes the whole stream."""

    capacity: int
    num_envs: int = 1
    frame_stack: int = 4
    n_step: int = 3
    chunk_frames: int = 4
    block_slots: int = 16
    stack_padding: str = "zero"
    gamma: float = 0.9
    max_flush_gap: int = 6  # ops between flushes: uniform in 1..max_flush_gap
    p_terminate: float = 0.05
    p_truncate: float = 0.02
    p_reset: float = 0.03  # an op resets some envs (cutting running episodes)
    p_cut: float = 0.01  # a running env is autoreset by an add, cutting its episode
    p_sample: float = 0.2  # an op ends with sample(8), which advances the store's RNG
    seed: int = 0

    @property
    def slots_per_env(self) -> int:
        return self.capacity // self.num_envs

    def store_kwargs(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity, "obs_shape": OBS_SHAPE, "num_envs": self.num_envs,
            "frame_stack": self.frame_stack, "n_step": self.n_step, "gamma": self.gamma,
            "stack_padding": self.stack_padding, "chunk_frames": self.chunk_frames,
            "block_slots": self.block_slots, "seed": self.seed,
        }


def make_frame(env: int, number: int) -> np.ndarray:
    """Frame `number` of `env`; see the module docstring for the encoding."""
    pattern = (np.arange(256, dtype=np.int64) * 7 + number * 31 + env * 101) % 251
    frame = pattern.astype(np.uint8).reshape(OBS_SHAPE)
    frame[0, 0] = env + 1
    frame[0, 1:9] = np.frombuffer(int(number).to_bytes(8, "little"), np.uint8)
    return frame


@dataclass(frozen=True)
class Op:
    """One recording call (``kind`` is "reset" or "add"), then maybe a sample and a flush."""

    kind: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    sample: bool
    flush: bool

    def apply(self, store: ReplayStore) -> None:
        """Record this op (not its flush: callers decide whether they persist)."""
        getattr(store, self.kind)(*self.args, **self.kwargs)
        if self.sample and len(store) > 0:
            store.sample(SAMPLE_BATCH)


class Stream:
    """The ops of one `StreamConfig`, generated lazily, with what each one leaves behind.

    Position ``i`` means "after ops ``0..i-1``". For every transition id the stream also
    knows its env, its frame number ``t`` and the oldest real frame its stack reads
    (``lower = max(t - frame_stack + 1, episode start)``).
    """

    def __init__(self, config: StreamConfig) -> None:
        self.config = config
        self.ops: list[Op] = []
        self.frames: list[np.ndarray] = [np.zeros(config.num_envs, np.int64)]  # per position
        self.totals: list[int] = [0]
        self.id_env: list[int] = []
        self.id_frame: list[int] = []
        self.id_lower: list[int] = []
        self._rng = np.random.default_rng([config.seed, 0x5EED])
        self._written = np.zeros(config.num_envs, np.int64)
        self._start = np.zeros(config.num_envs, np.int64)
        self._running = np.zeros(config.num_envs, bool)
        self._until_flush = self._flush_gap()

    # -- positions ------------------------------------------------------------------
    def op(self, i: int) -> Op:
        while len(self.ops) <= i:
            self._generate()
        return self.ops[i]

    def frames_at(self, position: int) -> np.ndarray:
        """Frames written per env at `position`."""
        if position > 0:
            self.op(position - 1)
        return self.frames[position]

    def position_of(self, frames_written: int) -> int:
        """The position at which `frames_written` frames (all envs) had been written."""
        while self.totals[-1] < frames_written:
            self._generate()
        position = bisect.bisect_left(self.totals, frames_written)
        if self.totals[position] != frames_written:
            raise AssertionError(f"{frames_written} frames is not an op boundary of the stream")
        return position

    def next_flush(self, position: int) -> int:
        """The first position after `position` at which the stream flushes."""
        i = position
        while not self.op(i).flush:
            i += 1
        return i + 1

    def id_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(env, frame, lower) of every transition id generated so far, indexed by id."""
        return (np.asarray(self.id_env, np.int64), np.asarray(self.id_frame, np.int64),
                np.asarray(self.id_lower, np.int64))

    # -- generation -----------------------------------------------------------------
    def _flush_gap(self) -> int:
        return int(self._rng.integers(1, self.config.max_flush_gap + 1))

    def _generate(self) -> None:
        rng = self._rng
        if rng.random() < self.config.p_reset:
            kind, args, kwargs = self._reset()
        else:
            kind, args, kwargs = self._add()
        sample = bool(rng.random() < self.config.p_sample)
        self._until_flush -= 1
        flush = self._until_flush == 0
        if flush:
            self._until_flush = self._flush_gap()
        self.ops.append(Op(kind, args, kwargs, sample, flush))
        self.frames.append(self._written.copy())
        self.totals.append(int(self._written.sum()))

    def _reset(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        n, rng = self.config.num_envs, self._rng
        if n == 1 or rng.random() < 0.3:
            frames = [self._begin(e) for e in range(n)]
            return "reset", (frames[0] if n == 1 else np.stack(frames),), {}
        size = int(rng.integers(1, n + 1))
        envs = np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)
        frames = [self._begin(int(e)) for e in envs]
        return "reset", (np.stack(frames),), {"env_ids": envs}

    def _add(self) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
        c, rng, n = self.config, self._rng, self.config.num_envs
        auto = ~self._running | (rng.random(n) < c.p_cut)
        action = rng.integers(0, 6, size=n).astype(np.int64)
        reward = rng.integers(-4, 5, size=n) * 0.25
        terminated = rng.random(n) < c.p_terminate
        truncated = rng.random(n) < c.p_truncate
        frames = [self._begin(e) if auto[e] else self._step(e, terminated[e] or truncated[e])
                  for e in range(n)]
        if n == 1:
            args = (int(action[0]), float(reward[0]), frames[0], bool(terminated[0]),
                    bool(truncated[0]))
            return "add", args, {"autoreset": bool(auto[0])}
        return "add", (action, reward, np.stack(frames), terminated, truncated), {
            "autoreset": auto}

    def _begin(self, env: int) -> np.ndarray:
        self._start[env] = self._written[env]
        self._running[env] = True
        return self._frame(env)

    def _step(self, env: int, ends: bool) -> np.ndarray:
        t = int(self._written[env]) - 1
        self.id_env.append(env)
        self.id_frame.append(t)
        self.id_lower.append(max(t - self.config.frame_stack + 1, int(self._start[env])))
        self._running[env] = not ends
        return self._frame(env)

    def _frame(self, env: int) -> np.ndarray:
        frame = make_frame(env, int(self._written[env]))
        self._written[env] += 1
        return frame


# ----------------------------------------------------------------------------- the writer


def run_writer(config: StreamConfig, root: str, side: str,
               crash_at: tuple[str, int, bool] | None = None, max_ops: int = 50_000,
               max_seconds: float = 60.0) -> None:
    """Record `config`'s stream into the store at `root` from where it stands, until killed.

    Exits (with status 0, without flushing: like a crash at a quiet point) after `max_ops`
    ops or `max_seconds`, so an orphaned writer cannot run forever.
    """
    if crash_at is not None:
        _install_crash(*crash_at)
    store = ReplayStore.open(root)
    stream = Stream(config)
    position = stream.position_of(store.counts.frames_written)
    _record_rng(side, position, store)
    _record(side, position, store.generation)
    deadline = time.monotonic() + max_seconds
    for i in range(position, position + max_ops):
        op = stream.op(i)
        op.apply(store)
        if op.flush:
            _record_rng(side, i + 1, store)
            store.flush()
            _record(side, i + 1, store.generation)
        if time.monotonic() > deadline:
            break
    os._exit(0)


def read_side(side: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """The (position, generation) pairs a writer recorded after each flush returned."""
    return [(int(a), int(b)) for kind, a, b in _side_lines(side) if kind == "flushed"]


def read_rng_states(side: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Position -> the store's RNG state as a flush at that position began (what it commits)."""
    states = {}
    for kind, a, b in _side_lines(side):
        if kind != "flushing":
            continue
        try:  # a fragment of a line from an older writer would not parse: skip it
            states[int(a)] = json.loads(b)
        except ValueError:
            continue
    return states


def _side_lines(side: str | os.PathLike[str]) -> list[list[str]]:
    text = Path(side).read_text() if Path(side).exists() else ""
    return [line.split(" ", 2) for line in text.splitlines() if line.endswith("\t")]


def _record(side: str, position: int, generation: int) -> None:
    _append(side, f"flushed {position} {generation}\t\n", sync=True)


def _record_rng(side: str, position: int, store: ReplayStore) -> None:
    """No fsync: only a power cut, not SIGKILL, loses what `write` handed the kernel."""
    state = json.dumps(store._batches.rng.bit_generator.state, separators=(",", ":"))
    _append(side, f"flushing {position} {state}\t\n", sync=False)


def _append(side: str, line: str, *, sync: bool) -> None:
    """One write(2) on an O_APPEND descriptor: a line is never split by a kill."""
    fd = os.open(side, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _install_crash(target: str, nth: int, after: bool) -> None:
    """SIGKILL this process at the `nth` os.replace onto a `target` file (before or after)."""
    real_replace = os.replace
    seen = 0

    def replace(src: Any, dst: Any) -> None:
        nonlocal seen
        hit = False
        if _is_target(target, Path(dst)):
            seen += 1
            hit = seen == nth
        if hit and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)
        if hit and after:
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace  # type: ignore[assignment]


def _is_target(target: str, dst: Path) -> bool:
    if target == "manifest":
        return dst.name == "manifest.json"
    if target == "chunk":
        return "frames" in dst.parts
    if target == "npy":
        return dst.suffix == ".npy"
    return True


def abandon(store: ReplayStore) -> None:
    """Drop a writable store the way process death would: no flush, just release the lock.

    Chunk writes already queued on the store's background thread are let finish first (a
    death just after they landed), so no thread of the dead store races the next open.
    """
    store._frames.close()
    if store._lock_fd is not None:
        os.close(store._lock_fd)
        store._lock_fd = None
    store._closed = True
