"""Every kept frame once in a device's memory: the frame ring of ``device=`` stores.

`DeviceFrames` owns one torch tensor on the device, ``(num_envs * slots_per_env + 1,
*obs_shape)`` in the store's dtype: row ``flat`` holds what the frame store holds at flat slot
``flat``, and the last row is zeros, so a plan's ``-1`` (zero stack padding) gathers zeros
without a branch::

    add ──> StepRing (CPU) ──> FrameStore (disk: the durable copy, unchanged)
                          └──> DeviceFrames.write: staged, copied in one block before the
                                                   next gather (or when the stage is full)
    open ──> FrameStore.read of the kept slots, a block at a time ──> DeviceFrames.fill
    sample ──> draw + `StepRing.lookup` on the CPU: the plan, (2, B, k) flat slots
           ──> frames.index_select(plan) on the device (`gather`)

It also owns the memory check (`check_fits`) and the one-copy transfer of a batch's small
arrays (`to_device`). It does not own which slots a batch reads (`ring`, `sequences`), the
draw (`samplers`) or the bytes on disk (`frame_store`). torch is imported lazily.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from mmreplay.errors import DeviceMemoryError, InvalidInputError
from mmreplay.spec import StoreSpec
from mmreplay.torch_batch import ArrayBatch, Batch, FrameSetBatch

if TYPE_CHECKING:
    import torch

FILL_BYTES = 32 << 20  # a fill reads and copies this many bytes of frames at a time
STAGE_BYTES = 4 << 20  # write-through frames staged before one copy to the device
EXTRA = "extra:"  # the name of an extra among the fields of a `Packing`
ALIGN = 16  # every array packed by `to_device` starts at a multiple of this many bytes


def parse_device(device: Any) -> torch.device:
    """`device` (a ``torch.device`` or a string such as ``"cuda"``, ``"cuda:1"``, ``"cpu"``)
    as a ``torch.device``, ``"cuda"`` named as the current one; `InvalidInputError` for
    anything else, or for CUDA where torch has none."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInputError(f"device must be a torch.device or a string such as 'cuda', "
                                f"'cuda:0' or 'cpu', got {device!r:.60}") from exc
    if parsed.type not in ("cuda", "cpu"):
        raise InvalidInputError(f"device must be 'cuda' or 'cpu', got device type "
                                f"{parsed.type!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device={device!r} needs CUDA, and "
                                f"torch.cuda.is_available() is False")
    if parsed.index is None and parsed.type == "cuda":  # "cuda": the current one, named
        parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed


def ring_bytes(spec: StoreSpec) -> int:
    """Bytes the frame ring of `spec` takes on its device (one zero row included)."""
    return (spec.num_envs * spec.slots_per_env + 1) * spec.frame_bytes


def free_bytes(device: torch.device) -> int | None:
    """Bytes free for the ring on `device`: CUDA's free memory plus what PyTorch's caching
    allocator holds unused there (it serves the ring from that first), for the CPU the
    kernel's ``MemAvailable`` (None where it cannot be known: no check)."""
    if device.type == "cuda":
        import torch

        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + max(0, cached)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(spec: StoreSpec, device: Any, *,
               budget: Callable[[torch.device], int | None] | None = None) -> torch.device:
    """The parsed device, if the frame ring of `spec` fits in what `budget` (default
    `free_bytes`) says is free there; `DeviceMemoryError` saying both figures otherwise.
    Allocates nothing."""
    parsed = parse_device(device)
    need, free = ring_bytes(spec), (budget or free_bytes)(parsed)
    if free is not None and need > free:
        raise DeviceMemoryError(
            f"device={str(parsed)!r}: the store's frames need {need:,} bytes "
            f"({need / 2**30:.2f} GiB: {spec.num_envs * spec.slots_per_env:,} frames of "
            f"{spec.frame_bytes:,} bytes, plus one zero frame), but {free:,} bytes "
            f"({free / 2**30:.2f} GiB) are free there; use a smaller capacity or no device=")
    return parsed


