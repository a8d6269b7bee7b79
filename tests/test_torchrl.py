"""`mmreplay.integrations.torchrl`: the same collector stream through TorchRL's
`LazyMemmapStorage` buffer and through ours, field by field, plus frames-once, priorities,
save/load across processes and refused input.

The stream is a fake collector (numpy): several envs, CatFrames-style 4-stacks padded by
repeating the first frame, random terminations, truncations at a step limit, trajectory
ids and extra entries, cut into ``[envs, T]`` batches whose last dim is named "time".
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrl")
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer  # noqa: E402

from mmreplay.errors import InvalidInputError  # noqa: E402
from mmreplay.integrations.torchrl import (  # noqa: E402
    FrameOnceSampler,
    FrameOnceStorage,
    FrameOnceWriter,
    make_replay_buffer,
)

ROOT = Path(__file__).resolve().parents[1]
K, HW = 4, (6, 6)
OPENED: list[Any] = []


@pytest.fixture(autouse=True)
def _close_buffers() -> Any:
    """Close every buffer a test made (each store flushes and releases its lock)."""
    yield
    while OPENED:
        OPENED.pop().storage.close()


def make_rb(*args: Any, **kwargs: Any) -> Any:
    rb = make_replay_buffer(*args, **kwargs)
    OPENED.append(rb)
    return rb


class FakeCollector:
    """Batches of ``num_envs`` envs as TorchRL's collector marks them (see the module doc)."""

    def __init__(self, num_envs: int, *, seed: int = 0, max_len: int = 9,
                 p_terminate: float = 0.08, stacked: bool = True, zeros: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.zeros = zeros  # CatFrames(padding="constant"): zeros before o_0
        self.n, self.max_len, self.p, self.stacked = num_envs, max_len, p_terminate, stacked
        self.next_traj = 0
        self.frames = [self._start(e) for e in range(num_envs)]
        self.traj = np.arange(num_envs)
        self.next_traj = num_envs
        self.count = np.zeros(num_envs, np.int64)
        self.frames_made = num_envs

    def _start(self, env: int) -> list[np.ndarray]:
        o0 = self.rng.integers(1, 256, HW, dtype=np.uint8)
        return [np.zeros_like(o0)] * (K - 1) + [o0] if self.zeros else [o0] * K

    def _pixels(self, frames: list[np.ndarray]) -> np.ndarray:
        return np.stack(frames) if self.stacked else frames[-1][None]

    def batch(self, steps: int) -> TensorDict:
        cols: dict[Any, list[np.ndarray]] = {}
        for env in range(self.n):
            for name, value in self._env_steps(env, steps).items():
                cols.setdefault(name, []).append(value)
        data = {key: torch.from_numpy(np.stack(v)) for key, v in cols.items()}
        td = TensorDict(batch_size=[self.n, steps])
        for key, value in data.items():
            td.set(key, value)
        td.refine_names(None, "time")
        return td

    def _env_steps(self, env: int, steps: int) -> dict[Any, np.ndarray]:
        rows: dict[Any, list[np.ndarray]] = {}
        for _ in range(steps):
            for key, value in self._step(env).items():
                rows.setdefault(key, []).append(value)
        return {key: np.stack(v) for key, v in rows.items()}

    def _step(self, env: int) -> dict[Any, np.ndarray]:
        rng, frames = self.rng, self.frames[env]
        new = rng.integers(0, 256, HW, dtype=np.uint8)
        self.frames_made += 1
        self.count[env] += 1
        term = bool(rng.random() < self.p)
        trunc = not term and self.count[env] >= self.max_len
        nxt = frames[1:] + [new]
        step = {
            "pixels": self._pixels(frames), ("next", "pixels"): self._pixels(nxt),
            "action": np.int64(rng.integers(0, 6)),
            "action_value": rng.standard_normal(6).astype(np.float32),
            ("next", "reward"): rng.standard_normal(1).astype(np.float32),
            ("next", "terminated"): np.array([term]), ("next", "truncated"): np.array([trunc]),
            ("next", "done"): np.array([term or trunc]),
            "done": np.array([False]), "terminated": np.array([False]),
            "truncated": np.array([False]),
            ("collector", "traj_ids"): np.int64(self.traj[env]),
            ("next", "step_count"): np.array([self.count[env]], np.int64),
        }
        if term or trunc:
            self.frames[env] = self._start(env)
            self.frames_made += 1
            self.traj[env], self.next_traj = self.next_traj, self.next_traj + 1
            self.count[env] = 0
        else:
            self.frames[env] = nxt
        return step


def both(tmp_path: Path, num_envs: int = 3, batches: int = 6, steps: int = 8, *,
         zeros: bool = False, **kw: Any) -> tuple[Any, Any, dict[int, int], FakeCollector]:
    """Our buffer and TorchRL's, fed the same stream; our id -> their index."""
    ours = make_rb(tmp_path / "rb", 10_000, batch_size=16, frame_stack=K, seed=1,
                              **kw)
    theirs = TensorDictReplayBuffer(storage=LazyMemmapStorage(10_000, scratch_dir=tmp_path / "m"),
                                    batch_size=16)
    fake = FakeCollector(num_envs, stacked=kw.get("stacked", True), zeros=zeros)
    to_theirs: dict[int, int] = {}
    for _ in range(batches):
        td = fake.batch(steps)
        a = ours.extend(td.clone())
        b = theirs.extend(td.clone().reshape(-1))
        to_theirs.update(zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), strict=True))
    return ours, theirs, to_theirs, fake


