"""Writing to object storage from a new machine: resume from a bucket (library and scripts),
older formats and zstd-dict stores in a bucket, one writer per prefix, credentials kept out.

Against a real S3 server (SeaweedFS, `tests/s3_server.py`); each test uses its own prefix.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from mmreplay import InvalidInputError, InvalidStoreError, ReplayStore, StoreLockedError
from mmreplay.errors import ObjectStoreError
from mmreplay.storage.bucket import read_bucket_manifest
from mmreplay.storage.lease import Lease
from mmreplay.storage.objects import open_objects
from mmreplay.storage.pull import pull
from mmreplay.tools.cli import main as cli

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("s3_server")
from s3_server import FaultProxy, S3Server, free_ports  # noqa: E402
from script_runner import Outcome, run_here  # noqa: E402
from test_object_storage import OBS, assert_same, continue_run, fill, make  # noqa: E402

pytest_plugins = ["s3_server"]

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
FIELDS = ("obs", "next_obs", "action", "reward", "discount", "terminated", "truncated")


def prefix(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def assert_same_steps(a: ReplayStore, b: ReplayStore) -> None:
    """`get` of every id equal, field by field (any store, any sampler)."""
    ids = a.valid_ids()
    np.testing.assert_array_equal(ids, b.valid_ids())
    assert ids.size > 0
    ba, bb = a.get(ids), b.get(ids)
    for name in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(ba, name)),
                                      np.asarray(getattr(bb, name)), err_msg=name)


# -- ReplayStore.open(URL, "r+", local=DIR) ----------------------------------------------------
def test_open_url_for_writing_pulls_resumes_and_mirrors_back(s3: S3Server,
                                                             tmp_path: Path) -> None:
    url = s3.url(prefix("rw"))
    with make(tmp_path / "a", mirror=url) as store:
        fill(store, 1500)
    local = tmp_path / "new-machine" / "b"
    with ReplayStore.open(tmp_path / "a", "r+") as here, \
            ReplayStore.open(url, "r+", local=local) as there:
        assert there.mirror is not None and there.path == local
        assert_same(here, there)  # get of every id, priorities, RNG state, counters
        np.testing.assert_array_equal(continue_run(here), continue_run(there))
        assert_same(here, there)
        there.flush(wait_mirror=True)
        assert there.mirror.pushed == there.generation
    pull(open_objects(url), tmp_path / "c")  # what the bucket holds now: the resumed run
    with ReplayStore.open(local, "r") as b, ReplayStore.open(tmp_path / "c", "r") as c:
        assert_same(b, c)
    with ReplayStore.open(url, "r+", local=local) as again:  # the working copy is kept
        assert again.generation == b.generation


def test_open_url_for_writing_refuses_what_it_cannot_do(s3: S3Server, tmp_path: Path) -> None:
    url = s3.url(prefix("rw-bad"))
    with make(tmp_path / "a", mirror=url) as store:
        fill(store, 300)
    shutil.copytree(tmp_path / "a", tmp_path / "old")  # a working copy left behind
    with ReplayStore.open(tmp_path / "a", "r+", mirror=url) as store:
        fill(store, 300, seed=5)
    with pytest.raises(InvalidInputError, match="local="):
        ReplayStore.open(url, "r+")
    with pytest.raises(InvalidInputError, match="local="):
        ReplayStore.open(url, "r", local=tmp_path / "x")
    with pytest.raises(InvalidInputError, match="local="):
        ReplayStore.open(tmp_path / "a", "r+", local=tmp_path / "x")
    with pytest.raises(StoreLockedError, match="newer than"):
        ReplayStore.open(url, "r+", local=tmp_path / "old")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidStoreError, match="holds files but no store"):
        ReplayStore.open(url, "r+", local=tmp_path / "junk")
    assert (tmp_path / "junk" / "notes.txt").read_text() == "mine"
    with pytest.raises(InvalidStoreError, match="not an mmreplay store"):
        ReplayStore.open(s3.url(prefix("empty")), "r+", local=tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()  # an interrupted pull leaves nothing


# -- older formats and zstd-dict stores in a bucket ------------------------------------------
@pytest.mark.parametrize("name", ["store_v1", "store_v1_lz4", "store_v2", "store_v3",
                                  "store_v4"])
def test_golden_stores_pushed_pulled_and_read_from_a_bucket(s3: S3Server, tmp_path: Path,
                                                            name: str) -> None:
    """Every on-disk format goes up and comes down unchanged; read-only opens of the URL
    work (format 1, a file per chunk, is fetched whole into the cache directory)."""
    url = s3.url(prefix(name))
    shutil.copytree(FIXTURES / name, tmp_path / "src")
    with ReplayStore.open(tmp_path / "src", "r") as src:
        report = src.push(url)
        assert report.uploaded_objects > 0
        assert cli(["pull", url, str(tmp_path / "pulled")]) == 0
        with ReplayStore.open(tmp_path / "pulled", "r") as pulled:
            assert_same_steps(src, pulled)
            assert pulled.spec == src.spec
        with ReplayStore.open(url, "r", cache_dir=tmp_path) as remote:
            assert_same_steps(src, remote)
    assert cli(["verify", url]) == 0


def test_zstd_dict_store_mirrored_pulled_and_read_from_a_bucket(s3: S3Server,
                                                                tmp_path: Path) -> None:
    """The dictionary is trained after the first push (the store starts without one): the
    mirror then carries zstd.dict and the rewritten frames/zarr.json."""
    url = s3.url(prefix("zdict"))
    with ReplayStore.create(tmp_path / "a", capacity=4000, obs_shape=OBS, frame_stack=4,
                            seed=3, codec="zstd-dict", dict_bytes=1024, dict_train_chunks=4,
                            chunk_frames=8, shard_chunks=16, mirror=url) as store:
        store.flush(wait_mirror=True)  # pushed before any dictionary exists
        assert open_objects(url).head("zstd.dict") is None
        fill(store, 1200)
        store.flush(wait_mirror=True)
    assert open_objects(url).head("zstd.dict") is not None
    pull(open_objects(url), tmp_path / "b")
    with ReplayStore.open(tmp_path / "a", "r") as a, ReplayStore.open(tmp_path / "b", "r") as b:
        assert a.spec.codec == b.spec.codec == "zstd-dict"
        assert (tmp_path / "b" / "zstd.dict").read_bytes() == \
            (tmp_path / "a" / "zstd.dict").read_bytes()
        assert_same_steps(a, b)
        with ReplayStore.open(url, "r", cache_dir=tmp_path) as remote:
            assert_same_steps(a, remote)
    with ReplayStore.open(url, "r+", local=tmp_path / "c") as c:  # and writing goes on
        fill(c, 200, seed=4)


# -- one writer per prefix ----------------------------------------------------------------
def test_second_writer_refused_by_mirror_push_and_resume(s3: S3Server, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    url = s3.url(prefix("two"))
    with make(tmp_path / "a", mirror=url) as first:
        fill(first, 200)
        first.flush(wait_mirror=True)
        with pytest.raises(StoreLockedError, match="another writer") as mirrored:
            make(tmp_path / "b", mirror=url)
        text = str(mirrored.value)
        assert url in text and "lease expires in" in text and "take_over=True" in text
        with make(tmp_path / "c") as second:
            fill(second, 50)
            with pytest.raises(StoreLockedError, match="another writer"):
                second.push(url)
        assert cli(["push", str(tmp_path / "c"), url]) == 2
        assert "another writer" in capsys.readouterr().err
        with pytest.raises(StoreLockedError, match="another writer"):
            ReplayStore.open(url, "r+", local=tmp_path / "d")
        fill(first, 100, seed=2)
        first.flush(wait_mirror=True)  # the first writer was never disturbed
    with ReplayStore.open(url, "r+", local=tmp_path / "d") as taken:  # released at close
        assert taken.generation == first.generation


def test_a_writer_restarted_with_its_writer_id_renews_its_own_lease(tmp_path: Path) -> None:
    """What a Ray store actor and its restarts do (file:// bucket): a lease taken for a
    writer id (by `start_store_actor`, or a process that died holding it) is renewed by a
    mirror with that id, while any other writer is refused. `Mirror.info` says where the
    mirror stands."""
    url = f"file://{tmp_path}/bucket"
    Lease(open_objects(url), writer_id="run-7").acquire()
    with make(tmp_path / "a") as store:
        fill(store, 100)
    with pytest.raises(StoreLockedError, match="another writer"):
        ReplayStore.open(tmp_path / "a", "r+", mirror=url)
    with ReplayStore.open(tmp_path / "a", "r+") as store:
        store.attach_mirror(url, writer_id="run-7")  # no take_over needed
        fill(store, 50, seed=2)
        store.flush(wait_mirror=True)
        info = store.mirror.info()
        assert (info.url, info.pushed, info.lag, info.error) == (url, store.generation, 0, None)
        assert info.pushes >= 1
        assert json.loads(open_objects(url).get("lease.json"))["writer"] == "run-7"
    assert open_objects(url).head("lease.json") is None  # released at close


# -- credentials --------------------------------------------------------------------------
def test_credentials_never_in_errors_logs_or_objects(s3: S3Server, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """Marker credentials in the AWS variables; errors provoked with them in use (a dead
    endpoint, a missing bucket, a refused lease, a mirror that cannot push) and objects
    written with them: no marker, nor the server's real secret, in any message, log line
    or object."""
    key_marker, secret_marker = "AKIAMARKER" + uuid.uuid4().hex[:10].upper(), \
        "SECRETMARKER" + uuid.uuid4().hex
    real = s3.options()
    markers = (key_marker, secret_marker, real["secret_access_key"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_marker)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_marker)
    caplog.set_level(logging.DEBUG)
    url = s3.url(prefix("cred"))
    messages: list[str] = []

    def refused(exc_type: type[BaseException], call: object) -> None:
        with pytest.raises(exc_type) as info:
            call()  # type: ignore[operator]
        messages.extend([str(info.value), repr(info.value)])

    dead = f"http://127.0.0.1:{free_ports(1)[0]}"
    with make(tmp_path / "a") as store:
        fill(store, 300)
        monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
        refused(ObjectStoreError, lambda: store.push(url))  # nobody listens there
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        store.push(url)  # signed with the markers (the test server checks no signature)
        refused(ObjectStoreError, lambda: store.push(f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}"
                                                     f"/x", storage_options=real))
        store.push(url, storage_options=real)
        store.push(url, storage_options=real)  # the lease is renewed, not refused
    leased = s3.url(prefix("cred-lease"))
    with make(tmp_path / "b", mirror=leased, storage_options=real) as first:
        fill(first, 100)
        with make(tmp_path / "c") as second:
            refused(StoreLockedError, lambda: second.push(leased, storage_options=real))
        first.flush(wait_mirror=True)
    proxy = FaultProxy(s3.ports[3])
    store = make(tmp_path / "d", mirror=s3.url(prefix("cred-gone")),
                 storage_options={**real, "endpoint": proxy.endpoint})
    proxy.close()  # the mirror's pushes now fail
    fill(store, 100)
    refused(ObjectStoreError, lambda: store.flush(wait_mirror=True))
    refused(ObjectStoreError, store.close)
    assert len(messages) == 10
    out, err = capfd.readouterr()
    seen = "\n".join([*messages, caplog.text, out, err])
    for marker in markers:
        assert marker not in seen
    for where in (url, leased):
        objects = open_objects(where, real)
        written = objects.list()
        assert {"manifest.json", "pushed.json"} <= set(written)
        for key in written:
            data = objects.get(key)
            for marker in markers:
                assert marker.encode() not in data, key


# -- the DQN scripts resume from the bucket on a new machine ------------------------------
TINY_DQN = ["--env", "CartPole-v1", "--learning-starts", "100", "--buffer-size", "600",
            "--checkpoint-every", "200", "--target-network-frequency", "100", "--prioritized",
            "--n-step", "3", "--batch-size", "16", "--progress-every", "0"]


def script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """A script as a user runs it; the s3 fixture put the server's AWS variables in the
    environment, which the subprocess inherits."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def in_process(name: str, *args: str, status: int = 0) -> Outcome:
    """A script run in this process (`run_here`), its exit status checked: what the DQN tests
    check is the runs' outcome (the s3 fixture's AWS variables are this process's)."""
    done = run_here(name, *args)
    assert done.returncode == status, done.stderr[-3000:]
    return done


def test_train_dqn_resumes_from_the_bucket_exactly_as_locally(s3: S3Server,
                                                              tmp_path: Path) -> None:
    """Run A mirrored to the bucket; resume it on a "new machine" (empty run dir B) from the
    bucket, and locally from A: the two stores and networks are equal."""
    import torch

    url = s3.url(prefix("dqn"))
    a, b = tmp_path / "A", tmp_path / "new-machine" / "B"
    in_process("train_dqn.py", *TINY_DQN, "--total-timesteps", "500", "--run-dir", str(a),
               "--store", url)
    objects = open_objects(url)
    assert {"checkpoint.pt", "summary.json", "store/manifest.json"} <= set(objects.list())
    refused = in_process("train_dqn.py", *TINY_DQN, "--run-dir", str(tmp_path / "C"),
                         "--store", url, status=2)
    assert "already holds a run" in refused.stderr
    there = in_process("train_dqn.py", *TINY_DQN, "--total-timesteps", "900", "--run-dir",
                       str(b), "--store", url, "--resume")
    assert "resumed at step 500" in there.stdout + there.stderr
    in_process("train_dqn.py", *TINY_DQN, "--total-timesteps", "900", "--run-dir", str(a),
               "--resume")
    with ReplayStore.open(a / "store", "r") as here, ReplayStore.open(b / "store", "r") as bb:
        assert_same(here, bb)  # get of every id, priorities, RNG state, counters
        assert here.counts.transitions > 500
    ca, cb = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (a, b))
    assert ca["global_step"] == cb["global_step"] == 900
    for name, tensor in ca["q_network"].items():
        assert torch.equal(tensor, cb["q_network"][name]), name
    pull(objects_store := open_objects(f"{url}/store"), tmp_path / "bucket-now")
    with ReplayStore.open(b / "store", "r") as bb, \
            ReplayStore.open(tmp_path / "bucket-now", "r") as now:
        assert_same(bb, now)  # the resumed run mirrored back to the bucket
    assert objects_store.head("lease.json") is None  # and let the prefix go at the end
    summary = json.loads(objects.get("summary.json"))
    assert summary["global_step"] == 900


