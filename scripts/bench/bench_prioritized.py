"""Latency of one prioritized learner step: draw a batch, then write back its new priorities.

    python scripts/bench/bench_prioritized.py               # 1M slots, all valid, random priorities
    python scripts/bench/bench_prioritized.py --slots 10000   # smaller

Times, per repetition, ``sample(rng, batch, beta)`` plus ``set_priorities`` of the drawn slots
on mmreplay's `PrioritizedSampler` (the batch as drawn: of a slot drawn twice the last value
wins, as in cpprb) and `RankSampler` (deduplicated first, as the store does), and, if `cpprb`
imports, ``sample(batch, beta)`` plus ``update_priorities(indexes, new)`` on cpprb's
`PrioritizedReplayBuffer` filled to the same size. New priorities are drawn before the clock
starts. The buffers are timed in turns, `--block` calls each, so a shared machine's load hits
them alike. Prints median, 90th percentile and mean microseconds (the rank sampler's mean
includes its amortized re-sorts) and the ratio of medians against cpprb, and writes them to
`--out`. Figures only, nothing asserted.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from common import run_main

import mmreplay
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
    """untimed steps of each buffer before timing"""
    block: int = 50
    """steps of one buffer timed in a row before the next buffer's turn"""
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
    out: str = "data/bench/prioritized.json"
    """where the JSON of figures goes ('' for none)"""


def time_in_turns(steps: dict[str, Step], args: Args,
                  rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Seconds per call of each step, `args.block` calls of one after the other's, after
    `args.warmup` untimed calls of each."""
    for step in steps.values():
        for _ in range(args.warmup):
            step(rng.random(args.batch_size))
    times: dict[str, list[float]] = {name: [] for name in steps}
    clock = time.perf_counter
    while len(times[next(iter(steps))]) < args.reps:
        for name, step in steps.items():
            for _ in range(min(args.block, args.reps - len(times[name]))):
                new = rng.random(args.batch_size)
                start = clock()
                step(new)
                times[name].append(clock() - start)
    return {name: np.asarray(got) for name, got in times.items()}


def ours(cls: type[PrioritizedSampler] | type[RankSampler], args: Args,
         rng: np.random.Generator) -> Step:
    sampler = cls(args.slots, alpha=args.alpha, eps=1e-6)
    everything = np.arange(args.slots)
    valid = np.ones(args.slots, bool)
    sampler.load(rng.random(args.slots), everything, 1.0, valid)  # O(N) build, all valid

    def step(new: np.ndarray) -> None:
        draw = sampler.sample(rng, args.batch_size, args.beta)
        sampler.set_priorities(draw.slots, new)  # a slot drawn twice: the last value wins

    def rank_step(new: np.ndarray) -> None:
        draw = sampler.sample(rng, args.batch_size, args.beta)
        slots, first = np.unique(draw.slots[::-1], return_index=True)  # the store dedupes
        sampler.set_priorities(slots, new[::-1][first])

    return rank_step if cls is RankSampler else step


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


def report(name: str, times: np.ndarray, baseline: np.ndarray | None) -> dict[str, float]:
    us = times * 1e6
    got = {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)),
           "mean_us": float(us.mean()), "reps": int(us.size)}
    if baseline is not None:
        got["ratio_to_cpprb"] = got["median_us"] / float(np.median(baseline * 1e6))
    ratio = f"   {got['ratio_to_cpprb']:.2f}x cpprb" if "ratio_to_cpprb" in got else ""
    print(f"{name:<44} median {got['median_us']:8.1f} us   p90 {got['p90_us']:8.1f} us   "
          f"mean {got['mean_us']:8.1f} us{ratio}")
    return got


def report_all(times: dict[str, np.ndarray], cpprb_name: str) -> dict[str, dict[str, float]]:
    baseline = times.get(cpprb_name)
    return {name: report(name, got, baseline) for name, got in times.items()}


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    rng = np.random.default_rng(args.seed)
    print(f"{args.slots:,} slots, batch {args.batch_size}, {args.reps} reps, "
          f"alpha {args.alpha}, beta {args.beta}; load average {os.getloadavg()}")
    steps = {"mmreplay PrioritizedSampler": ours(PrioritizedSampler, args, rng),
             "mmreplay RankSampler": ours(RankSampler, args, rng)}
    if args.store:
        steps["mmreplay ReplayStore (whole API)"] = store_step(args, rng)
    theirs = cpprb_step(args, rng)
    if theirs is None:
        print("cpprb not importable: no ratios (pip install cpprb)")
    else:
        steps["cpprb PrioritizedReplayBuffer"] = theirs
    result: dict[str, Any] = {
        "command": "python scripts/bench/bench_prioritized.py " + " ".join(sys.argv[1:]),
        "args": vars(args), "load_average_at_start": list(os.getloadavg()),
        "mmreplay_from": str(Path(mmreplay.__file__).parent),
        "samplers": report_all(time_in_turns(steps, args, rng), "cpprb PrioritizedReplayBuffer")}
    if args.frames > 0:
        frames = frame_steps(args, rng)
        result["with_frames"] = report_all(
            time_in_turns(frames, args, rng),
            f"cpprb PrioritizedReplayBuffer, {args.frames:,} frames")
    result["load_average_at_end"] = list(os.getloadavg())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run_main(main)
