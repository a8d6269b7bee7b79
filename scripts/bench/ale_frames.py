"""Real Atari frames for benchmarks: record once with a random policy, cache as `.npz`.

Not a script to run; `bench.py` (and later benchmarks) import it::

    from ale_frames import record_frames
    rec = record_frames("ALE/Breakout-v5", 100_000, seed=0)

A recording is one stream of observations, in the order an agent sees them::

    i         0     1     2    ...   k     k+1    k+2  ...
    frames    o_0   o_1   o_2  ...   o_T   o'_0   o'_1 ...
    is_first  T     F     F    ...   F     T      F    ...
    step      -     a,r   a,r  ...   a,r   -      a,r  ...   (terminated/truncated on o_T)

``frames[i]`` either starts an episode (``is_first[i]``; its step fields are 0/False) or is
the ``next_obs`` of the step ``actions[i], rewards[i], terminated[i], truncated[i]``. So
feeding a store is: ``reset(frames[i])`` where ``is_first[i]``, otherwise
``add(actions[i], rewards[i], frames[i], terminated[i], truncated[i])``.

Preprocessing is the usual DQN one: ``gym.make(game, frameskip=1)`` inside
``AtariPreprocessing`` (84x84 grayscale, max-pool over the last two of 4 skipped frames,
up to 30 no-op starts), no frame stacking. Recordings are cached under ``data/cache/``
(git-ignored), keyed by game, frame count and seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)

CACHE_DIR = Path(__file__).resolve().parents[2] / "data" / "cache"
# Bump when the recording procedure changes, so stale caches are not reused.
CACHE_VERSION = 1
FIELDS = ("frames", "is_first", "actions", "rewards", "terminated", "truncated")


@dataclass(frozen=True)
class AleFrames:
    """A recorded observation stream; every array has length ``n`` (see module docstring)."""

    game: str
    seed: int
    frames: np.ndarray  # (n, 84, 84) uint8
    is_first: np.ndarray  # (n,) bool: frames[i] came from env.reset()
    actions: np.ndarray  # (n,) int64: action that produced frames[i] (0 where is_first)
    rewards: np.ndarray  # (n,) float32: reward of that step (0 where is_first)
    terminated: np.ndarray  # (n,) bool
    truncated: np.ndarray  # (n,) bool

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def num_episodes(self) -> int:
        """Episodes started in the stream (the last one is usually unfinished)."""
        return int(self.is_first.sum())


def record(game: str, n_frames: int, seed: int, *, progress: bool = False) -> AleFrames:
    """Record `n_frames` observations with a uniform random policy (no cache). The ALE is
    imported here: cached frames load where it is not installed (a GPU host)."""
    import ale_py
    import gymnasium as gym
    from common import make_env
    from tqdm import tqdm

    gym.register_envs(ale_py)
    if n_frames < 1:
        raise ValueError(f"n_frames must be >= 1, got {n_frames}")
    # obs_type="grayscale" does not change the output (the wrapper reads the ALE screen
    # itself) but spares the inner env an RGB copy on each of the 4 skipped frames (~10%).
    env = make_env(game, obs_type="grayscale")
    rng = np.random.default_rng(seed)
    if not isinstance(env.action_space, gym.spaces.Discrete):
        raise TypeError(f"{game} has action space {env.action_space}; expected a Discrete one")
    num_actions = int(env.action_space.n)
    frames = np.empty((n_frames, 84, 84), dtype=np.uint8)
    is_first = np.zeros(n_frames, dtype=bool)
    actions = np.zeros(n_frames, dtype=np.int64)
    rewards = np.zeros(n_frames, dtype=np.float32)
    terminated = np.zeros(n_frames, dtype=bool)
    truncated = np.zeros(n_frames, dtype=bool)
    frames[0], _ = env.reset(seed=seed)
    is_first[0] = True
    for i in tqdm(range(1, n_frames), desc=f"record {game}", disable=not progress):
        if terminated[i - 1] or truncated[i - 1]:
            frames[i], _ = env.reset()
            is_first[i] = True
            continue
        actions[i] = rng.integers(num_actions)
        frames[i], rewards[i], terminated[i], truncated[i], _ = env.step(actions[i])
    env.close()
    return AleFrames(game, seed, frames, is_first, actions, rewards, terminated, truncated)


def cache_path(game: str, n_frames: int, seed: int, cache_dir: Path = CACHE_DIR) -> Path:
    name = game.replace("/", "-")
    return Path(cache_dir) / f"{name}_n{n_frames}_s{seed}_v{CACHE_VERSION}.npz"


def record_frames(
    game: str,
    n_frames: int,
    seed: int = 0,
    *,
    cache_dir: Path | str = CACHE_DIR,
    progress: bool = False,
) -> AleFrames:
    """Recorded frames for (game, n_frames, seed), from the cache when present."""
    path = cache_path(game, n_frames, seed, Path(cache_dir))
    if path.exists():
        return load(path, game=game, seed=seed)
    rec = record(game, n_frames, seed, progress=progress)
    save(rec, path)
    return rec


def save(rec: AleFrames, path: Path) -> None:
    """Write `rec` to `path` atomically (temp file + rename); compressed, Atari compresses well."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **{name: getattr(rec, name) for name in FIELDS})
    os.replace(tmp, path)


def load(path: Path, *, game: str, seed: int) -> AleFrames:
    with np.load(path, allow_pickle=False) as data:
        missing = set(FIELDS) - set(data.files)
        if missing:
            raise ValueError(f"{path} lacks arrays {sorted(missing)}; delete it to re-record")
        arrays = {name: data[name] for name in FIELDS}
    return AleFrames(game=game, seed=seed, **arrays)
