"""mmreplay at scale: a 10M-frame store of real Atari frames — add rate, sample, RSS, disk, time.

    python scripts/bench_scale.py                     # 10,000,000 frames (~10-15 min, ~1 GiB RSS)
    python scripts/bench_scale.py --frames 2000000    # smaller
    python scripts/bench_scale.py --frames 3000 --distinct-frames 2000 --reps 5   # smoke run

One single-env store (frame_stack=4, `cache_bytes = --cache-mib` MiB) is filled by cycling
through `--distinct-frames` real recorded frames (so compression reflects those distinct frames
only), with a progress line every `--report-every` frames. Then: sample(batch) latency on the
live writer; RSS growth; size on disk; and, after evicting the store's files from the page
cache, open + first batch and sample latency of the store reopened read-only. Writes
`scale.json` under `--out-dir`. Figures only: targets are read by people, never asserted.
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ale_frames import CACHE_DIR, AleFrames, record_frames
from benchlib.core import bench_disk
from benchlib.harness import (
    evict,
    feed_timed,
    latency_ms,
    machine_info,
    memory_growth,
    memory_status,
    new_store,
    steady_malloc,
    write_json,
)
from common import parse_args, run_main

from mmreplay import ReplayStore


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """gymnasium id of the ALE game whose frames fill the store"""
    frames: int = 10_000_000
    """frames fed to (and held by) the store; its capacity"""
    distinct_frames: int = 200_000
    """real frames recorded (cached under --cache-dir) and cycled to reach --frames"""
    cache_mib: int = 512
    """the store's decoded-chunk cache, MiB (`cache_bytes`)"""
    batch_size: int = 32
    """transitions per sampled batch"""
    reps: int = 200
    """timed sample calls per latency figure"""
    warmup: int = 20
    """untimed sample calls before the live-writer figure"""
    seed: int = 0
    """seed of the recording and the store"""
    report_every: int = 1_000_000
    """frames between progress lines"""
    store_dir: str = ""
    """where to build the store (kept); empty: a temp dir, removed at the end"""
    out_dir: str = "data/bench"
    """directory of scale.json"""
    cache_dir: str = str(CACHE_DIR)
    """where recorded frames are cached as .npz"""
    steady_malloc: bool = True
    """pin glibc's mmap/trim thresholds, as bench.py does (see benchlib.harness.steady_malloc)"""


def fill(store: ReplayStore, rec: AleFrames, args: Args) -> dict[str, Any]:
    """Feed --frames stream positions, printing progress; rates count time inside add/reset."""
    start, adds, spent, progress = time.perf_counter(), 0, 0.0, []
    print(f"{'frames':>14}{'steps/s':>10}{'RSS MiB':>10}{'elapsed s':>11}", flush=True)
    for first in range(0, args.frames, args.report_every):
        stop = min(args.frames, first + args.report_every)
        seg_adds, seg_spent = feed_timed(store, rec, first, stop, desc="fill", progress=False)
        adds, spent = adds + seg_adds, spent + seg_spent
        row = {"frames": stop, "steps_per_s": seg_adds / seg_spent,
               "rss_mib": memory_status()["VmRSS"] / 2**20,
               "elapsed_s": time.perf_counter() - start}
        progress.append(row)
        print(f"{stop:>14,}{row['steps_per_s']:>10,.0f}{row['rss_mib']:>10,.0f}"
              f"{row['elapsed_s']:>11.0f}", flush=True)
    begin = time.perf_counter()
    store.flush()
    flush_s = time.perf_counter() - begin
    wall = time.perf_counter() - start
    return {"adds": adds, "seconds_in_calls": spent, "flush_s": flush_s, "wall_s": wall,
            "steps_per_s": adds / (spent + flush_s), "frames_per_s_wall": args.frames / wall,
            "progress": progress}


