"""Minari export and import: round trips are identical, frames bit-exact, failures clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

minari = pytest.importorskip("minari")
pytest.importorskip("ale_py")
pytest.importorskip("cv2")

import gymnasium as gym  # noqa: E402
from minari.data_collector import EpisodeBuffer  # noqa: E402
from store_compare import assert_stores_equal  # noqa: E402

from mmreplay import DatasetFormatError, InvalidInputError, ReplayStore  # noqa: E402
from mmreplay.datasets.episodes import read_episodes  # noqa: E402
from mmreplay.datasets.minari import export_minari, import_minari  # noqa: E402
from mmreplay.tools.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning:minari.utils"),
    pytest.mark.integration,  # real ALE frames through Minari's format, 10-20 s in all
]


@pytest.fixture(autouse=True)
def minari_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


@pytest.fixture(scope="module")
def breakout(tmp_path_factory: pytest.TempPathFactory):
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import ale_frames
    finally:
        sys.path.remove(str(ROOT / "scripts" / "bench"))
    return ale_frames.record_frames("ALE/Breakout-v5", 1200, seed=2,
                                    cache_dir=tmp_path_factory.mktemp("ale"))


def breakout_store(rec, path: Path, **kw) -> ReplayStore:
    """The recording as a store; its unfinished last episode ends truncated."""
    kw = {"capacity": 2000, "obs_shape": (84, 84), "frame_stack": 4, "n_step": 3,
          "seed": 0, **kw}
    store = ReplayStore.create(path, **kw)
    last = len(rec) - 1
    for i in range(len(rec)):
        if rec.is_first[i]:
            store.reset(rec.frames[i])
        else:
            store.add(rec.actions[i], rec.rewards[i], rec.frames[i], rec.terminated[i],
                      rec.truncated[i] or i == last)
    return store


def test_store_to_minari_to_store_is_identical(breakout, tmp_path: Path) -> None:
    store = breakout_store(breakout, tmp_path / "a")
    done = export_minari(store, "breakout/random-v0", env_id="ALE/Breakout-v5",
                         batch_frames=500)  # several batches
    episodes = list(read_episodes(store))
    assert done.episodes == len(episodes) >= 4
    assert done.steps == store.counts.transitions

    data = minari.load_dataset("breakout/random-v0")
    assert data.total_episodes == len(episodes)
    meta = data.storage.metadata["mmreplay"]
    assert meta["frame_stack"] == 4 and meta["env_id"] == "ALE/Breakout-v5"
    for ours, theirs in zip(episodes, data.iterate_episodes(), strict=True):
        assert theirs.observations.shape == (len(ours) + 1, 84, 84)
        assert theirs.observations.dtype == np.uint8
        np.testing.assert_array_equal(theirs.observations, ours.observations)  # bit-exact
        np.testing.assert_array_equal(theirs.actions, ours.actions)
        np.testing.assert_array_equal(theirs.rewards, ours.rewards)
        np.testing.assert_array_equal(theirs.terminations, ours.terminations)
        np.testing.assert_array_equal(theirs.truncations, ours.truncations)
    statuses = {bool(e.terminations[-1]) for e in episodes}
    assert statuses == {True, False}  # terminated and truncated episodes both travel

    back = import_minari("breakout/random-v0", tmp_path / "b", capacity=2000, seed=0)
    assert back.episodes == len(episodes)
    with ReplayStore.open(tmp_path / "b", mode="r") as again:
        assert again.spec.frame_stack == 4 and again.spec.n_step == 3
        assert_stores_equal(store, again)


def rgb_dataset(dataset_id: str) -> list[EpisodeBuffer]:
    """Real 210x160x3 ALE frames (as hosted Atari datasets hold), episodes cut short."""
    env = gym.make("ALE/Pong-v5", max_episode_steps=30)
    rng = np.random.default_rng(0)
    buffers = []
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        frames, acts, rews, terms, truncs = [obs], [], [], [], []
        while not (terms and (terms[-1] or truncs[-1])):
            a = int(rng.integers(env.action_space.n))
            obs, r, term, trunc, _ = env.step(a)
            frames.append(obs)
            acts.append(a)
            rews.append(r)
            terms.append(term)
            truncs.append(trunc)
        buffers.append(EpisodeBuffer(observations=np.stack(frames), actions=np.array(acts),
                                     rewards=np.array(rews), terminations=np.array(terms),
                                     truncations=np.array(truncs)))
    minari.create_dataset_from_buffers(dataset_id, buffers, env=None,
                                       observation_space=env.observation_space,
                                       action_space=env.action_space, jpeg_encoding=False)
    return buffers


def assert_same_datasets(a: str, b: str) -> None:
    da, db = minari.load_dataset(a), minari.load_dataset(b)
    assert da.total_episodes == db.total_episodes and da.total_steps == db.total_steps
    assert da.observation_space == db.observation_space
    for x, y in zip(da.iterate_episodes(), db.iterate_episodes(), strict=True):
        for field in ("observations", "actions", "rewards", "terminations", "truncations"):
            np.testing.assert_array_equal(getattr(x, field), getattr(y, field), field)


def test_minari_to_store_to_minari_is_identical_with_rgb_frames(tmp_path: Path) -> None:
    buffers = rgb_dataset("pong/raw-v0")
    done = import_minari("pong/raw-v0", tmp_path / "store")
    assert done.episodes == 3 and done.steps == sum(len(b.rewards) for b in buffers)
    with ReplayStore.open(tmp_path / "store", mode="r") as store:
        assert store.spec.obs_shape == (210, 160, 3) and store.spec.frame_stack == 1
        export_minari(store, "pong/again-v0", num_actions=6)
    assert_same_datasets("pong/raw-v0", "pong/again-v0")


def test_float_observations_and_box_actions_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    obs_space = gym.spaces.Box(-np.inf, np.inf, (5,), np.float32)
    act_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    buffers = []
    for length in (4, 9, 1):
        buffers.append(EpisodeBuffer(
            observations=rng.normal(size=(length + 1, 5)).astype(np.float32),
            actions=rng.uniform(-1, 1, (length, 2)).astype(np.float32),
            rewards=rng.normal(size=length).astype(np.float32),
            terminations=np.arange(length) == length - 1, truncations=np.zeros(length, bool)))
    minari.create_dataset_from_buffers("vec/x-v1", buffers, env=None,
                                       observation_space=obs_space, action_space=act_space)
    import_minari("vec/x-v1", tmp_path / "store", frame_stack=2)
    with ReplayStore.open(tmp_path / "store", mode="r") as store:
        assert np.dtype(store.spec.obs_dtype) == np.float32 and store.spec.action_shape == (2,)
        export_minari(store, "vec/y-v1")
    assert_same_datasets("vec/x-v1", "vec/y-v1")


def test_multi_env_store_exports_every_env(breakout, tmp_path: Path) -> None:
    store = ReplayStore.create(tmp_path / "s", capacity=600, obs_shape=(84, 84), num_envs=2)
    frames = breakout.frames
    store.reset(frames[:2])
    for t in range(1, 40):
        end = t % 13 == 0
        store.add(np.array([1, 2]), np.array([0.5, 1.0]), frames[2 * t:2 * t + 2],
                  np.array([end, False]), np.array([False, end]),
                  autoreset=np.array([t % 13 == 1 and t > 1] * 2))
    exported = list(read_episodes(store))
    assert {e.env for e in exported} == {0, 1}
    export_minari(store, "multi/envs-v0")
    import_minari("multi/envs-v0", tmp_path / "t")
    with ReplayStore.open(tmp_path / "t", mode="r") as again:
        back = list(read_episodes(again))
    assert len(back) == len(exported)
    for x, y in zip(exported, back, strict=True):
        np.testing.assert_array_equal(x.observations, y.observations)
        np.testing.assert_array_equal(x.actions, y.actions)
        np.testing.assert_array_equal(x.truncations, y.truncations)


def test_failed_export_leaves_no_dataset(breakout, tmp_path: Path, minari_root: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store = breakout_store(breakout, tmp_path / "a")
    calls = []

    def fail(self, buffer):
        calls.append(len(buffer))
        raise OSError("disk full (injected)")

    monkeypatch.setattr(minari.MinariDataset, "update_dataset_from_buffer", fail)
    with pytest.raises(OSError, match="injected"):
        export_minari(store, "breakout/half-v0", batch_frames=300)
    assert calls
    assert not (minari_root / "breakout" / "half-v0").exists()
    monkeypatch.undo()
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(minari_root))
    export_minari(store, "breakout/half-v0")  # the id is free again
    assert minari.load_dataset("breakout/half-v0").total_episodes >= 4


def test_export_refuses_bad_ids_and_empty_stores(breakout, tmp_path: Path) -> None:
    store = breakout_store(breakout, tmp_path / "a")
    for bad in ("breakout/random", "breakout/random-v", "../escape-v0", "/abs-v0"):
        with pytest.raises(InvalidInputError, match="-vN"):
            export_minari(store, bad)
    export_minari(store, "dup-v0")
    with pytest.raises(InvalidInputError, match="already exists"):
        export_minari(store, "dup-v0")
    empty = ReplayStore.create(tmp_path / "e", capacity=16, obs_shape=(84, 84))
    empty.reset(breakout.frames[0])
    with pytest.raises(InvalidInputError, match="no finished"):
        export_minari(empty, "empty-v0")


def _raw(dataset_id: str, **fields) -> None:
    """A Minari dataset of one (84, 84) episode whose fields may be inconsistent."""
    base = {"observations": np.zeros((4, 84, 84), np.uint8), "actions": np.zeros(3, np.int64),
            "rewards": np.zeros(3, np.float32), "terminations": np.array([False, False, True]),
            "truncations": np.zeros(3, bool)}
    base.update(fields)
    minari.create_dataset_from_buffers(
        dataset_id, [EpisodeBuffer(**base)], env=None, jpeg_encoding=False,
        observation_space=gym.spaces.Box(0, 255, (84, 84), np.uint8),
        action_space=gym.spaces.Discrete(4))


HOSTILE = {
    "T observations for T steps": ({"observations": np.zeros((3, 84, 84), np.uint8)},
                                   "T\\+1 observations"),
    "T+2 observations": ({"observations": np.zeros((5, 84, 84), np.uint8)},
                         "T\\+1 observations"),
    "terminated mid-episode": ({"terminations": np.array([True, False, True])},
                               "before its last step"),
    "short actions": ({"actions": np.zeros(2, np.int64)}, "T\\+1 observations"),
    "frames unlike the space": ({"observations": np.zeros((4, 84, 83), np.uint8)},
                                "obs shape"),
    "NaN reward": ({"rewards": np.array([0, np.nan, 0], np.float32)}, "finite"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_minari_import_leaves_nothing(tmp_path: Path, case: str) -> None:
    fields, message = HOSTILE[case]
    _raw("bad/one-v0", **fields)
    with pytest.raises(DatasetFormatError, match=message):
        import_minari("bad/one-v0", tmp_path / "store")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minari"]
    assert main(["import-minari", "bad/one-v0", str(tmp_path / "store")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minari"]


def test_hostile_metadata_and_spaces(tmp_path: Path) -> None:
    _raw("meta/bad-v0")
    data = minari.load_dataset("meta/bad-v0")
    data.storage.update_metadata({"mmreplay": {"frame_stack": "4; rm -rf"}})
    with pytest.raises(DatasetFormatError, match="frame_stack"):
        import_minari("meta/bad-v0", tmp_path / "store")
    minari.create_dataset_from_buffers(
        "dict/obs-v0", [EpisodeBuffer(observations={"a": np.zeros((2, 3))}, actions=[0],
                                      rewards=[0.0], terminations=[True],
                                      truncations=[False])],
        env=None, observation_space=gym.spaces.Dict({"a": gym.spaces.Box(0, 1, (3,))}),
        action_space=gym.spaces.Discrete(2))
    with pytest.raises(DatasetFormatError, match="not a Box"):
        import_minari("dict/obs-v0", tmp_path / "store")
    with pytest.raises(InvalidInputError, match="is not found locally") as missing:
        import_minari("missing/none-v0", tmp_path / "store")
    assert "minari download missing/none-v0" in str(missing.value)
    assert "download=True" not in str(missing.value)  # Minari's own hint is not ours
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minari"]


def test_cli_export_and_import_minari(breakout, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    breakout_store(breakout, tmp_path / "a").close()
    assert main(["export-minari", str(tmp_path / "a"), "cli/out-v0",
                 "--env-id", "ALE/Breakout-v5"]) == 0
    assert "to Minari dataset cli/out-v0" in capsys.readouterr().out
    assert main(["import-minari", "cli/out-v0", str(tmp_path / "b")]) == 0
    assert "from Minari dataset cli/out-v0" in capsys.readouterr().out
    with ReplayStore.open(tmp_path / "a", mode="r") as a, \
            ReplayStore.open(tmp_path / "b", mode="r") as b:
        assert_stores_equal(a, b)


def test_import_mmreplay_and_cli_never_load_optional_packages() -> None:
    code = ("import sys, mmreplay, mmreplay.tools.cli; "
            "bad = [m for m in ('minari', 'gymnasium', 'h5py') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
