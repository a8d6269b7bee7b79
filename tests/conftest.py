"""Helpers and fixtures the test files share.

Helpers (import them: ``from conftest import frame``; pytest puts tests/ on sys.path):

- `frame(value, shape)`: a uint8 frame filled with ``value % 256``;
- `numbered_frame(t, shape)`: a frame unique to ``t`` (its first four bytes are ``t``,
  little-endian), so a frame read from the wrong slot never matches;
- `new_frame_store(path, ...)`: a writable `FrameStore` over a fresh frames array;
- `ShadowWriter(fs, rng)`: random frames appended to a writable `FrameStore` and remembered:
  random slots that hold a written frame (`readable`) and what reading them must give (`want`).

`scripts/` and `scripts/bench/` are put on sys.path too, so tests can import the scripts,
their shared module (`common`) and the benchmarks' (`ale_frames`, `benchlib`) as
`python scripts/x.py` and `python scripts/bench/x.py` do.

Tiers: a test marked ``integration`` starts servers, browsers, training runs, Ray, crash
loops or the docs build; ``python -m pytest -m "not integration"`` is the inner loop, and CI
runs everything. Modules and tests carry the marker themselves; `pytest_collection_modifyitems`
adds it to every test that uses a fixture of `INTEGRATION_FIXTURES` (SeaweedFS, Chromium,
Ray), so that a new test on those fixtures is in the right tier without a thought.

`pytest_runtest_teardown` stops the Ray cluster of test_ray's `cluster` fixture once the next
test does not use it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from mmreplay.spec import StoreSpec, make_spec
from mmreplay.storage.frame_store import FrameStore, create_frames_array

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
for _path in (SCRIPTS, SCRIPTS / "bench"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))


def frame(value: int, shape: tuple[int, ...]) -> np.ndarray:
    """A uint8 frame of `shape` filled with ``value % 256``."""
    return np.full(shape, value % 256, np.uint8)


def numbered_frame(t: int, shape: tuple[int, ...]) -> np.ndarray:
    """Frame number `t`: distinct for every t (at least 4 bytes): a pattern that moves with t,
    and t itself as four little-endian bytes at the start."""
    size = int(np.prod(shape))
    if size < 4:
        raise ValueError(f"a numbered frame needs at least 4 bytes, shape {shape} has {size}")
    out = ((np.arange(size, dtype=np.int64) * 13 + t * 29) % 251).astype(np.uint8)
    out[:4] = np.frombuffer(int(t).to_bytes(4, "little"), np.uint8)
    return out.reshape(shape)


def new_frame_store(path: Path, *, slots: int, chunk: int, shard: int = 1, envs: int = 1,
                    obs_shape: tuple[int, ...] = (3,), codec: str = "lz4",
                    hook: Callable[[int, int, int], object] | None = None
                    ) -> tuple[StoreSpec, FrameStore]:
    """(spec, writable FrameStore) of `slots` frames per env in chunks of `chunk` frames,
    `shard` chunks per shard file; `hook` runs before each chunk write."""
    spec = make_spec(capacity=slots * envs, num_envs=envs, obs_shape=obs_shape,
                     chunk_frames=chunk, codec=codec, shard_chunks=shard)
    create_frames_array(path, spec)
    (path / "tmp").mkdir()
    return spec, FrameStore(path, spec, writable=True, before_chunk_write=hook)


class ShadowWriter:
    """Random frames appended to a writable `FrameStore` (`append`: one frame, to a random
    env), remembered, so that every read of the store can be checked (`want`)."""

    def __init__(self, fs: FrameStore, rng: np.random.Generator) -> None:
        self.fs, self.rng = fs, rng
        spec = fs.spec
        self.slots = spec.slots_per_env
        self.shadow = np.zeros((spec.num_envs, self.slots, *spec.obs_shape), np.uint8)
        self.written = np.zeros(spec.num_envs, bool)  # whether each env's ring went round

    def append(self) -> None:
        env = int(self.rng.integers(self.written.size))
        slot = int(self.fs.next_slot[env])
        new = self.rng.integers(1, 255, (1, *self.shadow.shape[2:]), dtype=np.uint8)
        self.fs.append(np.array([env]), np.array([slot]), new)
        self.shadow[env, slot] = new[0]
        self.written[env] |= slot == self.slots - 1

    def readable(self, count: int) -> np.ndarray:
        """`count` random flat slots holding a written frame (below an env's cursor, or
        anywhere once its ring wrapped), -1 (the zero frame) one time in ten."""
        out = []
        for _ in range(count):
            env = int(self.rng.integers(self.written.size))
            top = self.slots if self.written[env] else int(self.fs.next_slot[env])
            out.append(-1 if top == 0 or self.rng.random() < 0.1
                       else env * self.slots + int(self.rng.integers(top)))
        return np.array(out, np.int64)

    def want(self, flat: np.ndarray) -> np.ndarray:
        """The frames a read of `flat` must return."""
        frames = self.shadow.reshape(-1, *self.shadow.shape[2:])[flat]
        frames[flat < 0] = 0
        return frames


@pytest.fixture
def fast_switches() -> Iterator[None]:
    """Switch threads every microsecond, so that races happen in a short test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


# Fixtures that start a server, a browser or a cluster: SeaweedFS (`s3_server`), Chromium
# (test_viewer), Ray (test_ray).
INTEGRATION_FIXTURES = frozenset({"s3_session", "s3_auth_session", "browser", "cluster"})


def lag_copies(monkeypatch: pytest.MonkeyPatch, cycles: int) -> None:
    """Keep `DeviceMover`'s copy stream behind (CUDA): a sleep of `cycles` GPU cycles is
    queued on it before every upload, so each batch's copies run late."""
    import torch

    from mmreplay.device_batches import DeviceMover

    real = DeviceMover.upload

    def upload_behind(self: DeviceMover, arrays: object) -> object:
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(cycles)
        return real(self, arrays)  # type: ignore[arg-type]

    monkeypatch.setattr(DeviceMover, "upload", upload_behind)


def used_at_once(batch: object) -> tuple[object, object, object]:
    """A device batch used by kernels on the current stream at once (no sync): its ids and
    copies of its stacks made there, for `assert_used_equal`."""
    return batch.ids.clone(), batch.obs + 0, batch.next_obs * 1  # type: ignore[attr-defined]


def assert_used_equal(store: object, used: list[tuple[object, object, object]]) -> None:
    """Once the GPU caught up, each `used_at_once` result holds the stacks `get` reads for
    its ids."""
    import torch

    torch.cuda.synchronize()
    for ids, obs, next_obs in used:
        again = store.get(ids.cpu())  # type: ignore[attr-defined]
        assert torch.equal(obs.cpu(), again.obs) and torch.equal(next_obs.cpu(), again.next_obs)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``integration`` each test that uses a fixture of `INTEGRATION_FIXTURES`."""
    for item in items:
        if INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the Ray cluster that test_ray's `cluster` fixture started (for test_ray and
    test_ray_mirror in a row) after the last test that uses it: the next one does not."""
    if "cluster" not in item.fixturenames or \
            (nextitem is not None and "cluster" in nextitem.fixturenames):
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
