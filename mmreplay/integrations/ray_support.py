"""Ray itself for `mmreplay.integrations.ray`: the import (a missing extra is named), the
errors that mean "the store actor's process is gone", and waiting for its restart."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

try:
    import ray
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError('mmreplay.integrations.ray needs Ray: pip install "mmreplay[ray]"') \
        from None

from mmreplay.torch_batch import Batch  # noqa: E402 -- after the one-line error for a missing extra

ACTOR_DIED = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# the tensor fields of a `Batch` the store actor sends as numpy arrays (not extras)
BATCH_FIELDS = tuple(f.name for f in fields(Batch) if f.name != "extras")


def wait_for_actor(actor: Any, timeout_s: float) -> None:
    """Block until the store actor answers again (Ray restarting it), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.info.remote(), timeout=max(0.1, deadline - time.monotonic()))
            return
        except (*ACTOR_DIED, ray.exceptions.GetTimeoutError):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the store actor did not come back within {timeout_s} s") \
                    from None
            time.sleep(0.05)