def assert_same(sample: TensorDict, theirs: Any, to_theirs: dict[int, int]) -> None:
    index = torch.tensor([to_theirs[i] for i in sample["index"].tolist()])
    want = theirs.storage[index]
    keys = set(want.keys(True, True)) - {"index"}
    assert keys <= set(sample.keys(True, True)), keys - set(sample.keys(True, True))
    for key in keys:
        got = sample.get(key)
        assert got.dtype == want.get(key).dtype, key
        assert torch.equal(got, want.get(key)), key


def test_every_sampled_field_equals_lazy_memmap(tmp_path: Path) -> None:
    ours, theirs, to_theirs, _ = both(tmp_path)
    assert len(ours) == len(theirs) == 3 * 6 * 8
    seen = Counter()
    for _ in range(40):
        td = ours.sample()
        assert_same(td, theirs, to_theirs)
        seen.update(td["next", "done"].reshape(-1).tolist())
        seen.update(f"term{x}" for x in td["next", "terminated"].reshape(-1).tolist())
    assert seen[True] > 0 and seen["termTrue"] > 0  # episode edges were sampled


@pytest.mark.parametrize("capacity", [45, 61])
def test_a_wrapped_store_samples_only_kept_transitions_exactly(tmp_path: Path,
                                                               capacity: int) -> None:
    ours = make_rb(tmp_path / "rb", capacity, batch_size=16, frame_stack=K)
    theirs = TensorDictReplayBuffer(storage=LazyMemmapStorage(10_000), batch_size=16)
    fake, to_theirs = FakeCollector(3, seed=9), {}
    for _ in range(6):
        td = fake.batch(8)
        a, b = ours.extend(td.clone()), theirs.extend(td.clone().reshape(-1))
        to_theirs.update(zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), strict=True))
    kept = ours.storage.store.valid_ids()
    assert 0 < len(ours) == kept.size < capacity and kept.min() > 3 * 8  # old ones evicted
    for _ in range(10):
        td = ours.sample()
        assert set(td["index"].tolist()) <= set(kept.tolist())
        assert_same(td, theirs, to_theirs)


def test_zero_padded_stacks_are_detected_and_exact(tmp_path: Path) -> None:
    ours, theirs, to_theirs, _ = both(tmp_path, zeros=True)
    assert ours.storage.store.spec.stack_padding == "zero"
    for _ in range(10):
        assert_same(ours.sample(), theirs, to_theirs)


def test_single_frames_are_stacked_on_sample(tmp_path: Path) -> None:
    ours, theirs, to_theirs, _ = both(tmp_path, stacked=False)
    td = ours.sample()
    assert td["pixels"].shape == (16, K, *HW)
    index = torch.tensor([to_theirs[i] for i in td["index"].tolist()])
    want = theirs.storage[index]
    # the newest frame of our rebuilt stack is the frame TorchRL stored
    assert torch.equal(td["pixels"][:, -1], want["pixels"][:, 0])
    assert torch.equal(td["next", "pixels"][:, -1], want["next", "pixels"][:, 0])


