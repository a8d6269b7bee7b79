"""Latency of one prioritized learner step: draw a batch, then write back its new priorities.

    python scripts/bench_prioritized.py                 # 1M slots, all valid, random priorities
    python scripts/bench_prioritized.py --slots 10000   # smaller

Times, per repetition, ``sample(rng, batch, beta)`` plus ``set_priorities`` of the drawn slots
(deduplicated first, as the store does) on mmreplay's `PrioritizedSampler` and `RankSampler`,
and, if `cpprb` imports, ``sample(batch, beta)`` plus ``update_priorities(indexes, new)`` on
cpprb's `PrioritizedReplayBuffer` filled to the same size. New priorities are drawn before the
clock starts. Prints median and mean microseconds (the rank sampler's mean includes its
amortized re-sorts) and the ratio of medians against cpprb. Figures only, nothing asserted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from common import parse_args, run_main

from mmreplay.index.samplers import PrioritizedSampler, RankSampler

Step = Callable[[np.ndarray], None]  # one timed learner step, given the new priorities


@dataclass
class Args:
    slots: int = 1_000_000
    """slots in the buffer, all valid"""
    batch_size: int = 32
    """transitions drawn per step"""
    reps: int = 2000
    """timed steps per figure"""
    warmup: int = 50
    """untimed steps before timing"""
    alpha: float = 0.6
    """priority exponent"""
    beta: float = 0.4
    """importance-weight exponent"""
    seed: int = 0
    """seed of the generator that draws priorities and batches"""
    store: bool = True
    """also time the pair through a whole `ReplayStore` (tiny (1,) observations, filled by add)"""
    frames: int = 0
    """if > 0: also time the pair with this many real Breakout frames (4-stacks + next stacks)
    in a prioritized `ReplayStore` and in cpprb's `PrioritizedReplayBuffer` (next_of,
    stack_compress), filled with the same stream"""


def time_steps(step: Step, args: Args, rng: np.random.Generator) -> np.ndarray:
    """Seconds per call of `step`, after `args.warmup` untimed calls."""
    for _ in range(args.warmup):
        step(rng.random(args.batch_size))
    times = np.empty(args.reps)
    for i in range(args.reps):
        new = rng.random(args.batch_size)
        start = time.perf_counter()
        step(new)
        times[i] = time.perf_counter() - start
    return times


def ours(cls: type[PrioritizedSampler] | type[RankSampler], args: Args,
         rng: np.random.Generator) -> Step:
    sampler = cls(args.slots, alpha=args.alpha, eps=1e-6)
    everything = np.arange(args.slots)
    valid = np.ones(args.slots, bool)
    sampler.load(rng.random(args.slots), everything, 1.0, valid)  # O(N) build, all valid

    def step(new: np.ndarray) -> None:
        draw = sampler.sample(rng, args.batch_size, args.beta)
        slots, first = np.unique(draw.slots, return_index=True)  # the store dedupes
        sampler.set_priorities(slots, new[first])

    return step


def store_step(args: Args, rng: np.random.Generator) -> Step:
    """`store.sample` + `store.update_priorities` on a full prioritized store (public API)."""
    import tempfile

    from mmreplay import ReplayStore

    path = tempfile.mkdtemp(prefix="mmreplay-bench-") + "/store"
    store = ReplayStore.create(path, capacity=args.slots + 1, obs_shape=(1,), seed=args.seed,
                               sampler="prioritized", alpha=args.alpha)
    frame = np.zeros(1, np.uint8)
    store.reset(frame)
    for _ in range(args.slots):
        store.add(0, 0.0, frame, False, False)
    for _ in range(20):  # give the tree varied priorities
        batch = store.sample(4096, beta=args.beta)
        store.update_priorities(batch.ids, rng.random(4096))

    def step(new: np.ndarray) -> None:
        batch = store.sample(args.batch_size, beta=args.beta)
        store.update_priorities(batch.ids, new)

    return step


def cpprb_step(args: Args, rng: np.random.Generator) -> Step | None:
    try:
        from cpprb import PrioritizedReplayBuffer
    except ImportError:
        return None
    rb: Any = PrioritizedReplayBuffer(args.slots, {"obs": {"shape": 1}}, alpha=args.alpha)
    rb.add(obs=np.zeros((args.slots, 1)), priorities=rng.random(args.slots))

    def step(new: np.ndarray) -> None:
        batch = rb.sample(args.batch_size, beta=args.beta)
        rb.update_priorities(batch["indexes"], new)

    return step


def frame_steps(args: Args, rng: np.random.Generator) -> dict[str, Step]:
    """sample + update_priorities with real frames: mmreplay's store and, if it imports,
    cpprb's PrioritizedReplayBuffer, both fed the same recorded stream."""
    import tempfile

    from ale_frames import record_frames
    from benchlib.baselines import stacked_steps
    from benchlib.harness import feed

    from mmreplay import ReplayStore

    rec = record_frames("ALE/Breakout-v5", args.frames, seed=args.seed)
    path = tempfile.mkdtemp(prefix="mmreplay-bench-") + "/store"
    store = ReplayStore.create(path, capacity=args.frames, obs_shape=(84, 84), frame_stack=4,
                               seed=args.seed, sampler="prioritized", alpha=args.alpha)
    feed(store, rec, args.frames, desc="fill mmreplay")

    def ours_step(new: np.ndarray) -> None:
        batch = store.sample(args.batch_size, beta=args.beta)
        store.update_priorities(batch.ids, new)

    steps = {f"mmreplay ReplayStore, {args.frames:,} frames": ours_step}
    try:
        from cpprb import PrioritizedReplayBuffer
    except ImportError:
        return steps
    rb: Any = PrioritizedReplayBuffer(
        args.frames, {"obs": {"shape": (84, 84, 4), "dtype": np.uint8},
                      "act": {"dtype": np.int64}, "rew": {}, "done": {}},
        next_of="obs", stack_compress="obs", alpha=args.alpha)
    for step in stacked_steps(rec, args.frames, channels_last=True, desc="fill cpprb"):
        if step.new_episode and rb.get_stored_size():
            rb.on_episode_end()
        rb.add(obs=step.obs, act=step.action, rew=step.reward, next_obs=step.next_obs,
               done=float(step.terminated))

    def cpprb_frames_step(new: np.ndarray) -> None:
        batch = rb.sample(args.batch_size, beta=args.beta)
        rb.update_priorities(batch["indexes"], new)

    steps[f"cpprb PrioritizedReplayBuffer, {args.frames:,} frames"] = cpprb_frames_step
    return steps


