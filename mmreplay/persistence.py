"""A store's RAM parts and its files: loaded from a manifest at open, committed at each
flush, closed at close (`StoreFiles`).

One generation is committed in this order (`commit`)::

    frames on disk (drained, or fsynced when durable)
      -> step blocks, tail, priorities, RNG, limiter counters, dictionary record
      -> manifest (`Committer.commit`: temp file + rename, the commit point)

The facade owns the lock and calls these under it; this module knows no sampling,
batches or rate limiting (it is handed the limiter's counters to commit).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from mmreplay.device_reader import DeviceReader, open_device
from mmreplay.mirror import Mirror
from mmreplay.priorities import Priorities
from mmreplay.reader import Reader
from mmreplay.recorder import Recorder
from mmreplay.sequence_reader import SequenceReader
from mmreplay.spec import StoreSpec
from mmreplay.storage.commit import Committer, release_lock, rng_from_state
from mmreplay.storage.remote_frames import RemoteChunks
from mmreplay.storage.safe_io import TMP_DIR


class StoreFiles:
    """Loading, committing and closing one store's parts (see the module doc)."""

    def __init__(self, commits: Committer, reader: Reader, priorities: Priorities, *,
                 durable: bool) -> None:
        self.commits, self.reader, self.priorities = commits, reader, priorities
        self.ring, self.frames = reader.ring, reader.frames
        self.durable = durable

    def start(self, manifest: dict[str, Any] | None,
              writable: bool) -> np.random.Generator | None:
        """Load `manifest` (if any; returns its RNG); a writer then opens the readers lock
        and sweeps. On failure, closes what the store opened."""
        try:
            rng = None if manifest is None else self._load(manifest)
            if writable:
                (self.commits.root / TMP_DIR).mkdir(exist_ok=True)
                self.commits.open_readers()
                if manifest is not None:
                    self.commits.sweep()
            return rng
        except BaseException:
            self.close()
            raise

    def open_device(self, device: Any, spec: StoreSpec, sequences: SequenceReader,
                    recorder: Recorder) -> DeviceReader | None:
        """`open_device` (None without a `device`); on failure, closes what the store
        opened."""
        try:
            return open_device(device, spec, self.reader, sequences, recorder)
        except BaseException:
            self.close()
            raise

    def commit(self, rng_state: Mapping[str, Any], rate_limiter: dict[str, Any] | None) -> None:
        """One generation (see the module doc): frames on disk first, then steps,
        priorities, RNG and limiter counters named by a new manifest. Under the store's
        lock."""
        self.reader.refresh()  # new transitions get their priorities before they are saved
        frames = self.frames
        if self.durable:
            frames.sync()
        else:
            frames.drain()  # the manifest may only name chunks that are on disk
        self.commits.commit(self.ring, frames.tail_frames(), rng_state,
                            **self.priorities.commit_fields(), rate_limiter=rate_limiter,
                            dictionary=frames.dictionary_record())
        self.ring.dirty_blocks.clear()
        self.priorities.dirty.clear()

    def close(self, lock_fd: int | None = None, remote: RemoteChunks | None = None,
              mirror: Mirror | None = None) -> None:
        """Close the mirror (pushing the last generation), the frame store, the committer
        (it may fail to delete retired files: they are swept later), the writer lock and a
        bucket store's cache, whatever the one before raised."""
        try:
            if mirror is not None:
                mirror.close()
        finally:
            self._close_files(lock_fd, remote)

    def _close_files(self, lock_fd: int | None, remote: RemoteChunks | None) -> None:
        try:
            self.frames.close()
        finally:
            try:
                self.commits.close()
            finally:
                if lock_fd is not None:
                    release_lock(lock_fd)
                if remote is not None:  # a store read from a bucket: its cache goes
                    remote.close()
                    shutil.rmtree(self.commits.root, ignore_errors=True)

    def _load(self, manifest: dict[str, Any]) -> np.random.Generator:
        """Fill the RAM parts from a manifest that passed `check_manifest`; returns the
        RNG."""
        commits, ring, frames = self.commits, self.ring, self.frames
        commits.load_ring(manifest, ring)
        tail = commits.load_tail(manifest, frames.tail)
        frames.load_tail(tail, ring.written % ring.slots_per_env)
        sampler = self.priorities.sampler
        if sampler is None:
            self.reader.update_all_slots()
        else:
            sampler.load(commits.load_priorities(manifest), ring.steps["id"].reshape(-1),
                         float(manifest["max_priority"]), ring.valid)
        commits.committed = manifest
        return rng_from_state(manifest["rng"])
