"""Import Dopamine replay checkpoints (the DQN Replay Dataset's format) into a store.

A checkpoint ``N`` of Dopamine's ``OutOfGraphReplayBuffer`` is six files in one
directory, each the gzip of one ``np.save`` array::

    $store$_observation_ckpt.N.gz   (C, H, W) uint8    record i: observation o_i
    $store$_action_ckpt.N.gz        (C,) int32         the action taken at o_i
    $store$_reward_ckpt.N.gz        (C,) float32       the reward of that step
    $store$_terminal_ckpt.N.gz      (C,) uint8         1: the episode ended after it
    add_count_ckpt.N.gz             () int             records ever added
    invalid_range_ckpt.N.gz         (k,) int           indices Dopamine does not sample

The buffer is circular: with ``add_count >= C`` the oldest record is at
``add_count % C``; otherwise records ``0 .. add_count-1`` are the data. Dopamine adds
``stack_size - 1`` zero records (zero frame, action 0, reward 0, terminal 0) before
each episode's first record; the importer drops them (up to `padding` zero records
after a terminal or at the oldest record) and relies on the store's zero stack padding,
which gives the same stacks. How records become store episodes::

    records  ... [a t=1] [0][0][0] [o_0 a_0 r_0] [o_1 a_1 r_1] ... [o_T-1 a_T-1 r_T-1 t=1]
    store    reset(o_0), add(a_0, r_0, o_1), ..., add(a_T-1, r_T-1, zeros, terminated)

* A terminal record ends the episode as *terminated*; the logs hold no final frame, so
  o_T is a zero frame (Dopamine's own next state there is the next episode's zero
  padding; with discount 0 no target reads it). Dopamine also sets terminal when an
  episode hits its step limit, so such episodes arrive as terminated too.
* The oldest records usually start mid-episode: that partial episode begins with
  ``reset`` on its first record, so its first ``frame_stack - 1`` stacks are
  zero-padded where the true frames were overwritten (Dopamine marks the first
  ``stack_size`` of them invalid through ``invalid_range``).
* The newest records end an unfinished episode: it ends *truncated* at the last record's
  frame, and that record's action and reward are dropped (their next frame was never
  logged; Dopamine marks the newest ``update_horizon`` records invalid). A last episode
  of a single record has no step and is dropped. So ``invalid_range`` is only validated:
  both ends it guards are handled above. Every checkpoint is imported on its own, in
  the order given; an episode that spans two checkpoints becomes two.

Files are streamed: the observation file is decompressed in blocks (twice when the
buffer wrapped: the rows after the cursor come first), never held whole in RAM.
Nothing is unpickled: headers are parsed from the stream and object dtypes refused.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from mmreplay.datasets.staging import staged_store
from mmreplay.errors import DatasetFormatError, InvalidStoreError
from mmreplay.storage.safe_io import open_bounded
from mmreplay.store import ReplayStore

PREFIX = "$store$_"
ELEMENTS: dict[str, np.dtype] = {"action": np.dtype("<i4"), "reward": np.dtype("<f4"),
                                 "terminal": np.dtype("u1")}
MAX_HEADER = 4096
MAX_FILE = 1 << 40
MAX_SMALL_ROWS = 1 << 26  # records per checkpoint (Dopamine's are 1M): small arrays read whole
MAX_FRAME_BYTES = 1 << 24
BLOCK_BYTES = 32 << 20
_NAME = re.compile(r"\$store\$_observation_ckpt\.(\d+)\.gz")


@dataclass(frozen=True)
class Checkpoint:
    """The small arrays of one checkpoint, unrolled oldest first (length ``size``)."""

    directory: Path
    number: int
    capacity: int        # C: rows in every file
    add_count: int
    obs_shape: tuple[int, ...]
    action: np.ndarray
    reward: np.ndarray
    terminal: np.ndarray

    @property
    def start(self) -> int:
        """Row of the oldest record."""
        return self.add_count % self.capacity if self.add_count >= self.capacity else 0

    @property
    def size(self) -> int:
        return min(self.add_count, self.capacity)

    def path(self, name: str) -> Path:
        return self.directory / f"{name}_ckpt.{self.number}.gz"


@dataclass(frozen=True)
class DopamineImport:
    """What an import wrote (totals over all checkpoints)."""

    checkpoints: tuple[int, ...]
    records: int           # records read (add_count, or capacity once full, per checkpoint)
    padding_records: int   # Dopamine's zero records dropped at episode starts
    dropped_records: int   # newest records whose next frame was never logged
    frames: int
    transitions: int
    episodes: int
    terminated: int
    truncated: int


# -- files -----------------------------------------------------------------------------
def find_checkpoints(directory: str | os.PathLike[str]) -> list[int]:
    """Checkpoint numbers with an observation file in `directory`, ascending."""
    root = check_directory(directory)
    found = sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.fullmatch(p.name)))
    if not found:
        raise DatasetFormatError(f"{root} holds no {PREFIX}observation_ckpt.N.gz file")
    return found


def check_directory(directory: str | os.PathLike[str]) -> Path:
    """`directory` as a Path, if it is one (`FileNotFoundError` / `NotADirectoryError`)."""
    root = Path(directory)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist (expected Dopamine's replay_logs "
                                f"directory)")
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory (expected Dopamine's replay_logs "
                                 f"directory)")
    return root


def open_npy_gz(path: Path) -> tuple[gzip.GzipFile, tuple[int, ...], np.dtype]:
    """A gzip stream positioned at the array data, with the header's shape and dtype."""
    try:
        fd, _ = open_bounded(path, path.name, MAX_FILE)
    except InvalidStoreError as exc:
        raise DatasetFormatError(str(exc)) from None
    stream = gzip.GzipFile(fileobj=io.FileIO(fd, "rb"), mode="rb")
    try:
        shape, dtype = _read_header(stream, path.name)
    except BaseException:
        close_stream(stream)
        raise
    return stream, shape, dtype


