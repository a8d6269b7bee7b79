"""``batches(..., workers=N, processes=True)``: a read-only store sampled by N processes into
shared slots (`mmreplay.sampling_processes`). Each test spawns processes (~2 s)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import assert_used_equal, frame, lag_copies, used_at_once

from mmreplay import EmptyStoreError, InvalidInputError, ReplayStore

pytestmark = pytest.mark.integration
OBS = (6, 5)
EXTRAS = {"logits": ((3,), "float32")}


def _record(store: ReplayStore, steps: int) -> None:
    store.reset(frame(0, OBS))
    for i in range(steps):
        store.add(i % 3, float(i), frame(i + 1, OBS), i % 50 == 49, False,
                  extras={"logits": np.full(3, i, np.float32)})
        if i % 50 == 49:
            store.reset(frame(i + 1, OBS))


def _read_only(tmp_path, **kw) -> ReplayStore:
    store = ReplayStore.create(tmp_path / "s", capacity=2000, obs_shape=OBS, frame_stack=4,
                               n_step=2, seed=0, chunk_frames=4, extras=EXTRAS, **kw)
    _record(store, 600)
    if kw.get("sampler") == "prioritized":
        ids = store.valid_ids()
        store.update_priorities(ids, np.linspace(0.1, 3, ids.size))
    store.close()
    return ReplayStore.open(tmp_path / "s", mode="r")


def _assert_same(batch, again) -> None:
    for name in ("obs", "next_obs", "action", "reward", "terminated", "truncated", "discount",
                 "ids", "steps"):
        assert torch.equal(getattr(batch, name), getattr(again, name)), name
    assert torch.equal(batch.extras["logits"], again.extras["logits"])


def test_processes_hand_out_the_transitions_of_their_ids(tmp_path):
    reader = _read_only(tmp_path)
    with reader.batches(16, prefetch=2, workers=2, processes=True) as it:
        batches = [next(it) for _ in range(30)]
        for batch in batches:
            assert batch.obs.shape == (16, 4, *OBS) and batch.obs.dtype == torch.uint8
            _assert_same(batch, reader.get(batch.ids))
    # two seeds drawn from the store's generator: the processes do not draw alike
    assert len({tuple(b.ids.tolist()) for b in batches}) == 30
    reader.close()


def test_processes_with_a_device_hand_over_device_batches(tmp_path, monkeypatch):
    """``device=``: the processes sample frame sets, a prefetch thread copies each slot's to
    the device (`DeviceMover`; on the CPU the stacks are gathered out of the slot, the small
    fields copied); batches hold their transitions, and closing the iterator stops the
    processes."""
    from mmreplay import sampling_processes

    made = []
    real = sampling_processes.SamplingProcesses.__init__

    def spy(self, *args, **kw):
        made.append(self)
        real(self, *args, **kw)

    monkeypatch.setattr(sampling_processes.SamplingProcesses, "__init__", spy)
    reader = _read_only(tmp_path, sampler="prioritized")
    with reader.batches(16, prefetch=2, workers=2, processes=True, device="cpu",
                        beta=1.0) as it:
        batches = [next(it) for _ in range(20)]
        for batch in batches:
            assert batch.obs.device.type == "cpu"
            _assert_same(batch, reader.get(batch.ids))
        assert min(float(b.weights.min()) for b in batches) < 1  # beta reached them
    assert len(made) == 1 and not any(p.is_alive() for p in made[0]._procs)
    reader.close()


def test_batches_kept_past_the_slots_stay_intact(tmp_path):
    """More batches kept than there are slots (2 processes x 2 in flight + prefetch + 2):
    the ones past that are copies; every batch still holds its transitions at the end, and
    slots come back once their batches are dropped."""
    reader = _read_only(tmp_path)
    with reader.batches(8, prefetch=1, workers=2, processes=True) as it:
        kept = [next(it) for _ in range(40)]
        assert it.copies >= 40 - 8
        for batch in kept:
            _assert_same(batch, reader.get(batch.ids))
        del kept, batch
        copies = it.copies
        for _ in range(40):  # slots reclaimed: no copies needed
            _assert_same(b := next(it), reader.get(b.ids))
        assert it.copies == copies
    reader.close()


def test_beta_reaches_the_processes(tmp_path):
    reader = _read_only(tmp_path, sampler="prioritized")
    with reader.batches(16, prefetch=1, workers=2, processes=True, beta=0.0) as it:
        assert all(bool((next(it).weights == 1).all()) for _ in range(5))
        it.beta = 1.0
        weights = torch.cat([next(it).weights for _ in range(20)])
    assert weights.min() < 1
    reader.close()


def test_close_stops_the_processes_and_removes_the_slots(tmp_path):
    reader = _read_only(tmp_path)
    it = reader.batches(8, workers=2, processes=True)
    batch = next(it)
    procs, slots = list(it._procs), it._file
    assert all(p.is_alive() for p in procs) and os.path.exists(slots)
    it.close()
    it.close()  # twice: nothing more
    assert not any(p.is_alive() for p in procs) and not os.path.exists(slots)
    with pytest.raises(StopIteration):
        next(it)
    _assert_same(batch, reader.get(batch.ids))  # a batch handed out outlives the iterator
    second = reader.batches(8, workers=1, processes=True)
    next(second)
    reader.close()  # the store's close closes its iterators
    assert not second._procs[0].is_alive()


def test_errors_and_refusals(tmp_path):
    store = ReplayStore.create(tmp_path / "empty", capacity=50, obs_shape=OBS, frame_stack=4)
    store.close()
    empty = ReplayStore.open(tmp_path / "empty", mode="r")
    it = empty.batches(4, workers=1, processes=True)
    with pytest.raises(EmptyStoreError, match="no sampleable transition"):
        next(it)
    assert not it._procs[0].is_alive()  # an error closes the iterator
    for kw, match in (({"pin_memory": True}, "pass device= to have them copied"),
                      ({"workers": 0}, "workers must be a positive int")):
        with pytest.raises(InvalidInputError, match=match):
            empty.batches(4, processes=True, **kw)
    empty.close()
    writable = ReplayStore.open(tmp_path / "empty")
    with pytest.raises(InvalidInputError, match="opened read-only"):
        writable.batches(4, workers=2, processes=True)
    writable.close()


def test_sample_arrays_reads_into_out(tmp_path):
    """What each process does with its slot: the frames read straight into `out`."""
    reader = _read_only(tmp_path)
    size = 2 * 16 * 4 * int(np.prod(OBS))
    out = np.zeros(size + 5, np.uint8)
    reader.reseed(3)
    arrays = reader.sample_arrays(16, out=out)
    assert arrays.frames.ctypes.data == out.ctypes.data
    reader.reseed(3)
    assert np.array_equal(reader.sample_arrays(16).frames, arrays.frames)
    for bad, match in ((np.zeros(size - 1, np.uint8), f"at least {size:,} bytes"),
                       (np.zeros(size, np.int16), "int16"),
                       (np.zeros((2, size), np.uint8), r"shape \(2, "),
                       ([0] * size, "got list")):
        with pytest.raises(InvalidInputError, match=match):
            reader.sample_arrays(16, out=bad)
    with pytest.raises(InvalidInputError, match="not both"):
        reader.sample_arrays(16, out=out, pin_memory=True)
    reader.close()


def test_a_process_killed_midway_is_an_error_not_a_hang(tmp_path):
    reader = _read_only(tmp_path)
    it = reader.batches(8, workers=2, processes=True)
    next(it)
    it._procs[1].kill()
    it._procs[1].join(timeout=10)
    with pytest.raises(RuntimeError, match="a sampling process ended unexpectedly"):
        for _ in range(50):  # the killed one's answers never come: its pipe ends
            next(it)
    assert not any(p.is_alive() for p in it._procs) and not os.path.exists(it._file)
    reader.close()


def test_processes_beside_a_writer_never_hand_out_overwritten_frames(tmp_path):
    """A read-only store beside a live writer that laps its ring: each process follows the
    writer's give-ups as any reader does, so every transition of a batch whose id the writer
    still holds has the writer's frames (a frame read while it was overwritten is read
    again), and ids given up before a batch was asked for are not drawn."""
    store = ReplayStore.create(tmp_path / "s", capacity=1_000, obs_shape=OBS, frame_stack=4,
                               n_step=2, seed=0, chunk_frames=4, extras=EXTRAS)
    _record(store, 900)
    store.flush()
    reader = ReplayStore.open(tmp_path / "s", mode="r")
    checked = 0
    with reader.batches(16, prefetch=1, workers=2, processes=True) as it:
        next(it)
        for i in range(900, 1400):  # the ring laps: ~400 of the reader's steps given up
            store.add(i % 3, float(i), frame(i + 1, OBS), False, False,
                      extras={"logits": np.full(3, i, np.float32)})
        store.flush()
        held = set(store.valid_ids().tolist())
        for step in range(40):
            batch = next(it)
            keep = [j for j, t in enumerate(batch.ids.tolist()) if t in held]
            if keep:
                rows = torch.tensor(keep)
                again = store.get(batch.ids[rows])
                for name in ("obs", "next_obs", "reward", "ids"):
                    assert torch.equal(getattr(batch, name)[rows], getattr(again, name)), name
                checked += len(keep)
            if step >= 2 * 2 + 1 + 2:  # past the slots filled before the give-ups
                assert len(keep) == len(batch)
    assert checked > 300
    reader.close()
    store.close()


class _Copy:
    """A stand-in for the CUDA event of a copy queued from a slot: done when told."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def _frame_set_processes(reader: ReplayStore, batch_size: int = 16):
    """The processes ``batches(processes=True, device=...)`` makes (slots of frame sets), one
    process, as few slots as it allows (2 in flight + 2 copying + 2)."""
    from mmreplay.sampling_processes import SamplingProcesses

    return SamplingProcesses(reader._batches.open_view, reader._batches.spec, batch_size,
                             workers=1, prefetch=1, beta=0.0, seeds=[7], frame_sets=True)


