"""Read-only inspection of a store on disk: summary, episode table, samples, images.

Every function here reads; nothing writes to a store. Stores are opened with
``mode="r"`` (no lock, no sweep), so inspecting a store another process is
writing is safe: a reader sees one committed generation, and an open or a
verify that raced a flush is retried once the generation has moved on.

Results are frozen dataclasses and numpy arrays. The terminal, image files and
plots belong to `cli.py`. A store is read through its public methods and its
read-only ``store.views`` (step columns, frames by slot, priorities, memory).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.index.ring import EXTRA_PREFIX, StepColumns
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


# -- frames and transitions -------------------------------------------------------------
@dataclass(frozen=True)
class TransitionView:
    """One transition as numpy: ``obs``/``next_obs`` are ``(frame_stack, *obs_shape)``."""

    id: int
    obs: np.ndarray
    next_obs: np.ndarray
    action: np.ndarray
    reward: float
    discount: float
    terminated: bool
    truncated: bool


def transition(store: ReplayStore, transition_id: int) -> TransitionView:
    """The sampleable transition `transition_id` (`UnknownIdError` if it is not)."""
    batch = store.get([transition_id])
    return TransitionView(
        id=int(transition_id), obs=batch.obs[0].numpy(), next_obs=batch.next_obs[0].numpy(),
        action=batch.action[0].numpy(), reward=float(batch.reward[0]),
        discount=float(batch.discount[0]), terminated=bool(batch.terminated[0]),
        truncated=bool(batch.truncated[0]))


def episode_frames(store: ReplayStore, episode: int) -> np.ndarray:
    """The kept frames of `episode` in order, ``(T, *obs_shape)``."""
    return store.views.read_frames(_episode_slots(store, episode))


def _episode_slots(store: ReplayStore, episode: int) -> np.ndarray:
    """Flat slots of the kept frames of `episode`, in frame order."""
    ring = store.views.step_columns()
    flat = ring.flat(*ring.kept_frames())
    mine = flat[ring.steps["episode"].reshape(-1)[flat] == episode]
    if mine.size == 0:
        raise InvalidInputError(f"episode {episode} has no kept frame in this store "
                                f"(see `mmreplay episodes` for the kept ones)")
    return mine


def as_images(frames: np.ndarray) -> np.ndarray:
    """Frames ``(N, *obs_shape)`` as uint8 images ``(N, H, W)`` or ``(N, H, W, C)``.

    Accepts (H, W), (H, W, C) and (C, H, W) observations with C in 1, 3, 4, and 1-D
    vectors (drawn as a one-pixel-high strip). Non-uint8 values are scaled min..max to 0..255.
    """
    shape = frames.shape[1:]
    if len(shape) == 1:
        frames = frames[:, None, :]
    elif len(shape) == 3 and shape[-1] not in (1, 3, 4) and shape[0] in (1, 3, 4):
        frames = np.moveaxis(frames, 1, -1)
    elif len(shape) != 2 and not (len(shape) == 3 and shape[-1] in (1, 3, 4)):
        raise InvalidInputError(f"cannot draw observations of shape {shape}: expected "
                                f"(H, W), (H, W, C) or (C, H, W) with C in 1, 3, 4")
    if frames.ndim == 4 and frames.shape[-1] == 1:
        frames = frames[..., 0]
    return _to_uint8(frames)


def _to_uint8(frames: np.ndarray) -> np.ndarray:
    if frames.dtype == np.uint8:
        return frames
    values = frames.astype(np.float64)
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if high <= low:
        return np.zeros(frames.shape, np.uint8)
    return np.round((values - low) * (255.0 / (high - low))).astype(np.uint8)


def tile(images: np.ndarray, *, cols: int, scale: int = 1, gap: int = 2,
         fill: int = 128) -> np.ndarray:
    """Lay images ``(N, H, W[, C])`` out row-major in a grid `cols` wide.

    Each image is enlarged `scale` times (nearest neighbour); cells are `gap` pixels
    apart on a `fill` background. Result: ``rows*H*scale + (rows-1)*gap`` high.
    """
    n = images.shape[0]
    rows = max(1, -(-n // cols))
    big = images.repeat(scale, axis=1).repeat(scale, axis=2)
    h, w = big.shape[1:3]
    out = np.full((rows * h + (rows - 1) * gap, cols * w + (cols - 1) * gap, *big.shape[3:]),
                  fill, np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        out[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = big[i]
    return out


# -- plot data ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Distributions:
    """What `mmreplay plot` draws: priorities of sampleable transitions (None when uniform),
    per-step rewards of kept steps, and lengths and returns of fully kept, ended episodes."""

    priorities: np.ndarray | None
    rewards: np.ndarray
    episode_lengths: np.ndarray
    episode_returns: np.ndarray


def distributions(store: ReplayStore) -> Distributions:
    ring = store.views.step_columns()
    env, frames = ring.kept_frames()
    cols = ring.steps[env, frames % ring.slots_per_env]
    done = [r for r in episode_table(store) if r.fully_kept and r.status != "running"]
    state = store.views.priority_state()
    return Distributions(
        priorities=None if state is None else state.sampleable,
        rewards=cols["reward"][cols["has_step"]].astype(np.float64),
        episode_lengths=np.array([r.length for r in done], np.int64),
        episode_returns=np.array([r.episode_return for r in done], np.float64))


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


# -- viewer data ----------------------------------------------------------------------------
def committed_generation(path: str | os.PathLike[str]) -> int | None:
    """Generation of the store's manifest on disk now (cheap: one small file); None if it
    cannot be read (no store there, or a manifest being replaced)."""
    return _committed_generation(Path(path))


def is_image_shape(obs_shape: Sequence[int]) -> bool:
    """True for observations `as_images` draws as pictures: (H, W), (H, W, C) or (C, H, W)
    with C in 1, 3, 4. Vectors and other layouts are not images."""
    shape = tuple(obs_shape)
    if len(shape) == 2:
        return True
    return len(shape) == 3 and (shape[-1] in (1, 3, 4) or shape[0] in (1, 3, 4))


@dataclass(frozen=True)
class EpisodeSteps:
    """The kept frames of one episode and the step taken from each; arrays are ``(T, ...)``.

    Frame ``t`` is o at episode position ``pos[t]``; its step (o, ``action[t]``,
    ``reward[t]``, next o) is transition ``ids[t]``, -1 where the frame has no step (the
    last frame of an ended episode, or the newest of a running one). ``priority`` is NaN
    for uniform stores and frames without a step.
    """

    episode: int
    env: int
    pos: np.ndarray
    ids: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    sampleable: np.ndarray
    priority: np.ndarray
    extras: dict[str, np.ndarray]


def episode_steps(store: ReplayStore, episode: int) -> EpisodeSteps:
    """Step columns of the kept frames of `episode` (`InvalidInputError` if none is kept)."""
    flat = _episode_slots(store, episode)
    ring = store.views.step_columns()
    cols = ring.steps.reshape(-1)[flat]
    has = cols["has_step"]
    prio = np.full(flat.size, np.nan)
    state = store.views.priority_state()
    if state is not None:  # priorities of sampleable transitions, in flat-slot order
        valid = np.flatnonzero(ring.valid)
        where = np.searchsorted(valid, flat)
        hit = ring.valid[flat]
        prio[hit] = state.sampleable[where[hit]]
    extras = {name: cols[EXTRA_PREFIX + name] for name, _, _ in store.spec.extras}
    return EpisodeSteps(
        episode=int(episode), env=int(flat[0] // ring.slots_per_env), pos=cols["pos"].copy(),
        ids=np.where(has, cols["id"], -1), action=cols["action"].copy(),
        reward=cols["reward"].astype(np.float64), terminated=cols["terminated"] & has,
        truncated=cols["truncated"] & has, sampleable=ring.valid[flat].copy(), priority=prio,
        extras={k: np.where(_rows(has, v), v, 0) for k, v in extras.items()})


def _rows(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    """`mask` (N,) shaped to broadcast over an (N, ...) array."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - 1))