def test_apex_dqn_resumes_from_the_bucket_on_a_new_machine(s3: S3Server,
                                                           tmp_path: Path) -> None:
    """The store actor mirrors its scheduled flushes (the first run checkpoints only at its
    end, yet the bucket got several generations while it trained); a new machine resumes."""
    pytest.importorskip("ray", reason="needs the ray extra: pip install 'mmreplay[ray]'")
    url = s3.url(prefix("apex"))
    tiny = ["--env", "CartPole-v1", "--num-actors", "2", "--learning-starts", "300",
            "--buffer-size", "4000", "--batch-size", "16", "--actor-steps", "64",
            "--block-steps", "16", "--learning-rate", "1e-3",
            "--object-store-mb", "100", "--flush-every-steps", "300"]
    script("apex_dqn.py", *tiny, "--total-timesteps", "1200", "--checkpoint-every", "100000",
           "--run-dir", str(tmp_path / "A"), "--store", url)
    first = json.loads(open_objects(url).get("summary.json"))
    mirrored = first["mirror"]  # as the actors stopped, before the run's only checkpoint
    assert mirrored["pushes"] >= 3 and mirrored["error"] is None, mirrored
    assert mirrored["url"] == f"{url}/store"
    with ReplayStore.open(tmp_path / "A" / "store", "r") as a:  # every flush was pushed
        assert read_bucket_manifest(open_objects(f"{url}/store"))["generation"] == a.generation
    assert open_objects(f"{url}/store").head("lease.json") is None  # let go at the end
    Lease(open_objects(f"{url}/store")).acquire()  # a writer on another machine (or a dead one)
    # refused before Ray starts (in this process: a refusal needs no interpreter of its own)
    refused = in_process("apex_dqn.py", *tiny, "--run-dir", str(tmp_path / "B"), "--store",
                         url, "--resume", status=2)
    assert "another writer" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "B" / "store").exists()  # refused before anything was pulled
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "the refusal started Ray"
    again = script("apex_dqn.py", *tiny, "--total-timesteps", "1800", "--checkpoint-every",
                   "1000", "--run-dir", str(tmp_path / "B"), "--store", url, "--resume",
                   "--take-over")
    assert f"resumed at step {first['global_step']} ({first['updates']} updates" \
        in again.stdout + again.stderr
    with ReplayStore.open(tmp_path / "A" / "store", "r") as a, \
            ReplayStore.open(tmp_path / "B" / "store", "r") as b:
        assert b.counts.transitions > a.counts.transitions
        old = a.valid_ids()
        kept = np.intersect1d(old, b.valid_ids())  # the ring may have dropped the oldest
        assert kept.size > 0
        # the steps the bucket carried over are those of machine A (the episodes the
        # restart cut end as truncated there, so n-step fields may differ at their ends)
        for name in ("obs", "action"):
            np.testing.assert_array_equal(np.asarray(getattr(a.get(kept), name)),
                                          np.asarray(getattr(b.get(kept), name)))
        assert b.get(b.valid_ids()).truncated.any()
    pull(open_objects(f"{url}/store"), tmp_path / "bucket-now")
    with ReplayStore.open(tmp_path / "B" / "store", "r") as b, \
            ReplayStore.open(tmp_path / "bucket-now", "r") as now:
        assert_same_steps(b, now)
    assert json.loads(open_objects(url).get("summary.json"))["global_step"] == 1800


