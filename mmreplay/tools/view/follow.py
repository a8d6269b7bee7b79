"""How the viewer learns that a writer committed: the store's committed generation, cheaply.

Every request asks (`StoreData.store`), so the answer must cost next to nothing:

- a directory: one ``stat`` of the manifest. A commit replaces the manifest
  (write temp + ``os.replace``), so its inode, size or mtime change; only then is the
  manifest read again and its generation parsed.
- a URL (``s3://``, ``file://``): one GET of the bucket's manifest, at most once every
  `URL_POLL_S` seconds; between two looks the last answer stands.

`generation()` returns None when the manifest cannot be read (damaged, being replaced,
or gone).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from mmreplay.errors import MmreplayError
from mmreplay.storage.manifest import MANIFEST
from mmreplay.storage.objects import is_url
from mmreplay.tools import inspection as ins

URL_POLL_S = 1.0


class DirectoryProbe:
    """The committed generation of a store directory, re-read only when the manifest changed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._key: tuple[int, ...] | None = None
        self._generation: int | None = None

    def generation(self) -> int | None:
        try:
            st = os.stat(self.root / MANIFEST)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if key != self._key:
                self._generation = ins.committed_generation(self.root)
                self._key = key if self._generation is not None else None
            return self._generation


class UrlProbe:
    """The committed generation of a bucket store, looked up at most every `interval` s."""

    def __init__(self, url: str, *, interval: float = URL_POLL_S) -> None:
        self.url, self.interval = url, interval
        self._lock = threading.Lock()
        self._objects: Any = None
        self._checked = -float("inf")
        self._generation: int | None = None

    def generation(self) -> int | None:
        from mmreplay.storage.bucket import read_bucket_manifest
        from mmreplay.storage.objects import open_objects  # obstore: only for URLs

        with self._lock:
            if time.monotonic() - self._checked < self.interval:
                return self._generation
            try:
                if self._objects is None:
                    self._objects = open_objects(self.url)
                self._generation = int(read_bucket_manifest(self._objects)["generation"])
            except (MmreplayError, OSError, KeyError, TypeError, ValueError):
                self._generation = None
            self._checked = time.monotonic()
            return self._generation


    def entries(self) -> dict[str, tuple[int, int]]:
        """The bucket's objects grouped by their first name part: (objects, bytes) each."""
        from mmreplay.storage.objects import open_objects

        with self._lock:
            if self._objects is None:
                self._objects = open_objects(self.url)
            objects = self._objects
        out: dict[str, tuple[int, int]] = {}
        for key, info in objects.list().items():
            head, sep, _ = key.partition("/")
            files, size = out.get(head + sep, (0, 0))
            out[head + sep] = (files + 1, size + info.size)
        return out


def probe(path: str | Path) -> DirectoryProbe | UrlProbe:
    """The probe for a store path or URL."""
    return UrlProbe(str(path)) if is_url(path) else DirectoryProbe(Path(path))
