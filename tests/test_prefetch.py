"""store.batches(): background prefetching is correct beside a writer and stops cleanly."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import frame

from mmreplay import EmptyStoreError, InvalidInputError, ReplayStore
from mmreplay.prefetch import BatchPrefetcher

OBS = (6, 5)


def make(tmp_path, **kw):
    kw.setdefault("capacity", 5000)
    return ReplayStore.create(tmp_path / "s", obs_shape=OBS, frame_stack=4, n_step=2, seed=0,
                              chunk_frames=4, **kw)


def record(store, start: int, steps: int) -> None:
    for i in range(start, start + steps):
        store.add(i % 3, 1.0, frame(i + 1, OBS), i % 50 == 49, False)
        if i % 50 == 49:
            store.reset(frame(i + 1, OBS))


def test_prefetched_batches_match_get_while_a_writer_adds(tmp_path):
    store = make(tmp_path)
    store.reset(frame(0, OBS))
    record(store, 0, 200)
    seen = 0
    with store.batches(16, prefetch=3) as it:
        for step in range(40):
            batch = next(it)
            record(store, 200 + 10 * step, 10)  # the writer keeps going meanwhile
            again = store.get(batch.ids)
            assert torch.equal(batch.obs, again.obs) and torch.equal(batch.next_obs, again.next_obs)
            assert torch.equal(batch.reward, again.reward)
            seen += len(batch)
    assert seen == 640
    store.close()


def test_errors_reach_the_consumer(tmp_path):
    store = make(tmp_path)
    it = store.batches(4)
    with pytest.raises(EmptyStoreError):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(InvalidInputError, match="prefetch"):
        store.batches(4, prefetch=0)
    with pytest.raises(InvalidInputError, match="batch_size"):
        store.batches(0)


def test_beta_can_be_annealed(tmp_path):
    store = make(tmp_path, sampler="prioritized")
    store.reset(frame(0, OBS))
    record(store, 0, 100)
    ids = store.valid_ids()
    store.update_priorities(ids, np.linspace(0.1, 5, ids.size))
    with store.batches(64, prefetch=1, beta=0.0) as it:
        assert torch.all(next(it).weights == 1)
        it.beta = 1.0
        weights = [next(it).weights for _ in range(3)][-1]
        assert weights.min() < 1  # batches drawn after the change use the new beta


def test_close_stops_the_threads(tmp_path):
    store = make(tmp_path)
    store.reset(frame(0, OBS))
    record(store, 0, 50)
    before = threading.active_count()
    iterators = [store.batches(8, prefetch=2) for _ in range(3)]
    next(iterators[0])
    store.close()  # closes its prefetchers first, then flushes
    assert threading.active_count() <= before
    with pytest.raises(StopIteration):
        next(iterators[1])


def wait_until(done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the prefetch thread did not get there in time"
        time.sleep(0.001)


def test_a_full_queue_is_refilled_after_each_take_and_never_overdrawn(tmp_path):
    # the thread polls a full queue instead of waiting on it (next() wakes no thread): it
    # must still refill every batch taken, and draw no more than one batch beyond the queue
    store = make(tmp_path)
    store.reset(frame(0, OBS))
    record(store, 0, 50)
    calls = []

    def sample(size, beta):
        calls.append(size)
        return store.sample(size, beta)

    with BatchPrefetcher(sample, 8, prefetch=2) as it:
        for taken in range(6):
            wait_until(lambda taken=taken: len(calls) == 3 + taken)  # 2 queued, 1 in hand
            time.sleep(0.05)  # several polls: none draws more
            assert len(calls) == 3 + taken
            assert len(next(it)) == 8
        wait_until(lambda: len(calls) == 3 + 6)
    store.close()


def test_workers_on_a_read_only_store_sample_from_views_of_their_own(tmp_path, monkeypatch):
    """Several workers on a read-only store: each samples a read-only view of the directory
    (its own lock, so their reads run at once); batches hold the transitions of their ids,
    and closing the iterator closes the views."""
    store = make(tmp_path)
    store.reset(frame(0, OBS))
    record(store, 0, 300)
    store.close()
    opened = []
    open_store = ReplayStore.open

    def spy(*args, **kw):
        opened.append(open_store(*args, **kw))
        return opened[-1]

    reader = ReplayStore.open(tmp_path / "s", mode="r")
    monkeypatch.setattr(ReplayStore, "open", spy)
    with reader.batches(16, prefetch=4, workers=3) as it:
        for _ in range(30):
            batch = next(it)
            again = reader.get(batch.ids)
            assert torch.equal(batch.obs, again.obs) and torch.equal(batch.next_obs,
                                                                     again.next_obs)
    assert len(opened) == 3 and all(view.closed for view in opened)
    assert not reader.closed
    with reader.batches(16, workers=1) as it:
        next(it)
    assert len(opened) == 3  # one worker samples the store itself
    reader.close()
