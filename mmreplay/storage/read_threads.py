"""Threads that share one frame read: more cores for a store that stays on the CPU.

A batch's read is the store's longest step (a batch of 256 4-stacks decodes ~500 chunks) and
runs in compiled code that releases the GIL. `ReadThreads` splits one read among `count`
threads, the caller's included: each decodes its share of the read's chunks
(`numba_kernels.read_frames` with ``part, parts``) straight into the batch's rows, so no row is
written twice and nothing is copied again.

Reads stay under the store's lock, so the writer, the shard mappings and the RAM tails do not
move during a read, and one read at a time uses the threads. Who turns threads on
(`FrameReader.use_threads`): ``batches(workers=N)`` of a writable store for its lifetime, and
the fill of a ``device=`` store on open. Each share is at least `MIN_SHARE_FRAMES` frames:
handing a share to a thread and back costs about what decoding it saves at ~256 frames (a
batch of 32 4-stacks: measured no faster split in two, on 2 cores).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

MIN_SHARE_FRAMES = 256  # fewest frames a thread takes of a read


class ReadThreads:
    """`count` threads sharing each read: the caller and ``count - 1`` pool threads."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._pool = ThreadPoolExecutor(max(1, count - 1), thread_name_prefix="mmreplay-read")

    def parts(self, frames: int) -> int:
        """How many shares a read of `frames` frames is split into."""
        return max(1, min(self.count, frames // MIN_SHARE_FRAMES))

    def run(self, share: Callable[[int, int], T], parts: int) -> list[T]:
        """``share(part, parts)`` for every part, part 0 in the caller's thread; the results
        in part order. Returns, or raises the first share's error, only once every share
        has finished: none may still write into the read's rows or read mapped files once
        the caller lets go of the store's lock."""
        futures: list[Future[T]] = [self._pool.submit(share, part, parts)
                                    for part in range(1, parts)]
        try:
            first = share(0, parts)
        finally:
            for future in futures:
                future.exception()  # waits; its error is raised below
        return [first, *(future.result() for future in futures)]

    def close(self) -> None:
        """Stop the pool threads (after the shares they run)."""
        self._pool.shutdown(wait=True)