def test_prepare_run_with_a_bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripts' `--store` checks (scripts/common.py), against a file:// bucket."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from common import UsageError, prepare_run

    url = f"file://{tmp_path}/bucket/run"
    with pytest.raises(UsageError, match="s3://bucket/prefix"):
        prepare_run(tmp_path / "r", resume=False, overwrite=False, store="bucket/run")
    with pytest.raises(UsageError, match="neither"):
        prepare_run(tmp_path / "r", resume=True, overwrite=False, store=url)
    run_dir, bucket = prepare_run(tmp_path / "r", resume=False, overwrite=False, store=url)
    assert bucket is not None and bucket.store_url == f"{url}/store"
    with make(run_dir / "store", mirror=bucket.store_url) as store:
        fill(store, 100)
    (run_dir / "checkpoint.pt").write_bytes(b"model")
    bucket.upload(run_dir, "checkpoint.pt")
    with pytest.raises(UsageError, match="already holds a run"):
        prepare_run(tmp_path / "other", resume=False, overwrite=False, store=url)
    new_dir, _ = prepare_run(tmp_path / "new", resume=True, overwrite=False, store=url)
    assert (new_dir / "checkpoint.pt").read_bytes() == b"model"
    assert not (new_dir / "checkpoint.pt.pending").exists()
    bucket.pull_store(new_dir)
    with ReplayStore.open(run_dir / "store", "r") as a, \
            ReplayStore.open(new_dir / "store", "r") as b:
        assert_same(a, b)


