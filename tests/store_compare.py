"""Field-by-field comparison of two stores (shared by the dataset round-trip tests), and of a
golden fixture with what its generator recorded (shared by the format tests)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import zarr

from mmreplay import ReplayStore
from mmreplay.tools import inspection as ins

FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated", "discount", "ids")


def assert_stores_equal(a: ReplayStore, b: ReplayStore, *, same_ids: bool = True) -> None:
    """Same counts, sampleable ids, every sampleable transition and every episode row."""
    assert a.counts == b.counts
    ids_a, ids_b = a.valid_ids(), b.valid_ids()
    assert ids_a.size > 0
    if same_ids:
        assert ids_a.tolist() == ids_b.tolist()
    assert ids_a.size == ids_b.size
    got_a, got_b = a.get(ids_a), b.get(ids_b)
    for field in FIELDS:
        if field == "ids" and not same_ids:
            continue
        x, y = getattr(got_a, field), getattr(got_b, field)
        assert x.dtype == y.dtype, field
        assert torch.equal(x, y), field
    assert ins.episode_table(a) == ins.episode_table(b)


def assert_golden_reads_back(root: Path, expected: dict) -> None:
    """A golden store opened read-only gives every transition and the next draws its
    generator recorded (``tests/fixtures/make_store_v*.py``)."""
    with ReplayStore.open(root, mode="r") as store:
        batch = store.get(store.valid_ids())
        for name in ("ids", "obs", "next_obs", "action", "terminated", "truncated"):
            assert getattr(batch, name).tolist() == expected[name], name
        np.testing.assert_allclose(batch.reward.numpy(), expected["reward"], rtol=1e-6)
        assert store.sample(8).ids.tolist() == expected["next_samples"]


def assert_golden_resumes(root: Path, copy: Path, frame: Callable[[int, int], np.ndarray]) -> None:
    """A copy of the two-env golden store at `root` takes 60 more steps of each env (past a
    ring lap) and reads the newest back (`frame(t, env)` is the fixture's frame)."""
    shutil.copytree(root, copy)
    with ReplayStore.open(copy) as store:
        before = store.counts.transitions
        for t in range(70, 130):
            store.add(np.zeros(2, np.int64), np.zeros(2), np.stack([frame(t, 0), frame(t, 1)]),
                      np.zeros(2, bool), np.zeros(2, bool))
    with ReplayStore.open(copy, mode="r") as store:
        assert store.counts.transitions == before + 120
        newest = store.get(store.valid_ids()[-1:]).next_obs[0, -1].numpy()
        assert newest.tolist() in (frame(129, 0).tolist(), frame(129, 1).tolist())


def assert_golden_frames_through_zarr(root: Path, frame: Callable[[int, int], np.ndarray]) -> None:
    """Plain zarr reads the frames of the two-env golden store at `root` (70 frames a env
    into 48 slots: slot s holds frame s + 48 below slot 20 and frame s from 24 on; frames
    68, 69 (slots 20, 21) wait in tail/, and the chunk on disk still holds 20..23)."""
    frames = zarr.open_array(str(root / "frames"), mode="r")
    assert frames.shape == (2, 48, 16, 16)
    for env in range(2):
        slots = [s for s in range(48) if not 20 <= s < 24]
        want = [frame(s + 48 if s < 20 else s, env).tolist() for s in slots]
        assert frames[env, slots].tolist() == want
