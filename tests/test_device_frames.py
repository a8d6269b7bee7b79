"""``device=`` stores (`device_frames`, `device_reader`): every kept frame once in a torch
tensor on the device, batches gathered there.

``device="cpu"`` runs the same code as CUDA, so every check here runs without a GPU: a device
store and a plain store driven by the same operations (and seeds) must hand out equal batches,
field by field, for uniform and prioritized draws, n-step windows, both stack paddings, episode
edges, ring wraparound and extras; before and after a close and reopen. The CUDA tests at the
end skip where CUDA is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import numbered_frame

from mmreplay import DeviceMemoryError, InvalidInputError, ReplayStore
from mmreplay import device_frames as dev
from mmreplay.device_frames import DeviceFrames, check_fits, parse_device, to_device
from mmreplay.spec import make_spec

OBS = (3, 4)
FIELDS = ("obs", "next_obs", "action", "reward", "terminated", "truncated", "discount",
          "weights", "ids", "steps")
EXTRAS = {"logp": ((), np.float32), "h": ((2,), np.int16)}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- helpers ---------------------------------------------------------------------------------
def twins(tmp_path: Path, device: str = "cpu", **kw: object) -> tuple[ReplayStore, ReplayStore]:
    """A plain store and a device store of the same spec and seed."""
    kw = {"obs_shape": OBS, "seed": 3, **kw}
    return (ReplayStore.create(tmp_path / "plain", **kw),  # type: ignore[arg-type]
            ReplayStore.create(tmp_path / "dev", device=device, **kw))  # type: ignore[arg-type]


def drive(stores: tuple[ReplayStore, ...], steps: int, *, seed: int = 0, start: int = 0,
          check_every: int = 0, on: str = "cpu") -> None:
    """The same random stream of steps into every store: episodes that end terminated or
    truncated, envs reset one at a time, extras if declared; every `check_every` steps the
    stores' next seeded draws are compared (write-through read back before it is flushed)."""
    spec, rng = stores[0].spec, np.random.default_rng(seed)
    envs = spec.num_envs
    if start == 0:
        for s in stores:
            s.reset(np.stack([numbered_frame(10_000 + e, OBS) for e in range(envs)]))
    for t in range(start, start + steps):
        obs = np.stack([numbered_frame(t * envs + e, OBS) for e in range(envs)])
        action = rng.integers(0, 5, envs)
        reward = rng.normal(size=envs).astype(np.float32)
        term, trunc = rng.random(envs) < 0.08, rng.random(envs) < 0.04
        extras = _extras(spec, rng, envs)
        for s in stores:
            if envs == 1 and extras is None:  # scalars: the recorder's one-env fast path
                s.add(int(action[0]), float(reward[0]), obs[0], bool(term[0]),
                      bool(trunc[0] & ~term[0]))
            else:
                s.add(action, reward, obs, term, trunc & ~term, extras=extras)
        ended = np.flatnonzero(term | trunc)
        if ended.size:
            first = np.stack([numbered_frame(20_000 + t * envs + e, OBS) for e in ended])
            for s in stores:
                s.reset(first, env_ids=ended)
        if check_every and t % check_every == check_every - 1 and len(stores[0]):
            assert_batches_equal(stores[0].sample(9), stores[1].sample(9), on)


def _extras(spec: object, rng: np.random.Generator, envs: int) -> dict | None:
    if not spec.extras:  # type: ignore[attr-defined]
        return None
    return {"logp": rng.normal(size=envs).astype(np.float32),
            "h": rng.integers(-300, 300, (envs, 2)).astype(np.int16)}


def assert_batches_equal(plain: object, device: object, on: str = "cpu",
                         fields: tuple[str, ...] = FIELDS) -> None:
    """Every field of `device` (on device `on`) equals that of `plain` (CPU)."""
    for name in fields:
        x, y = getattr(plain, name), getattr(device, name)
        assert y.device.type == on, name
        assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype)
        assert torch.equal(x, y.cpu()), name
    assert plain.extras.keys() == device.extras.keys()  # type: ignore[attr-defined]
    for name, x in plain.extras.items():  # type: ignore[attr-defined]
        y = device.extras[name]  # type: ignore[attr-defined]
        assert y.device.type == on, name
        assert x.dtype == y.dtype and torch.equal(x, y.cpu()), name


def assert_all_equal(a: ReplayStore, b: ReplayStore, on: str = "cpu") -> None:
    """Same sampleable ids; every one read by `get` equal; the next seeded draws equal."""
    ids = a.valid_ids()
    assert ids.size and ids.tolist() == b.valid_ids().tolist()
    assert_batches_equal(a.get(ids), b.get(ids), on)
    a.reseed(11), b.reseed(11)
    assert_batches_equal(a.sample(32), b.sample(32), on)


