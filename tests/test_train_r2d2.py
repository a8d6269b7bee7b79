"""Smoke run of scripts/train_r2d2.py (tiny arguments) and unit checks of its n-step targets.

The smoke runs execute the script in this process (`script_runner.run_here`): what they check
is the run's outcome, and the script's imports are then paid once per session."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from script_runner import run_here

pytestmark = pytest.mark.integration  # R2D2 training runs of scripts/train_r2d2.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
train_r2d2 = pytest.importorskip("train_r2d2")  # importable: gymnasium is in the test extra


@pytest.mark.parametrize("network", ["--no-feed-forward", "--feed-forward"])
def test_train_r2d2_smoke(tmp_path: Path, network: str) -> None:
    proc = run_here("train_r2d2.py", "--total-steps", "320", "--learning-starts", "200",
                      "--batch-size", "4", "--num-envs", "2", "--hidden", "8", "--buffer-size",
                      "1000", "--exploration-steps", "200", "--run-dir", str(tmp_path), network,
                    torch_threads=1)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["updates"] == 31  # at env steps 200, 204, ..., 320
    assert summary["episodes"] > 0 and summary["sampleable"] > 0
    with open(tmp_path / "curve.csv") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["step", "return"] and len(rows) == summary["episodes"] + 1


def test_train_r2d2_pixels_smoke(tmp_path: Path) -> None:
    """An ALE game end to end: 84x84 frames stored once, CNN torso, LSTM, sequences."""
    proc = run_here("train_r2d2.py", "--env", "ALE/Pong-v5", "--total-steps", "160",
                      "--learning-starts", "120", "--batch-size", "2", "--num-envs", "2",
                      "--hidden", "8", "--buffer-size", "1000", "--burn-in", "2", "--learn",
                      "4", "--n-step", "2", "--period", "2", "--run-dir", str(tmp_path),
                    torch_threads=1)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["updates"] == 11 and summary["sampleable"] == 160  # steps 120, 124, ..., 160
    from mmreplay import ReplayStore
    with ReplayStore.open(tmp_path / "store", "r") as store:
        assert store.spec.obs_shape == (84, 84) and store.spec.obs_dtype == "uint8"


def test_td_targets_cut_at_termination_and_bootstrap_after_truncation() -> None:
    args = train_r2d2.Args(burn_in=1, learn=2, n_step=2, gamma=0.5)
    # two sequences of T = 5 steps (+1 for the appended next_obs); Q values pick action 0
    q = torch.zeros(2, 6, 2)
    q[..., 0] = torch.arange(6, dtype=torch.float32) * 10  # bootstrap value at index i: 10 i
    reward = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0], [1.0, 2.0, 4.0, 8.0, 16.0]])
    terminated = torch.tensor([[False, False, True, False, False], [False] * 5])
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, False, False]])
    y = train_r2d2.td_targets(q, q, reward, terminated, mask, args)
    # row 0: step 1: 2 + .5 * 4 (terminated at 2: no bootstrap); step 2: 4
    # row 1 (truncated after step 2, next_obs at index 3): step 1: 2 + .5 * 4 + .25 * 30;
    # step 2: 4 + .5 * 30
    assert y.tolist() == [[4.0, 4.0], [11.5, 19.0]]
