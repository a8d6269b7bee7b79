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
"""

from __future__ import annotations

import os
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import StoreLockedError
from mmreplay.integrations.blocks import (
    BlockAck,
    BlockTaker,
    FlushInfo,
    FlushSchedule,
    StepBlock,
    compress_frames,
    make_block,
)
from mmreplay.integrations.ray_learner import RemoteBatches, to_batch
from mmreplay.integrations.ray_support import ACTOR_DIED, BATCH_FIELDS, ray, wait_for_actor
from mmreplay.spec import StoreSpec
from mmreplay.storage.manifest import MANIFEST
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

    Data calls (`add_block`, `sample`, `update_priorities`, `flush`) run one at a time
    on the actor's thread; `info` and `counts` run in a separate "stats" group.
    """

    def __init__(self, path: str, create: dict[str, Any] | None = None, *,
                 flush_every_steps: int = 10_000, flush_every_s: float = 30.0,
                 lock_wait_s: float = 10.0) -> None:
        self.store = open_or_create(path, create, lock_wait_s=lock_wait_s)
        self.incarnation = uuid.uuid4().hex
        self.taker = BlockTaker(self.store, incarnation=self.incarnation,
                                schedule=FlushSchedule(flush_every_steps, flush_every_s))

    def add_block(self, block: StepBlock) -> BlockAck:
        return self.taker.take(block)

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

    def update_priorities(self, ids: np.ndarray, priorities: np.ndarray) -> int:
        return self.store.update_priorities(ids, priorities)

    def flush(self) -> FlushInfo:
        """Commit now; says what was committed (see `BlockAck` for `seq`)."""
        return self.taker.flush()

    def spec(self) -> StoreSpec:
        return self.store.spec

    @ray.method(concurrency_group="stats")
    def counts(self) -> StoreCounts:
        return self.store.counts

    @ray.method(concurrency_group="stats")
    def info(self) -> ActorInfo:
        ctx = ray.get_runtime_context()
        return ActorInfo(pid=os.getpid(), node_id=ctx.get_node_id(),
                         incarnation=self.incarnation,
                         restarted=ctx.was_current_actor_reconstructed,
                         generation=self.store.generation)

    def close(self) -> None:
        self.store.close()


def start_store_actor(path: str | os.PathLike[str], create: dict[str, Any] | None = None, *,
                      flush_every_steps: int = 10_000, flush_every_s: float = 30.0,
                      max_restarts: int = -1, node_id: str | None = None,
                      name: str | None = None) -> Any:
    """Start a `StoreActor` pinned to `node_id` (default: this process's node, whose disk
    holds `path`); ``num_cpus=0`` so it takes no CPU slot from env actors."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_id or ray.get_runtime_context().get_node_id()
    cls = ray.remote(concurrency_groups={"stats": 1})(StoreActor)  # type: ignore[call-overload]
    return cls.options(
        num_cpus=0, max_restarts=max_restarts, max_task_retries=0, name=name,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(str(Path(path).resolve()), create, flush_every_steps=flush_every_steps,
             flush_every_s=flush_every_s)


@dataclass
class WriterStats:
    """What a `BlockWriter` has sent and what came back."""

    blocks_sent: int = 0
    steps_sent: int = 0
    steps_acked: int = 0
    bytes_sent: int = 0
    blocks_failed: int = 0  # refused after a store restart, or lost with the store process
    resyncs: int = 0  # times the writer started fresh episodes
    wait_s: float = 0.0  # time spent blocked on max_in_flight (backpressure)


class BlockWriter:
    """Buffers the steps of a vector env's E envs and sends them to a store actor in blocks.

    Mirrors the store's recording API for the envs it owns (`env_ids`):
    `reset(obs)` once, then `add(...)` per step with gymnasium's next-step `autoreset`.
    At most `max_in_flight` blocks wait for an answer; the next send blocks until the
    oldest is answered (backpressure: memory stays bounded). A block whose call fails or
    is refused is not sent again; the next block starts fresh episodes from the last
    frames sent (the store ends the interrupted ones as truncated). Frames travel
    lz4-compressed by default: faster than raw blocks even on one machine
    (``scripts/bench_ray.py``), and ~40x fewer bytes between machines.
    """

    def __init__(self, actor: Any, env_ids: Any, *, block_steps: int = 64,
                 max_in_flight: int = 2, compress: bool = True, spec: StoreSpec | None = None,
                 on_ack: Any = None, max_failures: int = 1000,
                 restart_wait_s: float = 60.0) -> None:
        if block_steps < 1 or max_in_flight < 1:
            raise ValueError(f"block_steps and max_in_flight must be >= 1, got "
                             f"{block_steps}, {max_in_flight}")
        self.actor = actor
        self.env_ids = np.asarray(env_ids, np.int64).reshape(-1)
        self.spec = spec if spec is not None else ray.get(actor.spec.remote())
        self.block_steps, self.max_in_flight, self.compress = block_steps, max_in_flight, compress
        self.stats = WriterStats()
        self._on_ack, self._max_failures, self._failures_in_row = on_ack, max_failures, 0
        self.restart_wait_s = restart_wait_s
        self._stream, self._resync = 0, False
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
        self._in_flight.append((self.actor.add_block.remote(block), block.stream, block))
        self.stats.blocks_sent += 1
        self.stats.steps_sent += block.steps
        self.stats.bytes_sent += block.nbytes

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

    def drain(self) -> None:
        """Send the rows buffered so far and wait until every block is answered."""
        if self._fill:
            self._send()
        self._wait_until(0)


__all__ = ["ActorInfo", "BlockWriter", "RemoteBatches", "StoreActor", "WriterStats",
           "open_or_create", "start_store_actor", "to_batch", "wait_for_actor"]
