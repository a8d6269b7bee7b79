"""Committing a store to its directory, and reading a commit back.

A commit (``flush``) writes, under names carrying the new generation, every step
block and priority block that changed, the RAM tail of frames, and finally
``manifest.json`` (atomically); then it deletes the files the previous manifest
named and the new one does not. Blocks are copy-on-write, so a crash at any
point leaves the previous manifest and everything it names intact.

`Committer` owns the committed manifest of one directory and every write that
changes it, including the *give-up* commits that must precede a frame chunk
overwriting frames the committed manifest still claims. It knows files and
arrays; it does not know how frames are read or transitions sampled.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import InvalidStoreError, StoreLockedError
from mmreplay.index.ring import StepRing, step_dtype
from mmreplay.spec import StoreSpec
from mmreplay.storage.manifest import (
    FORMAT,
    MAX_COUNTER,
    STEP_DIRS,
    check_rng,
    check_step_columns,
    committed_generation,
    write_manifest,
)
from mmreplay.storage.safe_io import TMP_DIR, TMP_SUFFIX, fsync_dir, load_npy, save_npy

LOCK = "lock"
# Read-only opens hold a shared flock on this file while they load a generation; the
# writer deletes replaced files only when it can take it exclusively, else at a later
# commit. So a reader never finds a file of the manifest it read missing.
READERS = "readers"
READERS_WAIT_S = 2.0  # a reader that cannot share the lock this long loads without it


class Committer:
    """The committed state of one store directory and the writes that advance it."""

    def __init__(self, root: Path, spec: StoreSpec, *, durable: bool) -> None:
        self.root = root
        self.spec = spec
        self.durable = durable
        self.committed: dict[str, Any] = {}
        self.retired: set[str] = set()  # replaced files not yet deleted
        self.readers_fd: int | None = None  # a writer's handle on READERS

    @property
    def generation(self) -> int:
        return int(self.committed.get("generation", 0))

    # -- block layout ---------------------------------------------------------------
    def num_blocks(self) -> int:
        return -(-self.spec.slots_per_env // self.spec.block_slots)

    def block_range(self, b: int) -> slice:
        size = self.spec.block_slots
        return slice(b * size, min((b + 1) * size, self.spec.slots_per_env))

    # -- writing --------------------------------------------------------------------
    def commit(self, ring: StepRing, tail: np.ndarray, rng_state: Mapping[str, Any], *,
               priorities: np.ndarray | None = None, max_priority: float = 1.0,
               prio_dirty: set[int] | None = None,
               rate_limiter: dict[str, Any] | None = None,
               dictionary: dict[str, int] | None = None) -> None:
        """Write what changed since the last commit, then the manifest (recording the
        `dictionary` of a "zstd-dict" store once it has one), then clean up.
        `rate_limiter`: a rate limiter's counters, committed with the steps they count."""
        gen = self.generation + 1
        files = dict(self.committed.get("files", {}))
        blocks = self._write_blocks("steps", ring.steps, ring.dirty_blocks, gen, files)
        tail_name = f"tail/tail.g{gen:08d}.npy"
        files.pop(self.committed.get("tail"), None)
        files[tail_name] = self._save(tail_name, tail)
        manifest = self._manifest(gen, ring, rng_state, blocks, tail_name, files)
        if priorities is not None:
            dirty = ring.dirty_blocks | (prio_dirty or set())
            grid = priorities.reshape(self.spec.num_envs, -1)
            manifest["prio_blocks"] = self._write_blocks("prio", grid, dirty, gen, files)
            manifest["max_priority"] = max_priority
        if rate_limiter is not None:
            manifest["rate_limiter"] = dict(rate_limiter)
        if dictionary is not None:
            manifest["dictionary"] = dictionary
        if self.durable:
            self._sync_dirs()
        old = self.committed
        self._publish(manifest)
        self._remove_unnamed(old)

    def _sync_dirs(self) -> None:
        """Make the new files' names durable before a manifest names them.

        Each file was fsynced before its rename, but a rename lives in its directory:
        without this a power cut can keep the new manifest (the root is fsynced after
        it) and lose the blocks and tail it names.
        """
        for sub in STEP_DIRS:
            if (self.root / sub).is_dir():
                fsync_dir(self.root / sub)

    def give_up_chunks(self, ring: StepRing, env: int, first: int, last: int) -> None:
        """A frame store is about to write chunks ``first..last`` of `env` with the frames
        they hold now over older ones (its ``before_chunk_write`` hook): `give_up` those."""
        spec = self.spec
        end = min((last + 1) * spec.chunk_frames, spec.slots_per_env)  # past the last slot
        last_new = ring.frame_at(np.array([env * spec.slots_per_env + end - 1]))[0]
        self.give_up(env, int(last_new), end - first * spec.chunk_frames)

    def give_up(self, env: int, last_new: int, chunk_slots: int) -> None:
        """Give up, in a committed manifest, the old frames a chunk write will destroy.

        The chunk about to be written ends with frame `last_new` of `env`; the
        frames it overwrites are exactly ``S`` older. If the committed manifest
        still claims any of them on disk, commit a copy that claims none of them
        (and, to amortise, up to ``max(chunk, S // 16)`` frames beyond) first.
        """
        committed, spec = self.committed, self.spec
        last_old = last_new - spec.slots_per_env
        first_old = last_old - chunk_slots + 1
        written = committed["written"][env]
        on_disk_end = written - written % spec.slots_per_env % spec.chunk_frames
        if last_old < committed["kept_from"][env] or first_old >= on_disk_end:
            return  # the committed manifest claims none of the frames being overwritten
        ahead = max(spec.chunk_frames, spec.slots_per_env // 16)
        kept = list(committed["kept_from"])
        kept[env] = min(last_old + 1 + ahead, written)
        self._publish({**committed, "kept_from": kept, "generation": self.generation + 1})

    def _publish(self, manifest: dict[str, Any]) -> None:
        """Write `manifest` and make it the committed one once it is ``manifest.json``.

        An error after the rename (the durable directory fsync) still raises, but the
        manifest is then the committed one: the next commit must not reuse its generation
        (its file names), nor may a give-up be believed before it is on disk.
        """
        try:
            write_manifest(self.root, manifest, self.root / TMP_DIR, durable=self.durable)
        except BaseException:
            if committed_generation(self.root) == manifest["generation"]:
                self.committed = manifest
            raise
        self.committed = manifest

    def _write_blocks(self, kind: str, columns: np.ndarray, dirty: set[int], gen: int,
                      files: dict[str, int]) -> list[str | None]:
        """Save the dirty blocks of a (num_envs, slots) array under new names."""
        key = "blocks" if kind == "steps" else f"{kind}_blocks"
        blocks = list(self.committed.get(key, [None] * self.num_blocks()))
        for b in sorted(dirty):
            name = f"{kind}/b{b:06d}.g{gen:08d}.npy"
            files.pop(blocks[b], None)
            blocks[b] = name
            files[name] = self._save(name, columns[:, self.block_range(b)])
        return blocks

    def _save(self, name: str, array: np.ndarray) -> int:
        return save_npy(self.root, name, array, self.root / TMP_DIR, durable=self.durable)

    def _manifest(self, gen: int, ring: StepRing, rng_state: Mapping[str, Any],
                  blocks: list[str | None], tail: str, files: dict[str, int]) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": self.spec.format_version, "generation": gen,
            "spec": self.spec.to_dict(),
            "written": ring.written.tolist(), "kept_from": ring.oldest.tolist(),
            "running": ring.running.tolist(), "next_id": ring.next_id,
            "next_episode": ring.next_episode, "rng": rng_state,
            "blocks": blocks, "tail": tail, "files": files,
        }

    def _remove_unnamed(self, old: dict[str, Any]) -> None:
        """Retire files the previous manifest named and the new one does not."""
        keep = self.committed["files"]
        self.retired.update(name for name in old.get("files", {}) if name not in keep)
        self.remove_retired()

    def remove_retired(self) -> None:
        """Delete retired files unless a reader is loading (then a later call does)."""
        if not self.retired:
            return
        with self._readers_excluded() as free:
            if free:
                for name in sorted(self.retired):
                    (self.root / name).unlink(missing_ok=True)
                self.retired.clear()

    @contextmanager
    def _readers_excluded(self) -> Iterator[bool]:
        """Whether no reader is loading; if so, none can start until the block ends."""
        if self.readers_fd is None:
            yield True
            return
        try:
            fcntl.flock(self.readers_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(self.readers_fd, fcntl.LOCK_UN)

    def open_readers(self) -> None:
        """Writer: create/open ``root/readers`` (regular file, never through a symlink)."""
        self.readers_fd = _open_lock_file(self.root / READERS, writer=True)

    def close(self) -> None:
        """Writer: delete what can be deleted and let go of ``root/readers``."""
        try:
            self.remove_retired()
        finally:
            if self.readers_fd is not None:
                os.close(self.readers_fd)
                self.readers_fd = None

    # -- reading --------------------------------------------------------------------
    def load_ring(self, manifest: dict[str, Any], ring: StepRing) -> None:
        """Fill the ring from a manifest that passed `check_manifest`."""
        spec = self.spec
        for b, name in enumerate(manifest["blocks"]):
            if name is not None:
                rows = self.block_range(b)
                ring.steps[:, rows] = load_npy(
                    self.root, name, manifest["files"][name], dtype=step_dtype(spec),
                    shape=(spec.num_envs, rows.stop - rows.start))
        check_step_columns(ring.steps, manifest)
        ring.written[:] = int_list(manifest, "written", spec.num_envs)
        ring.kept_from[:] = int_list(manifest, "kept_from", spec.num_envs)
        ring.running[:] = np.asarray(manifest["running"], dtype=bool)
        ring.next_id, ring.next_episode = manifest["next_id"], manifest["next_episode"]
        ring.rebuild_validity()
        ring.dirty_blocks.clear()

    def load_tail(self, manifest: dict[str, Any], like: np.ndarray) -> np.ndarray:
        name = manifest["tail"]
        return load_npy(self.root, name, manifest["files"][name], dtype=like.dtype,
                        shape=like.shape)

    def load_priorities(self, manifest: dict[str, Any]) -> np.ndarray:
        """The flat priority column of a prioritized store's manifest."""
        spec = self.spec
        priorities = np.zeros((spec.num_envs, spec.slots_per_env))
        for b, name in enumerate(manifest["prio_blocks"]):  # checked by check_manifest
            if name is not None:
                rows = self.block_range(b)
                priorities[:, rows] = load_npy(
                    self.root, name, manifest["files"][name], dtype=np.dtype("<f8"),
                    shape=(spec.num_envs, rows.stop - rows.start))
        if not (np.isfinite(priorities).all() and (priorities >= 0).all()):
            raise InvalidStoreError("stored priorities must be finite and >= 0")
        return priorities.reshape(-1)

    def sweep(self) -> None:
        """Remove temp files and step/tail/prio files the manifest does not name.

        Symlinks are removed, never followed; directories are left alone.
        """
        named = set(self.committed["files"])
        with self._readers_excluded() as free:  # else a loading reader may need them
            for sub in (*STEP_DIRS, TMP_DIR) if free else (TMP_DIR,):
                for entry in _entries(self.root / sub):
                    stray = (entry.name.endswith(TMP_SUFFIX) if sub == TMP_DIR else
                             entry.name.endswith(".npy") and f"{sub}/{entry.name}" not in named)
                    if stray and not entry.name.startswith(".") and not entry.is_dir(
                            follow_symlinks=False):
                        os.unlink(entry.path)


def rng_from_state(state: dict[str, Any]) -> np.random.Generator:
    """The PCG64 generator a manifest's ``rng`` field describes."""
    check_rng(state)
    try:
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = state
    except (ValueError, TypeError, KeyError, OverflowError) as exc:
        raise InvalidStoreError(f"manifest rng state is invalid: {exc}") from None
    return rng


def take_lock(root: Path) -> int:
    """Take the writer lock (``root/lock``, created if absent, never through a symlink).

    flock(2) locks belong to an open file, not a process, so a second writer in the same
    process is refused like one in another; the message says which (see `_HELD`).
    """
    fd = _open_lock_file(root / LOCK, writer=True)
    assert fd is not None  # a writer's open raises instead
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        here = _file_key(fd) in _HELD.values()
        os.close(fd)
        if here:
            raise StoreLockedError(
                f"{root} is already open for writing in this process: use that ReplayStore, "
                f"or close() it before opening the store again") from None
        raise StoreLockedError(f"{root} is already open for writing by another process") from None
    _HELD[fd] = _file_key(fd)
    return fd


def release_lock(fd: int) -> None:
    """Give up a lock `take_lock` returned (closing its descriptor)."""
    _HELD.pop(fd, None)
    os.close(fd)


# Lock files whose writer lock this process holds: descriptor -> (st_dev, st_ino).
_HELD: dict[int, tuple[int, int]] = {}


def _file_key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


@contextmanager
def readers_shared(root: Path) -> Iterator[None]:
    """Reader: hold a shared lock on ``root/readers`` while loading a generation.

    Without the file (a store no writer has opened since this version) or when
    the lock cannot be had within READERS_WAIT_S, the caller loads without it
    and relies on its retry.
    """
    fd = _open_lock_file(root / READERS, writer=False)
    if fd is None:
        yield
        return
    try:
        deadline = time.monotonic() + READERS_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # a writer is deleting files; that takes microseconds
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_lock_file(path: Path, *, writer: bool) -> int | None:
    """An fd on a regular file; a writer creates it, a reader gets None if it is absent.

    Never follows a symlink or blocks on a FIFO; anything but a regular file raises
    for a writer and is None for a reader.
    """
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_RDWR | os.O_CREAT if writer else os.O_RDONLY
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if not writer:
            return None
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise InvalidStoreError(f"{path.name} is not a regular file: {exc.strerror}") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        if not writer:
            return None
        raise InvalidStoreError(f"{path.name} is not a regular file")
    return fd


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    """The entries of a directory, none if it does not exist."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except FileNotFoundError:
        return []


def int_list(manifest: dict[str, Any], key: str, size: int) -> np.ndarray:
    value = manifest[key]
    if len(value) != size or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNTER
            for v in value):
        raise InvalidStoreError(f"manifest field {key!r} must be {size} non-negative ints")
    return np.asarray(value, dtype=np.int64)
