"""``lease.json``: which one writer may push into a prefix of object storage.

Every change is a conditional put (create if absent, replace if unchanged), so two writers
racing for a lease cannot both get it; a writer that has not pushed for `LEASE_TTL_S` may be
taken over.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

from mmreplay.errors import ObjectStoreError, StoreLockedError
from mmreplay.storage.objects import ObjectMissingError, Objects

LEASE = "lease.json"
LEASE_TTL_S = 120.0  # a writer that has not pushed for this long may be taken over


class Lease:
    """``lease.json``: the one writer allowed to push into a prefix, renewed by each push.

    A second writer is refused while the lease is held and fresh (`LEASE_TTL_S`);
    ``take_over=True`` takes it anyway (the other writer is known to be gone). Every change
    is a conditional put (create if absent, replace if unchanged), so two writers racing
    for a lease cannot both get it.
    """

    def __init__(self, objects: Objects, *, writer_id: str | None = None,
                 ttl_s: float = LEASE_TTL_S) -> None:
        self.objects, self.ttl_s = objects, ttl_s
        self.writer_id = writer_id or uuid.uuid4().hex
        self.held = False

    def _body(self) -> bytes:
        return json.dumps({"writer": self.writer_id, "host": socket.gethostname(),
                           "pid": os.getpid(), "expires": time.time() + self.ttl_s}).encode()

    def acquire(self, *, take_over: bool = False) -> None:
        """Take or renew the lease; `StoreLockedError` if another writer holds it."""
        for _ in range(8):
            info = self.objects.head(LEASE)
            if info is None:
                if self.objects.put_if_absent(LEASE, self._body()):
                    self.held = True
                    return
                continue
            current = self._read()
            mine = current.get("writer") == self.writer_id
            if not (mine or take_over or current.get("expires", 0) < time.time()):
                raise StoreLockedError(_locked_message(self.objects.url, current))
            if self.objects.put_if_match(LEASE, self._body(), info.etag or ""):
                self.held = True
                return
            if mine:  # our own lease changed under us: someone took it over
                break
        self.held = False
        raise StoreLockedError(f"{self.objects.url}: another writer took the lease "
                               f"({LEASE}); this one stops pushing")

    def check_free(self) -> None:
        """`StoreLockedError` if another writer holds the lease now (takes nothing)."""
        current = self._read()
        if current.get("writer") not in (None, self.writer_id) \
                and current.get("expires", 0) >= time.time():
            raise StoreLockedError(_locked_message(self.objects.url, current))

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.objects.get(LEASE)[:4096])
        except (ObjectMissingError, ValueError):  # gone, or not JSON: nobody's lease
            return {}
        return data if isinstance(data, dict) else {}

    def release(self) -> None:
        """Delete the lease if it is still this writer's (an unreachable bucket keeps it
        until it expires)."""
        try:
            if self.held and self._read().get("writer") == self.writer_id:
                self.objects.delete(LEASE)
        except ObjectStoreError:
            pass
        self.held = False


def _locked_message(url: str, lease: dict[str, Any]) -> str:
    left = float(lease.get("expires", 0)) - time.time()
    return (f"{url} is being written by another writer (id {str(lease.get('writer'))[:12]}, "
            f"host {str(lease.get('host'))[:64]}, pid {lease.get('pid')}), whose lease "
            f"expires in {left:.0f} s; if that writer is gone, push with take_over=True "
            f"(mmreplay push --take-over)")
