"""Memory the library did not allocate, page-locked in place for copies to a CUDA device.

A ``non_blocking`` copy to a GPU from pageable memory is staged by the driver through its own
page-locked buffers; from page-locked memory it is DMA, queued and done later. PyTorch's
pinned allocator page-locks the blocks it hands out; shared memory other processes write
(`sampling_processes`' slots) is locked where it is, with ``cudaHostRegister`` (as
PyTorch's checkpoint stager pins its shared memory, ``torch/cuda/_pin_memory_utils.py``).
Locked memory must stay mapped until it is unlocked, and a copy from it must be done before
it is rewritten: the owner's business (`SamplingProcesses.release_after`).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np


class LockedMaps:
    """Memory maps, page-locked for copies to a CUDA device once `lock` is called.

    ``cudaHostRegister`` (flag portable) pins the pages in place, so a ``non_blocking`` copy
    from one is DMA, not staged by the driver; nothing else changes for the mapping.
    Registering and unregistering run in a thread of their own: a CUDA runtime call that
    fails leaves its error as its thread's "last error", which PyTorch's next kernel launch
    check in that thread would raise as its own."""

    PORTABLE = 1  # cudaHostRegisterPortable

    def __init__(self, maps: list[mmap.mmap]) -> None:
        self.maps = maps  # kept until unlocked: locked pages must stay mapped
        self.addresses = [np.frombuffer(m, np.uint8).ctypes.data for m in maps]
        self.locked: list[int] = []  # addresses registered
        self.device: Any = None

    def lock(self, device: Any) -> bool:
        """Lock every mapping for `device`; all or none (False: CUDA refused one)."""
        import torch

        self.device = device

        def register() -> None:
            cudart = torch.cuda.cudart()
            for address, m in zip(self.addresses, self.maps, strict=True):
                if int(cudart.cudaHostRegister(address, len(m), self.PORTABLE)) != 0:
                    return
                self.locked.append(address)

        _in_own_thread(register, device)
        if len(self.locked) == len(self.maps):
            return True
        self.unlock()
        return False

    def unlock(self) -> None:
        """Unregister what `lock` registered (once the copies from it are done)."""
        addresses, self.locked = self.locked, []
        if not addresses:
            return
        import torch

        def unregister() -> None:
            cudart = torch.cuda.cudart()
            for address in addresses:
                cudart.cudaHostUnregister(address)

        _in_own_thread(unregister, self.device)


def _in_own_thread(work: Callable[[], None], device: Any = None) -> None:
    """Run `work` in a new thread (with `device` current, if given) and wait for it; its
    exception, if any, is raised here. At interpreter shutdown (no new thread) in this one:
    a CUDA error it leaves behind no longer matters then."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            if device is None:
                work()
            else:
                import torch

                with torch.cuda.device(device):
                    work()
        except BaseException as exc:  # noqa: BLE001  (raised in the caller's thread)
            failed.append(exc)

    thread = threading.Thread(target=run, name="mmreplay-page-lock")
    try:
        thread.start()
    except RuntimeError:  # at interpreter shutdown no thread starts: here, then
        run()
    else:
        thread.join()
    if failed:
        raise failed[0]
