"""`scripts/train_dqn.py`: smoke runs, a CartPole learning check, checkpoint/resume after a kill
(Ctrl-C: tests/test_script_cli.py).

The runs whose outcome is checked execute the script in this process (`script_runner.run_here`,
its imports paid once per session); the run that is killed is a real process (cleanrl
``tests/test_atari_gymnasium.py`` runs its scripts that way). The checkpoint helpers are also
imported to drive the crash windows of the two-phase commit.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ale_py")
pytest.importorskip("gymnasium")
pytest.importorskip("cv2")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

import torch  # noqa: E402
from script_runner import Outcome, run_here  # noqa: E402

from mmreplay import ReplayStore  # noqa: E402

pytestmark = pytest.mark.integration  # training runs of scripts/train_dqn.py, some in subprocesses

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_dqn.py"

# Solves CartPole (mean of the last 20 returns >= 195) in 8,981 steps with seed 1; seeds 0-15
# all solve it within 26k steps with these settings.
CARTPOLE = ["--env", "CartPole-v1", "--learning-rate", "1e-3", "--buffer-size", "10000",
            "--target-network-frequency", "500", "--train-frequency", "4", "--batch-size", "64",
            "--n-step", "3", "--exploration-fraction", "0.1", "--end-e", "0.05",
            "--learning-starts", "1000"]


def command(*args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), *args]


def script_env() -> dict[str, str]:
    """The environment with the repository importable, as `pip install -e .` would make it."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run(*args: str) -> Outcome:
    """The script run in this process (`run_here`)."""
    return run_here(SCRIPT.name, *args)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def try_load(path: Path) -> dict[str, Any] | None:
    """A checkpoint file, or None where it is absent or was cut short by the kill."""
    try:
        return load(path)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
        return None


