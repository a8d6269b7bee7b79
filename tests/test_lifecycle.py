"""Store lifecycle: flushed at exit when never closed, a crash unchanged, no reads after close,
a second writer told where the first one is, a recorder that closes the store it records into.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest

from mmreplay import ClosedStoreError, InvalidInputError, ReplayStore, StoreLockedError

ROOT = Path(__file__).resolve().parents[1]
OBS = (6, 6)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=120, check=False)


def record(store: ReplayStore, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        store.add(i % 3, 1.0, np.full(OBS, i % 251, np.uint8), False, False)


def make(path: Path, **kw: object) -> ReplayStore:
    store = ReplayStore.create(path, capacity=512, obs_shape=OBS, frame_stack=2,
                               chunk_frames=8, seed=0, **kw)
    store.reset(np.zeros(OBS, np.uint8))
    return store


WRITER = """
import sys
import numpy as np
from mmreplay import ReplayStore
path, steps, flush_at, end = {args}
store = ReplayStore.create(path, capacity=512, obs_shape=(6, 6), frame_stack=2,
                           chunk_frames=8, seed=0)
store.reset(np.zeros((6, 6), np.uint8))
for i in range(int(steps)):
    store.add(i % 3, 1.0, np.full((6, 6), i % 251, np.uint8), False, False)
    if i + 1 == int(flush_at):
        store.flush()
if end == "os._exit":
    import os
    os._exit(0)
if end == "raise":
    raise SystemExit("stopped by an uncaught exit")