def test_flat_one_env_batches(tmp_path: Path) -> None:
    ours = make_rb(tmp_path / "rb", 1000, batch_size=8, frame_stack=K)
    theirs = TensorDictReplayBuffer(storage=LazyMemmapStorage(1000), batch_size=8)
    fake, to_theirs = FakeCollector(1, seed=3), {}
    for _ in range(5):
        td = fake.batch(10).reshape(-1)
        a, b = ours.extend(td.clone()), theirs.extend(td.clone())
        to_theirs.update(zip(a.tolist(), b.tolist(), strict=True))
    for _ in range(10):
        assert_same(ours.sample(), theirs, to_theirs)


@pytest.mark.parametrize("layout", ["time_first_named", "time_first_unnamed", "flat_envs"])
def test_other_batch_layouts_sample_equal_fields(tmp_path: Path, layout: str) -> None:
    kw = {"time_dim": 0} if layout == "time_first_unnamed" else {"num_envs": 3}
    ours = make_rb(tmp_path / "rb", 10_000, batch_size=16, frame_stack=K, **kw)
    theirs = TensorDictReplayBuffer(storage=LazyMemmapStorage(10_000), batch_size=16)
    fake, to_theirs = FakeCollector(3, seed=4), {}
    for _ in range(5):
        td = fake.batch(8)
        if layout == "flat_envs":
            td = td.reshape(-1)  # env-major, as dqn_atari.py flattens: traj ids tell envs apart
        else:
            td = td.permute(1, 0)  # [T, envs]
            if layout == "time_first_unnamed":
                td.names = None
        a, b = ours.extend(td.clone()), theirs.extend(td.clone().reshape(-1))
        assert a.shape == td.shape
        to_theirs.update(zip(a.reshape(-1).tolist(), b.reshape(-1).tolist(), strict=True))
    assert ours.storage.store.counts.transitions == 3 * 5 * 8
    for _ in range(10):
        assert_same(ours.sample(), theirs, to_theirs)


def test_flat_batch_of_several_envs_needs_num_envs(tmp_path: Path) -> None:
    rb = make_rb(tmp_path / "rb", 1000, batch_size=4, frame_stack=K)
    with pytest.raises(InvalidInputError, match="needs num_envs=<envs>"):
        rb.extend(FakeCollector(2, seed=7).batch(6).reshape(-1))
    assert len(rb) == 0


def test_frames_are_stored_once(tmp_path: Path) -> None:
    ours = make_rb(tmp_path / "rb", 10_000, batch_size=16, frame_stack=K)
    fake, distinct, stacks = FakeCollector(3, seed=11), set(), 0
    for _ in range(6):
        td = fake.batch(8)
        ours.extend(td)
        for key in ("pixels", ("next", "pixels")):
            frames = td.get(key).reshape(-1, *HW).numpy()
            distinct.update(f.tobytes() for f in frames)
            stacks += td.get(key).shape[0] * td.get(key).shape[1]
    counts = ours.storage.store.counts
    assert counts.transitions == 3 * 6 * 8
    assert counts.frames_written == len(distinct)  # each distinct frame of the stream once
    assert counts.frames_written < stacks * K / 6  # LazyMemmapStorage keeps stacks * K


def test_prioritized_update_changes_the_distribution(tmp_path: Path) -> None:
    ours, _, _, _ = both(tmp_path, sampler="prioritized", alpha=1.0)
    td = ours.sample()
    assert "priority_weight" in td.keys()
    favourite = int(td["index"][0])
    ids = ours.storage.store.valid_ids()
    ours.update_priority(torch.from_numpy(ids), torch.full((ids.size,), 1e-3))
    ours.update_priority(torch.tensor([favourite]), torch.tensor([1e3]))
    drawn = torch.cat([ours.sample()["index"] for _ in range(20)])
    assert (drawn == favourite).float().mean() > 0.9
    td = ours.sample()
    td.set("td_error", torch.ones(16))
    ours.update_tensordict_priority(td)  # reaches the store: favourite no longer dominates
    ours.update_priority(torch.tensor([favourite]), torch.tensor([1e-3]))
    drawn = torch.cat([ours.sample()["index"] for _ in range(20)])
    assert (drawn == favourite).float().mean() < 0.5


def test_prefetch_samples_are_exact(tmp_path: Path) -> None:
    ours, theirs, to_theirs, _ = both(tmp_path, prefetch=3)
    for _ in range(10):
        assert_same(ours.sample(), theirs, to_theirs)


