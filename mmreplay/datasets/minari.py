"""Minari datasets (Farama's offline-RL format) from stores, and stores from them.

    export_minari(store, "breakout/random-v0", env_id="ALE/Breakout-v5")
    import_minari("breakout/random-v0", "runs/breakout")      # -> summary

Export writes the store's finished, fully kept episodes (see `mmreplay.datasets.episodes`):
observations T+1 single frames per episode (not stacks), actions, rewards,
terminations and truncations, streamed in batches of about `batch_frames` frames so
memory stays bounded. Frames are stored raw (``jpeg_encoding=False``; Minari 0.5.4
would otherwise store 84x84 uint8 frames as lossy JPEG). The dataset's metadata holds,
under ``"mmreplay"``, the store's ``frame_stack``, ``n_step``, ``gamma``,
``stack_padding``, ``action_dtype`` and the env id given, so an import rebuilds the same
store. A failed export removes the half-made dataset directory.

Import takes any Minari dataset with a Box observation space (any frame shape and dtype
a store can hold, e.g. hosted Atari datasets' 210x160x3 RGB frames) and a Discrete or
Box action space, and records each episode with ``reset`` + ``add`` into a new
one-env store built beside the target (see `mmreplay.datasets.staging`). minari is imported
only here (extra ``minari``).
"""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.datasets.episodes import (
    BATCH_FRAMES,
    Episode,
    check_episode,
    read_episodes,
    write_episode,
)
from mmreplay.datasets.staging import staged_store
from mmreplay.errors import DatasetFormatError, InvalidInputError
from mmreplay.store import ReplayStore

try:
    import gymnasium as gym
    import minari
    from minari.data_collector import EpisodeBuffer
    from minari.storage import get_dataset_path
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('mmreplay.datasets.minari needs minari: '
                      'pip install "mmreplay[minari]"') from exc

META_KEY = "mmreplay"
_NAGS = r"`(algorithm_name|eval_env|code_permalink|author|author_email)` is set to None|" \
        r"env_spec is None"
_ID = re.compile(r"[\w.\-/]+-v\d+")


@dataclass(frozen=True)
class MinariExport:
    dataset_id: str
    path: Path
    episodes: int
    steps: int
    bytes_on_disk: int


@dataclass(frozen=True)
class MinariImport:
    dataset_id: str
    episodes: int
    steps: int
    frames: int


# -- export -------------------------------------------------------------------------------
def export_minari(store: ReplayStore, dataset_id: str, *, env_id: str | None = None,
                  num_actions: int | None = None, description: str | None = None,
                  batch_frames: int = BATCH_FRAMES) -> MinariExport:
    """Write `store`'s finished, fully kept episodes to a new local Minari dataset."""
    path = _new_dataset_path(dataset_id)
    obs_space = _observation_space(store)
    act_space = _action_space(store, num_actions)
    batches = _buffers(read_episodes(store, batch_frames=batch_frames), batch_frames)
    first = next(batches, None)
    if first is None:
        raise InvalidInputError(f"{store.path} holds no finished, fully kept episode to export")
    try:
        with warnings.catch_warnings():  # Minari's reminders about fields a store lacks
            warnings.filterwarnings("ignore", _NAGS, UserWarning)
            dataset = minari.create_dataset_from_buffers(
                dataset_id, first, env=None, observation_space=obs_space,
                action_space=act_space, description=description or _description(store, env_id),
                jpeg_encoding=False)
        for batch in batches:
            dataset.update_dataset_from_buffer(batch)
        dataset.storage.update_metadata({META_KEY: _store_metadata(store, env_id)})
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return MinariExport(dataset_id, path, int(dataset.total_episodes),
                        int(dataset.total_steps), size)


def _new_dataset_path(dataset_id: str) -> Path:
    if not isinstance(dataset_id, str) or not _ID.fullmatch(dataset_id) or ".." in dataset_id \
            or dataset_id.startswith("/"):
        raise InvalidInputError(f"Minari dataset ids look like [namespace/]name-v0 (ending in "
                                f"-vN), got {dataset_id!r}")
    path = Path(get_dataset_path(dataset_id))
    if path.exists():
        raise InvalidInputError(f"a Minari dataset {dataset_id!r} already exists at {path}")
    return path


def _buffers(episodes: Iterable[Episode], batch_frames: int) -> Iterator[list[EpisodeBuffer]]:
    """`EpisodeBuffer` lists of about `batch_frames` frames (at least one episode each)."""
    batch: list[EpisodeBuffer] = []
    frames = 0
    for ep in episodes:
        check_episode(ep.observations, ep.actions, ep.rewards, ep.terminations,
                      ep.truncations, f"store episode {ep.number}")
        batch.append(EpisodeBuffer(observations=ep.observations, actions=ep.actions,
                                   rewards=ep.rewards, terminations=ep.terminations,
                                   truncations=ep.truncations))
        frames += len(ep.observations)
        if frames >= batch_frames:
            yield batch
            batch, frames = [], 0
    if batch:
        yield batch


def _observation_space(store: ReplayStore) -> Any:
    spec = store.spec
    dtype = np.dtype(spec.obs_dtype)
    low, high = _bounds(dtype)
    return gym.spaces.Box(low, high, spec.obs_shape, dtype)


