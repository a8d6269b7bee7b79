"""Ray itself for `mmreplay.integrations.ray`: the import (a missing extra is named), the
errors that mean "the store actor's process is gone", and waiting for its restart."""

from __future__ import annotations

import time
from typing import Any

try:
    import ray
except ImportError:  # pragma: no cover - depends on the environment
    raise ImportError('mmreplay.integrations.ray needs Ray: pip install "mmreplay[ray]"') \
        from None

ACTOR_DIED = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
BATCH_FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated", "discount",
                "weights", "ids")


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