def test_frame_set_slots_hold_each_distinct_frame_once(tmp_path):
    """With a device the slots hold frame sets: the distinct frames of the batch (fewer than
    its stacks have), and the rows that rebuild the stacks the store's `get` gives."""
    from mmreplay.torch_batch import FrameSetBatch

    reader = _read_only(tmp_path)
    with _frame_set_processes(reader) as it:
        for _ in range(10):
            arrays = it.next_arrays()
            assert isinstance(arrays, FrameSetBatch)
            assert np.unique(arrays.index).tolist() == list(range(len(arrays.frames)))
            assert len(arrays.frames) < 2 * 16 * 4
            again = reader.get(arrays.ids)
            stacks = torch.from_numpy(arrays.assembled().frames)
            assert torch.equal(stacks[0], again.obs) and torch.equal(stacks[1], again.next_obs)
            del arrays, stacks
            _assert_same(batch := next(it), reader.get(batch.ids))  # iterated: stacks built
    reader.close()


def test_a_slot_copied_from_is_reused_only_once_its_copy_is_done(tmp_path):
    """`release_after`: the slot of a batch whose copy is queued (its event pending) is not
    sampled into again when the arrays die, only once the event completed; when every other
    slot waits too, the iterator waits for the oldest copy instead of failing."""
    reader = _read_only(tmp_path)
    with _frame_set_processes(reader) as it:
        first = it.next_arrays()
        address, copy = first.frames.ctypes.data, _Copy()
        it.release_after(first, copy)
        del first
        assert all(it.next_arrays().frames.ctypes.data != address for _ in range(25))
        copy.done = True
        assert any(it.next_arrays().frames.ctypes.data == address for _ in range(25))
        copies = []
        for _ in range(12):  # every slot's copy pending: the oldest is waited for
            arrays = it.next_arrays()
            copies.append(_Copy())
            it.release_after(arrays, copies[-1])
            del arrays
        assert any(c.waited for c in copies) and it.copies == 0
    reader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_process_batches_behind_lagging_copies_are_intact(tmp_path, monkeypatch
                                                               ):  # pragma: no cover
    """``device="cuda"``: the slots are page-locked, so each copy from a slot is only queued
    when the thread moves on. With the copy stream kept behind (a sleep queued before every
    upload) and the consumer never synchronizing, a slot sampled into again before its copy
    ran would put another batch's frames on the GPU; every batch must equal `get`."""
    lag_copies(monkeypatch, 2_000_000)
    reader = _read_only(tmp_path)
    with reader.batches(16, prefetch=2, workers=2, processes=True, device="cuda") as it:
        used = [used_at_once(next(it)) for _ in range(200)]
    assert_used_equal(reader, used)
    reader.close()


