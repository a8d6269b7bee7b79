"""What the viewer serves, as JSON-ready dicts and image bytes, from one read-only store.

`StoreData` opens the store read-only (as ``mmreplay info`` does: no lock, nothing written,
safe beside a writer; a bucket URL is opened the same way). Each request first compares
the committed generation (`follow.py`: a stat of the manifest) with the one it holds and
reopens the store when a writer has committed since; if that reopen fails (a half-written
or damaged store) it keeps serving the generation it has and says so in `status`.
Everything derived (the episode table and its sort orders, decoded episodes, encoded PNGs)
is cached per generation and dropped when it moves.

Costs: a request pays O(page) (a page of episodes, one episode, one frame, one batch)
once the per-generation tables exist; building those is O(kept frames), once per
generation, like ``mmreplay episodes``.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError, InvalidStoreError, MmreplayError, UnknownIdError
from mmreplay.storage.objects import is_url
from mmreplay.store import ReplayStore
from mmreplay.tools import inspection as ins
from mmreplay.tools import render
from mmreplay.tools.images import as_images, is_image_shape, tile
from mmreplay.tools.steps import episode_frames, episode_steps, transition
from mmreplay.tools.view import follow, tables
from mmreplay.tools.view.health import DEFAULT_LIMIT_S, HealthCheck

PNG_CACHE = 4096  # encoded frames kept per generation (a few KiB each for Atari frames)
EPISODE_CACHE = 4  # decoded episodes kept per generation
MAX_BATCH = 64


class LRU:
    """A small least-recently-used mapping (callers hold the `StoreData` lock)."""

    def __init__(self, size: int) -> None:
        self.size, self.items = size, OrderedDict[Any, Any]()

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = self.items[key] = make()
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


class StoreData:
    """One store, followed across generations; every public method returns plain data."""

    def __init__(self, path: str | Path, *, verify_limit_s: float = DEFAULT_LIMIT_S) -> None:
        self.path: str | Path = path if is_url(path) else Path(path)
        self._probe = follow.probe(self.path)
        self.health = HealthCheck(None if is_url(path) else Path(path), limit_s=verify_limit_s,
                                  generation=self._probe.generation)
        self._lock = threading.RLock()
        self._store: ReplayStore | None = None
        self.follow_error: str | None = None
        self._failed: int | None = None  # the newest generation that could not be opened
        self._closed = False
        self._new_caches()

    def _new_caches(self) -> None:
        self._derived = LRU(16)  # the episode table, series, overview, sampling view
        self._items = LRU(256)  # episodes' steps, transitions' fields
        self._frames = LRU(EPISODE_CACHE)
        self._png = LRU(PNG_CACHE)

    # -- following the writer -------------------------------------------------------
    def store(self) -> ReplayStore:
        """The open store at the newest committed generation it could open."""
        with self._lock:
            if self._closed:
                raise InvalidInputError("the viewer's store was closed")
            on_disk = self._probe.generation()
            if self._store is None:
                self._open()
            elif on_disk is None:
                self.follow_error = "the manifest on disk cannot be read (damaged, or not a " \
                                    "store any more)"
            elif on_disk == self._store.generation:
                self.follow_error = None
            elif on_disk != self._failed:  # a generation that failed is not tried again
                try:
                    self._open()
                except (InvalidStoreError, OSError) as exc:
                    self._failed = on_disk
                    self.follow_error = f"generation {on_disk}: {exc}"
            assert self._store is not None
            return self._store

    def _open(self) -> None:
        new = ins.open_readonly(self.path)
        old, self._store = self._store, new
        self.follow_error = None
        self._new_caches()
        if old is not None:
            old.close()

    def close(self) -> None:
        self.health.close()
        with self._lock:
            self._closed = True
            if self._store is not None:
                self._store.close()
                self._store = None

    def cached(self, key: Any, make: Callable[[ReplayStore], Any], *,
               item: bool = False) -> Any:
        """`make(store)` once per generation (and per `key`). Per-episode or per-id results
        (`item`) have a cache of their own, so browsing many never evicts the tables."""
        with self._lock:
            store = self.store()
            return (self._items if item else self._derived).get(key, lambda: make(store))

    def warm(self) -> None:
        """Build what each view asks first (the episode table, series, overview, the first
        episode and its first frame and stacked state, the sampler's table) and import what
        batches need (torch: seconds, outside the lock), so that no first view pays for
        them. A store with nothing to draw, or one that fails here, is left for the
        requests to report."""
        try:
            first = self.episodes({"limit": "1"})["rows"]
            self.series()
            if first and is_image_shape(self.store().spec.obs_shape):
                self.frame_png(first[0]["episode"], 0)
                if first[0]["first_id"] is not None:
                    self.stack_png(first[0]["first_id"], "obs")
            self.first_episode()
            self.overview()
            importlib.import_module("mmreplay.torch_batch")
            self.sampling(1, 0, 0.4)  # the sampler's table, and torch (batches) imported
        except (MmreplayError, OSError, ValueError):
            return  # includes a store closed meanwhile

    # -- overview and status ----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            store = self.store()
            counts = store.counts
            return {"path": str(self.path), "generation": store.generation,
                    "episodes": counts.episodes, "transitions": counts.transitions,
                    "sampleable": counts.sampleable, "frames_kept": counts.frames_kept,
                    "follow_error": self.follow_error}

    def overview(self) -> dict[str, Any]:
        """`mmreplay info` of the store, named as given, with its directory's (or bucket's)
        top-level entries."""
        def make(store: ReplayStore) -> dict[str, Any]:
            if isinstance(self._probe, follow.UrlProbe):
                grouped = self._probe.entries()
                entries = [{"name": k, "files": v[0], "bytes": v[1]}
                           for k, v in sorted(grouped.items())[:tables.MAX_FILES]]
            else:
                entries = tables.directory_entries(store.path)
            return {**tables.overview(store), "path": str(self.path), "entries": entries,
                    "url": isinstance(self._probe, follow.UrlProbe)}

        return self.cached("overview", make)

    # -- episodes -----------------------------------------------------------------------
    def episodes(self, query: dict[str, str]) -> dict[str, Any]:
        table = self.cached("table", tables.EpisodeTable.of)
        return table.page(tables.PageQuery.parse(query))

    def series(self) -> dict[str, Any]:
        return self.cached("series", lambda s: self.cached("table", tables.EpisodeTable.of)
                           .series())

    def episode(self, episode: int) -> dict[str, Any]:
        return self.cached(("episode", episode),
                           lambda s: tables.episode_json(s, _known(episode_steps, s,
                                                                   episode)), item=True)

    def first_episode(self) -> dict[str, Any]:
        """The steps of the lowest-numbered kept episode; ``{"episode": None}`` if none."""
        rows = self.episodes({"limit": "1"})["rows"]
        return self.episode(rows[0]["episode"]) if rows else {"episode": None}

    def frame_png(self, episode: int, t: int) -> bytes:
        def make(store: ReplayStore) -> bytes:
            frames = self.episode_images(episode)
            if not 0 <= t < len(frames):
                raise UnknownIdError(f"episode {episode} has {len(frames)} kept "
                                     f"frames; frame {t} is not one of them")
            return render.png_bytes(frames[t])

        return self._image_png(("frame", episode, t), make)

    def _image_png(self, key: tuple[Any, ...], make: Callable[[ReplayStore], bytes]) -> bytes:
        """The PNG cached under `key`, else ``make(store)`` (an image store only)."""
        with self._lock:
            store = self.store()
            self._require_images(store)
            return self._png.get(key, lambda: make(store))

    def episode_images(self, episode: int) -> np.ndarray:
        """The kept frames of `episode` as uint8 images (decoded once per generation)."""
        with self._lock:
            store = self.store()
            self._require_images(store)
            return self._frames.get(episode, lambda: as_images(
                _known(episode_frames, store, episode)))

    def episode_gif(self, episode: int, *, fps: int, scale: int) -> bytes:
        return render.gif_bytes(self.episode_images(episode), fps=fps, scale=scale)

    def episode_mp4(self, episode: int, *, fps: int, scale: int, lossless: bool) -> bytes:
        return render.mp4_bytes(self.episode_images(episode), fps=fps, scale=scale,
                                lossless=lossless)

    # -- transitions and sampling ---------------------------------------------------------
    def transition(self, tid: int) -> dict[str, Any]:
        return self.cached(("transition", tid),
                           lambda s: tables.transition_json(transition(s, tid)), item=True)

    def stack_png(self, tid: int, which: str) -> bytes:
        def make(store: ReplayStore) -> bytes:
            view = transition(store, tid)
            return _stack_png(view.obs if which == "obs" else view.next_obs)

        return self._image_png((which, tid), make)

    def sampling(self, batch_size: int, seed: int | None, beta: float) -> dict[str, Any]:
        if not 1 <= batch_size <= MAX_BATCH:
            raise InvalidInputError(f"batch must be 1..{MAX_BATCH}, got {batch_size}")
        with self._lock:
            store = self.store()
            out = self.cached("sampling", tables.sampling_json)
            if store.counts.sampleable == 0:
                return {**out, "batch": None}
            batch = ins.draw_batch(store, batch_size, seed=seed, beta=beta)
            if is_image_shape(store.spec.obs_shape):
                for i, tid in enumerate(batch.ids.tolist()):  # the PNGs the page asks next
                    self._png.get(("obs", tid), functools.partial(_stack_png,
                                                                  batch.obs[i].numpy()))
            return {**out, "batch": tables.batch_json(batch, out["next_id"])}

    @staticmethod
    def _require_images(store: ReplayStore) -> None:
        shape = tuple(store.spec.obs_shape)
        if not is_image_shape(shape):
            raise InvalidInputError(f"observations of shape {shape} are not images; this "
                                    f"store has no frames to draw")



def _known(read: Callable[[ReplayStore, int], Any], store: ReplayStore, episode: int) -> Any:
    """`read(store, episode)`; an episode with no kept frame is an unknown one (404)."""
    try:
        return read(store, episode)
    except InvalidInputError as exc:
        raise UnknownIdError(str(exc)) from None


def _stack_png(stack: np.ndarray) -> bytes:
    """A stacked state ``(frame_stack, *obs_shape)`` as one PNG, oldest frame left."""
    return render.png_bytes(tile(as_images(stack), cols=len(stack)))
