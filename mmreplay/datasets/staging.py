"""Build a store beside its target and move it into place only when it is complete.

Importers write into ``<parent>/.<name>.partial-<random hex>`` (same filesystem, so the final
``os.rename`` is atomic) and remove that directory on any failure, so an import that
fails leaves neither a half-made store at the target nor anything outside its parent.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mmreplay.errors import InvalidInputError
from mmreplay.store import ReplayStore


def check_target(target: str | os.PathLike[str]) -> Path:
    """`target` is free for a new store: absent, or an empty directory, in an existing parent."""
    path = Path(target)
    if path.is_symlink() or (path.exists() and (not path.is_dir() or any(path.iterdir()))):
        raise InvalidInputError(f"{path} already exists and is not an empty directory")
    if not path.parent.is_dir():
        raise InvalidInputError(f"the parent directory {path.parent} of {path} does not exist")
    return path


@contextlib.contextmanager
def staged_store(target: str | os.PathLike[str], **create: Any) -> Iterator[ReplayStore]:
    """A new store (``ReplayStore.create(**create)``) that appears at `target` on success.

    On leaving the block normally the store is closed (flushed) and renamed to
    `target`; on an exception it is closed without a flush and its directory removed.
    """
    path = check_target(target)
    staging = path.parent / f".{path.name}.partial-{secrets.token_hex(6)}"
    staging.mkdir()  # the umask's permissions, as a plain ReplayStore.create would give
    try:
        store = ReplayStore.create(staging, **create)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        yield store
        store.close()
        check_target(path)  # still free: nothing appeared there meanwhile
        os.rename(staging, path)
    except BaseException:
        _abandon(store)
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _abandon(store: ReplayStore) -> None:
    """Release a store's files and lock without committing what it holds."""
    store.writable = False  # close() then skips its flush
    with contextlib.suppress(Exception):
        store.close()
