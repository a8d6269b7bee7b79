"""Figures for mmreplay on real Atari frames: speed, RAM and disk, side by side with baselines.

    python scripts/bench/bench.py                       # every section (~10 min; frames cached)
    python scripts/bench/bench.py --sections core,disk  # some sections
    python scripts/bench/bench.py --quick               # tiny smoke run, writes core_quick.json

Sections (`--sections`), each made of functions that return dicts of figures:

    core   on `--frames` recorded Breakout frames:
             add          `ReplayStore.add` steps/s into a single-env store (frame_stack=4)
             sample       `sample(batch)` latency on the live writer, then reopened "r"
             disk         that store's size on disk against the raw frame bytes
             numpy_floor  the same batch gathered from an in-RAM numpy array
             naive_zarr   the same batch read per sample from the store's zarr `frames` array
    ram    RSS growth of a fresh process that fills a buffer with `--scale-frames` frames
           (cycling through `--distinct-frames` real ones) and samples it: mmreplay, cpprb
           (next_of + stack_compress), a numpy array (the floor); at `--small-frames` also
           SB3 (optimize_memory_usage) and TorchRL (LazyMemmapStorage), which store 4-stacks.
           Each fill also gives that buffer's add rate and a warm sample(batch) latency.
    disk   bytes on disk / raw frame bytes, `--disk-frames` real frames of each `--disk-games`
    cold   sample(batch) of the scale store reopened with `cache_bytes=1` (no decoded chunk
           is reused): page cache warm, then the frame files evicted; naive zarr beside it
    open   open + first batch of the scale store, its files evicted from the page cache
    flush  flush after `--flush-steps` new steps: scale store vs a `--flush-small` store

The sections live in `scripts/bench/benchlib/` (`core`, `baselines`, `scale`, `workers`, `targets`,
with the shared measuring tools in `harness`); this file chooses and reports them. Every figure
about a process (RSS, caches, open) comes from a fresh subprocess: this file run as
``bench.py _worker JOB``. Page-cache eviction is `posix_fadvise(DONTNEED)` per file
after `os.sync()` (checked with `fincore`): it empties this machine's page cache for those
files, not a VM host's cache below it. Prints figures with their targets (PASS/SHORT) and
writes them, with machine info, as JSON under `--out-dir`. Targets are read by people, never
asserted.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import scripts_path  # noqa: F401  (scripts/ on sys.path)
from benchlib.config import SCALE_SECTIONS, Args, parse_args, sections_of
from benchlib.core import bench_core, print_core
from benchlib.harness import machine_info, steady_malloc, write_json
from benchlib.scale import (
    bench_disk_games,
    bench_scale,
    print_cold,
    print_disk_games,
    print_open_flush,
    print_ram,
)
from benchlib.targets import print_targets, targets
from benchlib.workers import WORKER, worker_main
from common import run_main


def print_report(result: dict[str, Any], args: Args) -> None:
    if "record" in result:
        print_core(result)
    if "ram" in result:
        print_ram(result["ram"], args)
    if "disk_games" in result:
        print_disk_games(result["disk_games"])
    if "cold" in result:
        print_cold(result, args)
    print_open_flush(result, args)
    print_targets(result["targets"])
    m = result["machine"]
    print(f"\nmalloc in every bench process: {m['malloc']}")
    print(f"mmreplay from {m['mmreplay_path']} (repository HEAD {str(m['git_head'])[:10]}, "
          f"mmreplay/ modified in the work tree: {m['git_mmreplay_modified']}); "
          f"load average at start {m['loadavg_1m_at_start']:.2f} on {m['cpu_count']} CPUs")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == WORKER:
        worker_main(sys.argv[2])
        return
    args = parse_args(__doc__ or "")
    sections = sections_of(args)
    start = time.perf_counter()
    malloc = steady_malloc() if args.steady_malloc else "unchanged (--no-steady-malloc)"
    result: dict[str, Any] = {"machine": {**machine_info(), "malloc": malloc},
                              "config": asdict(args)}
    with tempfile.TemporaryDirectory(prefix="mmreplay_bench_") as tmp:
        root = Path(tmp)
        if "core" in sections:
            result.update(bench_core(args, root))
        if SCALE_SECTIONS & set(sections):
            result.update(bench_scale(args, root, sections))
        if "disk" in sections:
            result["disk_games"] = bench_disk_games(args, root)
    result["targets"] = targets(result, args)
    result["seconds"] = time.perf_counter() - start
    print_report(result, args)
    path = write_json(result, Path(args.out_dir), "core_quick.json" if args.quick else "core.json")
    print(f"\nwrote {path} ({result['seconds']:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
