"""mmreplay.integrations.ray on one local Ray cluster (started once for this module).

Blocks sent by `BlockWriter`s through a `StoreActor` must leave the store exactly as an
in-process store fed the same rows in the order the actor took them; the learner's
`RemoteBatches` samples and updates priorities; killing the store actor's process
(SIGKILL) loses no step of a flushed block and duplicates none; a read-only open (and
the CLI) works beside the actor. `MMREPLAY_LONG=1` raises the kills from 3 to 24.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'mmreplay[ray]'")

from mmreplay import InvalidInputError, ReplayStore  # noqa: E402
from mmreplay.errors import RateLimitTimeoutError  # noqa: E402
from mmreplay.integrations.blocks import make_block  # noqa: E402
from mmreplay.integrations.ray import (  # noqa: E402
    BlockWriter,
    RemoteBatches,
    start_store_actor,
)
from mmreplay.rate_limit import RateLimiter  # noqa: E402

pytestmark = pytest.mark.integration  # a Ray cluster

LONG = os.environ.get("MMREPLAY_LONG") == "1"
OBS = (6, 5)


@pytest.fixture(autouse=True)
def cluster() -> Any:
    """One local Ray cluster for this module and the modules that import this fixture
    (test_ray_mirror): started by the first test that uses it, stopped by conftest's
    `pytest_runtest_teardown` after the last of a row of such tests (one start, not one per
    module)."""
    if not ray.is_initialized():
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20,
                 configure_logging=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield


class Stream:
    """Seeded steps of some envs whose action is a unique tag and whose frames encode it."""

    def __init__(self, envs: list[int], seed: int, *, p_end: float = 0.05) -> None:
        self.envs, self.rng, self.p_end = envs, np.random.default_rng(seed), p_end
        self.next_tag = (seed + 1) << 32
        self.autoreset = np.zeros(len(envs), bool)

    def frames(self, tags: np.ndarray) -> np.ndarray:
        values = (tags[:, None, None] + np.arange(30).reshape(OBS)) % 251
        return values.astype(np.uint8)

    def first(self) -> np.ndarray:
        return self.frames(self.tags())

    def tags(self) -> np.ndarray:
        out = self.next_tag + np.arange(len(self.envs))
        self.next_tag += len(self.envs)
        return out

    def step(self) -> dict[str, Any]:
        n, tags = len(self.envs), self.tags()
        row = {"action": tags, "reward": self.rng.integers(-2, 3, n).astype(np.float32),
               "next_obs": self.frames(tags), "terminated": self.rng.random(n) < self.p_end,
               "truncated": self.rng.random(n) < self.p_end / 3,
               "autoreset": self.autoreset.copy()}
        self.autoreset = row["terminated"] | row["truncated"]
        return row


def create_args(**kw: Any) -> dict[str, Any]:
    args = {"capacity": 4000, "obs_shape": OBS, "num_envs": 4, "frame_stack": 3, "n_step": 2,
            "seed": 0}
    args.update(kw)
    return args


def assert_same_store(got: ReplayStore, want: ReplayStore) -> None:
    ids = want.valid_ids()
    assert np.array_equal(got.valid_ids(), ids) and ids.size > 0
    a, b = got.get(ids), want.get(ids)
    for name in ("obs", "next_obs", "action", "reward", "terminated", "truncated", "discount"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert got.counts == want.counts


def test_ingest_equals_an_in_process_store(tmp_path: Path) -> None:
    """Two writers (one raw, one lz4) with odd block sizes, interleaved by Ray."""
    actor = start_store_actor(tmp_path / "ray", create_args(), flush_every_steps=50)
    taken: list[tuple[int, Any]] = []
    writers, streams = [], []
    for w, (envs, compress, block) in enumerate([([0, 2], False, 7), ([3, 1], True, 5)]):
        streams.append(Stream(envs, seed=w))
        writers.append(BlockWriter(actor, envs, block_steps=block, compress=compress,
                                   on_ack=lambda ack, blk: taken.append((ack.seq, blk))))
        writers[-1].reset(streams[-1].first())
    for _ in range(120):
        for writer, stream in zip(writers, streams, strict=True):
            writer.add(**stream.step())
    for writer in writers:
        writer.drain()
        assert writer.stats.steps_acked == writer.stats.steps_sent > 200
        assert writer.stats.blocks_failed == 0
    ray.get(actor.flush.remote())
    times = ray.get(actor.take_times.remote())  # the ingest profile counts every block
    assert times["blocks"] == sum(w.stats.blocks_sent for w in writers)
    assert min(times["check_s"], times["apply_s"], times["flush_s"]) > 0
    assert times["limiter_wait_s"] == 0 and times["process_cpu_s"] > 0
    local = ReplayStore.create(tmp_path / "local", **create_args())
    for _, block in sorted(taken, key=lambda x: x[0]):
        frames = block.frame_array()
        for t in range(block.rows):
            local.add(block.action[t], block.reward[t], frames[t], block.terminated[t],
                      block.truncated[t], autoreset=block.autoreset[t], env_ids=block.env_ids)
    with ReplayStore.open(tmp_path / "ray", mode="r") as got:
        assert_same_store(got, local)
    assert ray.get(actor.counts.remote()) == local.counts
    ray.kill(actor)


def test_sampling_and_priorities_through_the_iterator(tmp_path: Path) -> None:
    actor = start_store_actor(tmp_path / "s", create_args(sampler="prioritized", n_step=1))
    stream = Stream([0, 1, 2, 3], seed=5, p_end=0.0)
    writer = BlockWriter(actor, [0, 1, 2, 3], block_steps=16)
    writer.reset(stream.first())
    for _ in range(50):
        row = stream.step()
        writer.add(**row, priorities=np.where(row["action"] % 97 == 0, 1e4, 1e-3))
    writer.drain()
    ray.get(actor.flush.remote())
    with ReplayStore.open(tmp_path / "s", mode="r") as reader:  # lz4 stacks decode exactly
        lz4 = RemoteBatches(actor, 8, prefetch=2, batches_per_call=3)
        for _ in range(4):
            got = next(lz4)
            want = reader.get(got.ids)
            for name in ("obs", "next_obs", "action", "reward", "discount"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
        lz4.close()
        assert len(lz4.waits) == 4
    batches = RemoteBatches(actor, 32, prefetch=3, beta=0.5, compress=False, background=False)
    batch = next(batches)
    assert batch.obs.shape == (32, 3, *OBS) and batch.obs.dtype == torch.uint8
    assert batch.next_obs.shape == (32, 3, *OBS) and batch.weights.max() <= 1.0
    heavy = (batch.action % 97 == 0).float().mean()
    assert heavy > 0.9, f"initial priorities from the writer not applied: {heavy}"
    target = int(batch.ids[0])
    batches.update_priorities(batch.ids, torch.full((32,), 1e-6))
    batches.update_priorities([target], [1e6])
    for _ in range(batches.prefetch):  # drawn before the updates arrived
        next(batches)
    again = next(batches)
    assert (again.ids == target).float().mean() > 0.9
    batches.close()
    assert len(batches.waits) == batches.prefetch + 2
    ray.kill(actor)


def test_bad_block_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    actor = start_store_actor(tmp_path / "s", create_args())
    stream = Stream([0, 1], seed=7)
    good = {"env_ids": np.array([0, 1]), "stream": 0, "action": np.zeros((2, 2), np.int64),
            "reward": np.zeros((2, 2), np.float32), "frames": np.stack([stream.first()] * 2),
            "terminated": np.zeros((2, 2), bool), "truncated": np.zeros((2, 2), bool),
            "autoreset": np.array([[True, True], [False, False]])}
    ray.get(actor.add_block.remote(make_block(**good)))
    before = ray.get(actor.counts.remote())
    bad_cases = [({"reward": np.array([[0, 0], [np.nan, 0]], np.float32)}, "finite"),
                 ({"env_ids": np.array([1, 1])}, "duplicates"),
                 ({"frames": np.zeros((2, 2, 5, 6), np.uint8)}, "frames shape"),
                 ({"terminated": np.array([[True, False], [False, False]]),
                   "autoreset": np.zeros((2, 2), bool)}, "after its episode ended")]
    for change, message in bad_cases:
        with pytest.raises(InvalidInputError, match=message):
            ray.get(actor.add_block.remote(make_block(**{**good, **change})))
    assert ray.get(actor.counts.remote()) == before
    ray.kill(actor)


class Ledger:
    """Which tags were sent, acknowledged, and committed, per store process."""

    def __init__(self) -> None:
        self.sent: set[int] = set()
        self.acked: list[tuple[str, int, np.ndarray]] = []
        self.flushed: dict[str, int] = defaultdict(int)

    def on_ack(self, ack: Any, block: Any) -> None:
        tags = block.action[~block.autoreset]
        self.sent.update(tags.tolist())
        if ack is not None and ack.accepted:
            self.acked.append((ack.incarnation, ack.seq, tags))
        if ack is not None:
            self.flushed[ack.incarnation] = max(self.flushed[ack.incarnation], ack.flushed_seq)

    def committed(self) -> set[int]:
        out: set[int] = set()
        for incarnation, seq, tags in self.acked:
            if seq <= self.flushed[incarnation]:
                out.update(tags.tolist())
        return out


def test_killing_the_store_actor_loses_no_flushed_step_and_duplicates_none(
        tmp_path: Path) -> None:
    kills = 24 if LONG else 3
    args = create_args(frame_stack=1, n_step=1, capacity=200_000)
    actor = start_store_actor(tmp_path / "s", args, flush_every_steps=40, max_restarts=-1)
    ledger = Ledger()
    streams = [Stream([0, 1], seed=1, p_end=0.0), Stream([2, 3], seed=2, p_end=0.0)]
    writers = [BlockWriter(actor, s.envs, block_steps=8, max_in_flight=3, on_ack=ledger.on_ack)
               for s in streams]
    for writer, stream in zip(writers, streams, strict=True):
        writer.reset(stream.first())
    rng, pids = np.random.default_rng(0), []
    for _ in range(kills):
        for _ in range(int(rng.integers(20, 80))):
            for writer, stream in zip(writers, streams, strict=True):
                writer.add(**stream.step())
        info = ray.get(actor.info.remote())
        pids.append(info.pid)
        os.kill(info.pid, signal.SIGKILL)
    for _ in range(30):
        for writer, stream in zip(writers, streams, strict=True):
            writer.add(**stream.step())
    for writer in writers:
        writer.drain()
    last = ray.get(actor.flush.remote())
    ledger.flushed[last.incarnation] = last.seq
    assert len(set(pids)) == kills
    assert all(1 <= w.stats.resyncs <= kills for w in writers)  # one per restart it met
    with ReplayStore.open(tmp_path / "s", mode="r") as store:
        batch = store.get(store.valid_ids())
        stored = batch.action.numpy()
        assert np.unique(stored).size == stored.size, "a step was stored twice"
        assert set(stored.tolist()) <= ledger.sent
        lost = ledger.committed() - set(stored.tolist())
        assert not lost, f"{len(lost)} steps of flushed blocks lost"
        assert batch.truncated.any(), "interrupted episodes should end truncated"
        print(f"{kills} kills: {len(ledger.sent)} steps sent, {len(ledger.committed())} in "
              f"flushed blocks, {stored.size} stored, {len(lost)} lost, "
              f"{stored.size - np.unique(stored).size} duplicated")
    ray.kill(actor)


def test_read_only_opens_and_the_cli_work_while_the_actor_writes(tmp_path: Path) -> None:
    path = tmp_path / "s"
    actor = start_store_actor(path, create_args(), flush_every_steps=16)
    stream = Stream([0, 1, 2, 3], seed=3)
    writer = BlockWriter(actor, [0, 1, 2, 3], block_steps=4, max_in_flight=2)
    writer.reset(stream.first())
    seen = []
    for i in range(60):
        writer.add(**stream.step())
        if i % 10 == 9:
            with ReplayStore.open(path, mode="r") as reader:
                seen.append(reader.counts.transitions)
                if len(reader):
                    assert reader.sample(8).obs.shape == (8, 3, *OBS)
    cli = subprocess.run([sys.executable, "-m", "mmreplay", "info", str(path)],
                         capture_output=True, text=True, timeout=120)
    writer.drain()
    assert cli.returncode == 0, cli.stderr
    assert seen == sorted(seen) and seen[-1] > 0
    ray.kill(actor)


def test_import_mmreplay_does_not_import_ray_and_a_missing_extra_is_named() -> None:
    code = ("import sys, mmreplay, mmreplay.tools.cli, mmreplay.integrations.blocks;"
            "assert 'ray' not in sys.modules; sys.modules['ray'] = None\n"
            "try:\n import mmreplay.integrations.ray\n"
            "except ImportError as e:\n print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == 'mmreplay.integrations.ray needs Ray: pip install "mmreplay[ray]"'


def test_idle_writers_steps_are_committed_on_time(tmp_path: Path) -> None:
    """Writers go idle after `drain`; the actor's timer flushes within `flush_every_s`, so a
    kill `flush_every_s` + 1 s later loses no acknowledged step (the data path alone, which
    flushed only when a block arrived, left all 2,000 uncommitted)."""
    args = create_args(frame_stack=1, n_step=1, capacity=20_000)
    actor = start_store_actor(tmp_path / "s", args, flush_every_steps=10**9, flush_every_s=1.0)
    stream = Stream([0, 1], seed=4, p_end=0.0)
    writer = BlockWriter(actor, [0, 1], block_steps=64)
    writer.reset(stream.first())
    tags: list[int] = []
    for _ in range(1000):
        row = stream.step()
        tags.extend(row["action"].tolist())
        writer.add(**row)
    writer.drain()
    assert writer.stats.steps_acked == 2000 and writer.stats.steps_committed < 2000
    time.sleep(1.0 + 1.0)
    assert writer.committed_steps() == 2000
    os.kill(ray.get(actor.info.remote()).pid, signal.SIGKILL)
    ray.kill(actor)
    with ReplayStore.open(tmp_path / "s", mode="r") as store:
        assert store.counts.transitions == 2000
        assert sorted(store.get(store.valid_ids()).action.tolist()) == sorted(tags)


def test_rate_limited_writers_and_learner_through_the_actor(tmp_path: Path) -> None:
    lim = RateLimiter.sample_to_insert_ratio(2.0, 64, 64.0, timeout_s=2.0)
    args = create_args(frame_stack=1, n_step=1, capacity=20_000)
    actor = start_store_actor(tmp_path / "s", args, rate_limiter=lim)
    stream = Stream([0, 1, 2, 3], seed=6, p_end=0.0)
    writer = BlockWriter(actor, [0, 1, 2, 3], block_steps=8, insert_timeout_s=0.3)
    writer.reset(stream.first())
    with pytest.raises(RateLimitTimeoutError, match="dropped"):
        for _ in range(200):  # no learner: the band lets ~96 steps in
            writer.add(**stream.step())
    assert writer.stats.blocks_timed_out == 1
    batches = RemoteBatches(actor, 16, prefetch=2, background=False)
    with pytest.raises(RateLimitTimeoutError, match="writers are not inserting"):
        for _ in range(100):
            next(batches)
    writer.insert_timeout_s = 30.0
    errors: list[BaseException] = []
    thread = threading.Thread(target=_send_rows, args=(writer, stream, 150, errors))
    thread.start()
    while thread.is_alive():
        try:
            next(batches)
        except RateLimitTimeoutError:
            pass  # the writer finished while a sample waited
    assert not errors, errors
    stats = ray.get(actor.rate_limiter_stats.remote())
    assert -64 - 16 * 3 <= stats["error"] <= 64 + 8 * 4 * 2, stats
    # at every admission: past the band by less than one call (a batch, a block of 8 x 4)
    assert -64 - 15 <= stats["error_low"] <= stats["error_high"] <= 64 + 31 * 2, stats
    assert stats["insert_wait_s"] > 0 and stats["sample_wait_s"] > 0
    batches.close()
    ray.get(actor.flush.remote())
    with ReplayStore.open(tmp_path / "s", mode="r") as store:
        assert store.rate_limiter_state()["samples"] > 0
    ray.kill(actor)


def _send_rows(writer: BlockWriter, stream: Stream, rows: int,
               errors: list[BaseException]) -> None:
    try:
        for _ in range(rows):
            writer.add(**stream.step())
        writer.drain()
    except BaseException as exc:  # noqa: BLE001 - checked by the caller
        errors.append(exc)


def test_killing_a_rate_limited_actor_leaves_no_one_waiting(tmp_path: Path) -> None:
    """A writer waits in the actor for samples; the actor is killed: the writer's call
    fails, Ray restarts the actor with the committed counters, and a learner then lets
    the writer finish."""
    lim = RateLimiter.sample_to_insert_ratio(1.0, 32, 16.0)  # no timeout: waits for good
    args = create_args(frame_stack=1, n_step=1, capacity=20_000)
    actor = start_store_actor(tmp_path / "s", args, rate_limiter=lim, flush_every_steps=16)
    stream = Stream([0, 1], seed=8, p_end=0.0)
    writer = BlockWriter(actor, [0, 1], block_steps=4, max_in_flight=1)
    writer.reset(stream.first())
    errors: list[BaseException] = []
    thread = threading.Thread(target=_send_rows, args=(writer, stream, 120, errors))
    thread.start()
    deadline = time.monotonic() + 60
    while ray.get(actor.rate_limiter_stats.remote())["inserts_blocked"] == 0:
        assert time.monotonic() < deadline, "the writer never waited"
        time.sleep(0.05)
    os.kill(ray.get(actor.info.remote()).pid, signal.SIGKILL)
    batches = RemoteBatches(actor, 4, prefetch=1, background=False)
    while thread.is_alive():
        next(batches)
    thread.join()
    assert not errors and writer.stats.blocks_failed >= 1, errors
    stats = ray.get(actor.rate_limiter_stats.remote())
    assert stats["inserts"] == ray.get(actor.counts.remote()).transitions
    batches.close()
    ray.kill(actor)