# -- transitions: every case equal to the plain store ------------------------------------------
CASES = [  # (capacity, num_envs, frame_stack, stack_padding, n_step)
    (7, 1, 1, "zero", 1), (7, 1, 4, "zero", 3), (7, 1, 4, "first", 1), (7, 1, 2, "first", 3),
    (50, 1, 4, "zero", 1), (50, 2, 4, "first", 3), (50, 2, 1, "zero", 3),
    (50, 2, 4, "zero", 3), (51, 3, 4, "first", 1),
]


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_device_batches_equal_plain_ones(tmp_path, case, sampler):
    capacity, envs, stack, padding, n = case
    a, b = twins(tmp_path, capacity=capacity, num_envs=envs, frame_stack=stack,
                 stack_padding=padding, n_step=n, sampler=sampler)
    with a, b:
        drive((a, b), 4 * capacity // envs + 5, check_every=7)  # past several ring laps
        if sampler == "prioritized":
            batch = b.sample(16)
            values = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            assert a.update_priorities(batch.ids.cpu(), values) == \
                b.update_priorities(batch.ids, values.to(batch.ids.device))
        assert_all_equal(a, b)


def test_extras_travel_with_the_batch(tmp_path):
    a, b = twins(tmp_path, capacity=50, num_envs=2, frame_stack=4, n_step=3, extras=EXTRAS)
    with a, b:
        drive((a, b), 80, check_every=5)
        assert_all_equal(a, b)
        assert set(b.sample(4).extras) == {"logp", "h"}


def test_float_frames(tmp_path):
    a, b = twins(tmp_path, capacity=30, obs_dtype=np.float32, frame_stack=2, n_step=2)
    with a, b:
        for s in (a, b):
            s.reset(np.zeros(OBS, np.float32))
        for t in range(70):
            obs = np.full(OBS, t + 0.25, np.float32)
            for s in (a, b):
                s.add(t % 3, 0.5, obs, t % 17 == 16, False)
            if t % 17 == 16:
                for s in (a, b):
                    s.reset(np.full(OBS, -t, np.float32))
        assert_all_equal(a, b)
        assert b.sample(2).obs.dtype == torch.float32


def test_add_rows_is_written_through(tmp_path):
    from mmreplay import StepRows

    a, b = twins(tmp_path, capacity=50, num_envs=2, frame_stack=4)
    rows = 12  # fewer than the 25 slots of an env: one compiled block (`record_rows`)
    obs = np.stack([[numbered_frame(2 * t + e, OBS) for e in range(2)] for t in range(rows)])
    done = np.zeros((rows, 2), bool)
    done[rows // 2, 1] = True
    auto = np.zeros((rows, 2), bool)
    auto[rows // 2 + 1, 1] = True
    block = StepRows(env_ids=[0, 1], action=np.ones((rows, 2), np.int64),
                     reward=np.ones((rows, 2), np.float32), next_obs=obs, terminated=done,
                     truncated=np.zeros((rows, 2), bool), autoreset=auto)
    with a, b:
        for s in (a, b):
            s.reset(np.stack([numbered_frame(900, OBS), numbered_frame(901, OBS)]))
            s.add_rows(block)
        assert_all_equal(a, b)


def test_the_disk_store_is_the_plain_stores_byte_for_byte(tmp_path):
    """The files a device store writes are exactly a plain store's (the durable copy is
    unchanged), and `mmreplay verify` passes them."""
    a, b = twins(tmp_path, capacity=50, num_envs=2, frame_stack=4, n_step=3, extras=EXTRAS)
    with a, b:
        drive((a, b), 80)
    plain, dev = tmp_path / "plain", tmp_path / "dev"
    names = sorted(str(p.relative_to(plain)) for p in plain.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(dev)) for p in dev.rglob("*") if p.is_file())
    assert [n for n in names if (plain / n).read_bytes() != (dev / n).read_bytes()] == []
    done = subprocess.run([sys.executable, "-m", "mmreplay", "verify", str(dev)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# -- resume, read-only, prefetch, sequences --------------------------------------------------
@pytest.mark.parametrize("capacity", [7, 50])
def test_reopen_refills_the_ring(tmp_path, capacity):
    a, b = twins(tmp_path, capacity=capacity, num_envs=1, frame_stack=4, n_step=3,
                 extras=EXTRAS, chunk_frames=4)
    with a, b:
        drive((a, b), 3 * capacity + 2)  # the last chunk unfinished: from the RAM tail
    with ReplayStore.open(tmp_path / "plain") as a, \
            ReplayStore.open(tmp_path / "dev", device="cpu") as b:
        assert_all_equal(a, b)
        drive((a, b), capacity + 3, seed=1, start=10_000, check_every=3)  # after the fill
        assert_all_equal(a, b)
    with ReplayStore.open(tmp_path / "plain", mode="r") as a, \
            ReplayStore.open(tmp_path / "dev", mode="r", device="cpu") as b:
        assert_all_equal(a, b)


def test_a_device_reader_beside_a_live_writer(tmp_path):
    """A read-only device store filled at open, then the writer laps the ring: what the
    reader still offers (it follows the writer's give-ups) equals a plain reader's read."""
    with ReplayStore.create(tmp_path / "s", capacity=40, obs_shape=OBS, frame_stack=4,
                            n_step=3, chunk_frames=4) as writer:
        drive((writer,), 50)
        writer.flush()
        with ReplayStore.open(tmp_path / "s", mode="r", device="cpu") as dev_reader, \
                ReplayStore.open(tmp_path / "s", mode="r") as plain_reader:
            before = dev_reader.valid_ids()
            drive((writer,), 25, seed=2, start=1000)  # gives up and overwrites old frames
            writer.flush()
            dev_reader.reseed(4), plain_reader.reseed(4)  # the draw follows the writer first
            assert_batches_equal(plain_reader.sample(16), dev_reader.sample(16))
            ids = dev_reader.valid_ids()
            assert 0 < ids.size < before.size and ids.tolist() == plain_reader.valid_ids().tolist()
            assert_batches_equal(plain_reader.get(ids), dev_reader.get(ids))


def test_a_plain_store_opens_with_a_device_and_back(tmp_path):
    with ReplayStore.create(tmp_path / "s", capacity=40, obs_shape=OBS, frame_stack=4) as s:
        drive((s,), 90)
        want = s.get(s.valid_ids())
    with ReplayStore.open(tmp_path / "s", device="cpu") as s:
        assert_batches_equal(want, s.get(s.valid_ids()))


def test_prefetched_device_batches(tmp_path, monkeypatch):
    """Batches drawn by the prefetch thread equal the plain store's, and each is handed over
    again in the consumer's thread (to its current stream: on CUDA, a wait and
    ``record_stream``; on the CPU nothing to do)."""
    handed: list[tuple[int, int]] = []
    real = DeviceFrames.hand_over

    def spy(self, *tensors):
        handed.append((threading.get_ident(), len(tensors)))
        real(self, *tensors)

    monkeypatch.setattr(DeviceFrames, "hand_over", spy)
    a, b = twins(tmp_path, capacity=50, num_envs=2, frame_stack=4, n_step=3)
    with a, b:
        drive((a, b), 60)
        it = b.batches(8, prefetch=2)
        for _ in range(5):
            batch = next(it)
            assert_batches_equal(a.get(batch.ids.cpu()), batch)
        it.close()
    here = [count for ident, count in handed if ident == threading.get_ident()]
    assert len(here) >= 5 and set(here) == {2}  # frames and small fields, in this thread
    assert any(ident != threading.get_ident() for ident, _ in handed)  # and at the gather


@pytest.mark.parametrize("cross", [False, True])
def test_sequences_equal_plain_ones(tmp_path, cross):
    a, b = twins(tmp_path, capacity=60, num_envs=2, frame_stack=4, extras=EXTRAS,
                 sampler="prioritized")
    seq_fields = ("obs", "next_obs", "action", "reward", "terminated", "truncated",
                  "is_first", "mask", "ids", "weights")
    with a, b:
        drive((a, b), 70)
        a.reseed(5), b.reseed(5)
        x = a.sample_sequences(6, 5, cross_episodes=cross)
        y = b.sample_sequences(6, 5, cross_episodes=cross)
        assert_batches_equal(x, y, fields=seq_fields)
        starts = a.sequence_starts(5, cross_episodes=cross)
        assert_batches_equal(a.get_sequences(starts, 5, cross_episodes=cross),
                             b.get_sequences(starts, 5, cross_episodes=cross), fields=seq_fields)


# -- the ring itself -------------------------------------------------------------------------
def test_device_frames_write_flush_gather_fill():
    spec = make_spec(capacity=10, num_envs=2, obs_shape=(2, 3))
    ring = DeviceFrames(spec, parse_device("cpu"))
    assert ring.nbytes == (10 + 1) * 6 and ring.stage_rows == 5
    want = np.zeros((11, 2, 3), np.uint8)
    rng = np.random.default_rng(0)
    for _ in range(7):  # stages fill and flush part-way through writes
        flat = rng.choice(10, size=3, replace=False)
        frames = rng.integers(0, 255, (3, 2, 3), dtype=np.uint8)
        ring.write(flat, frames)
        want[flat] = frames
        ring.write_one(int(flat[0]), frames[2])
        want[flat[0]] = frames[2]
    plan = np.array([[0, -1, 9], [4, 4, -1]])
    assert ring.plan_rows(plan).tolist() == [[0, 10, 9], [4, 4, 10]]
    assert np.array_equal(ring.gather(torch.from_numpy(ring.plan_rows(plan))).numpy(),
                          want[plan])
    assert np.array_equal(ring.rows(plan).numpy(), want[plan])
    assert not want[-1].any()  # -1 is the zero row
    other = DeviceFrames(spec, parse_device("cpu"))
    other.fill(np.array([9, 0, 4]), lambda slots, out: want[slots])
    assert np.array_equal(other.rows(np.array([9, 0, 4, -1])).numpy(), want[[9, 0, 4, -1]])


def test_to_device_packs_every_dtype():
    arrays = {"a": np.arange(3, dtype=np.int16), "b": np.array([True, False]),
              "c": np.arange(6, dtype=">f8").reshape(2, 3), "d": np.zeros((0, 2), np.int64),
              "e": np.arange(5, dtype=np.uint8)}
    moved = to_device(arrays, parse_device("cpu"))
    for name, array in arrays.items():
        assert moved[name].numpy().tolist() == array.tolist(), name
        assert moved[name].dtype == dev.torch_dtype(array.dtype), name


# -- refusals ----------------------------------------------------------------------------------
def test_a_store_too_big_for_the_device_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(dev, "free_bytes", lambda device: 1000)
    spec = make_spec(capacity=100, obs_shape=OBS)
    need = dev.ring_bytes(spec)
    assert need == 101 * 12
    with pytest.raises(DeviceMemoryError, match=f"need {need:,} bytes .* but 1,000 bytes"):
        ReplayStore.create(tmp_path / "s", capacity=100, obs_shape=OBS, device="cpu")
    assert not (tmp_path / "s").exists()  # refused before any file
    with ReplayStore.create(tmp_path / "s", capacity=100, obs_shape=OBS) as s:
        drive((s,), 20)
    with pytest.raises(MemoryError, match="1,212 bytes"):
        ReplayStore.open(tmp_path / "s", device="cpu")
    with ReplayStore.open(tmp_path / "s") as s:  # the refusal released the writer lock
        assert len(s) > 0
    monkeypatch.setattr(dev, "free_bytes", lambda device: need)
    with ReplayStore.open(tmp_path / "s", device="cpu") as s:  # exactly fits
        assert s.sample(2).obs.shape == (2, 1, *OBS)


def test_check_fits_says_both_figures():
    spec = make_spec(capacity=1_000_000, obs_shape=(84, 84), num_envs=8)
    with pytest.raises(DeviceMemoryError, match=r"7,056,007,056 bytes \(6.57 GiB.* 2,000 bytes"):
        check_fits(spec, "cpu", budget=lambda device: 2000)
    assert check_fits(spec, "cpu", budget=lambda device: None).type == "cpu"


def test_bad_devices_and_bucket_stores_are_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="device type 'meta'"):
        ReplayStore.create(tmp_path / "a", capacity=10, obs_shape=OBS, device="meta")
    with pytest.raises(InvalidInputError, match="must be a torch.device or a string"):
        ReplayStore.create(tmp_path / "b", capacity=10, obs_shape=OBS, device="gpu0")
    with pytest.raises(InvalidInputError, match="needs a local store"):
        ReplayStore.open("s3://bucket/store", mode="r", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidInputError, match="is_available"):
            ReplayStore.create(tmp_path / "c", capacity=10, obs_shape=OBS, device="cuda")


def test_a_closed_device_store_refuses_reads(tmp_path):
    from mmreplay import ClosedStoreError

    with ReplayStore.create(tmp_path / "s", capacity=10, obs_shape=OBS, device="cpu") as s:
        drive((s,), 5)
        ids = s.valid_ids()
    for read in (lambda: s.sample(2), lambda: s.get(ids), lambda: s.sample_sequences(1, 2)):
        with pytest.raises(ClosedStoreError):
            read()


# -- CUDA (skipped without it) -----------------------------------------------------------------
@CUDA
def test_cuda_batches_equal_plain_ones(tmp_path):
    a, b = twins(tmp_path, device="cuda", capacity=50, num_envs=2, frame_stack=4, n_step=3,
                 extras=EXTRAS, sampler="prioritized")
    with a, b:
        drive((a, b), 120, check_every=9, on="cuda")
        batch = b.sample(16)
        assert batch.obs.is_cuda and batch.weights.is_cuda and batch.extras["h"].is_cuda
        values = batch.reward.abs().double() + 0.1
        assert b.update_priorities(batch.ids, values) is None  # CUDA tensors: late
        assert a.update_priorities(batch.ids.cpu(), values.cpu()) > 0
        b.flush()  # applies the late update
        assert_all_equal(a, b, "cuda")
    with ReplayStore.open(tmp_path / "plain") as a, \
            ReplayStore.open(tmp_path / "dev", device="cuda") as b:
        assert_all_equal(a, b, "cuda")


@CUDA
def test_cuda_prefetch_keeps_batches_apart(tmp_path):
    a, b = twins(tmp_path, device="cuda", capacity=200, frame_stack=4)
    with a, b:
        drive((a, b), 300)
        it = b.batches(32, prefetch=4)
        for _ in range(50):
            batch = next(it)
            drive((a, b), 3, seed=7, start=50_000 + int(batch.ids[0]))  # writes meanwhile
            # rows still sampleable (a batch drawn ahead may hold ids overwritten since)
            ids = batch.ids.cpu()
            live = torch.from_numpy(np.isin(ids.numpy(), a.valid_ids()))
            assert live.any()
            assert torch.equal(a.get(ids[live]).obs, batch.obs.cpu()[live])
        it.close()


@CUDA
def test_cuda_prefetched_batches_are_handed_to_the_consumers_stream(tmp_path):
    """The ring's stream (the default one) kept busy while the prefetch thread queues its
    gathers behind it; the consumer uses each batch at once on a side stream: `next()` makes
    that stream wait for the ring's, so every batch holds its frames (without the hand-over
    the side stream would read the gathers' output before they ran)."""
    a, b = twins(tmp_path, device="cuda", capacity=200, frame_stack=4)
    side = torch.cuda.Stream()
    with a, b:
        drive((a, b), 300)
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(500_000_000)  # the ring's stream lags
        kept = []
        with b.batches(16, prefetch=4) as it, torch.cuda.stream(side):
            for _ in range(20):
                batch = next(it)
                kept.append((batch.ids.clone(), batch.obs + 0))  # used at once, side stream
        torch.cuda.synchronize()
        for ids, obs in kept:
            assert torch.equal(a.get(ids.cpu()).obs, obs.cpu())


# -- the bench, with tiny arguments --------------------------------------------------------------
def test_bench_writes_its_figures(tmp_path):
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "scripts/bench/bench_device_frames.py"), "--frames", "600",
         "--samples", "20", "--warmup", "2", "--repeats", "1", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=170,
        env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "device_frames.json").read_text())
    for sampler in ("uniform", "prioritized"):
        run = report["runs"][sampler]
        assert run["batch_device"] == "cpu" and set(run["open_fill_s"]) == {"1", "cores"}
        assert all(len(times) == 1 for times in run["open_fill_s"].values())
        assert run["fill_cores"] >= 1
        assert 0 < run["sample_us"]["median"] <= run["sample_us"]["p90"]
        assert run["plain_sample_us"]["median"] > 0


@CUDA
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_batches_stay_right_behind_a_lagging_gpu(tmp_path, side_stream):
    """The GPU kept busy (a sleep kernel queued first), batches sampled, then frames added
    that overwrite their slots: every batch, read once the GPU catches up, still holds the
    frames its draw planned (the plain store's batch of the same draw), on the default
    stream or on a side stream (read there at the end: without the hand-over the side
    stream would not wait for the ring's lagging gathers)."""
    a, b = twins(tmp_path, device="cuda", capacity=40, frame_stack=4, n_step=3)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with a, b, torch.cuda.stream(stream):
        drive((a, b), 60)
        held = []
        for t in range(100):
            with torch.cuda.stream(torch.cuda.default_stream()):
                torch.cuda._sleep(2_000_000)  # the ring's stream lags the CPU
            held.append((a.sample(8), b.sample(8)))
            drive((a, b), 5, seed=t, start=10_000 + 5 * t)  # overwrites old slots meanwhile
        for plain, device in held:
            assert_batches_equal(plain, device, "cuda")