def transitions_on_disk(store_dir: Path) -> int:
    with ReplayStore.open(store_dir, "r") as store:
        return store.counts.transitions


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen[str], step: int) -> None:
    """Wait until the run has committed a checkpoint at `step` or later."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        ckpt = try_load(run_dir / "checkpoint.pt")
        if ckpt is not None and ckpt["global_step"] >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step >= {step} in time")


@pytest.fixture
def train_dqn(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import train_dqn

    return train_dqn


@pytest.mark.parametrize("extra", [[], ["--num-envs", "2", "--prioritized", "--n-step", "3"]],
                         ids=["default", "2envs-prioritized-nstep"])
def test_breakout_tiny_run(tmp_path: Path, extra: list[str]) -> None:
    run_dir = tmp_path / "run"
    proc = run("--total-timesteps", "300", "--learning-starts", "100", "--buffer-size", "1000",
               "--checkpoint-every", "200", "--target-network-frequency", "100",
               "--run-dir", str(run_dir), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("learning_curve.png", "episodes.csv", "summary.json", "checkpoint.pt"):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 300
    assert summary["store_bytes"] > 0

    with ReplayStore.open(run_dir / "store", "r") as store:
        assert store.spec.frame_stack == 4 and store.spec.obs_shape == (84, 84)
        assert store.counts.transitions == summary["store_transitions"] > 0
        batch = store.sample(8)
        assert batch.obs.shape == (8, 4, 84, 84) and batch.obs.dtype == torch.uint8
    ckpt = load(run_dir / "checkpoint.pt")
    assert ckpt["global_step"] == 300
    assert ckpt["transitions"] == summary["store_transitions"]


@pytest.mark.slow
def test_cartpole_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run(*CARTPOLE, "--seed", "1", "--total-timesteps", "100000", "--stop-at-return", "195",
               "--checkpoint-every", "50000", "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    returns = np.loadtxt(run_dir / "episodes.csv", delimiter=",", skiprows=1, ndmin=2)[:, 2]
    assert summary["solved_at_step"] is not None and summary["solved_at_step"] <= 100_000
    assert returns[-20:].mean() >= 195


def test_resume_after_sigkill(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*CARTPOLE, "--buffer-size", "1000", "--checkpoint-every", "500", "--run-dir",
            str(run_dir)]  # a small ring: wraparound commits happen between checkpoints
    first = subprocess.Popen(command(*args, "--total-timesteps", "1000000"), env=script_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_for_checkpoint(run_dir, first, 1500)  # past learning_starts and the wrap
    finally:
        first.kill()
        first.wait()
    assert first.returncode == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()

    # The store reopens at exactly the transitions one of the checkpoint files records.
    transitions = transitions_on_disk(run_dir / "store")
    candidates = [try_load(run_dir / name) for name in ("checkpoint.pt", "checkpoint.pt.pending")]
    matching = [c for c in candidates if c is not None and c["transitions"] == transitions]
    assert matching, (transitions, [c and c["transitions"] for c in candidates])
    step = matching[0]["global_step"]
    assert step >= 1500

    proc = run(*args, "--resume", "--total-timesteps", str(step + 500))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed at step {step} with {transitions} transitions" in proc.stdout
    assert not (run_dir / "checkpoint.pt.pending").exists()
    ckpt = load(run_dir / "checkpoint.pt")
    assert ckpt["global_step"] == step + 500
    assert ckpt["transitions"] == transitions_on_disk(run_dir / "store") > transitions
    assert len(ckpt["episodes"]["return"]) > len(matching[0]["episodes"]["return"])


def test_checkpoint_crash_windows(tmp_path: Path, train_dqn: ModuleType) -> None:
    """Whichever step of pending -> flush -> rename a crash interrupts, resume finds a pair."""
    store = ReplayStore.create(tmp_path / "store", capacity=64, obs_shape=(4,),
                               obs_dtype=np.float32, seed=0)
    store.reset(np.zeros(4, np.float32))

    def steps(count: int) -> None:
        for _ in range(count):
            store.add(0, 1.0, np.ones(4, np.float32), False, False)

    steps(5)
    train_dqn.save_checkpoint(tmp_path, store, {"global_step": 5})
    pending = tmp_path / "checkpoint.pt.pending"

    # Crash after the flush, before the rename: the complete pending file is promoted.
    steps(3)
    torch.save({"global_step": 8, "transitions": store.counts.transitions}, pending)
    store.flush()
    assert train_dqn.load_checkpoint(tmp_path, 8)["global_step"] == 8
    assert load(tmp_path / "checkpoint.pt")["global_step"] == 8 and not pending.exists()

    # Crash before the flush: the store did not move; the old checkpoint stands.
    steps(2)
    torch.save({"global_step": 10, "transitions": store.counts.transitions}, pending)
    assert train_dqn.load_checkpoint(tmp_path, 8)["global_step"] == 8
    assert not pending.exists()

    # A pending file cut short by the crash is ignored.
    pending.write_bytes(b"PK\x03\x04 truncated")
    assert train_dqn.load_checkpoint(tmp_path, 8)["global_step"] == 8

    # A store that matches no checkpoint refuses to resume.
    with pytest.raises(SystemExit, match="holds 10 transitions"):
        train_dqn.load_checkpoint(tmp_path, 10)
    store.close()


def test_progress_postfix_is_truthful_before_learning_starts(tmp_path: Path) -> None:
    """The bar's episodes and rate move from step 0, not only once learning starts."""
    proc = run(*CARTPOLE, "--seed", "0", "--total-timesteps", "2000", "--learning-starts", "2000",
               "--progress-every", "0", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [int(m) for m in re.findall(r"episodes=(\d+)", proc.stderr)]
    rates = [int(m) for m in re.findall(r"sps=(\d+)", proc.stderr)]
    assert shown and max(shown) > 0, proc.stderr[-2000:]
    assert len(set(shown)) > 1 and max(rates) > 0  # updated while no gradient step ran
