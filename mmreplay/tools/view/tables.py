"""The viewer's JSON: a store's figures turned into small dicts the page draws.

Pure functions of what `tools.inspection` returns (no HTTP, no caching: `data.py` owns
those). Floats that are NaN or infinite become ``null``, which JSON can carry.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError
from mmreplay.store import ReplayStore
from mmreplay.tools import inspection as ins
from mmreplay.tools.distributions import sampling_view
from mmreplay.tools.images import is_image_shape
from mmreplay.tools.steps import EpisodeSteps, TransitionView

MAX_PAGE = 500
SERIES_POINTS = 1000  # return/length plot: at most this many points (means of buckets)
RING_BINS = 400
AGE_BINS = 40
MAX_FILES = 40  # the overview lists at most this many entries of the store directory
STATUSES = ("terminated", "truncated", "running")
SORTS = ("episode", "env", "length", "return", "first_id")


def number(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def numbers(values: np.ndarray) -> list[Any]:
    """A numeric array as a JSON list (NaN and inf -> None)."""
    if values.dtype.kind in "biu":
        return values.tolist()  # type: ignore[no-any-return]
    floats = values.astype(np.float64)
    if np.isfinite(floats).all():
        return floats.tolist()  # type: ignore[no-any-return]
    return [_nested_none(v) for v in floats.tolist()]


def _nested_none(value: Any) -> Any:
    if isinstance(value, list):
        return [_nested_none(v) for v in value]
    return value if math.isfinite(value) else None


# -- overview -------------------------------------------------------------------------------
def overview(store: ReplayStore) -> dict[str, Any]:
    """What ``mmreplay info --json`` prints, plus whether observations are images."""
    info = ins.store_info(store).to_dict()
    info["images"] = is_image_shape(store.spec.obs_shape)
    info["disk"]["compression_ratio"] = number(info["disk"]["compression_ratio"] or math.nan)
    return info


def directory_entries(root: Path) -> list[dict[str, Any]]:
    """Top-level entries of the store directory: name, kind, files and bytes under it."""
    out = []
    with os.scandir(root) as it:
        for entry in sorted(it, key=lambda e: e.name)[:MAX_FILES]:
            if entry.is_dir(follow_symlinks=False):
                files, size = _tree_size(Path(entry.path))
                out.append({"name": entry.name + "/", "files": files, "bytes": size})
            elif entry.is_file(follow_symlinks=False):
                out.append({"name": entry.name, "files": 1,
                            "bytes": entry.stat(follow_symlinks=False).st_size})
    return out


def _tree_size(root: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                size += (Path(dirpath) / name).lstat().st_size
                files += 1
            except FileNotFoundError:  # removed by a writer meanwhile
                continue
    return files, size


# -- episode table ------------------------------------------------------------------------
@dataclass(frozen=True)
class PageQuery:
    """A page request: sort key and direction, filters, offset and limit."""

    sort: str = "episode"
    descending: bool = False
    status: str | None = None
    env: int | None = None
    kept: str | None = None  # "yes" or "partial"
    offset: int = 0
    limit: int = 50

    @classmethod
    def parse(cls, query: dict[str, str]) -> PageQuery:
        sort = query.get("sort", "episode")
        _choice("sort", sort, SORTS)
        status = query.get("status") or None
        if status is not None:
            _choice("status", status, STATUSES)
        kept = query.get("kept") or None
        if kept is not None:
            _choice("kept", kept, ("yes", "partial"))
        env = query.get("env") or None
        return cls(sort=sort, descending=query.get("order", "asc") == "desc", status=status,
                   env=None if env is None else int_param("env", env, 0, 1 << 20),
                   kept=kept, offset=int_param("offset", query.get("offset", "0"), 0, 1 << 62),
                   limit=int_param("limit", query.get("limit", "50"), 1, MAX_PAGE))


def int_param(name: str, text: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidInputError(f"{name} must be an integer, got {text[:40]!r}") from None
    if not low <= value <= high:
        raise InvalidInputError(f"{name} must be in {low}..{high}, got {value}")
    return value


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidInputError(f"{name} must be one of {list(allowed)}, got {value[:40]!r}")


class EpisodeTable:
    """The episode table of one generation as columns, with cached sort orders."""

    def __init__(self, rows: tuple[ins.EpisodeRow, ...]) -> None:
        def col(name: str, dtype: Any) -> np.ndarray:
            return np.array([getattr(r, name) for r in rows], dtype)

        self.rows = rows
        self.cols = {"episode": col("episode", np.int64), "env": col("env", np.int64),
                     "length": col("length", np.int64),
                     "return": col("episode_return", np.float64),
                     "first_id": np.array([-1 if r.first_id is None else r.first_id
                                           for r in rows], np.int64),
                     "status": col("status", object), "fully_kept": col("fully_kept", bool)}
        self._orders: dict[tuple[str, bool], np.ndarray] = {}

    @classmethod
    def of(cls, store: ReplayStore) -> EpisodeTable:
        return cls(ins.episode_table(store))

    def order(self, key: str, descending: bool) -> np.ndarray:
        if (key, descending) not in self._orders:
            values = self.cols[key]
            order = np.lexsort((self.cols["episode"], -values if descending else values))
            self._orders[(key, descending)] = order
        return self._orders[(key, descending)]

    def page(self, q: PageQuery) -> dict[str, Any]:
        order = self.order(q.sort, q.descending)
        keep = np.ones(order.size, bool)
        if q.status is not None:
            keep &= self.cols["status"][order] == q.status
        if q.env is not None:
            keep &= self.cols["env"][order] == q.env
        if q.kept is not None:
            keep &= self.cols["fully_kept"][order] == (q.kept == "yes")
        chosen = order[keep]
        shown = chosen[q.offset:q.offset + q.limit]
        return {"total": len(self.rows), "matching": int(chosen.size), "offset": q.offset,
                "limit": q.limit, "rows": [row_json(self.rows[i]) for i in shown.tolist()]}

    def series(self) -> dict[str, Any]:
        """Return and length over episode number, as means over buckets of `bucket`
        episodes (1 for stores with at most SERIES_POINTS ended episodes)."""
        ended = self.cols["status"] != "running"
        episode = self.cols["episode"][ended]
        n = episode.size
        bucket = max(1, math.ceil(n / SERIES_POINTS))
        starts = np.arange(0, n, bucket)
        order = np.argsort(episode, kind="stable")

        def means(values: np.ndarray) -> list[Any]:
            if n == 0:
                return []
            sums = np.add.reduceat(values[order].astype(np.float64), starts)
            return numbers(sums / np.diff(np.r_[starts, n]))

        return {"bucket": bucket, "episode": episode[order][starts].tolist() if n else [],
                "return": means(self.cols["return"][ended]),
                "length": means(self.cols["length"][ended])}


def row_json(r: ins.EpisodeRow) -> dict[str, Any]:
    return {"env": r.env, "episode": r.episode, "first_id": r.first_id, "last_id": r.last_id,
            "length": r.length, "kept_steps": r.kept_steps,
            "return": number(r.episode_return), "status": r.status, "fully_kept": r.fully_kept}


# -- one episode, one transition, a batch ----------------------------------------------------
def episode_json(store: ReplayStore, steps: EpisodeSteps) -> dict[str, Any]:
    spec = store.spec
    return {
        "episode": steps.episode, "env": steps.env, "frames": int(steps.pos.size),
        "images": is_image_shape(spec.obs_shape), "frame_stack": spec.frame_stack,
        "n_step": spec.n_step, "gamma": spec.gamma, "sampler": spec.sampler,
        "pos": steps.pos.tolist(), "ids": steps.ids.tolist(),
        "action": numbers(steps.action), "reward": numbers(steps.reward),
        "terminated": steps.terminated.tolist(), "truncated": steps.truncated.tolist(),
        "sampleable": steps.sampleable.tolist(), "priority": numbers(steps.priority),
        "extras": {k: extra_json(v) for k, v in steps.extras.items()},
        **nstep_targets(steps, n_step=spec.n_step, gamma=spec.gamma)}


def nstep_targets(steps: EpisodeSteps, *, n_step: int, gamma: float) -> dict[str, Any]:
    """Per frame, the n-step return and discount a batch holds for the transition starting
    there (``null`` where it is not sampleable): the window runs `n_step` steps or to the
    episode's end; discount is 0 if it ends terminated, else ``gamma ** steps`` (the
    store's own rule; the tests compare with `ReplayStore.get`).

    O(episode length * n_step), over the episode's arrays only."""
    t = steps.ids.size
    has = steps.ids >= 0
    alive, ended = has.copy(), np.zeros(t, bool)
    ret, m = np.zeros(t), np.zeros(t, np.int64)
    for j in range(n_step):
        u = np.minimum(np.arange(t) + j, t - 1)
        step = alive & (np.arange(t) + j < t) & has[u]
        ret += np.where(step, gamma ** j * steps.reward[u], 0.0)
        m += step
        stop_t, stop = step & steps.terminated[u], step & (steps.terminated[u] | steps.truncated[u])
        ended |= stop_t
        alive = step & ~stop
    discount = np.where(ended, 0.0, np.power(gamma, m))
    keep = steps.sampleable & has
    return {"n_step_return": numbers(np.where(keep, ret, np.nan)),
            "discount": numbers(np.where(keep, discount, np.nan))}