def close_stream(stream: gzip.GzipFile) -> None:
    fileobj = getattr(stream, "fileobj", None)
    stream.close()
    if fileobj is not None:
        fileobj.close()


def _read_header(stream: gzip.GzipFile, name: str) -> tuple[tuple[int, ...], np.dtype]:
    head = _read_exact(stream, 8, name)
    if head[:6] != b"\x93NUMPY" or head[6:8] not in (b"\x01\x00", b"\x02\x00"):
        raise DatasetFormatError(f"{name} does not hold a .npy array (version 1 or 2) in gzip")
    width = 2 if head[6] == 1 else 4
    size_bytes = _read_exact(stream, width, name)
    size = int.from_bytes(size_bytes, "little")
    if size > MAX_HEADER:
        raise DatasetFormatError(f"{name}: .npy header of {size} bytes, at most {MAX_HEADER}")
    raw = io.BytesIO(head + size_bytes + _read_exact(stream, size, name))
    try:
        npy_format.read_magic(raw)
        reader = npy_format.read_array_header_1_0 if width == 2 else \
            npy_format.read_array_header_2_0
        shape, fortran, dtype = reader(raw, max_header_size=MAX_HEADER)
    except Exception as exc:  # noqa: BLE001 -- numpy parses untrusted text
        raise DatasetFormatError(f"{name}: bad .npy header: {exc}") from None
    if dtype.hasobject or dtype.fields is not None or fortran:
        raise DatasetFormatError(f"{name} holds {dtype} (fortran order {fortran}); "
                                 f"expected a plain numeric C-order array, nothing pickled")
    return tuple(int(n) for n in shape), dtype


def _read_exact(stream: gzip.GzipFile, size: int, name: str) -> bytes:
    try:
        data = stream.read(size)
    except (EOFError, OSError, zlib.error) as exc:
        raise DatasetFormatError(f"{name}: corrupt or truncated gzip: {exc}") from None
    if len(data) != size:
        raise DatasetFormatError(f"{name} ends early: the gzip stream is shorter than its "
                                 f".npy header says")
    return data


def _expect_end(stream: gzip.GzipFile, name: str) -> None:
    """The stream ends here, and its gzip checksum holds."""
    try:
        extra = stream.read(1)
    except (EOFError, OSError, zlib.error) as exc:
        raise DatasetFormatError(f"{name}: corrupt or truncated gzip: {exc}") from None
    if extra:
        raise DatasetFormatError(f"{name} holds more data than its .npy header says")


def read_array(path: Path, dtype: np.dtype | None, ndim: int, max_rows: int) -> np.ndarray:
    """A small array read whole; `dtype` None accepts any integer or float dtype."""
    stream, shape, got = open_npy_gz(path)
    try:
        ok = got == dtype if dtype is not None else got.kind in "iuf"
        if not ok or len(shape) != ndim or (ndim and shape[0] > max_rows):
            want = dtype if dtype is not None else "an int or float"
            raise DatasetFormatError(f"{path.name} holds {got}{shape}, expected {want} with "
                                     f"{ndim} dimension(s) and at most {max_rows} rows")
        data = _read_exact(stream, got.itemsize * math.prod(shape), path.name)
        _expect_end(stream, path.name)
    finally:
        close_stream(stream)
    return np.frombuffer(data, dtype=got).reshape(shape).copy()


