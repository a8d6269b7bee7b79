"""Dopamine checkpoints (DQN Replay Dataset format) -> store, against naive references.

The checkpoints are written from real ALE frames by `dopamine_format.DopamineBuffer`,
which follows Dopamine's ``add`` record by record. Every imported transition is compared
with (1) the episodes cut naively from the unrolled arrays and (2) for every index
Dopamine itself would sample, Dopamine's own state, action, n-step reward, terminal and
next state.
"""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npy_format

pytest.importorskip("ale_py")
pytest.importorskip("cv2")

from dopamine_format import DopamineBuffer, episode_records, write_npy_gz  # noqa: E402

from mmreplay import DatasetFormatError, InvalidInputError, ReplayStore  # noqa: E402
from mmreplay.datasets.dopamine import import_dopamine  # noqa: E402
from mmreplay.tools.cli import main  # noqa: E402
from mmreplay.tools.cli_datasets import parse_checkpoints  # noqa: E402

pytestmark = pytest.mark.integration  # real ALE frames through Dopamine's format, 20-30 s

ROOT = Path(__file__).resolve().parents[1]
FRAMES = 1500
STACK = 4


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list:
    import sys
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import ale_frames
    finally:
        sys.path.remove(str(ROOT / "scripts" / "bench"))
    rec = ale_frames.record_frames("ALE/Breakout-v5", FRAMES, seed=5,
                                   cache_dir=tmp_path_factory.mktemp("ale"))
    out = episode_records(rec.frames, rec.is_first, rec.actions, rec.rewards, rec.terminated,
                          rec.truncated)
    assert sum(r[3] for r in out) >= 4  # several finished episodes
    return out


def fill(records: list, capacity: int, *, n_step: int = 1, count: int | None = None
         ) -> DopamineBuffer:
    buf = DopamineBuffer(capacity, (84, 84), stack_size=STACK, update_horizon=n_step)
    for obs, a, r, t in records[:count]:
        buf.add(obs, a, r, t)
    return buf


def linear_kinds(records: list) -> list[str]:
    """Kind of every record Dopamine adds, in add order: pad, first, step or terminal."""
    kinds, after_end = [], True
    for _, _, _, t in records:
        if after_end:
            kinds += ["pad"] * (STACK - 1)
        kinds.append("terminal" if t else ("first" if after_end else "step"))
        after_end = t
    return kinds


def capacity_where_oldest_is(records: list, kind: str, before: str, near: int) -> int:
    """A capacity (close to `near`) whose wrapped buffer's oldest record is of `kind` and
    the record overwritten just before it of kind `before`."""
    kinds = linear_kinds(records)
    total = len(kinds)
    for capacity in range(near, 50, -1):
        if kinds[total - capacity] == kind and kinds[total - capacity - 1] == before:
            return capacity
    raise AssertionError(f"no capacity puts a {kind} record first")


# -- the naive reference ------------------------------------------------------------------
def unrolled(buf: DopamineBuffer) -> list[int]:
    start = buf.cursor() if buf.is_full() else 0
    return [(start + i) % buf.capacity for i in range(min(buf.add_count, buf.capacity))]


