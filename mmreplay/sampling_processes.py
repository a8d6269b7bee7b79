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

With ``device=``, a thread of this process takes each batch and copies it to the device on
a side stream (`device_batches.DeviceMover`, as for the thread paths: the frames from the
slot, pageable, which the copy has read when it returns; the small fields packed and
page-locked), so the slot is free again at once. Processes start with ``spawn``: a script
that creates them needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

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
from mmreplay.spec import StoreSpec
from mmreplay.torch_batch import ArrayBatch, Batch, make_batch

REQUEST = struct.Struct("<qd")  # slot (-1: stop), beta
REPLY = struct.Struct("<qq")  # slot, status (0: done; else a message follows)
IN_FLIGHT = 2  # requests each process holds at once
START_TIMEOUT_S = 120.0  # a process that has not answered its first request by then failed
_ERRORS = {"EmptyStoreError": EmptyStoreError, "InvalidStoreError": InvalidStoreError}


def slot_fields(spec: StoreSpec, batch_size: int) -> list[tuple[str, tuple[int, ...], Any]]:
    """The fields of a batch slot: what `ReplayStore.sample_arrays` returns, in order."""
    return [("frames", (2, batch_size, spec.frame_stack, *spec.obs_shape), spec.obs_dtype),
            *small_fields(spec, batch_size)]


def slot_packing(spec: StoreSpec, batch_size: int) -> tuple[Packing, int]:
    """Where each field of a batch sits in a slot (`Packing`), and the slot's size: a whole
    number of pages, so that each slot is mapped on its own."""
    packing = Packing(slot_fields(spec, batch_size))
    return packing, -(-max(packing.nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def slot_arrays(packing: Packing, raw: np.ndarray) -> ArrayBatch:
    """The `ArrayBatch` a slot holds, viewing it."""
    views = packing.views(raw)
    return ArrayBatch(frames=views["frames"], action=views["action"], reward=views["reward"],
                      terminated=views["terminated"], truncated=views["truncated"],
                      discount=views["discount"], weights=views["weights"], ids=views["ids"],
                      steps=views["steps"], extras=extras_of(views))


def serve(open_view: Callable[[int], tuple[Any, Callable[[], None]]], seed: int,
          batch_size: int, slots_path: str, slot_bytes: int, conn: Connection) -> None:
    """A sampling process: open a read-only view of the store (`open_view`, the store's
    `batching.OpenView`), answer each request with a batch written into its slot, until a
    stop request or the end of the pipe."""
    close: Callable[[], None] | None = None
    try:
        maker, close = open_view(seed)
        packing, _ = slot_packing(maker.spec, batch_size)
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
                views = packing.views(raw[slot])  # the frames field first: read into place
                arrays = maker.sample_arrays(batch_size, beta, False, raw[slot][:frame_bytes])
                if arrays.frames.ctypes.data != views["frames"].ctypes.data:
                    views["frames"][...] = arrays.frames  # (a read that could not use `out`)
                for name, values in small_arrays(arrays).items():
                    views[name][...] = values
                conn.send_bytes(REPLY.pack(slot, 0))
            except Exception as exc:  # noqa: BLE001  (told to the iterator, which raises)
                conn.send_bytes(REPLY.pack(slot, 1)
                                + f"{type(exc).__name__}\0{exc}".encode("utf-8", "replace"))
    finally:
        if close is not None:
            close()


class SamplingProcesses(Iterator[Batch]):
    """An endless iterator of batches sampled by `workers` processes (see the module doc).
    ``beta`` may be changed between batches; ``close`` (or the context manager) stops the
    processes and removes the slots' file."""

    def __init__(self, open_view: Callable[[int], tuple[Any, Callable[[], None]]],
                 spec: StoreSpec, batch_size: int, *, workers: int, prefetch: int, beta: float,
                 seeds: list[int]) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidInputError(f"workers must be a positive int, got {workers!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise InvalidInputError(f"prefetch must be a positive int, got {prefetch!r}")
        self.beta = beta
        self._packing, slot_bytes = slot_packing(spec, batch_size)
        count = IN_FLIGHT * workers + prefetch + 2
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="mmreplay-slots-", dir=folder)
        self._file = name
        self._closed = False
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        try:
            os.ftruncate(fd, count * slot_bytes)
            self._maps = [mmap.mmap(fd, slot_bytes, offset=i * slot_bytes)
                          for i in range(count)]
        except BaseException:
            os.unlink(name)
            raise
        finally:
            os.close(fd)
        self._free: deque[int] = deque(range(count))
        self._ready: deque[int] = deque()
        self._lent: list[tuple[int, weakref.ref[np.ndarray]]] = []
        self._asked = [0] * workers  # requests in flight, by process
        self._owner: dict[int, int] = {}  # slot -> process answering it
        self._started = False
        self.copies = 0  # batches handed out as copies (the consumer held every other slot)
        self._finalize = weakref.finalize(self, _stop, self._procs, self._conns, name)
        ctx = multiprocessing.get_context("spawn")
        try:
            for seed in seeds[:workers]:
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=serve, daemon=True, name="mmreplay-sampler",
                                   args=(open_view, seed, batch_size, name, slot_bytes,
                                         theirs))
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(mine)
        except BaseException:
            self.close()
            raise

    def __next__(self) -> Batch:
        return make_batch(self.next_arrays())

    def next_arrays(self) -> ArrayBatch:
        """The next batch as numpy arrays viewing its slot (`ReplayStore.sample_arrays`'s
        fields): the slot is lent until nothing views them."""
        if self._closed:
            raise StopIteration
        self._reclaim()
        self._feed()
        while not self._ready:
            self._receive()
            self._feed()
        slot = self._ready.popleft()
        raw = np.frombuffer(self._maps[slot], np.uint8)
        if not self._free and not any(self._asked) and not self._ready:
            # the consumer holds every other slot: lending this one would leave none to
            # sample into, so a copy, and the slot goes back
            arrays = slot_arrays(self._packing, raw.copy())
            self._free.append(slot)
            self.copies += 1
            return arrays
        self._lent.append((slot, weakref.ref(raw)))
        return slot_arrays(self._packing, raw)

    def _reclaim(self) -> None:
        """Slots whose batches no longer exist go back to the free list."""
        held = []
        for slot, ref in self._lent:
            if ref() is None:
                self._free.append(slot)
            else:
                held.append((slot, ref))
        self._lent = held

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
        if not busy:  # nothing asked, nothing free: every slot is in the consumer's hands
            raise AssertionError("no slot to sample into")  # a copy is made before that
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
            slot, status = REPLY.unpack(data[:REPLY.size])
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


def _stop(procs: list[Any], conns: list[Connection], slots_file: str) -> None:
    """Ask each process to stop, wait a little, end the ones left; remove the file."""
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