# -- checkpoints -------------------------------------------------------------------------
def load_checkpoint(directory: Path, number: int) -> Checkpoint:
    """Read and check the small arrays of checkpoint `number` (frames are streamed later)."""
    probe = Checkpoint(directory, number, 1, 0, (), *(np.empty(0),) * 3)
    stream, shape, dtype = open_npy_gz(probe.path(PREFIX + "observation"))
    close_stream(stream)
    name = probe.path(PREFIX + "observation").name
    if dtype != np.uint8 or len(shape) < 2 or 0 in shape or shape[0] > MAX_SMALL_ROWS \
            or math.prod(shape[1:]) > MAX_FRAME_BYTES:
        raise DatasetFormatError(f"{name} holds {dtype}{shape}, expected uint8 (C, *frame) "
                                 f"with 1 <= C <= {MAX_SMALL_ROWS} records of at most "
                                 f"{MAX_FRAME_BYTES} bytes")
    arrays = {key: read_array(probe.path(PREFIX + key), dt, 1, MAX_SMALL_ROWS)
              for key, dt in ELEMENTS.items()}
    for key, arr in arrays.items():
        if arr.shape[0] != shape[0]:
            raise DatasetFormatError(f"{probe.path(PREFIX + key).name} has {arr.shape[0]} "
                                     f"records but {name} has {shape[0]}")
    add_count = _add_count(probe.path("add_count"))
    _check_invalid_range(probe.path("invalid_range"), shape[0], add_count)
    ckpt = Checkpoint(directory, number, shape[0], add_count, shape[1:], **arrays)
    return _unrolled(ckpt)


def _add_count(path: Path) -> int:
    value = read_array(path, None, 0, 0)
    if value.dtype.kind not in "iu" or int(value) < 0:
        raise DatasetFormatError(f"{path.name} holds {value.dtype} {value!r}, expected a "
                                 f"non-negative integer")
    return int(value)


def _check_invalid_range(path: Path, capacity: int, add_count: int) -> None:
    """Dopamine's invalid indices: integers in [0, C) (float zeros before the first add)."""
    rng = read_array(path, None, 1, MAX_SMALL_ROWS)
    if rng.dtype.kind == "f" and (add_count > 0 or rng.any()):
        raise DatasetFormatError(f"{path.name} holds {rng.dtype} after {add_count} adds, "
                                 f"expected integer indices")
    if rng.size and (rng.min() < 0 or rng.max() >= capacity):
        raise DatasetFormatError(f"{path.name} holds indices outside [0, {capacity})")


def _unrolled(ckpt: Checkpoint) -> Checkpoint:
    """The small arrays in record order (oldest first), checked for sane values."""
    order = (np.arange(ckpt.size) + ckpt.start) % ckpt.capacity
    action, reward, terminal = ckpt.action[order], ckpt.reward[order], ckpt.terminal[order]
    name = ckpt.path(PREFIX + "*").name
    if terminal.size and terminal.max() > 1:
        raise DatasetFormatError(f"{name}: terminal values must be 0 or 1, got {terminal.max()}")
    if not np.isfinite(reward).all():
        raise DatasetFormatError(f"{name}: rewards hold NaN or inf")
    return Checkpoint(ckpt.directory, ckpt.number, ckpt.capacity, ckpt.add_count,
                      ckpt.obs_shape, action, reward, terminal)


