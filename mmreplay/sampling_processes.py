"""Sampling processes: more cores for a store opened read-only, past the GIL.

Threads sampling read-only views of a store share one GIL: the Python around each batch's
compiled read (a quarter of a batch's time) stops them scaling past a few cores.
``store.batches(batch_size, workers=N, processes=True)`` of a store opened with ``mode="r"``
samples in N processes instead::

    this process (the iterator)                     N sampling processes (spawned)
    slots: a shared file of S batch slots           each opens the directory read-only,
                                                    its RNG seeded from the store's
    request (slot, beta)  ------- pipe ------->     sample_arrays(batch_size, beta, out=slot):
                                                    frames read into the slot, the
                                                    small fields copied there
    a Batch of tensors viewing the slot  <-- pipe -- done (slot) | error (slot, message)
    the slot goes back to the processes once no tensor views it

Each process keeps two requests in flight, so it samples while its last batch travels.
Messages are fixed little-endian records (`struct`), never pickled. A consumer that keeps
more batches than there are slots gets copies of the ones past that (always correct; a
memcpy each). Each process follows a writer beside the store as any reader does (the
store's directory is the only thing the processes share with it).

With ``device=``, each slot holds a frame set instead (`FrameSetBatch`: each distinct
frame of the batch once, the stacks' rows beside them; a one-step batch of 4-stacks: 5
frames a transition, not 8), and a thread of this process copies each batch to the device
on a side stream (`device_batches.DeviceMover`, as for the thread paths: the distinct
frames straight from the slot, the stacks gathered on the device). On a CUDA device the
slots are page-locked in place (`page_lock`: ``cudaHostRegister``, as PyTorch's own
checkpoint stager pins its shared memory), so that copy is DMA; it is only queued when
the thread moves on, so a slot copied from goes back to the processes once the copy's
event completed (`release_after`), not when the arrays die. Where CUDA refuses to lock
them the copies stay pageable (the driver stages them: done when they return).

Processes start with ``spawn``: a script that creates them needs the usual
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import math
import mmap
import multiprocessing
import os
import struct
import tempfile
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import numpy as np

from mmreplay.device_frames import Packing, extras_of, small_arrays, small_fields
from mmreplay.errors import EmptyStoreError, InvalidInputError, InvalidStoreError
from mmreplay.locked_memory import LockedMaps
from mmreplay.spec import StoreSpec
from mmreplay.torch_batch import ArrayBatch, Batch, FrameSetBatch, make_batch

REQUEST = struct.Struct("<qd")  # slot (-1: stop), beta
REPLY = struct.Struct("<qqq")  # slot, status (0: done; else a message follows), frame count
IN_FLIGHT = 2  # requests each process holds at once
COPYING = 2  # slots of frame sets whose copies to a device may still be queued
START_TIMEOUT_S = 120.0  # a process that has not answered its first request by then failed
_ERRORS = {"EmptyStoreError": EmptyStoreError, "InvalidStoreError": InvalidStoreError}


def slot_fields(spec: StoreSpec, batch_size: int, frame_sets: bool = False
                ) -> list[tuple[str, tuple[int, ...], Any]]:
    """The fields of a batch slot, in order: what `ReplayStore.sample_arrays` returns, or
    with `frame_sets` a `FrameSetBatch`'s (room for every frame of the stacks, the distinct
    ones first, then the stacks' rows). The frames come first: a slot's address is theirs."""
    stacks = (2, batch_size, spec.frame_stack)
    if not frame_sets:
        return [("frames", (*stacks, *spec.obs_shape), spec.obs_dtype),
                *small_fields(spec, batch_size)]
    return [("frames", (math.prod(stacks), *spec.obs_shape), spec.obs_dtype),
            ("index", stacks, np.int64), *small_fields(spec, batch_size)]


def slot_packing(spec: StoreSpec, batch_size: int, frame_sets: bool = False
                 ) -> tuple[Packing, int]:
    """Where each field of a batch sits in a slot (`Packing`), and the slot's size: a whole
    number of pages, so that each slot is mapped on its own."""
    packing = Packing(slot_fields(spec, batch_size, frame_sets))
    return packing, -(-max(packing.nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def slot_arrays(packing: Packing, raw: np.ndarray, count: int) -> ArrayBatch | FrameSetBatch:
    """The batch a slot holds, viewing it (a frame set's first `count` frames)."""
    views = packing.views(raw)
    small: dict[str, Any] = {
        "action": views["action"], "reward": views["reward"],
        "terminated": views["terminated"], "truncated": views["truncated"],
        "discount": views["discount"], "weights": views["weights"], "ids": views["ids"],
        "steps": views["steps"], "extras": extras_of(views)}
    if "index" in views:
        return FrameSetBatch(frames=views["frames"][:count], index=views["index"], **small)
    return ArrayBatch(frames=views["frames"], **small)


def fill_slot(maker: Any, views: dict[str, np.ndarray], frames_out: np.ndarray,
              batch_size: int, beta: float) -> int:
    """Sample a batch into a slot (`views`, `frames_out` its frames' bytes); returns how
    many frames a frame set holds (0 for stacks)."""
    arrays: ArrayBatch | FrameSetBatch
    if "index" in views:
        frame_set = maker.sample_frame_set(batch_size, beta, False, frames_out)
        views["index"][...] = frame_set.index
        arrays = frame_set
    else:
        arrays = maker.sample_arrays(batch_size, beta, False, frames_out)
    if arrays.frames.ctypes.data != views["frames"].ctypes.data:
        views["frames"][:len(arrays.frames)] = arrays.frames  # (a read that could not use it)
    for name, values in small_arrays(arrays).items():
        views[name][...] = values
    return len(arrays.frames) if "index" in views else 0


def serve(open_view: Callable[[int], tuple[Any, Callable[[], None]]], seed: int,
          batch_size: int, frame_sets: bool, slots_path: str, slot_bytes: int,
          conn: Connection) -> None:
    """A sampling process: open a read-only view of the store (`open_view`, the store's
    `batching.OpenView`), answer each request with a batch written into its slot, until a
    stop request or the end of the pipe."""
    close: Callable[[], None] | None = None
    try:
        maker, close = open_view(seed)
        packing, _ = slot_packing(maker.spec, batch_size, frame_sets)
        frame_bytes = 2 * batch_size * maker.spec.frame_stack * maker.spec.frame_bytes
        with open(slots_path, "r+b") as f:
            shared = mmap.mmap(f.fileno(), 0)
        raw = np.frombuffer(shared, np.uint8).reshape(-1, slot_bytes)
        failure: BaseException | None = None
    except BaseException as exc:  # told with the first request's answer
        failure = exc
    try:
        while True:
            try:
                slot, beta = REQUEST.unpack(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the iterator is gone
            if slot < 0:
                return
            try:
                if failure is not None:
                    raise failure
                count = fill_slot(maker, packing.views(raw[slot]), raw[slot][:frame_bytes],
                                  batch_size, beta)
                conn.send_bytes(REPLY.pack(slot, 0, count))
            except Exception as exc:  # noqa: BLE001  (told to the iterator, which raises)
                conn.send_bytes(REPLY.pack(slot, 1, 0)
                                + f"{type(exc).__name__}\0{exc}".encode("utf-8", "replace"))
    finally:
        if close is not None:
            close()


class SamplingProcesses(Iterator[Batch]):
    """An endless iterator of batches sampled by `workers` processes (see the module doc).
    ``beta`` may be changed between batches; ``close`` (or the context manager) stops the
    processes and removes the slots' file. With `frame_sets` the slots hold `FrameSetBatch`
    es (`next_arrays`; iterated, their stacks are built here)."""

    def __init__(self, open_view: Callable[[int], tuple[Any, Callable[[], None]]],
                 spec: StoreSpec, batch_size: int, *, workers: int, prefetch: int, beta: float,
                 seeds: list[int], frame_sets: bool = False) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidInputError(f"workers must be a positive int, got {workers!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise InvalidInputError(f"prefetch must be a positive int, got {prefetch!r}")
        self.beta = beta
        self._packing, slot_bytes = slot_packing(spec, batch_size, frame_sets)
        # slots: requests in flight, the batches the consumer holds (CPU batches view their
        # slot; frame sets, copied to a device, hold one only until their copy is done)
        count = IN_FLIGHT * workers + (COPYING if frame_sets else prefetch) + 2
        self._file, self._maps = _slots_file(count, slot_bytes)
        name = self._file
        self._closed = False
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._free: deque[int] = deque(range(count))
        self._ready: deque[int] = deque()
        self._counts = [0] * count  # frames of each slot's frame set, from its answer
        # (slot, its array handed out, the event of a copy from it still to complete)
        self._lent: list[tuple[int, weakref.ref[np.ndarray], Any]] = []
        self._locked = LockedMaps(self._maps)
        self._asked = [0] * workers  # requests in flight, by process
        self._owner: dict[int, int] = {}  # slot -> process answering it
        self._started = False
        self.copies = 0  # batches handed out as copies (the consumer held every other slot)
        self._finalize = weakref.finalize(self, _stop, self._procs, self._conns, name,
                                          self._lent, self._locked)
        ctx = multiprocessing.get_context("spawn")
        try:
            for seed in seeds[:workers]:
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=serve, daemon=True, name="mmreplay-sampler",
                                   args=(open_view, seed, batch_size, frame_sets, name,
                                         slot_bytes, theirs))
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(mine)
        except BaseException:
            self.close()
            raise

    def __next__(self) -> Batch:
        arrays = self.next_arrays()
        return make_batch(arrays if isinstance(arrays, ArrayBatch) else arrays.assembled())

    def next_arrays(self) -> ArrayBatch | FrameSetBatch:
        """The next batch as numpy arrays viewing its slot (`ReplayStore.sample_arrays`'s
        fields, or a frame set's): the slot is lent until nothing views them (and a copy
        from it is done: `release_after`)."""
        if self._closed:
            raise StopIteration
        self._reclaim()
        self._feed()
        while not self._ready:
            self._receive()
            self._feed()
        slot = self._ready.popleft()
        raw = np.frombuffer(self._maps[slot], np.uint8)
        if not self._free and not any(self._asked) and not self._ready \
                and not self._copying():
            # the consumer holds every other slot: lending this one would leave none to
            # sample into, so a copy, and the slot goes back
            arrays = slot_arrays(self._packing, raw.copy(), self._counts[slot])
            self._free.append(slot)
            self.copies += 1
            return arrays
        self._lent.append((slot, weakref.ref(raw), None))
        return slot_arrays(self._packing, raw, self._counts[slot])

    def release_after(self, arrays: ArrayBatch | FrameSetBatch, event: Any) -> None:
        """Keep the slot `arrays` view lent until `event` (a ``torch.cuda.Event`` recorded
        after a copy from it was queued) completed, however soon `arrays` die. Arrays that
        view no slot (a copy) need nothing."""
        address = arrays.frames.ctypes.data
        for i, (slot, ref, _) in enumerate(self._lent):
            if self._locked.addresses[slot] == address:
                self._lent[i] = (slot, ref, event)

    def page_lock(self, device: Any) -> bool:
        """Page-lock every slot for copies to this CUDA device (`LockedMaps.lock`); False
        where CUDA refused (copies from the slots stay pageable)."""
        return self._locked.lock(device)

    def _reclaim(self) -> None:
        """Slots whose batches no longer exist, and whose copies are done, go back to the
        free list."""
        held = []
        for slot, ref, event in self._lent:
            if ref() is None and (event is None or event.query()):
                self._free.append(slot)
            else:
                held.append((slot, ref, event))
        self._lent[:] = held  # in place: the finalizer holds the list

    def _copying(self) -> list[Any]:
        """The events of the copies that slots no batch views any more wait for, oldest
        first."""
        return [event for _, ref, event in self._lent if ref() is None and event is not None]

    def _feed(self) -> None:
        """Keep `IN_FLIGHT` requests with every process while free slots last."""
        for i, conn in enumerate(self._conns):
            while self._asked[i] < IN_FLIGHT and self._free:
                slot = self._free[0]
                try:
                    conn.send_bytes(REQUEST.pack(slot, float(self.beta)))
                except OSError as exc:
                    self._ended(exc)
                self._free.popleft()
                self._asked[i] += 1
                self._owner[slot] = i

    def _receive(self) -> None:
        """Wait for answers; raise what a process could not do."""
        busy = [conn for i, conn in enumerate(self._conns) if self._asked[i]]
        if not busy:  # nothing asked, nothing free: every slot lent, or waiting on a copy
            copying = self._copying()
            if not copying:  # a copy is handed out before the consumer holds every slot
                raise AssertionError("no slot to sample into")
            copying[0].synchronize()
            self._reclaim()
            return
        timeout = None if self._started else START_TIMEOUT_S
        ready = wait(busy, timeout=timeout)
        if not ready:
            self.close()
            raise RuntimeError(f"no sampling process answered within {START_TIMEOUT_S:.0f} s")
        self._started = True
        for conn in ready:
            assert isinstance(conn, Connection)  # `wait` returns what it was given
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError) as exc:
                self._ended(exc)
            slot, status, count = REPLY.unpack(data[:REPLY.size])
            self._counts[slot] = count
            self._asked[self._owner.pop(slot)] -= 1
            if status:
                kind, _, message = data[REPLY.size:].decode("utf-8", "replace").partition("\0")
                self.close()
                raise _ERRORS.get(kind, RuntimeError)(
                    message if kind in _ERRORS else f"a sampling process failed: {kind}: "
                                                    f"{message}")
            self._ready.append(slot)

    def _ended(self, exc: BaseException) -> NoReturn:
        """A process is gone (killed, or out of memory): close, and say so."""
        codes = [p.exitcode for p in self._procs]
        self.close()
        raise RuntimeError(f"a sampling process ended unexpectedly (exit codes of the "
                           f"processes: {codes})") from exc

    def close(self) -> None:
        """Stop the processes and remove the slots' file (batches handed out stay valid:
        their memory is released with them). Idempotent."""
        if not self._closed:
            self._closed = True
            self._finalize()

    def __enter__(self) -> SamplingProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _slots_file(count: int, slot_bytes: int) -> tuple[str, list[mmap.mmap]]:
    """A new shared file of `count` slots, and a mapping of each: in /dev/shm where it has
    room for them (a container's is often 64 MiB: a process writing past its end would be
    killed by SIGBUS), else in the temporary directory (the page cache shares it as well)."""
    fd, name = tempfile.mkstemp(prefix="mmreplay-slots-",
                                dir=_shared_folder(count * slot_bytes))
    try:
        os.ftruncate(fd, count * slot_bytes)
        return name, [mmap.mmap(fd, slot_bytes, offset=i * slot_bytes) for i in range(count)]
    except BaseException:
        os.unlink(name)
        raise
    finally:
        os.close(fd)


def _shared_folder(nbytes: int, folder: str = "/dev/shm") -> str | None:
    """`folder` if it is there with `nbytes` free (and a margin), else None (the default
    temporary directory)."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return folder if stat.f_bavail * stat.f_frsize >= nbytes + (64 << 20) else None


def _stop(procs: list[Any], conns: list[Connection], slots_file: str,
          lent: list[tuple[int, Any, Any]], locked: LockedMaps) -> None:
    """Ask each process to stop, wait a little, end the ones left; remove the file; once
    the copies from the slots are done, unlock them."""
    for conn in conns:
        try:
            conn.send_bytes(REQUEST.pack(-1, 0.0))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()
    try:
        os.unlink(slots_file)
    except FileNotFoundError:
        pass
    for _, _, event in lent:
        if event is not None:
            event.synchronize()
    locked.unlock()
