"""Priority updates applied late: a learner on a GPU hands ``|td|`` over without waiting.

A synchronous ``update_priorities(ids, td)`` with ``td`` on a CUDA device copies it to the
host and so waits, every step, for the step that computed it: the device runs dry while the
CPU draws the next batch. A late update is queued instead::

    step j   update_priorities(ids, td)  ──>  non_blocking copy into a fresh page-locked
             (returns None at once)           block, on the caller's current stream; an
                                              event recorded after it; queued
    draw     sample, batches, sample_sequences: first apply, in order, the queued updates
             whose events are done; then, while more than `max_pending` are left, wait for
             the oldest and apply it. So the update of step j is in effect from draw j+1 on
             if the device has finished step j by then, and from draw j+1+max_pending on
             whatever it does
    flush    (and close, and any synchronous update or sequence update): wait, apply all

Updates are applied in the order they were made, each exactly as a synchronous update
would be at that point: ids no longer sampleable are ignored, the last value of an id
wins. Their values are checked when applied: a late update with NaN, inf or negative
priorities is dropped whole (the others are applied) and the draw or flush that found it
raises `InvalidInputError` (a flush after committing). Shapes and dtypes are checked at
once. Without CUDA tensors there is nothing to wait for: an update is applied by the next
draw (what ``device="cpu"`` tests run).

The pinned blocks come from PyTorch's host allocator, which reuses a block only once the
copies queued from or into it are done; the queue also holds the device tensors until then.
torch is imported only for torch tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mmreplay import validate
from mmreplay.errors import InvalidInputError

MAX_PENDING = 2  # late updates a draw may leave unapplied (the device's lead, in steps)


class Event(Protocol):
    """What the queue needs of a ``torch.cuda.Event``."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class Pending:
    """One queued update: its host copies (complete once `events` are) and the device
    tensors they are copied from (kept alive until then)."""

    ids: Any
    values: Any
    events: list[Event]
    sources: tuple[Any, ...]

    def done(self) -> bool:
        return all(event.query() for event in self.events)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()


def is_device_tensor(value: Any) -> bool:
    """A torch tensor on a CUDA device (without importing torch). Tensors of other
    accelerators are read at once, like CPU ones (no CUDA stream or event to queue on)."""
    device = getattr(value, "device", None)  # the device first: a CPU tensor stops there
    return getattr(device, "type", "cpu") == "cuda" and hasattr(value, "detach")


def wants_late(ids: Any, values: Any, late: Any) -> bool:
    """`update_priorities`' ``late`` argument: None means late for CUDA tensors only."""
    if late is None:
        if type(ids) is np.ndarray and type(values) is np.ndarray:  # the usual call, at once
            return False
        return is_device_tensor(ids) or is_device_tensor(values)
    if not isinstance(late, bool | np.bool_):
        raise InvalidInputError(f"late must be None, True or False, got {late!r}")
    return bool(late)


def record_events(sources: Sequence[Any]) -> list[Event]:
    """An event recorded on the current stream of each CUDA device among `sources`."""
    if not sources:
        return []
    import torch

    devices = dict.fromkeys(tensor.device for tensor in sources)
    events: list[Event] = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


class LatePriorities:
    """The queue of late updates of one store (see the module doc). Its owner holds the
    store's lock around every call."""

    def __init__(self, apply: Callable[[np.ndarray, np.ndarray], int], *,
                 max_pending: int = MAX_PENDING,
                 record: Callable[[Sequence[Any]], list[Event]] = record_events) -> None:
        self.apply = apply  # a synchronous update of checked ids and float64 values
        self.max_pending = max_pending
        self.record = record
        self.queued: deque[Pending] = deque()
        self.error: InvalidInputError | None = None  # the first dropped update's, unreported

    def __len__(self) -> int:
        return len(self.queued)

    def queue(self, ids: Any, values: Any) -> None:
        """Check the shapes and dtypes, start the copies to the host, queue the update."""
        count = _check_ids(ids)
        _check_values(values, count)
        sources = tuple(x for x in (ids, values) if is_device_tensor(x))
        host_ids, host_values = _to_host(ids), _to_host(values)
        self.queued.append(Pending(host_ids, host_values, self.record(sources), sources))

    def apply_ready(self) -> None:
        """At a draw: apply the leading updates that are done, then wait for the oldest
        while more than `max_pending` are queued."""
        queued = self.queued
        while queued and (len(queued) > self.max_pending or queued[0].done()):
            self._apply(queued.popleft())

    def apply_all(self) -> None:
        """Wait for every queued update and apply them all, in order."""
        while self.queued:
            self._apply(self.queued.popleft())

    def report(self) -> None:
        """Raise the error of a dropped update, once."""
        error, self.error = self.error, None
        if error is not None:
            raise error

    def _apply(self, pending: Pending) -> None:
        pending.wait()
        ids = validate.transition_ids(_as_numpy(pending.ids))
        values = validate.priority_array(_as_numpy(pending.values), ids.size)
        try:
            self.apply(ids, values)
        except InvalidInputError as exc:
            if self.error is None:
                self.error = InvalidInputError(
                    f"a late update_priorities of {ids.size} ids was dropped (nothing of it "
                    f"applied; the updates before and after it were): {exc}")


def _shape_kind(value: Any) -> tuple[tuple[int, ...], str, str]:
    """Shape, numpy dtype kind and dtype name of an array or tensor, without reading it
    (a CUDA tensor is not synchronized)."""
    if hasattr(value, "detach") and hasattr(value, "dtype"):
        dtype = value.dtype
        kind = ("b" if str(dtype) == "torch.bool" else "c" if dtype.is_complex
                else "f" if dtype.is_floating_point else "i")
        return tuple(value.shape), kind, str(dtype)
    arr = np.asarray(value)
    return arr.shape, arr.dtype.kind, str(arr.dtype)


def _check_ids(ids: Any) -> int:
    shape, kind, name = _shape_kind(ids)
    count = int(np.prod(shape))
    if len(shape) > 1 or (count and kind not in "iu"):
        raise InvalidInputError(f"ids must be a 1-d array of ints, got dtype {name} "
                                f"shape {shape}")
    return count


def _check_values(values: Any, count: int) -> None:
    shape, kind, name = _shape_kind(values)
    if (shape if shape else (1,)) != (count,) or kind not in "iuf":
        raise InvalidInputError(f"priorities must be {count} numbers (one per id), got "
                                f"{name} {shape}")


def _to_host(value: Any) -> Any:
    """A copy of `value` on the host that later changes to `value` do not reach: for a
    CUDA tensor a fresh page-locked tensor, its copy only queued (``non_blocking``)."""
    if is_device_tensor(value):
        import torch

        value = validate.numpy_typed(value.detach())  # (a bfloat16 |td| made float32 there)
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        return host
    return np.array(validate.to_numpy(value), copy=True)


def _as_numpy(value: Any) -> np.ndarray:
    return value.numpy() if hasattr(value, "detach") else value