def report(name: str, times: np.ndarray) -> float:
    median = float(np.median(times)) * 1e6
    print(f"{name:<34} median {median:9.1f} us   mean {times.mean() * 1e6:9.1f} us")
    return median


def main() -> None:
    args = parse_args(Args, description=__doc__)
    rng = np.random.default_rng(args.seed)
    print(f"{args.slots:,} slots, batch {args.batch_size}, {args.reps} reps, "
          f"alpha {args.alpha}, beta {args.beta}")
    medians = {
        "mmreplay PrioritizedSampler": report(
            "mmreplay PrioritizedSampler", time_steps(ours(PrioritizedSampler, args, rng), args,
                                                      rng)),
        "mmreplay RankSampler": report(
            "mmreplay RankSampler", time_steps(ours(RankSampler, args, rng), args, rng)),
    }
    if args.store:
        medians["mmreplay ReplayStore (whole API)"] = report(
            "mmreplay ReplayStore (whole API)", time_steps(store_step(args, rng), args, rng))
    step = cpprb_step(args, rng)
    if step is None:
        print("cpprb not importable: skipped (pip install cpprb)")
        return
    theirs = report("cpprb PrioritizedReplayBuffer", time_steps(step, args, rng))
    for name, median in medians.items():
        print(f"{name} / cpprb median ratio: {median / theirs:.1f}x")
    if args.frames > 0:
        with_frames = {name: report(name, time_steps(fn, args, rng))
                       for name, fn in frame_steps(args, rng).items()}
        ours_ms, *rest = with_frames.values()
        if rest:
            print(f"with frames: mmreplay / cpprb median ratio: {ours_ms / rest[0]:.1f}x")


if __name__ == "__main__":
    run_main(main)
