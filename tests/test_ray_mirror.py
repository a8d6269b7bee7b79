"""A Ray store actor with ``mirror=``: every flush it makes goes to the bucket.

On one local Ray cluster and the SeaweedFS server of `s3_server`: writers send blocks, the
actor's timer flushes, and the bucket gains generations without any push from the caller;
the prefix's writer lease keeps a second writer out while a restarted actor renews its
own; an actor killed after a flush that waited for the mirror leaves a bucket that a new
machine resumes from with every committed step. The actor's workers do not see the
fixture's AWS variables (the cluster starts first), so the tests pass `storage_options`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install 'mmreplay[ray]'")
pytest.importorskip("obstore", reason='needs the cloud extra: pip install "mmreplay[cloud]"')

from mmreplay import ReplayStore, StoreLockedError  # noqa: E402
from mmreplay.integrations.ray import BlockWriter, start_store_actor  # noqa: E402
from mmreplay.storage.bucket import read_bucket_manifest  # noqa: E402
from mmreplay.storage.manifest import read_manifest  # noqa: E402
from mmreplay.storage.objects import open_objects  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("s3_server")
from s3_server import S3Server  # noqa: E402

# cluster: test_ray's module-scoped Ray cluster (autouse), started for this module too
from test_ray import Ledger, Stream, assert_same_store, cluster, create_args  # noqa: E402, F401

pytestmark = pytest.mark.integration  # a Ray cluster and the SeaweedFS server

pytest_plugins = ["s3_server"]  # the fixtures s3, s3_session


def bucket_generation(url: str, options: dict[str, str]) -> int:
    return int(read_bucket_manifest(open_objects(url, options))["generation"])


def wait_for_generation(url: str, options: dict[str, str], above: int,
                        timeout_s: float = 30.0) -> int:
    """The bucket's generation once it exceeds `above` (the actor flushes on its own)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = bucket_generation(url, options)
        if now > above:
            return now
        time.sleep(0.1)
    raise AssertionError(f"the bucket stayed at generation {above} for {timeout_s} s")


def send(writer: BlockWriter, stream: Stream, steps: int) -> None:
    for _ in range(steps):
        writer.add(**stream.step())
    writer.drain()


def test_timed_flushes_reach_the_bucket_and_the_lease_survives_restarts(
        s3: S3Server, tmp_path: Path) -> None:
    url, options = s3.url(f"ray-{uuid.uuid4().hex[:8]}"), s3.options()
    actor = start_store_actor(tmp_path / "s", create_args(), flush_every_steps=10**9,
                              flush_every_s=0.3, mirror=url, storage_options=options)
    stream = Stream([0, 1, 2, 3], seed=5)
    writer = BlockWriter(actor, [0, 1, 2, 3], block_steps=8)
    writer.reset(stream.first())
    seen = [wait_for_generation(url, options, 0)]  # the store as created
    for _ in range(3):  # no flush, no push from here: the actor's timer flushes
        send(writer, stream, 40)
        seen.append(wait_for_generation(url, options, seen[-1]))
    info = ray.get(actor.mirror_info.remote())
    assert info.pushes >= 4 and info.error is None and info.url == url
    print(f"bucket generations seen without a push: {seen}; mirror: {info}")
    with pytest.raises(StoreLockedError, match="another writer"):  # one writer per prefix
        start_store_actor(tmp_path / "other", create_args(), mirror=url,
                          storage_options=options)
    with pytest.raises(StoreLockedError, match="another writer"):
        ReplayStore.open(url, "r+", local=tmp_path / "elsewhere", storage_options=options)
    os.kill(ray.get(actor.info.remote()).pid, signal.SIGKILL)  # Ray restarts it: same lease
    send(writer, stream, 40)
    assert writer.stats.resyncs >= 1 and ray.get(actor.info.remote()).restarted
    flushed = ray.get(actor.flush.remote(wait_mirror=True))
    assert bucket_generation(url, options) == flushed.generation > seen[-1]
    assert ray.get(actor.mirror_info.remote()).error is None
    ray.get(actor.close.remote())  # pushes the last commit and lets the prefix go
    assert open_objects(url, options).head("lease.json") is None
    ray.kill(actor)


def test_an_actor_killed_after_a_mirrored_flush_resumes_on_a_new_machine(
        s3: S3Server, tmp_path: Path) -> None:
    url, options = s3.url(f"ray-kill-{uuid.uuid4().hex[:8]}"), s3.options()
    args = create_args(frame_stack=1, n_step=1, capacity=20_000)
    actor = start_store_actor(tmp_path / "s", args, flush_every_steps=48, mirror=url,
                              storage_options=options)
    ledger = Ledger()
    streams = [Stream([0, 1], seed=1, p_end=0.0), Stream([2, 3], seed=2, p_end=0.0)]
    writers = [BlockWriter(actor, s.envs, block_steps=8, on_ack=ledger.on_ack)
               for s in streams]
    for writer, stream in zip(writers, streams, strict=True):
        writer.reset(stream.first())
        send(writer, stream, 100)
    last = ray.get(actor.flush.remote(wait_mirror=True))  # a checkpoint
    ledger.flushed[last.incarnation] = last.seq
    for writer, stream in zip(writers, streams, strict=True):
        send(writer, stream, 4)  # acknowledged, not committed (fewer than flush_every_steps)
    ray.kill(actor)  # the machine is gone (no restart, no close: its lease still runs)
    local = tmp_path / "new-machine" / "s"
    with pytest.raises(StoreLockedError, match="another writer"):
        ReplayStore.open(url, "r+", local=local, storage_options=options)
    with ReplayStore.open(url, "r+", local=local, storage_options=options,
                          take_over=True) as resumed, \
            ReplayStore.open(tmp_path / "s", "r") as there:
        assert resumed.generation == last.generation
        assert resumed.counts.transitions == last.transitions
        stored = set(resumed.get(resumed.valid_ids()).action.numpy().tolist())
        assert ledger.committed() <= stored and len(ledger.committed()) == 400
        assert_same_store(resumed, there)  # what the actor committed, step for step
        resumed.reset(np.zeros((2, *args["obs_shape"]), np.uint8), env_ids=[0, 1])
        resumed.flush(wait_mirror=True)  # and the new machine mirrors on
    assert bucket_generation(url, options) == read_manifest(local)["generation"]
