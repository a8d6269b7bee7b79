"""Read-only inspection of a store on disk: opening, summary, episode table, sample summary.

Every function here reads; nothing writes to a store. Stores are opened with
``mode="r"`` (no lock, no sweep), so inspecting a store another process is
writing is safe: a reader sees one committed generation, and an open or a
verify that raced a flush is retried once the generation has moved on.

Results are frozen dataclasses and numpy arrays. The terminal, image files and
plots belong to `cli.py`. A store is read through its public methods and its
read-only ``store.views`` (step columns, frames by slot, priorities, memory). Beside it:
`steps` (one transition, one episode frame by frame), `distributions` (what `plot` draws),
`images` (observations as pictures).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.index.ring import StepColumns
from mmreplay.rate_limit import summary
from mmreplay.storage.frame_store import FRAMES
from mmreplay.storage.manifest import committed_generation as _committed_generation
from mmreplay.storage.objects import is_url
from mmreplay.store import ReplayStore, StoreCounts

Progress = Callable[[Iterable[Any], int], Iterable[Any]]
SORT_KEYS = ("episode", "return", "length")
ZARR_JSON = "zarr.json"


# -- opening ----------------------------------------------------------------------------
def open_readonly(path: str | os.PathLike[str]) -> ReplayStore:
    """Open a store read-only (`ReplayStore.open` retries opens that race a commit); a URL
    (``s3://``, ``file://``) is read from object storage."""
    return ReplayStore.open(path if is_url(path) else Path(path), mode="r")


# -- info -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiskUsage:
    """Bytes on disk, and the store's one compression figure (`compression_ratio`): raw
    bytes of every kept frame / bytes of every file of the store (frame files, the tail
    file of frames not yet in a chunk, step columns, manifest). `mmreplay info` and
    ``scripts/record_atari.py`` both report it; None while the store holds no frame."""

    total_bytes: int
    frames_bytes: int
    chunk_files: int
    frames_in_chunks: int
    frames_in_tail: int
    compression_ratio: float | None


@dataclass(frozen=True)
class RamEstimate:
    """Bytes an open store holds in RAM besides its decoded-chunk cache."""

    steps_bytes: int
    masks_bytes: int
    sampler_bytes: int
    tail_bytes: int
    total_bytes: int
    cache_budget_bytes: int


@dataclass(frozen=True)
class PriorityStats:
    """Raw priorities of the sampleable transitions of a prioritized store."""

    count: int
    min: float | None
    mean: float | None
    max: float | None
    max_priority: float


@dataclass(frozen=True)
class StoreInfo:
    path: str
    format_version: int
    generation: int
    spec: dict[str, Any]
    counts: StoreCounts
    episodes_running: int
    disk: DiskUsage
    ram: RamEstimate
    sampler: str
    priorities: PriorityStats | None
    rate_limiter: dict[str, Any] | None = None  # `rate_limit.summary` of its counters

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def store_info(store: ReplayStore) -> StoreInfo:
    """Summary of an open store: config, counts, disk, RAM and sampler figures."""
    return StoreInfo(
        path=str(store.path),
        format_version=store.format_version,
        generation=store.generation,
        spec=store.spec.to_dict(),
        counts=store.counts,
        episodes_running=int(store.views.step_columns().running.sum()),
        disk=disk_usage(store),
        ram=ram_estimate(store),
        sampler=store.spec.sampler,
        priorities=priority_stats(store),
        rate_limiter=rate_limiter_summary(store),
    )


def rate_limiter_summary(store: ReplayStore) -> dict[str, Any] | None:
    """The rate limiter's counters (live, or as committed) with the achieved ratio."""
    state = store.rate_limiter_state()
    try:
        return None if state is None else summary(state)
    except (KeyError, TypeError):  # a commit that lacks fields: show what it has
        return state


def disk_usage(store: ReplayStore) -> DiskUsage:
    cols, spec = store.views.step_columns(), store.spec
    in_tail = store.views.memory().tail_frames
    in_chunks = int((cols.written - cols.oldest).sum()) - in_tail
    frames_bytes, chunk_files = 0, 0
    for path, size in files_under(store.path / FRAMES):
        frames_bytes += size
        chunk_files += path.name != ZARR_JSON
    total_bytes = sum(size for _, size in files_under(store.path))
    return DiskUsage(
        total_bytes=total_bytes, frames_bytes=frames_bytes,
        chunk_files=chunk_files, frames_in_chunks=in_chunks, frames_in_tail=in_tail,
        compression_ratio=compression_ratio((in_chunks + in_tail) * spec.frame_bytes,
                                            total_bytes))


def compression_ratio(raw_frame_bytes: int, file_bytes: int) -> float | None:
    """Raw bytes of the kept frames over the bytes of the store's files (see `DiskUsage`)."""
    return raw_frame_bytes / file_bytes if raw_frame_bytes and file_bytes else None


def files_under(root: Path) -> Iterable[tuple[Path, int]]:
    """(path, size) of every regular file under `root` (symlinks not followed)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            try:
                yield path, path.lstat().st_size
            except FileNotFoundError:  # removed by a writer meanwhile
                continue


def ram_estimate(store: ReplayStore) -> RamEstimate:
    """RAM the open store holds besides its decoded-chunk cache (and that cache's budget)."""
    mem = store.views.memory()
    total = mem.steps_bytes + mem.index_bytes + mem.sampler_bytes + mem.tail_bytes
    return RamEstimate(steps_bytes=mem.steps_bytes, masks_bytes=mem.index_bytes,
                       sampler_bytes=mem.sampler_bytes, tail_bytes=mem.tail_bytes,
                       total_bytes=total, cache_budget_bytes=mem.cache.budget_bytes)


def priority_stats(store: ReplayStore) -> PriorityStats | None:
    """Min/mean/max raw priority over sampleable transitions; None for uniform stores."""
    state = store.views.priority_state()
    if state is None:
        return None
    p = state.sampleable
    some = p.size > 0
    return PriorityStats(
        count=int(p.size), min=float(p.min()) if some else None,
        mean=float(p.mean()) if some else None, max=float(p.max()) if some else None,
        max_priority=state.max_priority)


# -- episodes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EpisodeRow:
    """One episode with at least one kept frame.

    ``length`` counts all its steps (known from positions even when early frames were
    evicted); ``first_id`` and ``episode_return`` cover only its kept steps, which is all
    of them when ``fully_kept``.
    """

    env: int
    episode: int
    first_id: int | None
    last_id: int | None
    length: int
    kept_steps: int
    episode_return: float
    status: str  # "terminated", "truncated" or "running"
    fully_kept: bool


def episode_table(store: ReplayStore) -> tuple[EpisodeRow, ...]:
    """Every episode with a kept frame, by episode number (vectorized over frames)."""
    ring = store.views.step_columns()
    env, frames = ring.kept_frames()
    if env.size == 0:
        return ()
    cols = ring.steps[env, frames % ring.slots_per_env]
    order = np.argsort(cols["episode"], kind="stable")  # an episode's frames stay in order
    env, cols = env[order], cols[order]
    starts = np.flatnonzero(np.r_[True, cols["episode"][1:] != cols["episode"][:-1]])
    step = cols["has_step"]
    kept_steps = np.add.reduceat(step.astype(np.int64), starts)
    columns = {
        "env": env[starts],
        "episode": cols["episode"][starts],
        "first_id": np.minimum.reduceat(np.where(step, cols["id"], np.iinfo(np.int64).max),
                                        starts),
        "last_id": np.maximum.reduceat(np.where(step, cols["id"], -1), starts),
        "length": np.maximum.reduceat(cols["pos"], starts),
        "kept_steps": kept_steps,
        "episode_return": np.add.reduceat(
            np.where(step, cols["reward"].astype(np.float64), 0.0), starts),
        "fully_kept": np.minimum.reduceat(cols["pos"], starts) == 0,
    }
    status = _episode_status(ring, columns["env"], columns["episode"],
                             np.logical_or.reduceat(step & cols["terminated"], starts))
    return tuple(_episode_row({k: v[i].item() for k, v in columns.items()}, status[i])
                 for i in range(starts.size))


def _episode_row(values: dict[str, Any], status: str) -> EpisodeRow:
    if values["kept_steps"] == 0:
        values["first_id"] = values["last_id"] = None
    return EpisodeRow(status=status, **values)


def _episode_status(ring: StepColumns, env: np.ndarray, episode: np.ndarray,
                    terminated: np.ndarray) -> list[str]:
    """Ended by termination, still running (its env's current episode) or else truncated."""
    last = (ring.written - 1) % ring.slots_per_env
    newest = ring.steps["episode"][np.arange(ring.num_envs), last]
    running = ring.running[env] & (newest[env] == episode)
    return np.where(terminated, "terminated",
                    np.where(running, "running", "truncated")).tolist()


def sort_episodes(rows: Sequence[EpisodeRow], by: str) -> list[EpisodeRow]:
    """By episode number (ascending), or by return / length (largest first)."""
    if by not in SORT_KEYS:
        raise InvalidInputError(f"sort key must be one of {list(SORT_KEYS)}, got {by!r}")
    if by == "episode":
        return sorted(rows, key=lambda r: r.episode)
    if by == "return":
        return sorted(rows, key=lambda r: (-r.episode_return, r.episode))
    return sorted(rows, key=lambda r: (-r.length, r.episode))


# -- sample ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FieldSummary:
    name: str
    shape: tuple[int, ...]
    dtype: str
    min: float
    max: float


def sample_summary(store: ReplayStore, batch_size: int, *, seed: int | None = None,
                   beta: float = 0.4) -> tuple[FieldSummary, ...]:
    """Draw one batch (in memory only) and describe each field.

    Without `seed` the draw uses the store's persisted RNG state: the batch the
    writer would draw next. Nothing is written back.
    """
    batch = draw_batch(store, batch_size, seed=seed, beta=beta)
    out = []
    columns = {name: getattr(batch, name) for name in batch.__dataclass_fields__
               if name != "extras"}
    columns.update({f"extras.{name}": value for name, value in batch.extras.items()})
    for name, tensor in columns.items():
        values = tensor.numpy()
        out.append(FieldSummary(name=name, shape=tuple(values.shape), dtype=str(values.dtype),
                                min=float(values.min()), max=float(values.max())))
    return tuple(out)


def draw_batch(store: ReplayStore, batch_size: int, *, seed: int | None = None,
               beta: float = 0.4) -> Any:
    """One `Batch` drawn as the store's sampler draws (in memory only, nothing written).

    With `seed` the draw uses a fresh RNG seeded with it (repeatable); without, the store's
    persisted RNG state (the batch the writer would draw next).
    """
    if seed is not None:
        store.reseed(seed)
    return store.sample(batch_size, beta=beta)


# -- the viewer's poll -------------------------------------------------------------------
def committed_generation(path: str | os.PathLike[str]) -> int | None:
    """Generation of the store's manifest on disk now (cheap: one small file); None if it
    cannot be read (no store there, or a manifest being replaced)."""
    return _committed_generation(Path(path))
