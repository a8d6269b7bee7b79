"""Record real Atari steps with a random policy into a new `ReplayStore`, then inspect it.

    python scripts/record_atari.py --game ALE/Breakout-v5 --steps 3000 --out runs/breakout_store

Preprocessing is the usual DQN one: ``AtariPreprocessing`` over ``gym.make(game, frameskip=1)``
(84x84 grayscale, frame skip 4 with max-pooling, up to 30 no-op starts) and *no* env-side frame
stacking: the store keeps every frame once and stacks 4 of them when it samples.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import shutil
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import ale_py
import gymnasium as gym
import numpy as np
from gymnasium.wrappers import AtariPreprocessing
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


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, for `--help`."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    return {
        node.target.id: doc.value.value
        for node, doc in zip(body, body[1:], strict=False)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    docs = field_docs(Args)
    for f in fields(Args):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=docs.get(f.name))
        else:
            parser.add_argument(flag, type=type(default), default=default,
                                help=f"{docs.get(f.name)} (default: {default})")
    return Args(**vars(parser.parse_args()))


def make_env(game: str) -> gym.Env:
    env = gym.make(game, frameskip=1)
    return AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)


def dir_bytes(path: Path) -> tuple[int, int]:
    """Bytes under `path`: the files' sizes, and the filesystem blocks of files and folders."""
    paths = list(path.rglob("*"))
    files = sum(p.stat().st_size for p in paths if p.is_file())
    return files, sum(p.stat().st_blocks * 512 for p in paths)


if __name__ == "__main__":
    args = parse_args()
    out = Path(args.out)
    if out.exists():
        if not args.overwrite:
            sys.exit(f"{out} already exists; pass --overwrite to replace it")
        if not (out / "zarr.json").exists():
            sys.exit(f"{out} does not look like a store (no zarr.json); not deleting it")
        shutil.rmtree(out)

    env = make_env(args.game)
    rng = np.random.default_rng(args.seed)
    if not isinstance(env.action_space, gym.spaces.Discrete):
        sys.exit(f"{args.game} has action space {env.action_space}; expected a Discrete one")
    num_actions = int(env.action_space.n)
    store = ReplayStore.create(out, capacity=args.capacity, obs_shape=(84, 84), obs_dtype=np.uint8,
                               frame_stack=4, seed=args.seed)

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

    # Reopen read-only, as a learner would, and report what is on disk.
    with ReplayStore.open(out, mode="r") as store:
        counts = store.counts
        raw_bytes = counts.frames_kept * store.spec.frame_bytes
        (total_bytes, total_blocks), chunk_bytes = dir_bytes(out), dir_bytes(out / "frames")[0]
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
