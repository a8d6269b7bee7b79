"""Learning parity: SB3 DQN / QR-DQN with `FrameOnceReplayBuffer` vs SB3's own buffer.

    python scripts/bench/sb3_parity.py                      # DQN and QR-DQN, CartPole-v1, seeds 1-5
    python scripts/bench/sb3_parity.py --algos dqn --seeds 1,2 --jobs 2

Runs ``scripts/sb3_dqn.py`` (rl-baselines3-zoo hyperparameters) once per algorithm, buffer
and seed, ``--jobs`` at a time with one torch thread each, into ``<run-root>/<algo>-<buffer>-
<seed>/``; a run whose ``result.json`` exists is not run again. Then it writes every run's
figures and a summary per (algorithm, buffer) to ``--out`` and prints the summary table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from common import run_main

ROOT = Path(__file__).resolve().parents[2]
BUFFERS = ("mmreplay", "sb3")


@dataclass
class Args:
    algos: str = "dqn,qrdqn"
    """comma-separated: dqn, qrdqn"""
    seeds: str = "1,2,3,4,5"
    """comma-separated seeds"""
    env_id: str = "CartPole-v1"
    """gymnasium id"""
    jobs: int = 2
    """runs at a time"""
    total_timesteps: int = 0
    """0: zoo's n_timesteps"""
    run_root: str = "runs/sb3_parity"
    """one directory per run below it"""
    out: str = "data/bench/sb3_parity.json"
    """the JSON written at the end"""


def run_one(args: Args, algo: str, buffer: str, seed: int) -> dict[str, Any]:
    run_dir = Path(args.run_root) / f"{algo}-{buffer}-{seed}"
    result = run_dir / "result.json"
    if not result.exists():
        cmd = [sys.executable, str(ROOT / "scripts" / "sb3_dqn.py"), "--algo", algo,
               "--buffer", buffer, "--seed", str(seed), "--env-id", args.env_id,
               "--run-dir", str(run_dir), "--eval-episodes", "10",
               "--overwrite"]  # no result.json: whatever is there is an unfinished run
        if args.total_timesteps:
            cmd += ["--total-timesteps", str(args.total_timesteps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return dict(json.loads(result.read_text()))


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation of the returns per (algorithm, buffer)."""
    rows = []
    for algo in sorted({r["algo"] for r in runs}):
        for buffer in BUFFERS:
            mine = [r for r in runs if r["algo"] == algo and r["buffer"] == buffer]
            if not mine:
                continue
            final = np.array([r["eval_return"] for r in mine])
            train = np.array([r["train_return_last_100"] for r in mine])
            rows.append(dict(algo=algo, buffer=buffer, seeds=sorted(r["seed"] for r in mine),
                             eval_return_mean=round(float(final.mean()), 1),
                             eval_return_std=round(float(final.std()), 1),
                             train_return_last_100_mean=round(float(train.mean()), 1),
                             train_return_last_100_std=round(float(train.std()), 1)))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = tyro.cli(Args, args=argv, description=__doc__)
    algos = args.algos.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    todo = [(a, b, s) for a in algos for s in seeds for b in BUFFERS]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda job: run_one(args, *job), todo))
    command = "python scripts/bench/sb3_parity.py " + " ".join(argv)
    report = dict(env_id=args.env_id, command=command, summary=summarize(runs), runs=runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("| algo | buffer | seeds | final eval return (10 ep.) | last-100 train return |")
    print("|---|---|---|---|---|")
    for row in report["summary"]:
        print(f"| {row['algo']} | {row['buffer']} | {len(row['seeds'])} | "
              f"{row['eval_return_mean']} ± {row['eval_return_std']} | "
              f"{row['train_return_last_100_mean']} ± {row['train_return_last_100_std']} |")
    return report


if __name__ == "__main__":
    run_main(main)