def reopened(path: Path, args: Args) -> dict[str, Any]:
    """Evict the store's files from the page cache, reopen read-only, sample."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    evicted = evict(files, drop_caches=False)
    begin = time.perf_counter()
    store = ReplayStore.open(path, mode="r", cache_bytes=args.cache_mib << 20)
    opened = time.perf_counter()
    store.sample(args.batch_size)
    first = time.perf_counter()
    sample = latency_ms(lambda: store.sample(args.batch_size), reps=args.reps, warmup=0)
    store.close()
    return {"evicted": evicted, "open_s": opened - begin, "first_batch_s": first - opened,
            "sample": sample}


def run(path: Path, rec: AleFrames, args: Args) -> dict[str, Any]:
    gc.collect()
    before = memory_status()
    store = new_store(path, args.frames, args.seed, cache_bytes=args.cache_mib << 20)
    out: dict[str, Any] = {"fill": fill(store, rec, args)}
    filled = memory_status()
    out["sample_live"] = latency_ms(lambda: store.sample(args.batch_size), reps=args.reps,
                                    warmup=args.warmup)
    sampled = memory_status()
    out["sampleable"] = len(store)
    begin = time.perf_counter()
    store.close()
    out["close_s"] = time.perf_counter() - begin
    out["rss"] = {"before": before, "filled": filled, "sampled": sampled,
                  "growth_filled_mib": memory_growth(before, filled),
                  "growth_mib": memory_growth(before, sampled)}
    begin = time.perf_counter()
    out["disk"] = {**bench_disk(path, args.frames), "files": sum(1 for _ in path.rglob("*")),
                   "scan_s": time.perf_counter() - begin}
    out["reopened"] = reopened(path, args)
    return out


def print_report(result: dict[str, Any], args: Args) -> None:
    fill_, rss, disk, again = (result[k] for k in ("fill", "rss", "disk", "reopened"))
    g = rss["growth_mib"]
    resident = again["evicted"]["resident_fraction"]
    print(f"\n{args.frames:,} frames ({fill_['adds']:,} steps) cycled from "
          f"{args.distinct_frames:,} distinct real {args.game} frames, cache_bytes = "
          f"{args.cache_mib} MiB")
    print(f"add          {fill_['steps_per_s']:,.0f} steps/s in add/reset calls + final flush "
          f"({fill_['frames_per_s_wall']:,.0f} frames/s wall incl. the feeding loop)")
    print(f"fill time    {fill_['wall_s']:.0f} s (final flush {fill_['flush_s']:.2f} s, "
          f"close {result['close_s']:.2f} s)")
    print(f"sample({args.batch_size})   live writer: median "
          f"{result['sample_live']['median_ms']:.3f} ms, p90 {result['sample_live']['p90_ms']:.3f}"
          f" ms over {result['sampleable']:,} sampleable")
    print(f"RSS growth   {g['VmRSS']:,.0f} MiB (anon {g.get('RssAnon', float('nan')):,.0f}, "
          f"peak {g['VmHWM']:,.0f}); raw frames would be {disk['raw_mib']:,.0f} MiB")
    print(f"disk         {disk['file_mib']:,.0f} MiB in files ({disk['file_pct']:.1f}% of raw), "
          f"{disk['allocated_mib']:,.0f} MiB allocated ({disk['allocated_pct']:.1f}%), "
          f"{disk['files']:,} files")
    how = "?" if resident is None else f"{100 * resident:.1f}% resident after eviction"
    print(f"reopened     page cache evicted ({how}): open {again['open_s']:.2f} s + first batch "
          f"{again['first_batch_s'] * 1e3:.0f} ms; sample median "
          f"{again['sample']['median_ms']:.3f} ms (p90 {again['sample']['p90_ms']:.3f})")
    print(f"total        {result['seconds']:.0f} s")


def main() -> None:
    args = parse_args(Args, description=__doc__)
    malloc = steady_malloc() if args.steady_malloc else "unchanged (--no-steady-malloc)"
    start = time.perf_counter()
    rec = record_frames(args.game, args.distinct_frames, args.seed, cache_dir=args.cache_dir,
                        progress=True)
    tmp = None if args.store_dir else tempfile.mkdtemp(prefix="mmreplay_scale_")
    path = Path(args.store_dir or tmp or "") / "store"
    result: dict[str, Any] = {"machine": {**machine_info(), "malloc": malloc},
                              "config": asdict(args)}
    try:
        result.update(run(path, rec, args))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    result["seconds"] = time.perf_counter() - start
    print_report(result, args)
    out = write_json(result, Path(args.out_dir), "scale.json")
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