def observation_blocks(ckpt: Checkpoint, block_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
    """The checkpoint's frames oldest first, in blocks of rows (see the module doc)."""
    rows_per_block = max(1, block_bytes // math.prod(ckpt.obs_shape))
    spans = [(ckpt.start, ckpt.capacity if ckpt.start else ckpt.size)]
    if ckpt.start:
        spans.append((0, ckpt.start))
    for first, stop in spans:
        yield from _rows(ckpt, first, stop, rows_per_block)


def _rows(ckpt: Checkpoint, first: int, stop: int, block: int) -> Iterator[np.ndarray]:
    """Rows ``first..stop-1`` of the observation file; reads the whole stream to its end."""
    path = ckpt.path(PREFIX + "observation")
    stream, shape, _ = open_npy_gz(path)
    row_bytes = math.prod(ckpt.obs_shape)
    try:
        if shape != (ckpt.capacity, *ckpt.obs_shape):
            raise DatasetFormatError(f"{path.name} changed while it was read")
        for lo in range(0, ckpt.capacity, block):
            n = min(block, ckpt.capacity - lo)
            data = _read_exact(stream, n * row_bytes, path.name)
            a, b = max(lo, first), min(lo + n, stop)
            if a < b:
                rows = np.frombuffer(data, np.uint8).reshape(n, *ckpt.obs_shape)
                yield rows[a - lo:b - lo]
        _expect_end(stream, path.name)
    finally:
        close_stream(stream)


# -- records -> episodes -----------------------------------------------------------------
class _EpisodeWriter:
    """Turns a stream of Dopamine records into store episodes (see the module doc)."""

    def __init__(self, store: ReplayStore, padding: int) -> None:
        self.store, self.padding = store, padding
        self.zero: np.ndarray | None = None
        self.in_episode, self.pads = False, 0
        self.pending: tuple[int, float] = (0, 0.0)
        self.counts = {"padding_records": 0, "dropped_records": 0, "episodes": 0,
                       "terminated": 0, "truncated": 0}

    def record(self, obs: np.ndarray, action: int, reward: float, terminal: bool,
               last: bool) -> None:
        if not self.in_episode:
            if self.pads < self.padding and not (action or reward or terminal or obs.any()):
                self.pads += 1
                self.counts["padding_records"] += 1
                return
            if last and not terminal:
                self.counts["dropped_records"] += 1  # an episode of one frame, no step
                return
            self.store.reset(obs)
            self.in_episode = True
            self.counts["episodes"] += 1
        else:
            self.store.add(self.pending[0], self.pending[1], obs, False, last and not terminal)
            if last and not terminal:
                self.counts["truncated"] += 1
                self.counts["dropped_records"] += 1
                self._end()
                return
        self.pending = (action, reward)
        if terminal:
            if self.zero is None:
                self.zero = np.zeros_like(obs)
            self.store.add(action, reward, self.zero, True, False)
            self.counts["terminated"] += 1
            self._end()

    def _end(self) -> None:
        self.in_episode, self.pads = False, 0


def write_checkpoint(store: ReplayStore, ckpt: Checkpoint, *, padding: int,
                     progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Stream one checkpoint's records into `store`; returns the writer's counts."""
    writer = _EpisodeWriter(store, padding)
    action, reward = ckpt.action.tolist(), ckpt.reward.tolist()
    terminal = ckpt.terminal.astype(bool).tolist()
    i, last = 0, ckpt.size - 1
    for rows in observation_blocks(ckpt):
        for obs in rows:
            writer.record(obs, action[i], reward[i], terminal[i], i == last)
            i += 1
        if progress is not None:
            progress(len(rows))
    assert i == ckpt.size, (i, ckpt.size)  # observation_blocks yields exactly `size` rows
    return writer.counts


def import_dopamine(directory: str | os.PathLike[str], target: str | os.PathLike[str], *,
                    checkpoints: list[int] | None = None, frame_stack: int = 4,
                    n_step: int = 1, gamma: float = 0.99, padding: int | None = None,
                    capacity: int | None = None, progress: Callable[[int], None] | None = None,
                    **options: Any) -> DopamineImport:
    """Import Dopamine checkpoints from `directory` into a new store at `target`.

    `padding` (default ``frame_stack - 1``, Dopamine's ``stack_size - 1``) bounds the
    zero records dropped before each episode. `capacity` defaults to every frame the
    import can write. The store is built beside `target` and renamed into place at the
    end; on any error nothing is left at `target`. `options` go to `ReplayStore.create`.
    """
    root = check_directory(directory)
    numbers = find_checkpoints(root) if checkpoints is None else list(checkpoints)
    ckpts = [load_checkpoint(root, n) for n in numbers]  # all checked before a store exists
    shapes = {c.obs_shape for c in ckpts}
    if len(shapes) != 1:
        raise DatasetFormatError(f"checkpoints {numbers} have different frame shapes {shapes}")
    needed = sum(c.size + int(c.terminal.sum()) for c in ckpts)
    totals = dict.fromkeys(("padding_records", "dropped_records", "episodes", "terminated",
                            "truncated"), 0)
    with staged_store(target, capacity=capacity or max(needed, 1), obs_shape=ckpts[0].obs_shape,
                      frame_stack=frame_stack, n_step=n_step, gamma=gamma,
                      action_dtype=np.int32, stack_padding="zero", **options) as store:
        for ckpt in ckpts:
            counts = write_checkpoint(store, ckpt, padding=frame_stack - 1 if padding is None
                                      else padding, progress=progress)
            totals = {k: totals[k] + counts[k] for k in totals}
        written = store.counts
    return DopamineImport(checkpoints=tuple(numbers), records=sum(c.size for c in ckpts),
                          frames=written.frames_written, transitions=written.transitions,
                          **totals)
