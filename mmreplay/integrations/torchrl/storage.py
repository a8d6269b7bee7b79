"""`FrameOnceStorage`: a TorchRL `Storage` whose contents are an mmreplay store.

Directory (the checkpoint; nothing in it is pickled)::

    <path>/store/          the ReplayStore (manifest, frames, step columns, RNG, priorities)
    <path>/torchrl.json    the `KeyLayout`: which TensorDict entry is which store column

Indices are the store's transition ids (unique, increasing, never reused), so an index
handed out by ``extend`` or ``sample`` names one transition for as long as it is kept.
The storage is written by `FrameOnceWriter` (``extend`` -> `StreamRecorder`) and sampled by
`FrameOnceSampler` (the store's own uniform or prioritized draw); ``get`` rebuilds stacks
and next stacks from frames kept once.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import Storage

from mmreplay.errors import InvalidInputError
from mmreplay.integrations.torchrl.layout import (
    ACTION,
    DONE,
    REWARD,
    TERMINATED,
    TRAJ_IDS,
    TRUNCATED,
    Key,
    KeyLayout,
    check_stack_shape,
    infer_layout,
)
from mmreplay.integrations.torchrl.stream import Steps, StreamRecorder, detect_padding, flags
from mmreplay.storage.safe_io import write_atomic
from mmreplay.store import ReplayStore
from mmreplay.torch_batch import Batch

LAYOUT_FILE = "torchrl.json"
POINTER_FILE = "frame_once.json"  # what ``dumps`` writes: where the store is, which generation
POINTER_VERSION = 1
PADDINGS = ("auto", "first", "zero")


class FrameOnceStorage(Storage):
    """A TorchRL storage that keeps every frame once, in an mmreplay store at `path`.

    Created on the first ``extend`` (as `LazyMemmapStorage` is), from that batch's entries;
    opened if `path` already holds one (resume). `frame_stack`: frames per ``"pixels"``
    stack; ``stacked=True``: ``"pixels"`` arrive stacked by ``CatFrames(N=frame_stack,
    dim=-3)`` and only each step's newest frame is written; ``False``: single frames,
    stacked on sample. `stack_padding`: how an episode's first stack is padded ("auto":
    seen in the first batch). `num_envs`: env rows of a 2-d batch (default: the first
    batch's); `time_dim`: the time dimension of 2-d batches not named by the collector
    (``names[-1] == "time"``). `sampler`/`alpha`: the store's ("uniform", "prioritized").
    ``store_options`` go to `ReplayStore.create` (``codec``, ``cache_bytes``, ``seed``...).
    """

    def __init__(self, path: str | os.PathLike[str], max_size: int, *, frame_stack: int = 4,
                 stacked: bool = True, stack_padding: str = "auto", num_envs: int | None = None,
                 time_dim: int = -1, sampler: str = "uniform", alpha: float = 0.6,
                 pixels_key: str | tuple[str, ...] = "pixels", exclude_keys: Any = (),
                 **store_options: Any) -> None:
        super().__init__(max_size)
        if stack_padding not in PADDINGS:
            raise InvalidInputError(f"stack_padding must be one of {PADDINGS}, got "
                                    f"{stack_padding!r}")
        self.path = Path(path)
        self.frame_stack, self.stacked, self.stack_padding = frame_stack, stacked, stack_padding
        self.num_envs, self.time_dim = num_envs, time_dim
        self.pixels_key = _key(pixels_key)
        self.exclude_keys = tuple(_key(k) for k in exclude_keys)
        self.store_options = {"sampler": sampler, "alpha": alpha, **store_options}
        self.store: ReplayStore | None = None
        self.layout: KeyLayout | None = None
        self.recorder: StreamRecorder | None = None
        self._held: tuple[torch.Tensor, Batch] | None = None
        if (self.path / LAYOUT_FILE).exists():
            self.open()

    # -- opening ---------------------------------------------------------------------
    def open(self) -> None:
        """Open the store at `path` (written before) and its layout."""
        self.close()
        layout = KeyLayout.from_dict(json.loads((self.path / LAYOUT_FILE).read_text()))
        store = ReplayStore.open(self.path / "store")
        want = (self.max_size, self.store_options["sampler"])
        if (store.spec.capacity, store.spec.sampler) != want:
            store.close()
            raise InvalidInputError(
                f"{self.path} holds a store of capacity {store.spec.capacity} sampling "
                f"{store.spec.sampler!r}, expected max_size {want[0]} sampling {want[1]!r}")
        self.store, self.layout = store, layout
        self.recorder = StreamRecorder(layout, store.spec.num_envs)

    def _create(self, entries: dict[Key, np.ndarray], steps_shape: tuple[int, int]) -> None:
        padding = self.stack_padding
        if self.stacked:
            check_stack_shape(entries[self.pixels_key].shape[2:], self.frame_stack)
        if padding == "auto":
            first = entries[self.pixels_key].reshape(-1, *entries[self.pixels_key].shape[2:])[0]
            padding = detect_padding(first, self.frame_stack) if self.stacked else "first"
        layout = infer_layout(entries, batch_dims=2, pixels_key=self.pixels_key,
                              frame_stack=self.frame_stack, stacked=self.stacked,
                              stack_padding=padding, exclude=self.exclude_keys)
        num_envs = self.num_envs or steps_shape[0]
        self.path.mkdir(parents=True, exist_ok=True)
        store = ReplayStore.create(
            self.path / "store", capacity=self.max_size, obs_shape=layout.frame_shape,
            obs_dtype=layout.pixels.dtype, num_envs=num_envs, frame_stack=self.frame_stack,
            stack_padding=padding, action_shape=layout.action.shape,
            action_dtype=layout.action.dtype, extras=layout.store_extras() or None,
            **self.store_options)
        text = json.dumps(layout.to_dict(), indent=1).encode()
        write_atomic(self.path / LAYOUT_FILE, text, self.path, durable=False)
        self.store, self.layout = store, layout
        self.recorder = StreamRecorder(layout, num_envs)

    def close(self) -> None:
        """Flush and close the store (the storage opens it again on ``loads``)."""
        if self.store is not None:
            self.store.close()
        self.store = self.layout = self.recorder = None

    # -- writing ---------------------------------------------------------------------
    def record(self, data: TensorDictBase) -> torch.Tensor:
        """Write a collector batch (``[T]``, or 2-d with a time dim); returns its ids."""
        if not isinstance(data, TensorDictBase):
            raise InvalidInputError(f"extend takes a TensorDict, got {type(data).__name__}")
        time_dim = _time_dim(data, self.time_dim)
        entries = _entries(data, time_dim)
        rows = next(iter(entries.values())).shape[:2]
        if self.store is None:
            self._create(entries, rows)
        assert self.recorder is not None and self.store is not None
        if data.ndim == 2 and rows[0] != self.store.spec.num_envs:
            raise InvalidInputError(f"a 2-d batch has {rows[0]} env rows, expected num_envs="
                                    f"{self.store.spec.num_envs}")
        ids = _recorded(self.recorder, self.store, self._steps(entries))
        self._bump_mutation_revision()
        out = torch.from_numpy(ids)
        return out[0] if data.ndim == 1 else out.movedim(1, time_dim)

    def _steps(self, entries: dict[Key, np.ndarray]) -> Steps:
        layout = self.layout
        assert layout is not None
        got = {k: a.shape[2:] for k, a in entries.items()}
        want = {c.key: c.shape for c in (layout.pixels, layout.action, layout.reward,
                                          *layout.extras)}
        want[("next", *layout.pixels_key)] = layout.pixels.shape
        for key, shape in want.items():
            if got.get(key) != shape:
                raise InvalidInputError(f"entry {key} per-step shape {got.get(key)} != "
                                        f"expected {shape} (the storage's first batch)")
        term = flags(entries[TERMINATED], "('next', 'terminated')", layout.flag_shape)
        trunc = flags(entries[TRUNCATED], "('next', 'truncated')", layout.flag_shape)
        if DONE in entries and (flags(entries[DONE], "('next', 'done')", layout.flag_shape)
                                != (term | trunc)).any():
            raise InvalidInputError("('next', 'done') != terminated | truncated")
        reward = entries[REWARD].reshape(entries[REWARD].shape[:2])
        return Steps(pixels=entries[layout.pixels_key],
                     next_pixels=entries[("next", *layout.pixels_key)],
                     action=entries[ACTION], reward=reward, terminated=term, truncated=trunc,
                     traj=entries.get(TRAJ_IDS),
                     extras={n: entries[c.key] for n, c in layout.extra_names().items()})

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        """What TorchRL's own samplers draw from: refused (they draw positions 0..len-1;
        this storage's indices are transition ids, drawn by `FrameOnceSampler`)."""
        raise NotImplementedError("FrameOnceStorage is sampled by FrameOnceSampler: its "
                                  "indices are the store's transition ids, not positions")

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        raise NotImplementedError("FrameOnceStorage is written by extend (FrameOnceWriter): "
                                  "stored transitions cannot be overwritten in place")

    # -- reading ---------------------------------------------------------------------
    def draw(self, batch_size: int, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The store's draw of `batch_size` transitions: (ids, importance weights); the
        batch is held for the ``get`` of those ids that follows (one read, not two)."""
        batch = self.opened().sample(batch_size, beta)
        self._held = (batch.ids, batch)
        return batch.ids, batch.weights

    def get(self, index: Any) -> TensorDictBase:
        held, self._held = self._held, None
        if held is not None and held[0] is index:
            return self.to_tensordict(held[1])
        ids = torch.as_tensor(index).reshape(-1).numpy()
        return self.to_tensordict(self.opened().get(ids))

    def to_tensordict(self, batch: Batch) -> TensorDictBase:
        """A sampled batch in TorchRL's layout (see `layout`)."""
        layout = self.layout
        assert layout is not None
        size, shape = len(batch), layout.sample_pixels_shape
        flag = (size, *layout.flag_shape)
        term, trunc = batch.terminated.reshape(flag), batch.truncated.reshape(flag)
        reward = batch.reward.reshape(size, *layout.reward.shape)
        out = TensorDict(batch_size=[size])
        for key, value in ((layout.pixels_key, batch.obs.reshape(size, *shape)),
                           (ACTION, batch.action),
                           (("next", *layout.pixels_key), batch.next_obs.reshape(size, *shape)),
                           (REWARD, reward.to(getattr(torch, layout.reward.dtype))),
                           (TERMINATED, term), (TRUNCATED, trunc), (DONE, term | trunc),
                           *((c.key, batch.extras[n]) for n, c in layout.extra_names().items())):
            out.set(key, value)
        return out

    def __len__(self) -> int:
        return 0 if self.store is None else len(self.store)

    def contains(self, item: Any) -> Any:
        ids = torch.as_tensor(item)
        if self.store is None:
            return torch.zeros(ids.shape, dtype=torch.bool)
        return torch.from_numpy(np.isin(ids.numpy(), self.store.valid_ids()))

    # -- persistence -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Flushes the store; the state is where it is and which generation (no frames)."""
        store = self.opened()
        store.flush()
        return {"version": POINTER_VERSION, "path": str(self.path.resolve()),
                "generation": store.generation, "transitions": store.counts.transitions}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != POINTER_VERSION:
            raise InvalidInputError(f"storage state version {state_dict.get('version')!r} "
                                    f"!= supported {POINTER_VERSION}")
        path = Path(state_dict["path"])
        if self.store is None or path.resolve() != self.path.resolve():
            self.path = path
            self.open()
        store = self.opened()
        if store.counts.transitions != state_dict["transitions"]:
            warnings.warn(f"{path}: the store holds {store.counts.transitions} transitions "
                          f"since creation, the save {state_dict['transitions']}: it committed "
                          f"generation {store.generation} after the saved "
                          f"{state_dict['generation']} and resumes from that", stacklevel=2)
        assert self.recorder is not None
        self.recorder.forget()
        self._bump_mutation_revision()

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Flush the store (the checkpoint) and write a small JSON pointer to it at `path`."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.state_dict()).encode()
        write_atomic(folder / POINTER_FILE, text, folder, durable=False)

    def loads(self, path: str | os.PathLike[str]) -> None:
        """Open the store a `dumps` at `path` points to (see `load_state_dict`)."""
        self.load_state_dict(json.loads((Path(path) / POINTER_FILE).read_text()))

    def _empty(self) -> None:
        raise NotImplementedError("a FrameOnceStorage is its store on disk: to start over, "
                                  "close it and delete its directory")

    def opened(self) -> ReplayStore:
        """The store, once the first ``extend`` created it (or it was opened)."""
        if self.store is None:
            raise InvalidInputError(f"{self.path}: nothing stored yet (extend first)")
        return self.store

    def __repr__(self) -> str:
        return (f"FrameOnceStorage({str(self.path)!r}, max_size={self.max_size}, "
                f"len={len(self)})")


def _key(key: str | tuple[str, ...]) -> Key:
    return (key,) if isinstance(key, str) else tuple(key)


def _time_dim(data: TensorDictBase, default: int) -> int:
    """1 for ``[T]`` (made ``[1, T]``); for 2-d, the dim named "time", else `default`."""
    if data.ndim == 1:
        return 1
    if data.ndim != 2:
        raise InvalidInputError(f"extend takes a [T] or a 2-d ([envs, T] / [T, envs]) batch, "
                                f"got batch_size {tuple(data.batch_size)}")
    try:
        names = list(data.names)
    except (RuntimeError, ValueError):  # some lazy TensorDicts have no names
        names = [None, None]
    return names.index("time") if "time" in names else default % 2


def _entries(data: TensorDictBase, time_dim: int) -> dict[Key, np.ndarray]:
    """Every leaf as a ``(R, T, ...)`` numpy array."""
    out = {}
    for key, value in data.items(include_nested=True, leaves_only=True):
        arr = value.detach().cpu().numpy()
        arr = arr[None] if data.ndim == 1 else np.moveaxis(arr, time_dim, 1)
        out[_key(key)] = arr
    return out


def _recorded(recorder: StreamRecorder, store: ReplayStore, steps: Steps) -> np.ndarray:
    """`recorder.record`, its lane state restored if the batch is refused."""
    saved = (recorder.traj.copy(), recorder.running.copy(), recorder.last_next.copy())
    try:
        return recorder.record(store, steps)
    except BaseException:
        recorder.traj, recorder.running, recorder.last_next = saved
        raise
