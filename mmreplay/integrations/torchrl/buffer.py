"""The sampler, the writer and the buffer that go with `FrameOnceStorage`.

What a user swaps in TorchRL's DQN (`make_replay_buffer` does all three)::

    TensorDictReplayBuffer(storage=LazyMemmapStorage(1_000_000), batch_size=32, prefetch=3)
    ->
    FrameOnceReplayBuffer(storage=FrameOnceStorage("runs/rb", 1_000_000),
                          sampler=FrameOnceSampler(), writer=FrameOnceWriter(),
                          batch_size=32, prefetch=3)

`FrameOnceSampler` draws with the store's own sampler (uniform, or prioritized by the
store's sum tree) and its persisted RNG; its ``update_priority`` sets the store's
priorities. `FrameOnceReplayBuffer` is TorchRL's `TensorDictReplayBuffer` with two
differences: ``update_tensordict_priority`` reaches the store's priorities, and ``dumps``
keeps the prefetch queue as the ids it drew (JSON, read back from the store on ``loads``)
instead of pickling the queued frames.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase
from torchrl.data import TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage
from torchrl.data.replay_buffers.writers import Writer

from mmreplay.errors import InvalidInputError
from mmreplay.integrations.torchrl.storage import FrameOnceStorage
from mmreplay.storage.safe_io import write_atomic

SAMPLER_FILE = "frame_once_sampler.json"
PREFETCH_FILE = "frame_once_prefetch.json"


def _ours(storage: Storage | None) -> FrameOnceStorage:
    if not isinstance(storage, FrameOnceStorage):
        raise InvalidInputError(f"FrameOnceSampler and FrameOnceWriter work on a "
                                f"FrameOnceStorage, got {type(storage).__name__}")
    return storage


class FrameOnceSampler(Sampler):
    """The store's draw behind TorchRL's sampler interface. `beta`: importance-weight
    exponent of a prioritized store (``info["priority_weight"]``; set ``sampler.beta`` to
    anneal). Its state (sampling RNG, priorities) lives in the store."""

    def __init__(self, beta: float = 0.4) -> None:
        self.beta = float(beta)

    def sample(self, storage: Storage, batch_size: int) -> tuple[torch.Tensor, dict]:
        ours = _ours(storage)
        index, weights = ours.draw(batch_size, self.beta)
        prioritized = ours.store is not None and ours.store.spec.sampler != "uniform"
        return index, ({"priority_weight": weights} if prioritized else {})

    def update_priority(self, index: Any, priority: Any, *,
                        storage: Storage | None = None) -> None:
        store = _ours(storage).opened()
        ids = torch.as_tensor(index).reshape(-1).cpu().numpy()
        values = torch.as_tensor(priority).detach().reshape(-1).float().cpu().numpy()
        if values.size != ids.size:
            raise InvalidInputError(f"{values.size} priorities for {ids.size} indices: "
                                    f"expected one per index")
        store.update_priorities(ids, values)

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.beta = float(state_dict["beta"])

    def dumps(self, path: str | os.PathLike[str]) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / SAMPLER_FILE, json.dumps(self.state_dict()).encode(), folder,
                     durable=False)

    def loads(self, path: str | os.PathLike[str]) -> None:
        self.load_state_dict(json.loads((Path(path) / SAMPLER_FILE).read_text()))

    def _empty(self) -> None:
        return None


class FrameOnceWriter(Writer):
    """Hands whole collector batches to the storage (which assigns the ids)."""

    @property
    def _write_count(self) -> int:
        """TorchRL's ``rb.write_count``: transitions written since the store was created
        (the store's counter, so it survives a resume)."""
        store = _ours(self._storage).store
        return 0 if store is None else store.counts.transitions

    def add(self, data: Any) -> Any:
        return self.extend(data.unsqueeze(0))[0]

    def extend(self, data: Any) -> torch.Tensor:
        return _ours(self._storage).record(data)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def dumps(self, path: str | os.PathLike[str]) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def loads(self, path: str | os.PathLike[str]) -> None:
        return None

    def _empty(self, empty_write_count: bool = True) -> None:
        _ours(self._storage)._empty()


class FrameOnceReplayBuffer(TensorDictReplayBuffer):
    """TorchRL's `TensorDictReplayBuffer` for a `FrameOnceStorage` (see the module doc)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("collate_fn", _same)
        super().__init__(**kwargs)

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Priorities from ``data[priority_key]`` (e.g. DQNLoss's ``"td_error"``) for
        ``data["index"]``, as TorchRL's prioritized buffers take them."""
        priority = data.get(self.priority_key).reshape(data.shape[0], -1).amax(-1)
        self.update_priority(data.get("index"), priority)

    def _dump_prefetch_state(self, path: Path, prefetch_state: dict[str, Any]) -> None:
        queue = [info["index"].tolist() for _, info in prefetch_state["queue"]]
        state = {"version": 1, "capacity": prefetch_state["capacity"], "queue": queue}
        write_atomic(path / PREFETCH_FILE, json.dumps(state).encode(), path, durable=False)

    def _load_prefetch_state(self, path: Path) -> dict[str, Any] | None:
        file = path / PREFETCH_FILE
        if not file.exists():
            return None
        state = json.loads(file.read_text())
        queue = tuple(self._queued(torch.tensor(ids, dtype=torch.int64))
                      for ids in state["queue"])
        return {"version": state["version"], "capacity": state["capacity"], "queue": queue}

    def _queued(self, index: torch.Tensor) -> tuple[TensorDictBase, dict[str, Any]]:
        """A prefetched batch rebuilt from the store: its data and info as `_sample` made
        them (weights 1: the store's ``get`` draws nothing)."""
        data = self.storage.get(index)
        if self.transform is not None and len(self.transform):
            data = self.transform(data)
        info: dict[str, Any] = {"index": index}
        if self.storage.store is not None and self.storage.store.spec.sampler != "uniform":
            info["priority_weight"] = torch.ones(index.shape)
        return data, info


def _same(data: Any) -> Any:
    return data


def make_replay_buffer(path: str | os.PathLike[str], max_size: int, *, batch_size: int,
                       prefetch: int | None = None, sampler: str = "uniform",
                       alpha: float = 0.6, beta: float = 0.4, **storage_options: Any
                       ) -> FrameOnceReplayBuffer:
    """A `FrameOnceReplayBuffer` on a `FrameOnceStorage` at `path` (opened if it exists),
    drawing ``"uniform"`` or ``"prioritized"`` (`alpha`, `beta`). `storage_options`: see
    `FrameOnceStorage` (``frame_stack``, ``stacked``, ``num_envs``, ``seed``...)."""
    storage = FrameOnceStorage(path, max_size, sampler=sampler, alpha=alpha, **storage_options)
    return FrameOnceReplayBuffer(storage=storage, sampler=FrameOnceSampler(beta),
                                 writer=FrameOnceWriter(), batch_size=batch_size,
                                 prefetch=prefetch)
