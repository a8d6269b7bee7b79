"""Late priority updates (`mmreplay.late_priorities`): queued, applied in order by the next
draws, at most `MAX_PENDING` draws late, all of them by flush/close, checked when applied.

On the CPU there is no event to wait for: ``late=True`` queues CPU tensors the same way and
a fake event stands in for a device that lags. The CUDA test runs where CUDA is.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import frame

from mmreplay import InvalidInputError, ReplayStore
from mmreplay.late_priorities import MAX_PENDING, LatePriorities, wants_late

OBS = (2, 2)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class FakeEvent:
    """An event of a lagging device: done once `finish` or `synchronize` is called."""

    def __init__(self, log: list[str]) -> None:
        self.finished, self.log = False, log

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.log.append("waited")
        self.finished = True


def lagging(store: ReplayStore) -> list[FakeEvent]:
    """Make every late update of `store` wait on a `FakeEvent`; returns them as made."""
    events: list[FakeEvent] = []
    log: list[str] = []

    def record(sources: object) -> list[FakeEvent]:
        events.append(FakeEvent(log))
        return [events[-1]]

    store._priorities.late.record = record
    return events


def make(path, steps: int = 30, capacity: int = 64, **kw) -> ReplayStore:
    store = ReplayStore.create(path, capacity=capacity, obs_shape=OBS, seed=0,
                               sampler="prioritized", **kw)
    store.reset(frame(0, OBS))
    for i in range(1, steps + 1):
        add(store, i)
    return store


def add(store: ReplayStore, i: int) -> None:
    store.add(i % 4, 1.0, frame(i, OBS), i % 11 == 0, False, autoreset=i % 11 == 0)


def prios(store: ReplayStore) -> np.ndarray:
    state = store.views.priority_state()
    assert state is not None
    return state.sampleable.copy()


def td(ids: torch.Tensor, scale: float) -> torch.Tensor:
    return (ids.to(torch.float32) * scale + 0.5).requires_grad_()


def test_late_update_returns_none_and_the_next_draw_applies_it(tmp_path):
    late, now = make(tmp_path / "late"), make(tmp_path / "now")
    ids = torch.as_tensor(late.sample(8).ids)
    before = prios(late)
    assert late.update_priorities(ids, td(ids, 0.1), late=True) is None
    assert len(late._priorities.late) == 1
    np.testing.assert_array_equal(prios(late), before)  # not yet: no draw since
    now.sample(8)
    assert now.update_priorities(ids, td(ids, 0.1)) == len(set(ids.tolist()))
    late.sample(4)
    assert len(late._priorities.late) == 0
    np.testing.assert_array_equal(prios(late), prios(now))


def test_bfloat16_priorities_are_taken_late_and_at_once(tmp_path):
    """|td| computed under autocast arrives as bfloat16, which numpy lacks: late or at once
    it is taken as float32 (late, converted before the queue copies it, so the draw that
    applies it does not fail)."""
    late, now = make(tmp_path / "late"), make(tmp_path / "now")
    ids = torch.arange(3, 9)
    values = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    assert late.update_priorities(ids, values, late=True) is None
    assert now.update_priorities(ids, values) == 6
    late.sample(2)
    assert len(late._priorities.late) == 0
    np.testing.assert_array_equal(prios(late), prios(now))
    got = dict(zip(now.valid_ids().tolist(), prios(now).tolist(), strict=True))
    assert [got[i] for i in range(3, 9)] == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0]


def test_updates_apply_in_order_and_a_synchronous_one_applies_the_queue_first(tmp_path):
    store = make(tmp_path / "s")
    ids = torch.arange(3, 9)
    store.update_priorities(ids, torch.full((6,), 5.0), late=True)
    store.update_priorities(ids[:3], torch.full((3,), 7.0), late=True)
    store.sample(2)
    got = dict(zip(store.valid_ids().tolist(), prios(store).tolist(), strict=True))
    assert [got[i] for i in range(3, 9)] == [7.0, 7.0, 7.0, 5.0, 5.0, 5.0]
    store.update_priorities(ids[3:], torch.full((3,), 9.0), late=True)
    assert store.update_priorities(ids[5:], np.array([1.0])) == 1  # the queue goes first
    got = dict(zip(store.valid_ids().tolist(), prios(store).tolist(), strict=True))
    assert [got[i] for i in range(3, 9)] == [7.0, 7.0, 7.0, 9.0, 9.0, 1.0]
    assert len(store._priorities.late) == 0


def test_a_lagging_device_makes_updates_at_most_max_pending_draws_late(tmp_path):
    store = make(tmp_path / "s")
    events = lagging(store)
    seen = []
    for step in range(6):
        store.sample(4)
        seen.append(len(store._priorities.late))
        store.update_priorities(torch.tensor([step]), torch.tensor([10.0 + step]), late=True)
    assert seen == [0, 1, 2, 2, 2, 2]  # no event done: the draw waits for the oldest
    assert [e.finished for e in events] == [True, True, True, False, False, False]
    events[3].finished = events[5].finished = True  # done out of order: 3 only goes first
    store.sample(4)
    assert [e.finished for e in events] == [True] * 4 + [False, True]
    assert len(store._priorities.late) == 2  # the 6th waits behind the 5th
    store.flush()  # waits for all
    assert len(store._priorities.late) == 0
    got = dict(zip(store.valid_ids().tolist(), prios(store).tolist(), strict=True))
    assert [got[i] for i in range(6)] == [10.0 + i for i in range(6)]


@pytest.mark.parametrize("finish", ["flush", "close"])
def test_flush_and_close_apply_everything_and_persist_it(tmp_path, finish):
    store, twin = make(tmp_path / "s"), make(tmp_path / "t")
    lagging(store)
    for step in range(4):
        ids = torch.arange(step, step + 5)
        store.update_priorities(ids, td(ids, step + 1.0), late=True)
        twin.update_priorities(ids, td(ids, step + 1.0))
    getattr(store, finish)()
    if finish == "close":
        store = ReplayStore.open(tmp_path / "s")
    np.testing.assert_array_equal(prios(store), prios(twin))
    store.close()
    twin.close()


def test_an_id_overwritten_before_the_draw_is_ignored(tmp_path):
    store, twin = make(tmp_path / "s", capacity=24), make(tmp_path / "t", capacity=24)
    ids = torch.tensor([store.valid_ids()[0], store.valid_ids()[-1]])
    store.update_priorities(ids, torch.tensor([3.0, 4.0]), late=True)
    for i in range(31, 45):  # the first id leaves the ring
        add(store, i)
        add(twin, i)
    assert int(ids[0]) not in store.valid_ids().tolist()
    store.sample(2)
    assert twin.update_priorities(ids, torch.tensor([3.0, 4.0])) == 1
    np.testing.assert_array_equal(prios(store), prios(twin))


def test_late_updates_equal_synchronous_ones_made_at_the_next_draw(tmp_path):
    """A random stream of adds, draws and updates (stale ids among them): the late store and
    a store that applies the same updates synchronously just before each of its draws
    draw the same batches and end with the same priorities."""
    rng = np.random.default_rng(7)
    late, now = make(tmp_path / "late", capacity=40), make(tmp_path / "now", capacity=40)
    waiting: list[tuple[np.ndarray, np.ndarray]] = []
    step = 31
    for _ in range(60):
        if rng.random() < 0.4:
            for _ in range(int(rng.integers(1, 6))):
                add(late, step)
                add(now, step)
                step += 1
            continue
        for ids, values in waiting:
            now.update_priorities(ids, values)
        waiting.clear()
        a, b = late.sample(6), now.sample(6)
        np.testing.assert_array_equal(a.ids, b.ids)
        values = rng.random(6) * 3
        late.update_priorities(a.ids, torch.from_numpy(values), late=True)
        waiting.append((b.ids.numpy().copy(), values))
    for ids, values in waiting:
        now.update_priorities(ids, values)
    late.flush()
    np.testing.assert_array_equal(prios(late), prios(now))


def test_bad_values_are_dropped_and_raised_by_the_draw_that_finds_them(tmp_path):
    store, twin = make(tmp_path / "s"), make(tmp_path / "t")
    store.update_priorities([1, 2], torch.tensor([2.0, 3.0]), late=True)
    store.update_priorities([3, 4], torch.tensor([1.0, float("nan")]), late=True)
    store.update_priorities([5], torch.tensor([6.0]), late=True)
    with pytest.raises(InvalidInputError, match="late update_priorities of 2 ids was dropped"):
        store.sample(2)
    twin.update_priorities([1, 2], [2.0, 3.0])
    twin.update_priorities([5], [6.0])
    np.testing.assert_array_equal(prios(store), prios(twin))
    store.sample(2)  # reported once
    store.update_priorities([6], torch.tensor([-1.0]), late=True)
    with pytest.raises(InvalidInputError, match="finite and >= 0"):
        store.flush()
    assert store.generation == twin.generation + 1  # the flush committed first
    store.close()


def test_shapes_and_dtypes_are_refused_at_once(tmp_path):
    store = make(tmp_path / "s")
    before = prios(store)
    with pytest.raises(InvalidInputError, match="ids must be a 1-d array of ints, got dtype "
                                                "torch.float32"):
        store.update_priorities(torch.ones(3), torch.ones(3), late=True)
    with pytest.raises(InvalidInputError, match=r"priorities must be 3 numbers \(one per id\), "
                                                r"got torch.float32 \(2,\)"):
        store.update_priorities(torch.arange(3), torch.ones(2), late=True)
    with pytest.raises(InvalidInputError, match="ids must be a 1-d array of ints"):
        store.update_priorities(torch.ones(2, 2, dtype=torch.int64), torch.ones(4), late=True)
    with pytest.raises(InvalidInputError, match="late must be None, True or False"):
        store.update_priorities([1], [1.0], late="yes")
    assert len(store._priorities.late) == 0
    store.sample(2)
    np.testing.assert_array_equal(prios(store), before)
    uniform = ReplayStore.create(tmp_path / "u", capacity=8, obs_shape=OBS)
    with pytest.raises(InvalidInputError, match="needs sampler='prioritized' or 'rank'"):
        uniform.update_priorities([0], [1.0], late=True)


def test_only_cuda_tensors_are_late_by_default():
    assert not wants_late(np.arange(2), np.ones(2), None)
    assert not wants_late(torch.arange(2), torch.ones(2, requires_grad=True), None)
    assert wants_late(np.arange(2), np.ones(2), True)
    assert not wants_late(np.arange(2), np.ones(2), False)


def test_the_queue_copies_its_inputs_and_keeps_the_order_of_done_events():
    applied: list[list[int]] = []
    log: list[str] = []
    events = [FakeEvent(log) for _ in range(3)]
    queue = LatePriorities(lambda ids, values: applied.append(ids.tolist()) or ids.size,
                           record=lambda sources: [events[len(applied) + len(queue)]])
    ids = np.array([1, 2])
    queue.queue(ids, np.ones(2))
    ids[:] = 9  # the caller reuses its buffer: the queue holds a copy
    queue.queue(np.array([3]), np.ones(1))
    events[1].finished = True
    queue.apply_ready()
    assert applied == [] and len(queue) == 2  # the first is not done: nothing jumps it
    events[0].finished = True
    queue.apply_ready()
    assert applied == [[1, 2], [3]]
    assert MAX_PENDING >= 1


def test_a_device_store_takes_its_own_batch_tensors(tmp_path):
    store, twin = make(tmp_path / "d", device="cpu"), make(tmp_path / "t")
    batch = store.sample(8)
    twin.sample(8)
    assert store.update_priorities(batch.ids, batch.ids.float() + 1, late=True) is None
    twin.update_priorities(batch.ids, batch.ids.float() + 1)
    np.testing.assert_array_equal(store.sample(8).ids, twin.sample(8).ids)
    np.testing.assert_array_equal(prios(store), prios(twin))


def test_sequence_priorities_take_tensors_and_apply_the_queue_first(tmp_path):
    store, twin = make(tmp_path / "s"), make(tmp_path / "t")
    seq = store.sample_sequences(3, 4)
    twin.sample_sequences(3, 4)  # (the index of sequences of 4 steps, built at a first use)
    store.update_priorities(seq.ids[:, 0].clone(), torch.full((3,), 50.0), late=True)
    errors = torch.ones(seq.ids.shape, requires_grad=True)
    applied = store.update_sequence_priorities(seq.ids, errors)
    twin.update_priorities(seq.ids[:, 0].numpy(), np.full(3, 50.0))
    assert twin.update_sequence_priorities(seq.ids.numpy(), np.ones(seq.ids.shape)) == applied
    np.testing.assert_array_equal(prios(store), prios(twin))
    store.close()
    twin.close()


@CUDA
def test_cuda_updates_wait_for_a_lagging_stream(tmp_path):
    """The stream lags (a sleep queued first): the values the store applies are the ones
    the device computed after it, not what the pinned block held before the copy."""
    store, twin = make(tmp_path / "s", device="cuda"), make(tmp_path / "t")
    made = []
    for step in range(8):
        batch = store.sample(16)
        torch.cuda._sleep(50_000_000)
        values = batch.ids.double() * 0.25 + step
        assert store.update_priorities(batch.ids, values) is None  # CUDA: late by default
        assert len(store._priorities.late) <= MAX_PENDING + 1
        made.append((batch.ids, values))
    store.flush()
    for ids, values in made:  # the same updates in the same order, synchronously
        twin.update_priorities(ids.cpu(), values.cpu())
    np.testing.assert_array_equal(prios(store), prios(twin))


@CUDA
def test_cuda_sequence_updates_are_taken_synchronously(tmp_path):
    store, twin = make(tmp_path / "s", device="cuda"), make(tmp_path / "t")
    seq = store.sample_sequences(3, 4)
    twin.sample_sequences(3, 4)
    assert seq.ids.is_cuda
    errors = seq.ids.double() * 0.5 + 1
    applied = store.update_sequence_priorities(seq.ids, errors)
    assert applied == twin.update_sequence_priorities(seq.ids.cpu(), errors.cpu())
    np.testing.assert_array_equal(prios(store), prios(twin))