@functools.cache
def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a numpy dtype (remembered: a batch asks for each of its fields)."""
    import torch

    return torch.from_numpy(np.empty(0, np.dtype(dtype).newbyteorder("="))).dtype


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A fresh uint8 host tensor to copy from: page-locked for a CUDA device (PyTorch's host
    allocator reuses it only once the copies queued from it are done, so a
    ``non_blocking`` copy from it is safe whatever the caller does next)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


class DeviceFrames:
    """The frame ring on a device: write-through, fill from disk, gather by plan."""

    def __init__(self, spec: StoreSpec, device: torch.device) -> None:
        import torch

        self.spec = spec
        self.device = device
        rows = spec.num_envs * spec.slots_per_env + 1
        # Every write and gather runs on one stream (the device's default one), so a gather
        # queued before a write reads the frame it planned for, whatever stream the caller is
        # on; the caller's stream then waits for the batch (`hand_over`).
        self._stream = torch.cuda.default_stream(device) if device.type == "cuda" else None
        # Rows are written before any plan reads them (only kept frames are read), so the
        # ring is not cleared, but for its last row: the zero frame of zero stack padding.
        # Made on the ring's stream (a store opened under another stream included), so the
        # zeroing is ordered before the gathers and the memory belongs to that stream.
        with self._on_ring():
            self.frames = torch.empty((rows, *spec.obs_shape),
                                      dtype=torch_dtype(spec.obs_dtype), device=device)
            self.frames[-1].zero_()
        # At most slots_per_env staged frames: no slot is staged twice (one index_copy_).
        self.stage_rows = max(1, min(spec.slots_per_env, STAGE_BYTES // spec.frame_bytes))
        # One page-locked buffer per stage: the slots (stage_rows int64), then the frames.
        self._host: torch.Tensor | None = None
        self._stage: np.ndarray = np.empty(0)  # (stage_rows, *obs_shape) view of `_host`
        self._stage_slots: np.ndarray = np.empty(0, np.int64)  # view of `_host` too
        self._slot_bytes = -(-self.stage_rows * 8 // ALIGN) * ALIGN
        self.staged = 0

    @property
    def nbytes(self) -> int:
        """Bytes the ring takes on its device."""
        return int(self.frames.numel() * self.frames.element_size())

    # -- writing -------------------------------------------------------------------
    def write(self, flat: np.ndarray, frames: np.ndarray) -> None:
        """Frames `frames` (``(len(flat), *obs_shape)``) at flat slots `flat`, staged: they
        reach the device by the next `flush` (every gather flushes first)."""
        done = 0
        while done < flat.size:
            if self._host is None:
                self._new_stage()
            take = min(flat.size - done, self.stage_rows - self.staged)
            self._stage[self.staged:self.staged + take] = frames[done:done + take]
            self._stage_slots[self.staged:self.staged + take] = flat[done:done + take]
            self.staged += take
            done += take
            if self.staged == self.stage_rows:
                self.flush()

    def write_one(self, flat: int, frame: np.ndarray) -> None:
        """`write` of one frame (the recorder's one-env fast path)."""
        if self._host is None:
            self._new_stage()
        self._stage[self.staged] = frame
        self._stage_slots[self.staged] = flat
        self.staged += 1
        if self.staged == self.stage_rows:
            self.flush()

    def _new_stage(self) -> None:
        self._host = host_buffer(self._slot_bytes + self.stage_rows * self.spec.frame_bytes,
                                 self.device)
        raw = self._host.numpy()
        self._stage_slots = raw[:self.stage_rows * 8].view(np.int64)
        self._stage = raw[self._slot_bytes:].view(self.spec.obs_dtype).reshape(
            self.stage_rows, *self.spec.obs_shape)

    def flush(self) -> None:
        """Copy the staged frames to their rows: one copy from page-locked memory (slots and
        frames; no copy from pageable memory, which may wait for the device), one
        ``index_copy_``."""
        if not self.staged:
            return
        assert self._host is not None
        count, head = self.staged, self._slot_bytes
        with self._on_ring():
            moved = self._host[:head + count * self.spec.frame_bytes].to(self.device,
                                                                         non_blocking=True)
            slots = moved[:count * 8].view(torch_dtype(np.int64))
            rows = moved[head:].view(self.frames.dtype).view(count, *self.spec.obs_shape)
            self.frames.index_copy_(0, slots, rows)
        self._host = None  # a fresh buffer next time (see `host_buffer`)
        self._stage, self._stage_slots = np.empty(0), np.empty(0, np.int64)
        self.staged = 0

    # -- filling from disk ------------------------------------------------------------
    def fill(self, flat: np.ndarray, read: Callable[[np.ndarray, np.ndarray], np.ndarray]
             ) -> None:
        """Copy the frames at flat slots `flat` from `read` (the frame store's
        ``read(slots, out)``), a block of `FILL_BYTES` at a time (the store is never decoded
        whole in RAM), each run of consecutive slots in one copy straight into its rows."""
        self.flush()
        block = max(1, FILL_BYTES // self.spec.frame_bytes)
        for lo in range(0, flat.size, block):
            slots = flat[lo:lo + block]
            host = host_buffer(slots.size * self.spec.frame_bytes, self.device)
            out = host.numpy()
            got = read(slots, out)
            if got.ctypes.data != out.ctypes.data:  # `read` may not have used `out`
                out[:] = got.reshape(-1).view(np.uint8)
            rows = host.view(torch_dtype(self.spec.obs_dtype)).view(slots.size,
                                                                     *self.spec.obs_shape)
            starts = np.flatnonzero(np.diff(slots, prepend=-2) != 1).tolist()
            with self._on_ring():
                for i, j in zip(starts, [*starts[1:], slots.size], strict=True):
                    first = int(slots[i])
                    self.frames[first:first + j - i].copy_(rows[i:j], non_blocking=True)

    # -- reading -----------------------------------------------------------------------
    def gather_batch(self, arrays: dict[str, np.ndarray]
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A batch on the device: `arrays` (its ``"plan"``, flat slots, and its small fields)
        packed (`Packing.pack`), then as `gather_packed`."""
        packing = Packing.like(arrays)
        buffer, views = packing.pack(arrays, self.device)
        return self.gather_packed(packing, buffer, views["plan"])

    def gather_packed(self, packing: Packing, buffer: torch.Tensor, plan: np.ndarray
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A batch on the device from `buffer`, laid out by `packing` with a ``"plan"`` field
        of flat slots, `plan` its view (`Packing.host`): the plan made rows (`plan_rows`, in
        place), the buffer moved in one copy, then the plan's frames gathered (`gather`).
        Returns the frames and the other fields as tensors."""
        self.plan_rows(plan, out=plan)
        with self._on_ring():  # one stream switch for the copy and the gather
            moved = packing.moved(buffer, self.device)
            rows = moved.pop("plan")
            out = self._select(rows)
        return self._handed(out, rows), moved

    def plan_rows(self, flat: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Flat slots as rows of the ring (the host side of a plan): ``-1`` (zero padding)
        becomes the zero row, the last (``-1`` modulo the row count), so `gather` needs no
        negative index. Into `out` (may be `flat`) if given."""
        return np.remainder(flat, self.frames.shape[0], out=out)

    def gather(self, plan: torch.Tensor) -> torch.Tensor:
        """The frames at the rows of `plan` (an int64 tensor on the device, any shape, from
        `plan_rows`), shaped ``(*plan.shape, *obs_shape)``: one ``index_select`` (whole rows
        copied, on the CPU a ``memcpy`` each, where ``frames[plan]`` goes element by element)."""
        with self._on_ring():
            out = self._select(plan)
        return self._handed(out, plan)

    def _select(self, plan: torch.Tensor) -> torch.Tensor:
        """`gather`'s work on the ring's stream (made current by the caller): the staged
        frames flushed, then one ``index_select``."""
        self.flush()
        return self.frames.index_select(0, plan.reshape(-1))

    def _handed(self, out: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """`out` (gathered by `_select` for `plan`) handed to the caller's stream (outside the
        ring's stream context), shaped ``(*plan.shape, *obs_shape)``."""
        self.hand_over(out, plan)
        return out.view(*plan.shape, *self.frames.shape[1:])

    def _on_ring(self) -> contextlib.AbstractContextManager[Any]:
        """The ring's stream made current (CUDA), or nothing."""
        if self._stream is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self._stream)

    def hand_over(self, *tensors: torch.Tensor) -> None:
        """Let the calling thread's current stream use `tensors`, made on the ring's stream:
        it waits for that stream, and their memory is not reused before it is done with them
        (one tensor of each storage is enough). `gather` hands its batch to the stream of
        the thread that sampled; a batch sampled by a prefetch thread is handed again in
        the consumer's thread (`DeviceReader.receive`)."""
        if self._stream is None:
            return
        import torch

        current = torch.cuda.current_stream(self.device)
        if current != self._stream:
            current.wait_stream(self._stream)
            for tensor in tensors:
                tensor.record_stream(current)

    def rows(self, flat: np.ndarray) -> torch.Tensor:
        """The frames at these flat slots (-1: zeros), on the device (for checks and tools)."""
        import torch

        rows = self.plan_rows(np.asarray(flat, np.int64))
        return self.gather(torch.from_numpy(rows).to(self.device))


def small_fields(spec: StoreSpec, size: int) -> list[tuple[str, tuple[int, ...], Any]]:
    """Every field of a batch of `size` transitions but its frames, ``(name, shape, dtype)``
    in the dtypes a batch hands them out, extras named ``EXTRA + name``: how a device batch
    (`device_reader`, `device_batches`) and a sampling process's slot (`sampling_processes`)
    lay them out (`Packing`)."""
    return [("action", (size, *spec.action_shape), spec.action_dtype),
            ("reward", (size,), np.float32), ("terminated", (size,), np.bool_),
            ("truncated", (size,), np.bool_), ("discount", (size,), np.float32),
            ("weights", (size,), np.float32), ("ids", (size,), np.int64),
            ("steps", (size,), np.int64),
            *((EXTRA + name, (size, *shape), dtype) for name, shape, dtype in spec.extras)]


def small_arrays(arrays: ArrayBatch | FrameSetBatch) -> dict[str, np.ndarray]:
    """The `small_fields` of a batch of arrays, by name."""
    return {"action": arrays.action, "reward": arrays.reward,
            "terminated": arrays.terminated, "truncated": arrays.truncated,
            "discount": arrays.discount, "weights": arrays.weights, "ids": arrays.ids,
            "steps": arrays.steps, **{EXTRA + name: a for name, a in arrays.extras.items()}}


def extras_of(fields: dict[str, Any]) -> dict[str, Any]:
    """The extras among named fields (``EXTRA + name``), by their own names."""
    return {name[len(EXTRA):]: a for name, a in fields.items() if name.startswith(EXTRA)}


def transition_batch(frames: torch.Tensor, moved: dict[str, torch.Tensor]) -> Batch:
    """The `Batch` of `frames` (``(2, B, stack, *obs)``: its obs and next obs stacks) and
    its `small_fields` as tensors, by name."""
    return Batch(obs=frames[0], next_obs=frames[1], action=moved["action"],
                 reward=moved["reward"], terminated=moved["terminated"],
                 truncated=moved["truncated"], discount=moved["discount"],
                 weights=moved["weights"], ids=moved["ids"], steps=moved["steps"],
                 extras=extras_of(moved))


def to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The arrays as tensors on `device`, moved in one copy (`Packing`). On the CPU the
    tensors view one buffer."""
    packing = Packing.like(arrays)
    return packing.moved(packing.pack(arrays, device)[0], device)


class Packing:
    """Where named arrays sit in one host buffer that one copy moves to a device: each field
    (name, shape, dtype, in native byte order) at a multiple of `ALIGN` bytes, in order.

    `pack` copies arrays made elsewhere into a fresh buffer; `host` hands out a fresh buffer
    and a numpy view of each field, for code that computes a batch straight into it (a
    device store's `sample`: its compiled lookup writes there, nothing is packed after).
    `moved` copies a buffer to the device and splits it into the fields as tensors. `views`
    alone needs no torch (the slots of `sampling_processes` are laid out by it too)."""

    def __init__(self, fields: Iterable[tuple[str, tuple[int, ...], Any]]) -> None:
        self.sizes: list[int] = []  # bytes each field takes in the buffer (padded)
        # (name, start, bytes, numpy dtype, shape) per field
        self._layout: list[tuple[str, int, int, np.dtype[Any], tuple[int, ...]]] = []
        start = 0
        for name, shape, dtype in fields:
            dt = np.dtype(dtype).newbyteorder("=")
            nbytes = math.prod(shape) * dt.itemsize
            self.sizes.append(-(-nbytes // ALIGN) * ALIGN or ALIGN)
            self._layout.append((name, start, nbytes, dt, tuple(shape)))
            start += self.sizes[-1]
        self.nbytes = start
        self._torch_dtypes: list[Any] = []  # by field, on the first `moved`

    @classmethod
    def like(cls, arrays: dict[str, np.ndarray]) -> Packing:
        """The packing of arrays shaped and typed as `arrays`."""
        return cls((name, a.shape, a.dtype) for name, a in arrays.items())

    def views(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        """Each field as a view of `raw` (uint8, at least `nbytes`), by name."""
        return {name: raw[start:start + nbytes].view(dt).reshape(shape)
                for name, start, nbytes, dt, shape in self._layout}

    def host(self, device: torch.device) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """A fresh host buffer for `device` (`host_buffer`) and a view of each field in it."""
        buffer = host_buffer(self.nbytes, device)
        return buffer, self.views(buffer.numpy())

    def pack(self, arrays: dict[str, np.ndarray], device: torch.device
             ) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
        """A fresh host buffer holding `arrays` (named as the fields), and its views."""
        buffer, views = self.host(device)
        for name, view in views.items():
            view[...] = arrays[name]
        return buffer, views

    def moved(self, buffer: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """`buffer` copied to `device` (``non_blocking``: `host_buffer` says why that is
        safe) and split (one call) into its fields as tensors, by name."""
        if not self._torch_dtypes:
            self._torch_dtypes = [torch_dtype(dt) for _, _, _, dt, _ in self._layout]
        parts = buffer.to(device, non_blocking=True).split(self.sizes)
        out = {}
        for (name, _, nbytes, _, shape), tdt, part in zip(self._layout, self._torch_dtypes,
                                                          parts, strict=True):
            if part.numel() != nbytes:
                part = part[:nbytes]
            part = part.view(tdt)
            out[name] = part if len(shape) == 1 else part.view(shape)
        return out
