"""A batch drawn, looked up and read in one compiled call (`kernels.sample_kernels`, through
`FrameStore.read_drawn`) against the three calls it replaces: for every sampler, with and
without a decoded-chunk table, several envs, n-step windows, extras, a live writer and a
reader beside it, both give the same batches from the same RNG state, field for field."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import numbered_frame

from mmreplay import ReplayStore
from mmreplay.errors import InvalidStoreError
from mmreplay.storage.frame_store import FrameStore

SHAPE = (6, 5)
FIELDS = ("obs", "next_obs", "action", "reward", "terminated", "truncated", "discount",
          "weights", "ids", "steps")


@contextlib.contextmanager
def _three_calls(monkeypatch) -> Iterator[None]:
    """Stores sample as before inside: draw, `batch`, read."""
    with monkeypatch.context() as patch:
        patch.setattr(FrameStore, "one_call_reads", lambda self, frames: False)
        yield


def _fill(store: ReplayStore, steps: int, seed: int, start: int = 0) -> None:
    """`steps` steps of every env: episodes of random length, each env's frames unique."""
    envs = store.spec.num_envs
    rng = np.random.default_rng(seed)
    extras = {"h": rng.random((envs, 2)).astype(np.float32)} if store.spec.extras else None
    if start == 0:
        store.reset(np.stack([numbered_frame(e << 20, SHAPE) for e in range(envs)]))
    for t in range(start, start + steps):
        done = rng.random(envs) < 0.08
        cut = ~done & (rng.random(envs) < 0.03)
        store.add(rng.integers(0, 4, envs), rng.random(envs).astype(np.float32),
                  np.stack([numbered_frame((e << 20) + t + 1, SHAPE) for e in range(envs)]),
                  done, cut, autoreset=None,
                  extras=None if extras is None else {"h": extras["h"] + t})
        if (done | cut).any():
            store.reset(np.stack([numbered_frame((e << 20) + t + 1, SHAPE)
                                  for e in range(envs)])[done | cut],
                        env_ids=np.flatnonzero(done | cut))


def _same(a, b) -> None:
    for name in FIELDS:
        assert np.array_equal(getattr(a, name).numpy(), getattr(b, name).numpy()), name
    assert a.extras.keys() == b.extras.keys()
    for name in a.extras:
        assert np.array_equal(a.extras[name].numpy(), b.extras[name].numpy()), name