RESUME = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    from mmreplay.integrations.torchrl import make_replay_buffer
    sys.path.insert(0, {tests!r})
    from test_torchrl import FakeCollector
    rb = make_replay_buffer({path!r}, 10_000, batch_size=8, frame_stack=4, seed=2,
                            sampler="prioritized", prefetch=2)
    fake = FakeCollector(2, seed=5)
    for _ in range(4):
        rb.extend(fake.batch(8))
    rb.update_priority(torch.arange(10), torch.linspace(0.1, 5, 10))
    rb.sample()  # fills the prefetch queue
    rb.dumps({ckpt!r})
    after = [rb.sample()["index"].tolist() for _ in range(3)]
    ids = rb.storage.store.valid_ids()
    everything = rb.storage.get(torch.from_numpy(ids))
    json.dump({{"after": after, "len": len(rb), "writes": rb.write_count, "ids": ids.tolist(),
               "pixels": int(everything["pixels"].sum()),
               "next_pixels": int(everything["next", "pixels"].sum()),
               "counts": list(rb.storage.store.counts.__dict__.values())}},
              open({out!r}, "w"))
    rb.extend(fake.batch(8))  # added after the save, never flushed
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.integration
def test_killed_after_save_resumes_with_same_contents(tmp_path: Path) -> None:
    path, ckpt, out = tmp_path / "rb", tmp_path / "ckpt", tmp_path / "out.json"
    code = RESUME.format(tests=str(ROOT / "tests"), path=str(path), ckpt=str(ckpt),
                         out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT)}, timeout=120, check=False)
    assert proc.returncode == -9, proc.stderr
    before = json.loads(out.read_text())
    assert not list(ckpt.rglob("*.pkl"))  # no pickle in the checkpoint
    rb = make_rb(path, 10_000, batch_size=8, frame_stack=4, sampler="prioritized",
                            prefetch=2)
    rb.loads(ckpt)
    assert len(rb) == before["len"] and rb.write_count == before["writes"] == 4 * 2 * 8
    ids = rb.storage.store.valid_ids()
    assert ids.tolist() == before["ids"]
    everything = rb.storage.get(torch.from_numpy(ids))
    assert int(everything["pixels"].sum()) == before["pixels"]
    assert int(everything["next", "pixels"].sum()) == before["next_pixels"]
    assert list(rb.storage.store.counts.__dict__.values()) == before["counts"]
    assert [rb.sample()["index"].tolist() for _ in range(3)] == before["after"]


def test_state_dict_is_a_pointer_not_frames(tmp_path: Path) -> None:
    ours, theirs, to_theirs, _ = both(tmp_path, batches=2)
    state = ours.state_dict()
    assert set(state["_storage"]) == {"version", "path", "generation", "transitions"}
    ours.storage.close()
    fresh = make_rb(tmp_path / "other", 10_000, batch_size=16, frame_stack=K)
    fresh.load_state_dict(state)
    assert len(fresh) == 3 * 2 * 8
    assert_same(fresh.sample(), theirs, to_theirs)


def bad_batch(change: str) -> TensorDict:
    td = FakeCollector(2, seed=7).batch(6)
    if change == "not_shifted":
        td["next", "pixels"][0, 2] = 0
    elif change == "not_padded":
        td["pixels"][1, 0, 0] = td["pixels"][1, 0, 0] ^ 1
    elif change == "done":
        td["next", "done"][0, 1] = ~td["next", "done"][0, 1]
    elif change == "shape":
        td.set("pixels", td["pixels"][..., :3, :], inplace=False)
    return td


@pytest.mark.parametrize(("change", "message"), [
    ("not_shifted", "not pixels shifted by one frame"),
    ("not_padded", "not a first stack padded"),
    ("done", "('next', 'done') != terminated | truncated"),
])
def test_refused_streams_say_what_was_expected(tmp_path: Path, change: str,
                                               message: str) -> None:
    rb = make_rb(tmp_path / "rb", 1000, batch_size=4, frame_stack=K,
                            stack_padding="first")
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("|", r"\|")):
        rb.extend(bad_batch(change))
    rb.extend(bad_batch("none"))  # a refused batch changed nothing
    assert len(rb) == 12


def test_refused_rewards_say_what_the_store_keeps(tmp_path: Path) -> None:
    td = bad_batch("none")
    td.set(("next", "reward"), td["next", "reward"].double())
    rb = make_rb(tmp_path / "rb", 1000, batch_size=4, frame_stack=K)
    with pytest.raises(InvalidInputError, match=r"one float32 per step .* got per-step \(1,\) "
                                                r"float64"):
        rb.extend(td)


