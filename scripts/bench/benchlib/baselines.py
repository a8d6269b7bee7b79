"""The buffers the ram section compares, one per subprocess: mmreplay, cpprb, a numpy
array (the floor), SB3 and TorchRL, each behind the same small `Buffer` interface.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from ale_frames import AleFrames
from tqdm import tqdm

from benchlib.config import Args
from benchlib.core import bench_disk
from benchlib.harness import FRAME_STACK, T, disk_usage, feed_timed, new_store, numpy_gather


@dataclass(frozen=True)
class Buffer:
    """A buffer under test: fill it with (stream, frames) -> (adds, seconds), sample, release."""

    fill: Callable[[AleFrames, int], tuple[int, float]]
    sample: Callable[[], object]
    close: Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class Step:
    """One transition as a frame-stacking env wrapper hands it to an agent."""

    obs: np.ndarray
    action: int
    reward: float
    next_obs: np.ndarray
    terminated: bool
    truncated: bool
    new_episode: bool  # first transition of its episode


def push(stack: np.ndarray, frame: np.ndarray, channels_last: bool) -> np.ndarray:
    """`stack` shifted by one frame, with `frame` newest."""
    out = np.empty_like(stack)
    if channels_last:
        out[..., :-1], out[..., -1] = stack[..., 1:], frame
    else:
        out[:-1], out[-1] = stack[1:], frame
    return out


def stacked_steps(rec: AleFrames, count: int, *, channels_last: bool,
                  desc: str) -> Iterator[Step]:
    """Transitions of stream positions 0 .. count-1 (`rec` repeated end to end), with
    zero-padded `FRAME_STACK`-stacks: (4, 84, 84), or (84, 84, 4) when `channels_last`."""
    shape = (84, 84, FRAME_STACK) if channels_last else (FRAME_STACK, 84, 84)
    stack, new_episode = np.zeros(shape, np.uint8), True
    for i in tqdm(range(count), desc=desc, unit="frame", mininterval=2.0, leave=False):
        j = i % len(rec)
        if rec.is_first[j]:
            stack, new_episode = push(np.zeros(shape, np.uint8), rec.frames[j], channels_last), True
            continue
        nxt = push(stack, rec.frames[j], channels_last)
        yield Step(stack, int(rec.actions[j]), float(rec.rewards[j]), nxt,
                   bool(rec.terminated[j]), bool(rec.truncated[j]), new_episode)
        stack, new_episode = nxt, False


def timed_adds(items: Iterable[T], add: Callable[[T], object]) -> tuple[int, float]:
    """Call `add` on every item; (calls, seconds inside `add`). Building items is not timed."""
    clock, spent, calls = time.perf_counter, 0.0, 0
    for item in items:
        start = clock()
        add(item)
        spent += clock() - start
        calls += 1
    return calls, spent


def make_mmreplay(n: int, path: Path, args: Args) -> Buffer:
    store = new_store(path, n, args.seed)

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        adds, seconds = feed_timed(store, rec, 0, count, desc="fill mmreplay")
        start = time.perf_counter()
        store.flush()  # the closing commit is part of the fill
        return adds, seconds + time.perf_counter() - start

    def close() -> dict[str, Any]:
        store.close()
        return {"cache_bytes": 0, **bench_disk(path, n)}

    return Buffer(fill, lambda: store.sample(args.batch_size), close)


def make_cpprb(n: int, path: Path, args: Args) -> Buffer:
    from cpprb import ReplayBuffer

    # stack_compress wants the stack on the last axis (cpprb docs); next_obs shares memory.
    rb = ReplayBuffer(n, {"obs": {"shape": (84, 84, FRAME_STACK), "dtype": np.uint8},
                          "act": {"dtype": np.int64}, "rew": {}, "done": {}},
                      next_of="obs", stack_compress="obs")

    def add(step: Step) -> None:
        if step.new_episode and rb.get_stored_size():
            rb.on_episode_end()
        rb.add(obs=step.obs, act=step.action, rew=step.reward, next_obs=step.next_obs,
               done=float(step.terminated))

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        return timed_adds(stacked_steps(rec, count, channels_last=True, desc="fill cpprb"), add)

    return Buffer(fill, lambda: rb.sample(args.batch_size), lambda: {})


def make_numpy(n: int, path: Path, args: Args) -> Buffer:
    frames = np.empty((n, 84, 84), np.uint8)  # pages are touched (counted) as they are filled
    actions, rewards = np.zeros(n, np.int64), np.zeros(n, np.float32)
    done = np.zeros(n, bool)
    rng = np.random.default_rng(args.seed)

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        def put(i: int) -> None:
            j = i % len(rec)
            frames[i], actions[i], rewards[i] = rec.frames[j], rec.actions[j], rec.rewards[j]
            done[i] = rec.terminated[j]

        return timed_adds(range(count), put)

    return Buffer(fill, lambda: numpy_gather(frames, rng, args.batch_size), lambda: {})


def make_sb3(n: int, path: Path, args: Args) -> Buffer:
    import gymnasium as gym
    from stable_baselines3.common.buffers import ReplayBuffer

    rb = ReplayBuffer(n, gym.spaces.Box(0, 255, (FRAME_STACK, 84, 84), np.uint8),
                      gym.spaces.Discrete(18), device="cpu", optimize_memory_usage=True,
                      handle_timeout_termination=False)  # SB3 refuses both at once

    def prepared(rec: AleFrames, count: int) -> Iterator[tuple[Any, ...]]:
        for s in stacked_steps(rec, count, channels_last=False, desc="fill sb3"):
            yield (s.obs[None], s.next_obs[None], np.array([s.action]), np.array([s.reward]),
                   np.array([s.terminated]), [{}])

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        return timed_adds(prepared(rec, count), lambda item: rb.add(*item))

    return Buffer(fill, lambda: rb.sample(args.batch_size), lambda: {})


def make_torchrl(n: int, path: Path, args: Args) -> Buffer:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyMemmapStorage(n, scratch_dir=path),
                      batch_size=args.batch_size)

    def prepared(rec: AleFrames, count: int) -> Iterator[TensorDict]:
        for s in stacked_steps(rec, count, channels_last=False, desc="fill torchrl"):
            yield TensorDict({
                "obs": torch.from_numpy(s.obs), "action": torch.tensor(s.action),
                "reward": torch.tensor(s.reward), "terminated": torch.tensor(s.terminated),
                "truncated": torch.tensor(s.truncated),
                "next": {"obs": torch.from_numpy(s.next_obs)}}, batch_size=[])

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        return timed_adds(prepared(rec, count), rb.add)

    def close() -> dict[str, Any]:
        files, allocated = disk_usage(path)
        return {"disk_file_mib": files / 2**20, "disk_allocated_mib": allocated / 2**20}

    return Buffer(fill, rb.sample, close)


BUFFERS: dict[str, Callable[[int, Path, Args], Buffer]] = {
    "mmreplay": make_mmreplay, "cpprb": make_cpprb, "numpy": make_numpy,
    "sb3": make_sb3, "torchrl": make_torchrl}


MODULES = {"cpprb": "cpprb", "sb3": "stable_baselines3", "torchrl": "torchrl"}


PIP_NAMES = {"cpprb": "cpprb", "sb3": "stable-baselines3", "torchrl": "torchrl"}


def missing(system: str) -> str | None:
    """Why `system` cannot be benchmarked here, or None."""
    module = MODULES.get(system)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return (f"{PIP_NAMES[system]} is not installed (`pip install --dry-run "
            f"{PIP_NAMES[system]}` shows whether it keeps the installed torch)")