def test_slots_go_where_there_is_room_for_them(tmp_path):
    """/dev/shm only when its free space holds the slots (a container's 64 MiB would SIGBUS
    the processes): else the temporary directory."""
    from mmreplay.sampling_processes import _shared_folder

    assert _shared_folder(1, str(tmp_path)) == str(tmp_path)
    assert _shared_folder(1 << 60, str(tmp_path)) is None
    assert _shared_folder(1, str(tmp_path / "absent")) is None


class _FakeCudart:
    """CUDA's host-registration calls as a log (which thread, which address); registering
    the address `refuse` fails with an error code."""

    def __init__(self, log: list, refuse: int | None = None) -> None:
        self.log, self.refuse = log, refuse

    def cudaHostRegister(self, address, size, flags):  # noqa: N802  (CUDA's name)
        import threading

        self.log.append(("register", address, size, flags, threading.current_thread().name))
        return 1 if address == self.refuse else 0

    def cudaHostUnregister(self, address):  # noqa: N802
        import threading

        self.log.append(("unregister", address, threading.current_thread().name))
        return 0


def test_page_locking_registers_every_slot_off_thread_and_undoes_it_after_the_copies(
        tmp_path, monkeypatch):
    """`page_lock` (CUDA's calls faked): every slot registered whole and portable, in a
    thread of its own (a failed call leaves CUDA's error there); one refused: none stays
    registered; close unregisters only after the copies' events completed."""
    import contextlib

    log: list = []
    cudart = _FakeCudart(log)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    reader = _read_only(tmp_path)
    it = _frame_set_processes(reader)
    maps = it._maps
    addresses = [np.frombuffer(m, np.uint8).ctypes.data for m in maps]
    assert it.page_lock("cuda:0")
    assert [(a, s, f) for _, a, s, f, _ in log] == [(a, len(m), 1)
                                                    for a, m in zip(addresses, maps, strict=True)]
    assert {name for *_, name in log} == {"mmreplay-page-lock"}
    arrays = it.next_arrays()
    copy = _Copy()
    copy.synchronize = lambda: log.append(("copy done",))  # the close waits for it
    it.release_after(arrays, copy)
    del arrays
    log.clear()
    it.close()
    assert log[0] == ("copy done",)
    assert sorted(a for _, a, _ in log[1:]) == sorted(addresses)
    log.clear()
    again = _frame_set_processes(reader)
    cudart.refuse = np.frombuffer(again._maps[2], np.uint8).ctypes.data
    assert not again.page_lock("cuda:0")
    registered = [entry[1] for entry in log if entry[0] == "register"]
    unregistered = [entry[1] for entry in log if entry[0] == "unregister"]
    assert registered[:3] == [np.frombuffer(m, np.uint8).ctypes.data for m in again._maps[:3]]
    assert unregistered == registered[:2]  # the ones locked before the refusal
    log.clear()
    again.close()
    assert log == []  # nothing left to undo
    reader.close()
