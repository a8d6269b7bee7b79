"""The offline scripts with small arguments: `train_offline.py` learns CartPole from a
recorded store and runs on an imported Dopamine checkpoint of real ALE frames (pixel path);
`bench_datasets.py` writes its figures. `train_offline.py` runs in this process
(`script_runner.run_here`); `bench_datasets.py`, which starts a process per measured step,
as a user's shell runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gym = pytest.importorskip("gymnasium")
pytest.importorskip("ale_py")
pytest.importorskip("cv2")

from dopamine_format import DopamineBuffer, episode_records  # noqa: E402
from script_runner import Outcome, run_here  # noqa: E402

from mmreplay.datasets.dopamine import import_dopamine  # noqa: E402
from mmreplay.integrations.gymnasium import RecordToStore, create_store_for  # noqa: E402

pytestmark = pytest.mark.integration  # offline training runs and a benchmark smoke run

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> Outcome:
    return run_here("train_offline.py", *args)


def test_offline_cql_learns_cartpole_from_random_data(tmp_path: Path) -> None:
    env = gym.make("CartPole-v1")
    store = create_store_for(env, tmp_path / "store", capacity=20_000, seed=0)
    env = RecordToStore(env, store)
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    for _ in range(20_000):
        _, _, term, trunc, _ = env.step(int(rng.integers(2)))
        if term or trunc:
            env.reset()
    store.close()
    proc = run("--store", str(tmp_path / "store"), "--env", "CartPole-v1", "--algo", "cql",
               "--total-steps", "3000", "--eval-every", "1500", "--eval-episodes", "5",
               "--learning-rate", "1e-3", "--target-network-frequency", "500",
               "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [e["step"] for e in summary["evals"]] == [1500, 3000]
    # a uniform random policy averages ~22 on CartPole; the data holds only such episodes
    assert max(e["mean_return"] for e in summary["evals"]) >= 100
    assert (tmp_path / "run" / "evals.csv").read_text().startswith("step,mean_return")


def test_offline_dqn_runs_on_an_imported_dopamine_checkpoint(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import ale_frames
    finally:
        sys.path.remove(str(ROOT / "scripts" / "bench"))
    rec = ale_frames.record_frames("ALE/Breakout-v5", 600, seed=1, cache_dir=tmp_path)
    buf = DopamineBuffer(511, (84, 84))
    for record in episode_records(rec.frames, rec.is_first, rec.actions, rec.rewards,
                                  rec.terminated, rec.truncated):
        buf.add(*record)
    buf.save(tmp_path / "logs", 0)
    import_dopamine(tmp_path / "logs", tmp_path / "store")
    proc = run("--store", str(tmp_path / "store"), "--env", "ALE/Breakout-v5", "--algo", "dqn",
               "--total-steps", "20", "--eval-every", "10", "--eval-episodes", "1",
               "--eval-max-steps", "50", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert "states (4, 84, 84), 4 actions, dqn on" in proc.stdout
    evals = json.loads((tmp_path / "run" / "summary.json").read_text())["evals"]
    assert [e["step"] for e in evals] == [10, 20]
    assert all(np.isfinite(e["loss"]) for e in evals)


def test_bench_datasets_runs_with_tiny_arguments(tmp_path: Path) -> None:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "bench_datasets.py"), "--records", "3001",
         "--distinct-frames", "1500", "--gzip-level", "1", "--workdir", str(tmp_path / "w"),
         "--out", str(tmp_path / "figures.json")],
        env={**os.environ, "PYTHONPATH": path, "MINARI_DATASETS_PATH": str(tmp_path / "m")},
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["raw_frame_bytes"] == 3001 * 84 * 84
    for key in ("import_lz4", "import_zstd", "export_minari"):
        assert figures[key]["peak_rss_mib"] > 0 and figures[key]["seconds"] > 0
    assert 0 < figures["store_zstd_frame_bytes"] < figures["store_lz4_frame_bytes"]
    assert figures["minari_bytes"] > figures["raw_frame_bytes"] * 0.9  # raw frames