def _action_space(store: ReplayStore, num_actions: int | None) -> Any:
    """Discrete(n) for integer scalar actions (n = `num_actions` or largest + 1), else Box."""
    spec = store.spec
    dtype = np.dtype(spec.action_dtype)
    if dtype.kind in "iu" and spec.action_shape == ():
        steps = store.views.step_columns().steps
        kept = steps["action"][steps["has_step"]]
        largest = int(kept.max()) if kept.size else 0
        if int(kept.min(initial=0)) < 0:
            raise InvalidInputError("integer actions below 0 do not fit a Discrete space")
        n = largest + 1 if num_actions is None else num_actions
        if n <= largest:
            raise InvalidInputError(f"num_actions={n} but the store holds action {largest}")
        return gym.spaces.Discrete(n)
    low, high = _bounds(dtype)
    return gym.spaces.Box(low, high, spec.action_shape, dtype)


def _bounds(dtype: np.dtype) -> tuple[Any, Any]:
    if dtype.kind in "iu":
        return np.iinfo(dtype).min, np.iinfo(dtype).max
    if dtype.kind == "b":
        return 0, 1
    return -np.inf, np.inf


def _store_metadata(store: ReplayStore, env_id: str | None) -> dict[str, Any]:
    spec = store.spec
    return {"frame_stack": spec.frame_stack, "n_step": spec.n_step, "gamma": spec.gamma,
            "stack_padding": spec.stack_padding, "action_dtype": np.dtype(spec.action_dtype).str,
            "env_id": env_id, "num_envs": spec.num_envs}


def _description(store: ReplayStore, env_id: str | None) -> str:
    return (f"Exported from an mmreplay store (env {env_id or 'not given'}): single frames; "
            f"the store stacked {store.spec.frame_stack} of them per state.")


# -- import -------------------------------------------------------------------------------
def import_minari(dataset_id: str, target: str | Path, *, frame_stack: int | None = None,
                  n_step: int | None = None, gamma: float | None = None,
                  capacity: int | None = None, **options: Any) -> MinariImport:
    """Record every episode of a local Minari dataset into a new store at `target`.

    ``frame_stack``, ``n_step`` and ``gamma`` default to the values an mmreplay export
    saved in the metadata, else 1, 1 and 0.99. `capacity` defaults to every frame.
    """
    try:
        dataset = minari.load_dataset(dataset_id)
    except FileNotFoundError:
        raise InvalidInputError(
            f"Minari dataset {dataset_id!r} is not found locally (in "
            f"{get_dataset_path(dataset_id)}); download it first with "
            f"`minari download {dataset_id}` or minari.download_dataset({dataset_id!r})"
        ) from None
    saved = _saved_metadata(dataset)
    obs_shape, obs_dtype = _box(dataset.observation_space, "observation")
    action_shape, action_dtype = _action_layout(dataset.action_space, saved)
    with staged_store(
            target, capacity=capacity or int(dataset.total_steps + dataset.total_episodes),
            obs_shape=obs_shape, obs_dtype=obs_dtype, action_shape=action_shape,
            action_dtype=action_dtype,
            frame_stack=frame_stack or int(saved.get("frame_stack", 1)),
            n_step=n_step or int(saved.get("n_step", 1)),
            gamma=gamma if gamma is not None else float(saved.get("gamma", 0.99)),
            stack_padding=str(saved.get("stack_padding", "zero")), **options) as store:
        for ep in dataset.iterate_episodes():
            obs, act, rew, term, trunc = (np.asarray(getattr(ep, k)) for k in (
                "observations", "actions", "rewards", "terminations", "truncations"))
            where = f"{dataset_id} episode {ep.id}"
            check_episode(obs, act, rew, term, trunc, where)
            try:
                write_episode(store, obs, act, rew, term, trunc)
            except InvalidInputError as exc:  # data that disagrees with its own spaces
                raise DatasetFormatError(f"{where}: {exc}") from None
        counts = store.counts
    return MinariImport(dataset_id, counts.episodes, counts.transitions, counts.frames_written)


_SAVED_TYPES = {"frame_stack": int, "n_step": int, "gamma": float, "stack_padding": str,
                "action_dtype": str}


def _saved_metadata(dataset: Any) -> dict[str, Any]:
    """What an mmreplay export saved (type-checked: the file may come from anyone)."""
    saved = dataset.storage.metadata.get(META_KEY) or {}
    if not isinstance(saved, dict):
        raise DatasetFormatError(f"metadata {META_KEY!r} is {type(saved).__name__}, "
                                 f"expected an object")
    for key, kind in _SAVED_TYPES.items():
        value = saved.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise DatasetFormatError(f"metadata {META_KEY}.{key} is {value!r}, expected "
                                     f"{kind.__name__}")
    return {k: v for k, v in saved.items() if k in _SAVED_TYPES and v is not None}


def _box(space: Any, what: str) -> tuple[tuple[int, ...], np.dtype]:
    if not isinstance(space, gym.spaces.Box):
        raise DatasetFormatError(f"{what} space {space} is not a Box: a store holds arrays "
                                 f"of one shape and dtype")
    return tuple(space.shape), np.dtype(space.dtype)


def _action_layout(space: Any, saved: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(space, gym.spaces.Discrete):
        name = saved.get("action_dtype", "<i8")
        if name not in ("<i8", "<i4", "<i2", "|i1", "|u1", "<u2", "<u4", "<u8"):
            raise DatasetFormatError(f"metadata {META_KEY}.action_dtype is {name!r}, "
                                     f"expected an integer dtype such as '<i8'")
        return (), np.dtype(name)
    return _box(space, "action")