@dataclass(frozen=True)
class SamplingView:
    """What the sampler draws from: every sampleable id (increasing), the exact probability
    of drawing it, and its raw priority (None for uniform stores). ``next_id`` is the id
    the next transition will get, so ``next_id - 1 - ids`` are the ages in transitions."""

    sampler: str
    ids: np.ndarray
    probabilities: np.ndarray
    priorities: np.ndarray | None
    next_id: int

    @property
    def effective_sample_size(self) -> float:
        """``1 / sum(p^2)``: as many ids as a uniform draw over that many would cover
        (equal to the count for a uniform sampler); 0 when nothing is sampleable."""
        total = float(np.square(self.probabilities).sum())
        return 1.0 / total if total > 0 else 0.0


def sampling_view(store: ReplayStore) -> SamplingView:
    """From the raw priorities: ``(p + eps)^alpha`` (prioritized) or ``rank^-alpha`` with
    exact ranks (rank; the sampler's lazily re-sorted ranks may differ slightly)."""
    ring = store.views.step_columns()
    flat = np.flatnonzero(ring.valid)
    ids = ring.steps["id"].reshape(-1)[flat]
    order = np.argsort(ids, kind="stable")
    state = store.views.priority_state()
    spec = store.spec
    if state is None or ids.size == 0:
        prios = None if state is None else state.sampleable[order]
        probs = np.full(ids.size, 1.0 / ids.size) if ids.size else np.zeros(0)
    else:
        prios = state.sampleable[order]
        if spec.sampler == "rank":
            ranks = np.empty(prios.size)
            ranks[np.lexsort((flat[order], -prios))] = np.arange(1, prios.size + 1)
            mass = ranks ** -spec.alpha
        else:
            mass = (prios + spec.priority_eps) ** spec.alpha
        probs = mass / mass.sum() if mass.sum() > 0 else np.full(ids.size, 1.0 / ids.size)
    return SamplingView(sampler=spec.sampler, ids=ids[order], probabilities=probs,
                        priorities=prios, next_id=int(ring.next_id))
