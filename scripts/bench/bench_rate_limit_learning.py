"""Learning with and without the rate limiter: Ape-X DQN on CartPole, same seeds.

    python scripts/bench/bench_rate_limit_learning.py  # ~15 min on 2 cores

writes data/bench/rate_limit_learning.json.

Runs `scripts/apex_dqn.py` on CartPole-v1 (2 env actors on a local Ray cluster, small
budgets) once per seed and setting, the settings alternated seed by seed so that the
machine's drift falls on both: without a limiter (the learner takes at most one batch per
`train_frequency` env steps and otherwise runs as fast as it can: the replay ratio is what
the machine delivers) and with `--samples-per-insert X` for each X asked. Each run gives
its returns over env steps (mean return of the episodes that ended in each bin of
`bin_steps`), its mean return at the end, and the measured replay ratio: samples drawn per
step inserted after `learning_starts` (gradient steps x batch size / (steps -
learning_starts)), and for a limited run the limiter's own count.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import torch
import tyro
from common import run_main

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Args:
    seeds: str = "0,1,2"
    """seeds, each run once per setting"""
    samples_per_insert: str = "8"
    """limited settings (`--samples-per-insert` of apex_dqn.py); each is compared with none"""
    total_timesteps: int = 20_000
    """env steps per run (summed over actors)"""
    num_actors: int = 2
    """env actors"""
    learning_starts: int = 1_000
    """steps before the first gradient step (and the limiter's min size)"""
    batch_size: int = 64
    """transitions per gradient step"""
    learning_rate: float = 1e-3
    """Adam learning rate"""
    bin_steps: int = 2_000
    """env steps per point of the returns-over-steps curve"""
    timeout_s: float = 900.0
    """limit of one run"""
    out: str = "data/bench/rate_limit_learning.json"
    """where the figures go (relative to the repository)"""


def apex_command(args: Args, seed: int, spi: float, run_dir: Path) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "apex_dqn.py"), "--env", "CartPole-v1",
            "--seed", str(seed), "--num-actors", str(args.num_actors),
            "--total-timesteps", str(args.total_timesteps),
            "--learning-starts", str(args.learning_starts),
            "--learning-rate", str(args.learning_rate), "--buffer-size", "20000",
            "--batch-size", str(args.batch_size), "--checkpoint-every", str(10**9),
            "--samples-per-insert", str(spi), "--run-dir", str(run_dir), "--overwrite"]


def curve(episodes: dict[str, list[Any]], bin_steps: int, total: int) -> list[float | None]:
    """Mean return of the episodes that ended in each bin of `bin_steps` env steps."""
    steps, returns = np.asarray(episodes["step"]), np.asarray(episodes["return"], float)
    out: list[float | None] = []
    for lo in range(0, total, bin_steps):
        inside = returns[(steps > lo) & (steps <= lo + bin_steps)]
        out.append(float(inside.mean()) if inside.size else None)
    return out


def one_run(args: Args, seed: int, spi: float, tmp: Path) -> dict[str, Any]:
    run_dir = tmp / f"s{seed}-spi{spi:g}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}
    start = time.perf_counter()
    proc = subprocess.run(apex_command(args, seed, spi, run_dir), env=env, text=True,
                          capture_output=True, timeout=args.timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"apex_dqn.py seed {seed} spi {spi:g} failed: {proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=True)
    learned = summary["global_step"] - args.learning_starts
    limiter = summary["rate_limiter"]
    return {"seed": seed, "samples_per_insert": spi or None,
            "returns_over_steps": curve(ckpt["episodes"], args.bin_steps, args.total_timesteps),
            "final_mean_return": summary["mean_return"], "episodes": summary["episodes"],
            "updates": summary["updates"],
            "replay_ratio": summary["updates"] * args.batch_size / learned,
            "limiter_samples_per_insert":
                None if limiter is None else limiter["achieved_samples_per_insert"],
            "limiter_error_range": None if limiter is None else
                [limiter.get("error_low"), limiter.get("error_high")],
            "actor_wait_s": None if limiter is None else limiter["insert_wait_s"],
            "learner_wait_s": None if limiter is None else limiter["sample_wait_s"],
            "wall_s": time.perf_counter() - start}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setting: mean curve over seeds, mean and spread of the final return and ratio."""
    out: dict[str, Any] = {}
    for spi in sorted({r["samples_per_insert"] or 0 for r in runs}):
        rows = [r for r in runs if (r["samples_per_insert"] or 0) == spi]
        curves = np.array([[np.nan if v is None else v for v in r["returns_over_steps"]]
                           for r in rows])
        finals = [r["final_mean_return"] for r in rows]
        ratios = [r["replay_ratio"] for r in rows]
        out["none" if spi == 0 else f"{spi:g}"] = {
            "returns_over_steps_mean": [None if np.isnan(v) else float(v)
                                        for v in np.nanmean(curves, axis=0)],
            "final_mean_return": statistics.mean(finals), "final_min": min(finals),
            "final_max": max(finals), "replay_ratio_mean": statistics.mean(ratios),
            "replay_ratio_min": min(ratios), "replay_ratio_max": max(ratios)}
    return out


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    settings = [0.0, *(float(x) for x in args.samples_per_insert.split(","))]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rl-learning-") as tmp:
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            order = settings if i % 2 == 0 else settings[::-1]  # alternate which goes first
            for spi in order:
                run = one_run(args, seed, spi, Path(tmp))
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items()
                                  if k != "returns_over_steps"}), flush=True)
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average": os.getloadavg()},
              "args": asdict(args), "runs": runs, "by_setting": aggregate(runs)}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["by_setting"], indent=1))


if __name__ == "__main__":
    run_main(main)