def test_refused_shapes_and_env_counts(tmp_path: Path) -> None:
    rb = make_rb(tmp_path / "rb", 1000, batch_size=4, frame_stack=K)
    rb.extend(bad_batch("none"))
    td = FakeCollector(3, seed=7).batch(6)
    with pytest.raises(InvalidInputError, match="3 env rows, expected num_envs=2"):
        rb.extend(td)
    small = FakeCollector(2, seed=7).batch(6)
    small.set("action_value", torch.zeros(2, 6, 5))
    with pytest.raises(InvalidInputError, match=r"per-step shape \(5,\) != expected \(6,\)"):
        rb.extend(small)
    with pytest.raises(InvalidInputError, match="frame_stack=3"):
        make_rb(tmp_path / "r3", 1000, batch_size=4, frame_stack=3).extend(
            bad_batch("none"))


def test_reopening_with_other_settings_is_refused(tmp_path: Path) -> None:
    ours, _, _, _ = both(tmp_path, batches=1)
    ours.storage.close()
    with pytest.raises(InvalidInputError, match="sampling 'uniform', expected max_size 10000 "
                                                "sampling 'prioritized'"):
        make_rb(tmp_path / "rb", 10_000, batch_size=16, sampler="prioritized")
    with pytest.raises(InvalidInputError, match="capacity 10000 .* expected max_size 500"):
        make_rb(tmp_path / "rb", 500, batch_size=16)
    assert len(make_rb(tmp_path / "rb", 10_000, batch_size=16)) == 3 * 8


@pytest.mark.integration
def test_torchrl_dqn_script_help_and_refused_second_run(tmp_path: Path) -> None:
    def dqn(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "torchrl_dqn.py"),
                               *args], capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                              check=False)

    shown = dqn("--help")
    assert shown.returncode == 0
    for flag in ("--total-frames", "--learning-starts", "--prefetch", "--resume", "--overwrite"):
        assert flag in shown.stdout
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "something").write_text("x")
    refused = dqn("--run-dir", str(tmp_path / "run"))
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_the_pieces_in_torchrl_s_own_buffer(tmp_path: Path) -> None:
    storage = FrameOnceStorage(tmp_path / "rb", 1000, frame_stack=K)
    rb = TensorDictReplayBuffer(storage=storage, sampler=FrameOnceSampler(),
                                writer=FrameOnceWriter(), batch_size=4, collate_fn=lambda x: x)
    rb.extend(bad_batch("none"))
    assert rb.sample()["pixels"].shape == (4, K, *HW) and rb.write_count == 12
    storage.close()


def test_torchrl_s_own_writer_and_sampler_are_refused(tmp_path: Path) -> None:
    storage = FrameOnceStorage(tmp_path / "rb", 1000, frame_stack=K)
    plain = TensorDictReplayBuffer(storage=storage, batch_size=4, collate_fn=lambda x: x)
    with pytest.raises(NotImplementedError, match="written by extend"):
        plain.extend(bad_batch("none"))
    ours = TensorDictReplayBuffer(storage=storage, writer=FrameOnceWriter(), batch_size=4,
                                  collate_fn=lambda x: x)
    ours.extend(bad_batch("none"))
    with pytest.raises(NotImplementedError, match="sampled by FrameOnceSampler"):
        ours.sample()  # TorchRL's RandomSampler draws positions, not transition ids
    storage.close()


@pytest.mark.integration
def test_torchrl_dqn_script_learns_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("ale_py")
    run = tmp_path / "run"
    tiny = ["--total-frames", "300", "--frames-per-batch", "100", "--learning-starts", "200",
            "--num-updates", "2", "--batch-size", "8", "--buffer-size", "2000",
            "--run-dir", str(run)]

    def dqn(*extra: str) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "torchrl_dqn.py"), *tiny,
                               *extra], capture_output=True, text=True, timeout=120,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                              check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = dqn()
    assert first["steps"] == 300 and first["updates"] == 4 and first["transitions"] == 300
    assert first["frames_written"] == 300 + first["episodes"] + 1  # o_0 of each episode once
    assert (run / "rb_ckpt" / "storage" / "frame_once.json").exists()
    assert not list((run / "rb_ckpt").rglob("*.pkl"))
    again = dqn("--resume")
    assert again["transitions"] == 600  # the store resumed with the first run's 300
    # the first run's unfinished episode reads as truncated; the new one starts with its o_0
    assert again["frames_written"] == 600 + first["episodes"] + again["episodes"] + 2