CASES = [
    dict(sampler="uniform", cache_bytes=0),
    dict(sampler="uniform", cache_bytes=None),  # small frames: the whole ring decoded
    dict(sampler="prioritized", cache_bytes=0),
    dict(sampler="prioritized", cache_bytes=None),
    dict(sampler="rank", cache_bytes=0),
    dict(sampler="uniform", cache_bytes=3 * 4 * 30),  # 3 rows: CLOCK evicts, wide reads
    dict(sampler="prioritized", cache_bytes=0, num_envs=3, n_step=3, frame_stack=4),
    dict(sampler="uniform", cache_bytes=None, num_envs=2, n_step=2, frame_stack=3,
         extras={"h": ((2,), np.float32)}),
    dict(sampler="prioritized", cache_bytes=0, codec="lz4hc"),  # the lz4 format too
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_one_call_equals_three_calls_beside_a_live_writer(tmp_path, monkeypatch, case):
    case = dict(case)
    cache = case.pop("cache_bytes")
    opts = dict(capacity=150, obs_shape=SHAPE, num_envs=1, frame_stack=2, n_step=1, seed=7,
                chunk_frames=4, shard_chunks=3, cache_bytes=cache) | case
    one = ReplayStore.create(tmp_path / "one", **opts)
    three = ReplayStore.create(tmp_path / "three", **opts)
    assert one._frames.one_call_reads(256)
    rng = np.random.default_rng(0)
    for round_ in range(6):  # the ring laps twice; chunks in RAM, pending, written
        for store in (one, three):
            _fill(store, 53, seed=round_, start=round_ * 53)
        for _ in range(5):
            size = int(rng.integers(1, 40))
            a = one.sample(size, beta=0.5)
            with _three_calls(monkeypatch):
                b = three.sample(size, beta=0.5)
            _same(a, b)
            if opts["sampler"] != "uniform":
                new = rng.random(size) + 0.01
                assert one.update_priorities(a.ids, new) == three.update_priorities(b.ids, new)
        one.flush(), three.flush()
    reader = ReplayStore.open(tmp_path / "one", mode="r", cache_bytes=cache)
    twin = ReplayStore.open(tmp_path / "one", mode="r", cache_bytes=cache)
    reader.reseed(3), twin.reseed(3)
    for _ in range(4):  # a reader's first reads map the files (the call is finished in Python)
        a = reader.sample(16)
        with _three_calls(monkeypatch):
            b = twin.sample(16)
        _same(a, b)
    for store in (reader, twin, one, three):
        store.close()


def test_a_damaged_chunk_raises_the_same_error_through_one_call(tmp_path, monkeypatch):
    store = ReplayStore.create(tmp_path / "s", capacity=96, obs_shape=SHAPE, frame_stack=2,
                               seed=1, chunk_frames=4, shard_chunks=3, cache_bytes=0)
    _fill(store, 200, seed=1)
    store.close()
    shard = tmp_path / "s" / "frames" / "c.0.1.0.0"  # the chunks of slots 12-23
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF  # inside its first chunk's bytes
    shard.write_bytes(bytes(data))
    errors = []
    for one_call in (True, False):
        store = ReplayStore.open(tmp_path / "s", mode="r", cache_bytes=0)
        with _three_calls(monkeypatch) if not one_call else contextlib.nullcontext():
            with pytest.raises(InvalidStoreError) as caught:
                for _ in range(200):
                    store.sample(32)
        errors.append((type(caught.value), str(caught.value)))
        store.close()
    assert errors[0] == errors[1]
    assert "c.0.1.0.0" in errors[0][1], errors[0]


@pytest.mark.parametrize("kind", ["uniform", "prioritized", "rank"])
@pytest.mark.parametrize("slots", [1, 7, 1500])
def test_tree_draw_then_draw_slots_is_the_samplers_sample(kind, slots):
    """`Sampler.tree_draw` takes from the RNG what `sample` takes, and the compiled
    `draw_slots` of it gives `sample`'s slots and weights (one-leaf trees included)."""
    from mmreplay.index.samplers import PrioritizedSampler, RankSampler, UniformSampler
    from mmreplay.kernels import samples

    make = {"uniform": lambda: UniformSampler(slots),
            "prioritized": lambda: PrioritizedSampler(slots, alpha=0.6, eps=1e-6),
            "rank": lambda: RankSampler(slots, alpha=0.7, eps=1e-6)}[kind]
    sampler = make()
    rng = np.random.default_rng(slots)
    valid = rng.random(slots) < 0.7
    valid[0] = True
    sampler.update(np.arange(slots), valid, np.arange(slots))
    if kind != "uniform":
        sampler.set_priorities(np.arange(slots), rng.random(slots) * 5)
    a, b = np.random.default_rng(1), np.random.default_rng(1)
    for size in (1, 5, 32):
        want = sampler.sample(a, size, 0.4)
        draw = sampler.tree_draw(b, size, 0.4)
        flat, weights = np.empty(size, np.int64), np.empty(size, np.float32)
        samples().draw_slots(draw, flat, weights)
        assert np.array_equal(flat, want.slots)
        assert np.array_equal(weights, want.weights)
        assert valid[flat].all()
    assert a.bit_generator.state == b.bit_generator.state


@pytest.mark.parametrize("bits", ["PCG64", "MT19937", "Philox", "SFC64"])
def test_the_compiled_uniform_draw_is_numpys_integers(bits):
    """`uniform_targets` gives ``rng.integers(0, count, size) + 0.5`` and leaves the
    generator where numpy leaves it: counts whose draws are rejected often (3 << 30: one
    in four), the largest 32-bit count, and a generator holding half of a 64-bit word."""
    import ctypes

    from mmreplay.kernels import samples

    for count in (2, 3, 190_000, (1 << 31) + 1, 3 << 30, (1 << 32) - 1):
        for half_word in (False, True):
            a, b = (np.random.Generator(getattr(np.random, bits)(count)) for _ in range(2))
            if half_word:
                a.integers(0, 5, size=1), b.integers(0, 5, size=1)
            want = a.integers(0, count, size=65) + 0.5
            iface, got = b.bit_generator.ctypes, np.empty(65)
            samples().uniform_targets(ctypes.cast(iface.next_uint32, ctypes.c_void_p).value,
                                      iface.state_address, count, got)
            assert np.array_equal(got, want), (count, half_word)
            assert a.integers(0, 7, size=3).tolist() == b.integers(0, 7, size=3).tolist()
            assert np.array_equal(a.bit_generator.random_raw(4), b.bit_generator.random_raw(4))


@pytest.mark.parametrize("slots", [1, 2, 1500])
def test_the_uniform_sampler_draws_what_numpy_integers_picks(slots):
    """The uniform sampler's k-th sampleable slot is numpy's ``integers(0, count)``: the
    draws a seed or a saved RNG state gives stay those of earlier versions (a count of 1
    draws nothing, as numpy)."""
    from mmreplay.index.samplers import UniformSampler
    from mmreplay.index.sum_tree import SumTree

    sampler, tree = UniformSampler(slots), SumTree(slots)
    valid = np.random.default_rng(slots).random(slots) < 0.6
    valid[-1] = True
    sampler.update(np.arange(slots), valid, np.arange(slots))
    tree.set(np.arange(slots), valid.astype(np.float64))
    a, b = np.random.default_rng(4), np.random.default_rng(4)
    for size in (1, 32, 64):
        k = a.integers(0, int(valid.sum()), size=size)
        assert np.array_equal(sampler.sample(b, size).slots, tree.find_checked(k + 0.5))
    assert a.bit_generator.state == b.bit_generator.state