def expected_episodes(buf: DopamineBuffer) -> list[dict]:
    """Cut at terminals, strip up to STACK-1 leading zero records, then frames and steps."""
    order = unrolled(buf)
    cuts = [k + 1 for k, i in enumerate(order) if buf.terminal[i]]
    segments = [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    episodes = []
    for seg in segments:
        for _ in range(STACK - 1):
            if seg and not (buf.observation[seg[0]].any() or buf.action[seg[0]]
                            or buf.reward[seg[0]] or buf.terminal[seg[0]]):
                seg = seg[1:]
        ended = bool(seg) and bool(buf.terminal[seg[-1]])
        steps = seg if ended else seg[:-1]
        if not steps:
            continue
        frames = [buf.observation[i] for i in seg]
        if ended:
            frames.append(np.zeros_like(frames[0]))
        episodes.append({"frames": frames, "steps": steps, "terminated": ended})
    return episodes


def expected_transitions(buf: DopamineBuffer, n_step: int, gamma: float = 0.99) -> dict:
    """Every transition the import must hold, in insertion order, with its record index."""
    out: dict[str, list] = {k: [] for k in ("record", "obs", "next_obs", "action", "reward",
                                            "terminated", "truncated", "discount")}
    for ep in expected_episodes(buf):
        frames, steps, length = ep["frames"], ep["steps"], len(ep["steps"])

        def stack(t: int, frames: list = frames) -> np.ndarray:
            return np.stack([frames[u] if u >= 0 else np.zeros_like(frames[0])
                             for u in range(t - STACK + 1, t + 1)])

        for t, record in enumerate(steps):
            m = min(n_step, length - t)
            end = t + m == length
            out["record"].append(record)
            out["obs"].append(stack(t))
            out["next_obs"].append(stack(t + m))
            out["action"].append(int(buf.action[record]))
            out["reward"].append(sum(gamma ** j * float(buf.reward[steps[t + j]])
                                     for j in range(m)))
            out["terminated"].append(end and ep["terminated"])
            out["truncated"].append(end and not ep["terminated"])
            out["discount"].append(0.0 if end and ep["terminated"] else gamma ** m)
    return out


def concat(parts: list[dict]) -> dict:
    return {k: [v for p in parts for v in p[k]] for k in parts[0]}


def assert_import_matches(store: ReplayStore, bufs: list[DopamineBuffer], n_step: int) -> None:
    want = concat([expected_transitions(b, n_step) for b in bufs])
    ids = store.valid_ids()
    assert ids.tolist() == list(range(len(want["record"])))  # every step, all sampleable
    got = store.get(ids)
    np.testing.assert_array_equal(got.obs.numpy(), np.stack(want["obs"]))
    np.testing.assert_array_equal(got.next_obs.numpy(), np.stack(want["next_obs"]))
    assert got.action.tolist() == want["action"]
    np.testing.assert_allclose(got.reward.numpy(), want["reward"], rtol=1e-6, atol=1e-6)
    assert got.terminated.tolist() == want["terminated"]
    assert got.truncated.tolist() == want["truncated"]
    np.testing.assert_allclose(got.discount.numpy(), want["discount"], rtol=1e-6)
    # Dopamine's own view, for the last checkpoint: every index it would sample is here
    buf, first = bufs[-1], len(want["record"]) - len(expected_transitions(bufs[-1], n_step)
                                                     ["record"])
    where = {r: first + j for j, r in enumerate(want["record"][first:])}
    valid = buf.valid_indices()
    assert len(valid) > 100
    for index in valid:
        d, j = buf.transition(index), where[index]
        np.testing.assert_array_equal(got.obs[j].numpy(), d.state)
        np.testing.assert_array_equal(got.next_obs[j].numpy(), d.next_state)
        assert got.action[j].item() == d.action
        assert got.reward[j].item() == pytest.approx(d.reward, rel=1e-6, abs=1e-6)
        assert got.terminated[j].item() == d.terminal == (got.discount[j].item() == 0)


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("oldest", "before"), [
    ("step", "step"),      # the oldest episode starts mid-way
    ("pad", "terminal"),   # all of the next episode's padding is there
    ("pad", "pad"),        # only part of it
    ("first", "pad"),      # none of it
    ("terminal", "step"),  # the oldest episode is a single terminal record
])
def test_wrapped_checkpoint_equals_dopamine_semantics(records: list, tmp_path: Path,
                                                      oldest: str, before: str) -> None:
    capacity = capacity_where_oldest_is(records, oldest, before, near=997)
    buf = fill(records, capacity)
    assert buf.is_full() and buf.add_count > capacity
    buf.save(tmp_path / "logs", 0)
    summary = import_dopamine(tmp_path / "logs", tmp_path / "store")
    with ReplayStore.open(tmp_path / "store", mode="r") as store:
        assert store.spec.frame_stack == STACK and store.spec.obs_shape == (84, 84)
        assert_import_matches(store, [buf], n_step=1)
        assert summary.transitions == store.counts.transitions
    assert summary.records == capacity
    assert summary.truncated == 1  # the newest records end an unfinished episode


