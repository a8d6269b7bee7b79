"""Smoke tests of `scripts/sb3_dqn.py` with tiny arguments, run as a user runs it: in this
process (`script_runner.run_here`, one thread as ``OMP_NUM_THREADS=1``), and as a real process
where the test kills it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")

from script_runner import run_here  # noqa: E402

from mmreplay import ReplayStore  # noqa: E402

pytestmark = pytest.mark.integration  # SB3 training runs of scripts/sb3_dqn.py, killed subprocesses

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sb3_dqn.py"


def command(*args: str) -> tuple[list[str], dict[str, str]]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, str(SCRIPT), *args], {**os.environ, "PYTHONPATH": path,
                                                  "OMP_NUM_THREADS": "1"}


def run(*args: str) -> list[dict]:
    """The JSON lines the script prints, run in this process."""
    proc = run_here(SCRIPT.name, *args, torch_threads=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("algo, buffer", [("dqn", "mmreplay"), ("qrdqn", "mmreplay"),
                                          ("dqn", "sb3")])
def test_cartpole_tiny_run_writes_figures(tmp_path, algo, buffer):
    out = run("--algo", algo, "--buffer", buffer, "--total-timesteps", "600",
              "--learning-starts", "300", "--run-dir", str(tmp_path), "--eval-episodes", "2")
    result = out[-1]
    assert json.loads((tmp_path / "result.json").read_text()) == result
    assert (result["algo"], result["buffer"], result["timesteps"]) == (algo, buffer, 768)
    assert result["eval_return"] > 0 and result["peak_rss_mib"] > 0
    assert result["buffer_transitions"] == 768
    assert (tmp_path / "store").exists() == (buffer == "mmreplay")


def test_killed_run_resumes_with_every_transition_up_to_the_checkpoint(tmp_path):
    cmd, env = command("--total-timesteps", "100000", "--learning-starts", "100000",
                       "--checkpoint-every", "400", "--run-dir", str(tmp_path),
                       "--eval-episodes", "0")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    second = tmp_path / "checkpoints" / "rl_model_replay_buffer_800_steps.pkl"
    try:
        deadline = time.monotonic() + 240
        while not second.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.exists(), "no second checkpoint"
        time.sleep(0.5)  # keep adding past the checkpoint, unflushed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    resumed = run("--total-timesteps", "3000", "--learning-starts", "100000",
                  "--checkpoint-every", "400", "--run-dir", str(tmp_path), "--resume",
                  "--eval-episodes", "0")
    at = resumed[0]
    # SB3 calls the checkpoint callback after a step, before storing its transition: the
    # buffer saved at step S holds S - 1 transitions (SB3's own buffer too). SB3 writes a
    # checkpoint's pickle after pickling the buffer, which commits the store: a kill between
    # the two leaves the store at the next checkpoint (S + 400, one commit ahead of the newest
    # complete pickle), which the resume takes with a warning (running episodes truncated)
    assert at["resumed_at"] >= 800
    assert at["buffer_transitions"] in (at["resumed_at"] - 1, at["resumed_at"] + 400 - 1)
    final = resumed[-1]["timesteps"]
    assert final >= 3000  # rollouts of train_freq=256 steps
    with ReplayStore.open(tmp_path / "store", mode="r") as store:
        # the checkpoint's transitions, then the new ones: nothing from after the checkpoint
        assert store.counts.transitions == at["buffer_transitions"] + final - at["resumed_at"]
        assert len(store) == store.counts.transitions


def test_parity_script_summarizes_runs(tmp_path):
    """`sb3_parity.py` reuses finished runs (result.json) and writes the summary."""
    returns = {("mmreplay", 1): 500.0, ("mmreplay", 2): 400.0, ("sb3", 1): 300.0,
               ("sb3", 2): 500.0}
    for (buffer, seed), value in returns.items():
        run_dir = tmp_path / "runs" / f"dqn-{buffer}-{seed}"
        run_dir.mkdir(parents=True)
        (run_dir / "result.json").write_text(json.dumps(dict(
            algo="dqn", buffer=buffer, seed=seed, eval_return=value,
            train_return_last_100=value / 2)))
    out = tmp_path / "parity.json"
    cmd, env = command()
    cmd[1] = str(ROOT / "scripts" / "bench" / "sb3_parity.py")
    proc = subprocess.run([*cmd, "--algos", "dqn", "--seeds", "1,2", "--run-root",
                           str(tmp_path / "runs"), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())["summary"]
    assert [(r["buffer"], r["eval_return_mean"], r["eval_return_std"]) for r in summary] == [
        ("mmreplay", 450.0, 50.0), ("sb3", 400.0, 100.0)]
    assert "| dqn | mmreplay | 2 | 450.0 ± 50.0 | 225.0 ± 25.0 |" in proc.stdout


def test_a_buffer_checkpoint_cut_while_written_leaves_no_file_to_resume_from(tmp_path):
    """The script's checkpoints write the replay buffer under a temporary name and rename it:
    a save that dies half-way leaves the previous checkpoints and no truncated buffer file
    (a run SIGKILLed there used to resume from an empty pickle: EOFError)."""
    import gymnasium as gym
    from sb3_dqn import checkpoints
    from stable_baselines3 import DQN

    model = DQN("MlpPolicy", gym.make("CartPole-v1"), learning_starts=1000, seed=0)
    saved = model.save_replay_buffer
    calls = []

    def dies_half_way(path):
        calls.append(Path(path))
        if len(calls) == 2:
            Path(path).write_bytes(b"\x80\x04")  # the start of a pickle, then the kill
            raise KeyboardInterrupt
        saved(path)

    model.save_replay_buffer = dies_half_way
    with pytest.raises(KeyboardInterrupt):
        model.learn(10, callback=checkpoints(4, tmp_path))
    assert sorted(p.name for p in tmp_path.glob("*.pkl")) == ["rl_model_replay_buffer_4_steps.pkl"]
    assert model.load_replay_buffer(tmp_path / "rl_model_replay_buffer_4_steps.pkl") is None
    assert all(p.suffix == ".partial" for p in calls)
