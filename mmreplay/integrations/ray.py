"""Many actors, one store, on Ray: a store actor, actor-side writers, a learner iterator.

::

    env actors (any node)            store actor (the store's node)       learner
    BlockWriter.add(...) --block-->  StoreActor.add_block -> ReplayStore  <--sample-- RemoteBatches
      <= max_in_flight blocks          one data call at a time, flushes   --update_priorities-->
                                       on a schedule, restarts by Ray       (fire and forget)

The store actor owns the one writer of the store. Ray restarts it (``max_restarts``) in a
new process, which reopens the store at its last flush (retrying the writer lock for a
moment while the old process exits). Blocks are never re-sent: a block whose call failed
is dropped, so nothing is ever duplicated, and every writer then starts fresh episodes
(see `mmreplay.integrations.blocks`). Steps in blocks committed by a flush before the
restart are kept. Only this module imports Ray.

With ``mirror=URL`` the store actor mirrors every flush it makes (scheduled, timed or
asked for) into object storage in the background (`mmreplay.mirror`); ``flush(wait_mirror=
True)`` returns once the flush is in the bucket. `start_store_actor` takes the prefix's
writer lease before the actor starts (a second writer is refused there, in the caller)
and hands the actor its writer id, which a restarted actor renews.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import RateLimitTimeoutError, StoreLockedError
from mmreplay.integrations.blocks import (
    BlockAck,
    BlockTaker,
    FlushInfo,
    FlushSchedule,
    FlushTimer,
    StepBlock,
    compress_frames,
    make_block,
    warm_up_kernels,
)
from mmreplay.integrations.ray_learner import RemoteBatches, to_batch
from mmreplay.integrations.ray_support import ACTOR_DIED, BATCH_FIELDS, ray, wait_for_actor
from mmreplay.mirror import MirrorInfo
from mmreplay.rate_limit import RateLimiter
from mmreplay.spec import StoreSpec
from mmreplay.storage.lease import Lease
from mmreplay.storage.manifest import MANIFEST
from mmreplay.storage.objects import open_objects
from mmreplay.store import ReplayStore, StoreCounts


@dataclass(frozen=True)
class ActorInfo:
    """Where the store actor runs and how it started."""

    pid: int
    node_id: str
    incarnation: str
    restarted: bool
    generation: int


def open_or_create(path: str | os.PathLike[str], create: dict[str, Any] | None, *,
                   lock_wait_s: float = 10.0) -> ReplayStore:
    """Open the store at `path` for writing, or create it with `create`'s keywords.

    A lock still held (a dying predecessor) is retried for up to `lock_wait_s` seconds.
    """
    root = Path(path)
    if not (root / MANIFEST).exists():
        if create is None:
            raise FileNotFoundError(f"{root} holds no store and no create arguments were given")
        return ReplayStore.create(root, **create)
    deadline = time.monotonic() + lock_wait_s
    while True:
        try:
            return ReplayStore.open(root)
        except StoreLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class StoreActor:
    """The store's one writer, as a plain Ray actor class (see `start_store_actor`).

    `add_block` calls run one at a time on one thread, learner calls (`sample`,
    `update_priorities`) on another ("learner" group) and `flush` on a third, so a block
    waiting on the rate limiter for samples never holds the samples or a checkpoint up;
    `info`, `counts` and the limiter's switches run in a "stats" group. A `FlushTimer`
    thread flushes `flush_every_s` after the first unflushed step even when no block
    arrives.
    `rate_limiter` is a `RateLimiter.config()` dict (the limiter takes the store's
    committed counters, so a restarted actor keeps the ratio). `mirror` (a URL, with
    `storage_options`, `take_over` and the lease's `writer_id`) mirrors every flush there
    (`ReplayStore.attach_mirror`); a restarted actor never takes a lease over.
    """

    def __init__(self, path: str, create: dict[str, Any] | None = None, *,
                 flush_every_steps: int = 10_000, flush_every_s: float = 30.0,
                 lock_wait_s: float = 10.0, rate_limiter: dict[str, Any] | None = None,
                 mirror: str | None = None, storage_options: dict[str, str] | None = None,
                 take_over: bool = False, writer_id: str | None = None) -> None:
        self.store = open_or_create(path, create, lock_wait_s=lock_wait_s)
        take_over = take_over and not ray.get_runtime_context().was_current_actor_reconstructed
        self.store.attach_mirror(mirror, storage_options, take_over, writer_id=writer_id)
        if rate_limiter is not None:
            self.store.set_rate_limiter(RateLimiter.from_config(rate_limiter))
        self.incarnation = uuid.uuid4().hex
        self.taker = BlockTaker(self.store, incarnation=self.incarnation,
                                schedule=FlushSchedule(flush_every_steps, flush_every_s))
        warm_up_kernels()  # before the first block: the timer's first flush keeps its time
        self.timer = FlushTimer(self.taker)

    def add_block(self, block: StepBlock, timeout_s: float | None = None) -> BlockAck:
        """Apply `block`; with a rate limiter wait at most `timeout_s` (None: its own)."""
        return self.taker.take(block, timeout_s=timeout_s)

    @ray.method(concurrency_group="learner")
    def sample(self, batch_size: int, beta: float = 0.4, compress: bool = True,
               count: int = 1) -> list[dict[str, Any]]:
        """`count` batches as numpy arrays (they cross Ray without pickling tensors); with
        `compress` the stacks travel as lz4 bytes (see `to_batch`)."""
        return [self._sample_one(batch_size, beta, compress) for _ in range(count)]

    def _sample_one(self, batch_size: int, beta: float, compress: bool) -> dict[str, Any]:
        batch = self.store.sample(batch_size, beta)
        out: dict[str, Any] = {name: getattr(batch, name).numpy() for name in BATCH_FIELDS}
        if compress:
            for name in ("obs", "next_obs"):
                out[name] = (compress_frames(out[name]), out[name].shape, out[name].dtype.str)
        return out

    @ray.method(concurrency_group="learner")
    def update_priorities(self, ids: np.ndarray, priorities: np.ndarray) -> int | None:
        return self.store.update_priorities(ids, priorities)

    @ray.method(concurrency_group="flush")
    def flush(self, wait_mirror: bool = False) -> FlushInfo:
        """Commit now; says what was committed (see `BlockAck` for `seq`). Runs in its own
        thread: a block waiting on the rate limiter must not hold a checkpoint up. With a
        mirror and `wait_mirror`, returns once the commit is in the bucket (blocks keep
        arriving meanwhile: the wait holds no lock)."""
        info = self.taker.flush()
        if wait_mirror and self.store.mirror is not None:
            self.store.mirror.wait()
        return info

    @ray.method(concurrency_group="stats")
    def mirror_info(self) -> MirrorInfo | None:
        """Where the mirror stands (`Mirror.info`); None without ``mirror=``."""
        mirror = self.store.mirror
        return None if mirror is None else mirror.info()

    def spec(self) -> StoreSpec:
        return self.store.spec

    @ray.method(concurrency_group="stats")
    def counts(self) -> StoreCounts:
        return self.store.counts

    @ray.method(concurrency_group="stats")
    def flushed(self) -> tuple[str, int]:
        """(incarnation, seq): every block of this process up to `seq` is committed."""
        return self.incarnation, self.taker.flushed_seq

    @ray.method(concurrency_group="stats")
    def take_times(self) -> dict[str, float]:
        """A profile of ingest: where the block writer thread's time went (`TakerTimes`)
        and the CPU seconds of this whole process (Ray's own threads included)."""
        return {**dataclasses.asdict(self.taker.times), "process_cpu_s": time.process_time()}

    @ray.method(concurrency_group="stats")
    def rate_limiter_stats(self) -> dict[str, Any] | None:
        """The rate limiter's `stats()` (None without one)."""
        limiter = self.store.rate_limiter
        return None if limiter is None else limiter.stats()

    @ray.method(concurrency_group="stats")
    def set_rate_limiting(self, enabled: bool) -> None:
        """Switch the rate limiter off (preloading) or back on (see `RateLimiter.enable`)."""
        limiter = self.store.rate_limiter
        if limiter is not None:
            limiter.enable() if enabled else limiter.disable()

    @ray.method(concurrency_group="stats")
    def info(self) -> ActorInfo:
        ctx = ray.get_runtime_context()
        return ActorInfo(pid=os.getpid(), node_id=ctx.get_node_id(),
                         incarnation=self.incarnation,
                         restarted=ctx.was_current_actor_reconstructed,
                         generation=self.store.generation)

    def close(self) -> None:
        self.timer.close()
        self.store.close()


def start_store_actor(path: str | os.PathLike[str], create: dict[str, Any] | None = None, *,
                      flush_every_steps: int = 10_000, flush_every_s: float = 30.0,
                      max_restarts: int = -1, node_id: str | None = None,
                      name: str | None = None, rate_limiter: RateLimiter | None = None,
                      mirror: str | None = None, storage_options: dict[str, str] | None = None,
                      take_over: bool = False) -> Any:
    """Start a `StoreActor` pinned to `node_id` (default: this process's node, whose disk
    holds `path`); ``num_cpus=0`` so it takes no CPU slot from env actors. The actor
    builds its own copy of `rate_limiter` (its parameters travel, not the object).

    `mirror` (a URL) mirrors every flush of the actor there. The prefix's writer lease is
    taken here first (`StoreLockedError` here if another writer holds it, unless
    `take_over`), for a writer id the actor and its restarts then renew. The actor reads
    credentials from the AWS variables of its node; `storage_options` travel with the
    actor's arguments (docs/guides/ray.md).
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    writer_id = None
    if mirror is not None:
        writer_id = uuid.uuid4().hex
        Lease(open_objects(mirror, storage_options), writer_id=writer_id).acquire(
            take_over=take_over)
    node = node_id or ray.get_runtime_context().get_node_id()
    cls = ray.remote(concurrency_groups={"stats": 1, "learner": 1, "flush": 1})(  # type: ignore[call-overload]
        StoreActor)
    return cls.options(
        num_cpus=0, max_restarts=max_restarts, max_task_retries=0, name=name,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(str(Path(path).resolve()), create, flush_every_steps=flush_every_steps,
             flush_every_s=flush_every_s,
             rate_limiter=None if rate_limiter is None else rate_limiter.config(),
             mirror=mirror, storage_options=storage_options, writer_id=writer_id)


@dataclass
class WriterStats:
    """What a `BlockWriter` has sent and what came back."""

    blocks_sent: int = 0
    steps_sent: int = 0
    steps_acked: int = 0
    bytes_sent: int = 0
    blocks_failed: int = 0  # refused after a store restart, or lost with the store process
    blocks_timed_out: int = 0  # of those: refused after waiting on the rate limiter
    resyncs: int = 0  # times the writer started fresh episodes
    wait_s: float = 0.0  # time spent blocked on max_in_flight (backpressure, rate limiter)
    steps_committed: int = 0  # acknowledged steps known to be committed by a flush


class BlockWriter:
    """Buffers the steps of a vector env's E envs and sends them to a store actor in blocks.

    Mirrors the store's recording API for the envs it owns (`env_ids`):
    `reset(obs)` once, then `add(...)` per step with gymnasium's next-step `autoreset`.
    At most `max_in_flight` blocks wait for an answer; the next send blocks until the
    oldest is answered (backpressure: memory stays bounded). A block whose call fails or
    is refused is not sent again; the next block starts fresh episodes from the last
    frames sent (the store ends the interrupted ones as truncated). Frames travel
    zstd-compressed (level 1) by default: 2.8-5.3x fewer bytes than lz4 for about the same
    CPU on real Atari frames (docs/compression.md), and faster than raw blocks even on one
    machine (``scripts/bench/bench_ray.py``).

    With a rate limiter in the store a block waits there for the learner, at most
    `insert_timeout_s` (None: the limiter's own timeout); a block that timed out is
    dropped like a refused one (fresh episodes follow) and the send that learns it
    raises `RateLimitTimeoutError`. `committed_steps()` says how many acknowledged
    steps a flush has committed.
    """

    def __init__(self, actor: Any, env_ids: Any, *, block_steps: int = 64,
                 max_in_flight: int = 2, compress: bool = True, spec: StoreSpec | None = None,
                 on_ack: Any = None, max_failures: int = 1000,
                 restart_wait_s: float = 60.0, insert_timeout_s: float | None = None) -> None:
        if block_steps < 1 or max_in_flight < 1:
            raise ValueError(f"block_steps and max_in_flight must be >= 1, got "
                             f"{block_steps}, {max_in_flight}")
        self.actor = actor
        self.env_ids = np.asarray(env_ids, np.int64).reshape(-1)
        self.spec = spec if spec is not None else ray.get(actor.spec.remote())
        self.block_steps, self.max_in_flight, self.compress = block_steps, max_in_flight, compress
        self.stats = WriterStats()
        self._on_ack, self._max_failures, self._failures_in_row = on_ack, max_failures, 0
        self.restart_wait_s, self.insert_timeout_s = restart_wait_s, insert_timeout_s
        self._acked: deque[tuple[str, int, int]] = deque()  # (incarnation, seq, steps)
        self._flushed: tuple[str, int] = ("", 0)  # the newest (incarnation, flushed_seq)
        self._stream, self._resync = 0, False
        self._timeout: RateLimitTimeoutError | None = None  # raised after the send
        self._prev_frames: np.ndarray | None = None
        self._in_flight: deque[tuple[Any, int, StepBlock]] = deque()
        self._new_buffer()

    def _new_buffer(self) -> None:
        """Row 0 is kept for a reset row after a failure; rows 1.. hold the steps."""
        rows, spec = (self.block_steps + 1, self.env_ids.size), self.spec
        self._buf = {
            "action": np.zeros((*rows, *spec.action_shape), spec.action_dtype),
            "reward": np.zeros(rows, np.float32),
            "frames": np.empty((*rows, *spec.obs_shape), spec.obs_dtype),
            "terminated": np.zeros(rows, bool), "truncated": np.zeros(rows, bool),
            "autoreset": np.zeros(rows, bool), "priorities": np.ones(rows, np.float64),
        }
        self._fill, self._with_priorities = 0, False

    def reset(self, obs: Any) -> None:
        """o_0 of new episodes in every env of this writer."""
        self._row(action=0, reward=0.0, frames=obs, terminated=False, truncated=False,
                  autoreset=True)

    def add(self, action: Any, reward: Any, next_obs: Any, terminated: Any, truncated: Any,
            autoreset: Any = None, priorities: Any = None) -> None:
        """One step of every env of this writer (as ``ReplayStore.add``); optional
        initial `priorities` (one per env, e.g. |TD error| computed by the actor)."""
        self._row(action=action, reward=reward, frames=next_obs, terminated=terminated,
                  truncated=truncated, autoreset=False if autoreset is None else autoreset,
                  priorities=priorities)

    def _row(self, *, priorities: Any = None, **values: Any) -> None:
        self._fill += 1
        for name, value in values.items():
            self._buf[name][self._fill] = value
        if priorities is not None:
            self._buf["priorities"][self._fill] = priorities
            self._with_priorities = True
        if self._fill == self.block_steps:
            self._send()

    def _send(self) -> None:
        self._wait_until(self.max_in_flight - 1)  # first: an answer may ask for a resync
        first = 1
        if self._resync and self._prev_frames is not None:
            first = 0
            self._buf["frames"][0] = self._prev_frames
            self._buf["autoreset"][0] = True
        rows = slice(first, self._fill + 1)
        buf = {k: v[rows] for k, v in self._buf.items()}
        prios = buf.pop("priorities")
        block = make_block(env_ids=self.env_ids, stream=self._stream, compress=self.compress,
                           priorities=prios if self._with_priorities else None, **buf)
        self._resync = False
        self._prev_frames = self._buf["frames"][self._fill].copy()
        self._new_buffer()
        self._in_flight.append((self.actor.add_block.remote(block, self.insert_timeout_s),
                                block.stream, block))
        self.stats.blocks_sent += 1
        self.stats.steps_sent += block.steps
        self.stats.bytes_sent += block.nbytes
        self._raise_timeout()

    def _raise_timeout(self) -> None:
        """Raise the rate limiter timeout an answer reported, once."""
        error, self._timeout = self._timeout, None
        if error is not None:
            raise error

    def _wait_until(self, at_most: int) -> None:
        start = time.perf_counter()
        while len(self._in_flight) > at_most:
            self._settle(*self._in_flight.popleft())
        self.stats.wait_s += time.perf_counter() - start

    def _settle(self, ref: Any, stream: int, block: StepBlock) -> None:
        try:
            ack: BlockAck | None = ray.get(ref)
        except ACTOR_DIED:
            ack = None
            wait_for_actor(self.actor, self.restart_wait_s)  # hold steps, do not drop them
        if ack is not None and ack.accepted:
            self.stats.steps_acked += block.steps
            self._failures_in_row = 0
            self._acked.append((ack.incarnation, ack.seq, block.steps))
            self._learn_flushed(ack.incarnation, ack.flushed_seq)
        else:
            self.stats.blocks_failed += 1
            self._failures_in_row += 1
            if stream == self._stream:  # the first failure of this stream: start afresh
                self._stream += 1
                self._resync = True
                self.stats.resyncs += 1
            if self._failures_in_row > self._max_failures:
                raise RuntimeError(f"the store actor failed {self._failures_in_row} blocks "
                                   f"in a row; giving up")
        if self._on_ack is not None:
            self._on_ack(ack, block)
        if ack is not None and ack.timed_out:
            self.stats.blocks_timed_out += 1
            self._timeout = RateLimitTimeoutError(
                f"a block of {block.steps} steps waited longer than the store's rate limiter "
                f"allows (insert_timeout_s={self.insert_timeout_s}); it was dropped and the "
                f"next block starts fresh episodes")

    def _learn_flushed(self, incarnation: str, flushed_seq: int) -> None:
        """Count acknowledged blocks that a flush of their store process has committed."""
        if incarnation == self._flushed[0]:
            flushed_seq = max(flushed_seq, self._flushed[1])
        self._flushed = (incarnation, flushed_seq)
        while self._acked and self._acked[0][0] != incarnation:
            self._acked.popleft()  # an earlier process: whether its last flush had them is unknown
        while self._acked and self._acked[0][1] <= flushed_seq:
            self.stats.steps_committed += self._acked.popleft()[2]

    def committed_steps(self) -> int:
        """Acknowledged steps of this writer known to be committed, after asking the store
        actor what it has flushed (its timer flushes while the writer is idle)."""
        try:
            self._learn_flushed(*ray.get(self.actor.flushed.remote()))
        except ACTOR_DIED:
            pass  # a restarted process has flushed nothing of ours yet
        return self.stats.steps_committed

    def drain(self) -> None:
        """Send the rows buffered so far and wait until every block is answered."""
        if self._fill:
            self._send()
        self._wait_until(0)
        self._raise_timeout()


__all__ = ["ActorInfo", "BlockWriter", "RemoteBatches", "StoreActor", "WriterStats",
           "open_or_create", "start_store_actor", "to_batch", "wait_for_actor"]