def extra_json(values: np.ndarray) -> dict[str, Any]:
    """A per-step extra: scalars as they are; wider ones as their per-step mean."""
    shape = list(values.shape[1:])
    if values.ndim == 1:
        return {"shape": shape, "summary": "value", "values": numbers(values)}
    means = values.reshape(values.shape[0], -1).astype(np.float64).mean(axis=1)
    return {"shape": shape, "summary": "mean", "values": numbers(means)}


def transition_json(view: TransitionView) -> dict[str, Any]:
    return {"id": view.id, "action": numbers(view.action), "reward": number(view.reward),
            "discount": number(view.discount), "terminated": view.terminated,
            "truncated": view.truncated, "frame_stack": int(view.obs.shape[0])}


def sampling_json(store: ReplayStore) -> dict[str, Any]:
    view = sampling_view(store)
    n = view.ids.size
    out: dict[str, Any] = {"sampler": view.sampler, "sampleable": int(n),
                           "images": is_image_shape(store.spec.obs_shape),
                           "next_id": view.next_id,
                           "effective_sample_size": view.effective_sample_size}
    if n == 0:
        return {**out, "ring": None, "ages": None}
    bins = min(RING_BINS, n)
    edges = np.linspace(0, n, bins + 1).astype(np.int64)
    starts = edges[:-1]
    counts = np.diff(edges)
    mean_p = np.add.reduceat(view.probabilities, starts) / counts
    ring = {"first_id": view.ids[starts].tolist(), "count": counts.tolist(),
            "probability": numbers(mean_p), "max_priority": None}
    if view.priorities is not None:
        ring["max_priority"] = numbers(np.maximum.reduceat(view.priorities, starts))
    ages = view.next_id - 1 - view.ids
    mass, age_edges = np.histogram(ages, bins=min(AGE_BINS, n), weights=view.probabilities)
    return {**out, "ring": ring, "ages": {"edges": numbers(age_edges),
                                          "probability": numbers(mass)}}


def batch_json(batch: Any, next_id: int) -> dict[str, Any]:
    ids = batch.ids.numpy()
    return {"ids": ids.tolist(), "age": (next_id - 1 - ids).tolist(),
            "weights": numbers(batch.weights.numpy()), "action": numbers(batch.action.numpy()),
            "reward": numbers(batch.reward.numpy()), "discount": numbers(batch.discount.numpy()),
            "terminated": batch.terminated.numpy().tolist(),
            "truncated": batch.truncated.numpy().tolist()}