def test_train_dqn_preempted_resumes_from_the_bucket_with_take_over(s3: S3Server,
                                                                    tmp_path: Path) -> None:
    """A mirrored run SIGKILLed (a preempted machine): its lease still runs, so a resume
    elsewhere is refused until `--take-over`; then the bucket's store and checkpoint match
    (the checkpoint's transitions are the store's) and the run goes on from there."""
    import io
    import signal
    import time

    import torch

    url = s3.url(prefix("preempt"))
    objects = open_objects(url)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "scripts" / "train_dqn.py"), *TINY_DQN]
    first = subprocess.Popen([*cmd, "--total-timesteps", "1000000", "--run-dir",
                              str(tmp_path / "A"), "--store", url], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert first.poll() is None, "the run ended before it could be killed"
            if objects.head("checkpoint.pt") is not None and torch.load(io.BytesIO(
                    objects.get("checkpoint.pt")), weights_only=True)["global_step"] >= 400:
                break
            time.sleep(0.3)
        else:
            raise AssertionError("no checkpoint at step >= 400 in the bucket in time")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    refused = in_process("train_dqn.py", *TINY_DQN, "--run-dir", str(tmp_path / "B"),
                         "--store", url, "--resume", "--total-timesteps", "5000", status=2)
    assert "another writer" in refused.stderr, refused.stderr
    assert not (tmp_path / "B" / "store").exists()  # refused before anything was pulled
    saved = torch.load(io.BytesIO(objects.get("checkpoint.pt")), weights_only=True)
    step = int(saved["global_step"])
    again = in_process("train_dqn.py", *TINY_DQN, "--run-dir", str(tmp_path / "B"), "--store",
                       url, "--resume", "--take-over", "--total-timesteps", str(step + 300))
    assert f"resumed at step {step} " in again.stdout + again.stderr or \
        f"resumed at step {step + 200} " in again.stdout + again.stderr  # a pending one
    done = json.loads(objects.get("summary.json"))
    assert done["global_step"] == step + 300
