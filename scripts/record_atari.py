"""Record real Atari steps with a random policy into a new `ReplayStore`, then inspect it.

    python scripts/record_atari.py --game ALE/Breakout-v5 --steps 3000 --out runs/breakout_store

Preprocessing is the usual DQN one: ``AtariPreprocessing`` over ``gym.make(game, frameskip=1)``
(84x84 grayscale, frame skip 4 with max-pooling, up to 30 no-op starts) and *no* env-side frame
stacking: the store keeps every frame once and stacks 4 of them when it samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path

import ale_py
import gymnasium as gym
import numpy as np
import tyro
from common import (
    UsageError,
    dir_blocks,
    dir_bytes,
    holds_run,
    make_env,
    on_interrupt,
    prepare_run_dir,
    run_main,
)
from tqdm import tqdm

from mmreplay import ReplayStore
from mmreplay.tools.inspection import disk_usage

gym.register_envs(ale_py)


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """gymnasium id of the ALE game (ale-py registers `ALE/<Game>-v5`)"""
    steps: int = 3000
    """environment steps (agent decisions, 4 emulator frames each) to record"""
    out: str = "runs/breakout_store"
    """directory of the new store"""
    seed: int = 0
    """seed of the environment, the random policy and the store's sampler"""
    capacity: int = 100_000
    """frames the store keeps; once full the oldest are overwritten"""
    overwrite: bool = False
    """replace `out` if it already holds a store"""


def prepare_out(args: Args) -> Path:
    """`out` free for a new store: refused if it holds something, unless --overwrite and
    it is a store (a directory that is not one is never deleted)."""
    out = Path(args.out)
    if holds_run(out) and args.overwrite and not (out / "zarr.json").exists():
        raise UsageError(f"{out} does not look like a store (no zarr.json); not deleting it")
    prepare_run_dir(out, overwrite=args.overwrite, resumable=False)
    out.rmdir()  # ReplayStore.create makes it
    return out


def record(args: Args, out: Path) -> None:
    """`steps` random-policy steps into a new store at `out`, flushed and closed."""
    env = make_env(args.game)
    if not isinstance(env.action_space, gym.spaces.Discrete):
        raise UsageError(f"{args.game} has action space {env.action_space}; "
                         f"expected a Discrete one")
    rng = np.random.default_rng(args.seed)
    num_actions = int(env.action_space.n)
    store = ReplayStore.create(out, capacity=args.capacity, obs_shape=(84, 84),
                               obs_dtype=np.uint8, frame_stack=4, seed=args.seed)
    on_interrupt(store.close, message=f"{out} keeps the steps recorded so far")
    # Random policy; a single env has no autoreset, so a finished episode is reset by hand and
    # its first observation handed to the store with `reset`.
    start = time.perf_counter()
    obs, _ = env.reset(seed=args.seed)
    store.reset(obs)
    episode_return, returns = 0.0, []
    for _ in tqdm(range(args.steps), desc=f"record {args.game}", unit="step"):
        action = int(rng.integers(num_actions))
        next_obs, reward, terminated, truncated, _ = env.step(action)
        store.add(action, float(reward), next_obs, terminated, truncated)
        episode_return += float(reward)
        if terminated or truncated:
            returns.append(episode_return)
            obs, _ = env.reset()
            store.reset(obs)
            episode_return = 0.0
    store.flush()
    store.close()
    env.close()
    elapsed = time.perf_counter() - start
    mean_return = f"{np.mean(returns):.2f}" if returns else "n/a"
    print(f"recorded {args.steps} steps in {elapsed:.1f} s ({args.steps / elapsed:.0f} steps/s), "
          f"{len(returns)} finished episodes, mean return {mean_return}")


def describe(out: Path) -> None:
    """Reopen read-only, as a learner would, and report what is on disk."""
    with ReplayStore.open(out, mode="r") as store:
        counts = store.counts
        raw_bytes = counts.frames_kept * store.spec.frame_bytes
        total_bytes, total_blocks = dir_bytes(out), dir_blocks(out)
        chunk_bytes = dir_bytes(out / "frames")
        print(f"store        {out}")
        print(f"frames       {counts.frames_kept} kept, {counts.frames_written} written "
              f"(capacity {store.spec.capacity})")
        print(f"transitions  {counts.transitions} recorded, {counts.sampleable} sampleable")
        print(f"episodes     {counts.episodes}")
        print(f"disk         {total_bytes / 2**20:.2f} MiB in files ({chunk_bytes / 2**20:.2f} MiB "
              f"frame chunks), {total_blocks / 2**20:.2f} MiB allocated incl. folders")
        ratio = disk_usage(store).compression_ratio or float("nan")  # as `mmreplay info`
        print(f"compression  {ratio:.1f}x: {raw_bytes / 2**20:.1f} MiB of raw frames / file "
              f"bytes ({raw_bytes / total_blocks:.1f}x of allocated blocks)")
        batch = store.sample(32)
        print("sample(32)")
        for f in fields(batch):
            value = getattr(batch, f.name)
            if f.name == "extras":
                continue  # this store declares none
            print(f"  {f.name:<11} {str(tuple(value.shape)):<20} {value.dtype}")


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    out = prepare_out(args)
    record(args, out)
    describe(out)


if __name__ == "__main__":
    run_main(main)
