"""Start-up time of the `mmreplay` command: ``--version``, ``info``, ``episodes``, ``verify``.

    python scripts/bench/bench_cli.py                       # this checkout only
    python scripts/bench/bench_cli.py --before-rev 2f892f1  # side by side with an older commit

Each command runs as a fresh process (``python -m mmreplay ...``, as the console script
does) on `--store` (default ``data/breakout_store``) `--runs` times; with `--before-rev`
the two checkouts alternate run by run, so a load change on the machine hits both alike.
Prints the median wall time of each, and the median CPU time (user + system) of the process,
which a loaded machine inflates far less, and writes both to ``data/bench/cli_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"--version": ["--version"], "info": ["info", "{store}"],
            "episodes": ["episodes", "{store}"], "verify": ["verify", "{store}"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=ROOT / "data" / "breakout_store",
                        help="store the commands inspect (default: data/breakout_store)")
    parser.add_argument("--runs", type=int, default=7, help="runs of each command per tree")
    parser.add_argument("--before-rev", default=None,
                        help="git revision to measure beside this checkout (e.g. main)")
    parser.add_argument("--out", type=Path, default=ROOT / "data" / "bench" / "cli_start.json")
    return parser.parse_args()


def export_rev(rev: str, into: Path) -> Path:
    """The package files of `rev` (``git archive``) under `into`."""
    archive = into / "rev.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "mmreplay"],
                   check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def run_once(tree: Path, argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one ``python -m mmreplay argv`` importing from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mmreplay", *argv], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"mmreplay {' '.join(argv)} failed in {tree}: {proc.stderr.strip()}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return elapsed, cpu


Medians = dict[str, dict[str, float]]  # tree -> command -> seconds


def measure(trees: dict[str, Path], store: Path, runs: int) -> tuple[Medians, Medians]:
    """Median wall and CPU seconds per (tree, command); trees alternate within each round."""
    wall: dict[str, dict[str, list[float]]] = {t: {c: [] for c in COMMANDS} for t in trees}
    cpu: dict[str, dict[str, list[float]]] = {t: {c: [] for c in COMMANDS} for t in trees}
    for _ in range(runs):
        for name, template in COMMANDS.items():
            argv = [a.format(store=store) for a in template]
            for tree_name, tree in trees.items():
                w, c = run_once(tree, argv)
                wall[tree_name][name].append(w)
                cpu[tree_name][name].append(c)
    return _medians(wall), _medians(cpu)


def _medians(times: dict[str, dict[str, list[float]]]) -> Medians:
    return {t: {c: round(statistics.median(v), 3) for c, v in per.items()}
            for t, per in times.items()}


def print_table(title: str, medians: Medians, runs: int) -> None:
    names = list(medians)
    print(f"{title:<10}" + "".join(f"{n:>10}" for n in names) + f"   (median s of {runs} runs)")
    for command in COMMANDS:
        print(f"{command:<10}" + "".join(f"{medians[n][command]:>10.3f}" for n in names))


def main() -> None:
    args = parse_args()
    store = args.store.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"after": ROOT}
        if args.before_rev:
            trees = {"before": export_rev(args.before_rev, Path(tmp)), **trees}
        load_before = os.getloadavg()[0]
        wall, cpu = measure(trees, store, args.runs)
    print_table("wall", wall, args.runs)
    print_table("cpu", cpu, args.runs)
    result = {"store": os.path.relpath(store, ROOT), "runs": args.runs,
              "before_rev": args.before_rev, "median_wall_s": wall, "median_cpu_s": cpu,
              "load_avg_1m_at_start": round(load_before, 2), "python": sys.version.split()[0],
              "machine": platform.machine(), "cpus": os.cpu_count(),
              "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
