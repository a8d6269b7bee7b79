"""A ReplayStore with a RateLimiter: `add` waits on inserts, `sample`, `batches` and
`sample_sequences` on samples; the counters are committed with the store and come back
on open; `close` wakes waiters; `mmreplay info` shows the ratio and the blocked times."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mmreplay import (
    EmptyStoreError,
    InvalidInputError,
    InvalidStoreError,
    ReadOnlyError,
    ReplayStore,
)
from mmreplay.errors import RateLimiterClosedError, RateLimitTimeoutError
from mmreplay.rate_limit import RateLimiter

OBS = (4, 4)


def frame(i: int) -> np.ndarray:
    return np.full(OBS, i % 251, np.uint8)


def make(path: Path, limiter: RateLimiter | None, **kw: object) -> ReplayStore:
    store = ReplayStore.create(path, capacity=500, obs_shape=OBS, seed=0, rate_limiter=limiter,
                               **kw)  # type: ignore[arg-type]
    store.reset(frame(0))
    return store


def test_env_thread_beside_batches_keeps_the_ratio(tmp_path: Path) -> None:
    lim = RateLimiter.sample_to_insert_ratio(4.0, 100, 64.0, timeout_s=30)
    store = make(tmp_path / "s", lim)
    steps, errors = 1500, []

    def env() -> None:
        try:
            for i in range(steps):
                store.add(i % 5, 1.0, frame(i + 1), False, False)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=env)
    thread.start()
    samples = 0
    with store.batches(32, prefetch=2) as it:
        while samples < (steps - 100) * 4 - 64:
            batch = next(it)
            samples += batch.ids.numel()
            diff = lim.stats()["error"]
            assert -64 - 32 * 3 <= diff <= 64 + 4, diff  # the band, plus a batch in flight
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    stats = lim.stats()
    assert stats["inserts"] == steps
    assert stats["achieved_samples_per_insert"] == pytest.approx(4.0, rel=0.05)
    assert stats["insert_wait_s"] > 0  # the env runs ahead of the learner and waits
    store.close()


def test_counters_are_committed_and_come_back(tmp_path: Path) -> None:
    lim = RateLimiter.sample_to_insert_ratio(2.0, 10, 8.0)
    store = make(tmp_path / "s", lim)
    for i in range(14):
        store.add(0, 0.0, frame(i), False, False)
    store.sample(20)
    store.flush()
    saved = lim.state()
    store.add(0, 0.0, frame(99), False, False)  # not flushed: not in the committed counters
    store.close()
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["rate_limiter"][
        "samples"] == 20
    again = RateLimiter.sample_to_insert_ratio(2.0, 10, 8.0)
    with ReplayStore.open(tmp_path / "s", rate_limiter=again) as reopened:
        state = again.state()
        assert state["samples"] == saved["samples"] == 20
        assert state["inserts"] == reopened.counts.transitions == 15  # closed with a flush
    with ReplayStore.open(tmp_path / "s") as plain:  # no limiter: its counters are kept
        plain.add(0, 0.0, frame(5), False, False)
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["rate_limiter"][
        "samples"] == 20


def test_sequences_count_their_steps_and_a_refused_call_is_cancelled(tmp_path: Path) -> None:
    lim = RateLimiter.min_size(5)
    store = make(tmp_path / "s", lim)
    with pytest.raises(InvalidInputError):
        store.add(0, 0.0, np.zeros((3, 3), np.uint8), False, False)  # wrong shape
    assert lim.state()["inserts"] == 0
    for i in range(12):
        store.add(0, 0.0, frame(i), False, False)
    store.sample_sequences(3, 4)
    assert lim.state()["samples"] == 12
    with pytest.raises(EmptyStoreError):
        store.sample_sequences(2, 100)  # no start yet for sequences this long: refused
    assert lim.state()["samples"] == 12
    store.close()


def test_waits_time_out_close_wakes_and_bad_limiters_are_refused(tmp_path: Path) -> None:
    lim = RateLimiter.sample_to_insert_ratio(1.0, 3, 2.0, timeout_s=0.1)
    store = make(tmp_path / "s", lim)
    with pytest.raises(RateLimitTimeoutError, match="writers are not inserting"):
        store.sample(4)
    for i in range(5):
        store.add(0, 0.0, frame(i), False, False)
    with pytest.raises(RateLimitTimeoutError, match="learner is not sampling"):
        store.add(0, 0.0, frame(9), False, False)
    lim.timeout_s = None
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(errors, store.add, 0, 0.0, frame(1),
                                                    False, False))
    thread.start()
    time.sleep(0.1)
    store.close()  # wakes the waiting add
    thread.join(timeout=10)
    assert not thread.is_alive() and isinstance(errors[0], RateLimiterClosedError)
    with pytest.raises(InvalidInputError, match="capacity"):
        make(tmp_path / "big", RateLimiter.min_size(10_000))
    with ReplayStore.open(tmp_path / "s", mode="r") as reader, pytest.raises(ReadOnlyError):
        reader.set_rate_limiter(RateLimiter.min_size(1))
    with pytest.raises(ReadOnlyError, match="writable"):
        ReplayStore.open(tmp_path / "s", mode="r", rate_limiter=RateLimiter.min_size(1))


def _catch(errors: list[BaseException], fn: object, *args: object) -> None:
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001 - checked by the caller
        errors.append(exc)


def test_preloading_with_the_limiter_off(tmp_path: Path) -> None:
    lim = RateLimiter.sample_to_insert_ratio(4.0, 50, 16.0, timeout_s=0.05)
    store = make(tmp_path / "s", lim)
    lim.disable()
    for i in range(300):  # offline data: no learner yet, nothing waits
        store.add(0, 0.0, frame(i), False, False)
    lim.enable()  # the run resumes at the band's upper edge
    with pytest.raises(RateLimitTimeoutError):
        store.add(0, 0.0, frame(1), False, False)
    store.sample(4)
    store.add(0, 0.0, frame(2), False, False)
    store.close()


def test_hostile_rate_limiter_field_is_refused(tmp_path: Path) -> None:
    store = make(tmp_path / "s", RateLimiter.min_size(1))
    store.close()
    path = tmp_path / "s" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("checksum", None)
    manifest["rate_limiter"]["samples"] = "many"
    path.write_text(json.dumps(manifest))
    with pytest.raises(InvalidStoreError, match="rate_limiter"):
        ReplayStore.open(tmp_path / "s")


def test_info_shows_the_ratio_and_blocked_times(tmp_path: Path) -> None:
    lim = RateLimiter.sample_to_insert_ratio(2.0, 10, 8.0, timeout_s=0.05)
    store = make(tmp_path / "s", lim)
    for i in range(14):  # the band's upper edge: 14 * 2 - 0 = 20 + 8
        store.add(0, 0.0, frame(i), False, False)
    with pytest.raises(RateLimitTimeoutError):
        store.add(0, 0.0, frame(1), False, False)
    store.sample(16)
    store.close()
    run = [sys.executable, "-m", "mmreplay", "info", str(tmp_path / "s")]
    text = subprocess.run(run, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "rate limiter" in text and "4.000 achieved, target 2" in text
    assert "writers blocked" in text
    data = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True,
                                     timeout=120, check=True).stdout)
    assert data["rate_limiter"]["samples"] == 16