"""


def writer(path: Path, steps: int, flush_at: int, end: str) -> subprocess.CompletedProcess[str]:
    return run_python(WRITER.format(args=repr((str(path), steps, flush_at, end))))


@pytest.mark.integration  # interpreter exits in subprocesses
@pytest.mark.parametrize("end", ["return", "raise"])
def test_a_store_never_closed_is_flushed_at_exit_with_a_warning(tmp_path: Path, end: str) -> None:
    path = tmp_path / "s"
    proc = writer(path, 203, 0, end)  # 203 steps: chunk files and a part-filled RAM tail
    assert "was never closed; flushing it at exit" in proc.stderr
    assert str(path) in proc.stderr
    with ReplayStore.open(path, mode="r") as store:
        assert store.counts.transitions == 203
        assert store.counts.frames_written == 204
        last = store.get([202])
    assert int(last.next_obs[0, -1, 0, 0]) == 202


@pytest.mark.integration  # interpreter exits in subprocesses
def test_a_crash_still_keeps_only_what_a_flush_committed(tmp_path: Path) -> None:
    path = tmp_path / "s"
    proc = writer(path, 203, 120, "os._exit")  # no atexit hooks, as SIGKILL
    assert proc.returncode == 0 and "never closed" not in proc.stderr
    with ReplayStore.open(path, mode="r") as store:
        assert store.counts.transitions == 120


@pytest.mark.integration  # interpreter exits in subprocesses
def test_a_closed_store_warns_nothing_at_exit(tmp_path: Path) -> None:
    proc = run_python(f"""
        import numpy as np
        from mmreplay import ReplayStore
        with ReplayStore.create({str(tmp_path / "s")!r}, capacity=8, obs_shape=(2,)) as s:
            s.reset(np.zeros(2, np.uint8))
        reader = ReplayStore.open({str(tmp_path / "s")!r}, mode="r")  # a reader: nothing to do
        """)
    assert proc.returncode == 0 and proc.stderr == ""


def test_tracked_stores_can_still_be_garbage_collected(tmp_path: Path) -> None:
    store = make(tmp_path / "s")
    record(store, 10)
    ref = weakref.ref(store)
    store.close()
    del store
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("mode", ["r+", "r"])
def test_reads_after_close_raise_closed_store_error(tmp_path: Path, mode: str) -> None:
    store = make(tmp_path / "s")
    record(store, 40)
    if mode == "r":
        store.close()
        store = ReplayStore.open(tmp_path / "s", mode="r")
    store.close()
    calls = {
        "sample": lambda: store.sample(4),
        "get": lambda: store.get([3]),
        "batches": lambda: store.batches(4),
        "sample_sequences": lambda: store.sample_sequences(2, 5),
        "get_sequences": lambda: store.get_sequences([3], 5),
    }
    for name, call in calls.items():
        with pytest.raises(ClosedStoreError, match=f"{name} on a closed store"):
            call()
    with pytest.raises(InvalidInputError):  # still the error class writes raised before
        store.add(0, 0.0, np.zeros(OBS, np.uint8), False, False)
    assert store.closed


def test_a_second_writer_in_this_process_is_told_so(tmp_path: Path) -> None:
    store = make(tmp_path / "s")
    with pytest.raises(StoreLockedError, match="in this process") as err:
        ReplayStore.open(tmp_path / "s")
    assert "another process" not in str(err.value)
    proc = run_python(f"import mmreplay; mmreplay.ReplayStore.open({str(tmp_path / 's')!r})")
    assert "by another process" in proc.stderr
    store.close()
    ReplayStore.open(tmp_path / "s").close()  # released: opens again


# -- the gymnasium recorder ------------------------------------------------------------------
gym = pytest.importorskip("gymnasium")


def vector_env() -> object:
    return gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)


def test_recorder_closes_the_store_with_the_env(tmp_path: Path) -> None:
    from mmreplay.integrations.gymnasium import RecordVectorToStore, create_store_for

    envs = vector_env()
    store = create_store_for(envs, tmp_path / "s", capacity=400, seed=0)
    envs = RecordVectorToStore(envs, store)
    envs.reset(seed=0)
    for _ in range(30):
        envs.step(envs.action_space.sample())
    envs.close()
    assert store.closed
    with ReplayStore.open(tmp_path / "s", mode="r") as reader:
        assert reader.counts.frames_written == 4 * 31


def test_recorder_with_close_store_false_only_flushes(tmp_path: Path) -> None:
    from mmreplay.integrations.gymnasium import RecordToStore, create_store_for

    env = gym.make("CartPole-v1")
    store = create_store_for(env, tmp_path / "s", capacity=400, seed=0)
    env = RecordToStore(env, store, close_store=False)
    env.reset(seed=0)
    for _ in range(5):
        env.step(0)
    env.close()
    assert not store.closed
    with ReplayStore.open(tmp_path / "s", mode="r") as reader:
        assert reader.counts.frames_written == 6  # committed by the env's close
    store.sample(2)
    store.close()


@pytest.mark.integration  # interpreter exits in subprocesses
def test_readme_recorder_line_without_a_store_handle_keeps_the_steps(tmp_path: Path) -> None:
    """The README's one-liner, then a normal exit: the steps are on disk."""
    proc = run_python(f"""
        import gymnasium as gym
        from mmreplay.integrations.gymnasium import RecordVectorToStore, create_store_for
        envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 8)
        envs = RecordVectorToStore(envs, create_store_for(envs, {str(tmp_path / "c8")!r},
                                                          capacity=8000))
        envs.reset(seed=0)
        for _ in range(200):
            envs.step(envs.action_space.sample())
        """)
    assert proc.returncode == 0, proc.stderr
    with ReplayStore.open(tmp_path / "c8", mode="r") as reader:
        assert reader.counts.frames_written == 8 * 201


@pytest.mark.integration  # interpreter exits in subprocesses
def test_an_sb3_buffer_left_open_is_closed_by_its_owner_without_a_warning(tmp_path: Path) -> None:
    pytest.importorskip("stable_baselines3")
    proc = run_python(f"""
        import numpy as np
        from gymnasium import spaces
        from mmreplay.integrations.sb3 import FrameOnceReplayBuffer
        buf = FrameOnceReplayBuffer(100, spaces.Box(0, 255, (4, 5, 5), np.uint8),
                                    spaces.Discrete(3), device="cpu",
                                    path={str(tmp_path / "b")!r}, frame_stack=4)
        obs = np.zeros((1, 4, 5, 5), np.uint8)
        buf.add(obs, obs, np.array([1]), np.array([1.0]), np.array([False]), [{{}}])
        """)
    assert proc.returncode == 0 and "never closed" not in proc.stderr, proc.stderr
    with ReplayStore.open(tmp_path / "b", mode="r") as reader:
        assert reader.counts.transitions == 1  # closed, so flushed, by the buffer's finalizer
