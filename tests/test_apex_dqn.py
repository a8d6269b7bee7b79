"""`scripts/apex_dqn.py` with tiny arguments on CartPole: a rate-limited run, then a resume of it.

The script starts its own local Ray cluster (2 CPUs, a small object store) in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="needs the ray extra: pip install 'mmreplay[ray]'")
pytest.importorskip("gymnasium")
pytest.importorskip("ale_py")
pytest.importorskip("tqdm")

from mmreplay import ReplayStore  # noqa: E402
from mmreplay.rate_limit import summary as summary_of  # noqa: E402

pytestmark = pytest.mark.integration  # Ape-X training on a Ray cluster

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--env", "CartPole-v1", "--num-actors", "2", "--learning-starts", "300",
        "--buffer-size", "4000", "--batch-size", "16", "--actor-steps", "64",
        "--block-steps", "16", "--checkpoint-every", "1000", "--learning-rate", "1e-3",
        "--object-store-mb", "100", "--flush-every-steps", "500"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "apex_dqn.py"), *TINY, *args],
                          capture_output=True, text=True, timeout=300, env=env, check=False)


def test_apex_dqn_runs_holds_samples_per_insert_checkpoints_and_resumes(tmp_path: Path
                                                                       ) -> None:
    """A first run held to --samples-per-insert 2 by the store's rate limiter, then a resume
    of it without a limiter (one Ray cluster start per run: the limiter's checks ride on the
    first run)."""
    run_dir = tmp_path / "run"
    first = run("--total-timesteps", "1500", "--run-dir", str(run_dir),
                "--samples-per-insert", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # actors are asked for no more than what is left: the run ends where it was asked to,
    # and every step the store holds was counted
    assert summary["global_step"] == 1500 and summary["updates"] > 0
    assert 0 < summary["store_transitions"] <= summary["global_step"]
    shown = re.findall(r"(\d+)/1500 [^\r\n]*?episodes=(\d+)", first.stderr)
    assert shown and shown[-1] == ("1500", str(summary["episodes"])), first.stderr[-1500:]
    assert summary["episodes"] > 0 and summary["bytes_per_step"] > 0
    assert summary["epsilons"][0] == pytest.approx(0.4)
    assert summary["epsilons"][1] == pytest.approx(0.4 ** 8)
    limited = summary["rate_limiter"]
    assert limited["inserts"] > 1000 and limited["samples_per_insert"] == 2.0
    assert limited["achieved_samples_per_insert"] == pytest.approx(2.0, rel=0.05), limited
    with ReplayStore.open(run_dir / "store", mode="r") as store:
        first_transitions = store.counts.transitions
        assert store.spec.num_envs == 2 and store.spec.sampler == "prioritized"
        assert store.spec.n_step == 3 and first_transitions > 1000
        state = summary_of(store.rate_limiter_state())  # committed, with the actors'
    # last steps drained unlimited
    assert state["samples"] >= limited["samples"] and state["inserts"] >= limited["inserts"]
    again = run("--total-timesteps", "2500", "--run-dir", str(run_dir), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed at step {summary['global_step']} ({summary['updates']} updates" \
        in again.stderr + again.stdout
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["global_step"] == 2500 and resumed["updates"] > summary["updates"]
    assert resumed["rate_limiter"] is None  # the resume asked for no limiter
    with ReplayStore.open(run_dir / "store", mode="r") as store:
        assert store.counts.transitions > first_transitions
        assert store.get(store.valid_ids()).truncated.any()  # episodes cut by the restart