@pytest.mark.parametrize("n_step", [1, 3])
def test_partly_filled_checkpoint_and_two_checkpoints(records: list, tmp_path: Path,
                                                      n_step: int) -> None:
    early = fill(records, 4001, n_step=n_step, count=600)   # not full: starts with padding
    assert not early.is_full()
    early.save(tmp_path / "logs", 3)
    late = fill(records, 701, n_step=n_step)                # full and wrapped
    late.save(tmp_path / "logs", 4)
    summary = import_dopamine(tmp_path / "logs", tmp_path / "store", n_step=n_step)
    assert summary.checkpoints == (3, 4)
    assert summary.padding_records >= STACK - 1
    with ReplayStore.open(tmp_path / "store", mode="r") as store:
        assert store.spec.n_step == n_step
        assert_import_matches(store, [early, late], n_step=n_step)


def test_cli_import_dopamine(records: list, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    for number, count in ((0, 300), (1, 500), (2, 700)):
        fill(records, 5000, count=count).save(tmp_path / "logs", number)
    code = main(["import-dopamine", str(tmp_path / "logs"), str(tmp_path / "store"),
                 "--checkpoints", "1-2"])
    assert code == 0, capsys.readouterr().err
    assert "checkpoints 1-2" in capsys.readouterr().out
    (tmp_path / "plain").mkdir()  # the store gets the permissions any new directory gets
    assert (tmp_path / "store").stat().st_mode == (tmp_path / "plain").stat().st_mode
    with ReplayStore.open(tmp_path / "store", mode="r") as store:
        assert_import_matches(store, [fill(records, 5000, count=500),
                                      fill(records, 5000, count=700)], n_step=1)


def test_cli_import_dopamine_into_an_lz4hc_store(records: list, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fill(records, 5000, count=400).save(tmp_path / "logs", 0)
    code = main(["import-dopamine", str(tmp_path / "logs"), str(tmp_path / "store"),
                 "--codec", "lz4hc"])
    assert code == 0, capsys.readouterr().err
    with ReplayStore.open(tmp_path / "store", mode="r") as store:
        assert store.spec.codec == "lz4hc" and store.format_version == 5
        assert_import_matches(store, [fill(records, 5000, count=400)], n_step=1)


def test_parse_checkpoints(tmp_path: Path) -> None:
    assert parse_checkpoints("0-3") == [0, 1, 2, 3]
    assert parse_checkpoints("7") == [7]
    assert parse_checkpoints("1,3,5-6") == [1, 3, 5, 6]
    for bad in ("3-1", "a", "1,,2", "1,1", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_checkpoints(bad)
        assert main(["import-dopamine", str(tmp_path), str(tmp_path / "s"),
                     "--checkpoints", bad]) == 2
    assert main(["import-dopamine", str(tmp_path), str(tmp_path / "s"), "--checkpoints",
                 "4"]) == 2  # no such checkpoint: one error line, nothing made
    assert list(tmp_path.iterdir()) == []


# -- hostile inputs ------------------------------------------------------------------------------
class Canary:
    """Unpickling this would create a file: proof that nothing was unpickled."""

    path = ""

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _pickled(path: Path, canary: Path) -> None:
    Canary.path = str(canary)
    arr = np.empty(3, dtype=object)
    arr[:] = [Canary(), 1, 2]
    with gzip.open(path, "wb") as f:
        np.save(f, arr, allow_pickle=True)


def _raw_pickle(path: Path, canary: Path) -> None:
    Canary.path = str(canary)
    with gzip.open(path, "wb") as f:
        pickle.dump(Canary(), f)


def _truncate(path: Path, _: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])


def _flip(path: Path, _: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _replace(array: np.ndarray):
    def mutate(path: Path, _: Path) -> None:
        write_npy_gz(path, array)
    return mutate


def _huge_header(shape: tuple[int, ...]):
    """A header that claims `shape` with (almost) no data behind it."""
    def mutate(path: Path, _: Path) -> None:
        with gzip.open(path, "wb") as f:
            npy_format.write_array_header_1_0(f, {"descr": "|u1", "fortran_order": False,
                                                  "shape": shape})
            f.write(b"\0" * 100)
    return mutate


def _extra_rows(path: Path, _: Path) -> None:
    with gzip.open(path, "rb") as f:
        data = f.read()
    with gzip.open(path, "wb") as f:
        f.write(data + b"\0" * 7056)


def _fifo(path: Path, _: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _symlink(path: Path, _: Path) -> None:
    target = path.with_name("elsewhere.gz")
    path.rename(target)
    path.symlink_to(target)


C = 301
HOSTILE = {
    "pickled observation": ("$store$_observation", _pickled, "object"),
    "pickled action": ("$store$_action", _pickled, "object"),
    "raw pickle add_count": ("add_count", _raw_pickle, "does not hold a .npy"),
    "truncated observation gzip": ("$store$_observation", _truncate, "truncated|ends early"),
    "flipped byte in observation": ("$store$_observation", _flip, "corrupt|truncated|ends"),
    "truncated terminal gzip": ("$store$_terminal", _truncate, "truncated|ends early"),
    "float64 actions": ("$store$_action", _replace(np.zeros(C)), "expected int32"),
    "int64 actions": ("$store$_action", _replace(np.zeros(C, np.int64)), "expected int32"),
    "big-endian rewards": ("$store$_reward", _replace(np.zeros(C, ">f4")), "expected float32"),
    "short rewards": ("$store$_reward", _replace(np.zeros(C - 1, np.float32)), "records"),
    "2-d terminals": ("$store$_terminal", _replace(np.zeros((C, 2), np.uint8)), "dimension"),
    "float observation": ("$store$_observation", _replace(np.zeros((C, 84, 84), np.float32)),
                          "expected uint8"),
    "1-d observation": ("$store$_observation", _replace(np.zeros(C, np.uint8)),
                        "expected uint8"),
    "fortran observation": ("$store$_observation",
                            _replace(np.asfortranarray(np.zeros((C, 8, 9), np.uint8))),
                            "fortran"),
    "structured rewards": ("$store$_reward", _replace(np.zeros(C, [("a", "<f4")])), "plain"),
    "terminal value 2": ("$store$_terminal", _replace(np.full(C, 2, np.uint8)), "0 or 1"),
    "NaN reward": ("$store$_reward", _replace(np.full(C, np.nan, np.float32)), "NaN"),
    "negative add_count": ("add_count", _replace(np.array(-5)), "non-negative"),
    "float add_count": ("add_count", _replace(np.array(5.0)), "integer"),
    "invalid_range outside": ("invalid_range", _replace(np.array([0, C + 3])), "outside"),
    "huge frames in the header": ("$store$_observation", _huge_header((C, 1 << 20, 1 << 20)),
                                  "at most"),
    "huge record count": ("$store$_observation", _huge_header((1 << 40, 84, 84)), "at most"),
    "extra observation rows": ("$store$_observation", _extra_rows, "more data"),
    "missing reward file": ("$store$_reward", lambda p, _: p.unlink(), "missing"),
    "FIFO observation": ("$store$_observation", _fifo, "FIFO"),
    "symlinked action": ("$store$_action", _symlink, "symlink"),
}


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_checkpoint_is_refused_cleanly(records: list, tmp_path: Path,
                                               case: str) -> None:
    name, mutate, message = HOSTILE[case]
    logs = tmp_path / "logs"
    fill(records, C, count=900).save(logs, 0)
    canary = tmp_path / "canary"
    mutate(logs / f"{name}_ckpt.0.gz", canary)
    before = tree(tmp_path)
    with pytest.raises(DatasetFormatError, match=message):
        import_dopamine(logs, tmp_path / "store")
    assert not canary.exists()
    assert tree(tmp_path) == before  # no store, no partial directory, nothing touched
    assert main(["import-dopamine", str(logs), str(tmp_path / "store")]) == 2
    assert tree(tmp_path) == before


def test_target_that_exists_is_refused(records: list, tmp_path: Path) -> None:
    fill(records, C, count=400).save(tmp_path / "logs", 0)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "mine.txt").write_text("keep me")
    with pytest.raises(InvalidInputError, match="already exists"):
        import_dopamine(tmp_path / "logs", tmp_path / "store")
    assert (tmp_path / "store" / "mine.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "store"]
