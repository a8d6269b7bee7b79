"""What `ReplayStore` does with object storage: push, and mirror in the background.

`BucketMethods` is a mixin of `ReplayStore` that uses only the store's public surface
(``path``, ``writable``, ``generation``, ``flush``, ``close``); the work is done by
`storage.push`, `storage.pull`, `storage.lease` and `mirror` (the background thread).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmreplay.errors import InvalidInputError
from mmreplay.mirror import Mirror
from mmreplay.storage.objects import open_objects
from mmreplay.storage.push import Pusher, PushReport
from mmreplay.storage.remote_frames import RemoteChunks


class BucketMethods:
    """`push` and ``mirror=`` for `ReplayStore` (see docs/object-storage.md)."""

    path: Path
    writable: bool
    generation: int
    mirror: Mirror | None = None  # the background mirror (``mirror=`` at create/open)
    remote: RemoteChunks | None = None  # a store read from a bucket fetches chunks here

    def flush(self, *, wait_mirror: bool = False) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def push(self, url: str, *, storage_options: dict[str, str] | None = None,
             take_over: bool = False) -> PushReport:
        """Commit (if writable), then upload the committed generation to `url`: only what
        the bucket lacks or what changed, the manifest last (docs/object-storage.md)."""
        if self.remote is not None:
            raise InvalidInputError("a store read from a bucket holds only the chunks it "
                                    "fetched; pull it (mmreplay pull) before pushing it")
        if self.writable:
            self.flush()
        pusher = Pusher(self.path, open_objects(url, storage_options))
        try:
            return pusher.push(take_over=take_over)
        finally:
            pusher.close()

    def attach_mirror(self, url: str | None, storage_options: dict[str, str] | None = None,
                      take_over: bool = False, *, writer_id: str | None = None) -> Any:
        """Start mirroring every flush into `url` (what ``mirror=`` at create/open does);
        returns the store. A store that cannot mirror as asked is closed again.
        `writer_id` names the writer in the prefix's lease (default: a new one), so that a
        writer restarted elsewhere renews its own lease (see `Mirror`)."""
        if url is None:
            return self
        try:
            if not self.writable:
                raise InvalidInputError("mirror= needs a writable open (mode='r+')")
            self.mirror = Mirror(self.path, open_objects(url, storage_options),
                                 take_over=take_over, writer_id=writer_id)
            self.mirror.notify(self.generation)
        except BaseException:
            self.close()
            raise
        return self
