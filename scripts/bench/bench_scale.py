"""mmreplay at scale: a 10M-frame store of real Atari frames — add rate, sample, RSS, disk, time.

    python scripts/bench/bench_scale.py                     # 10,000,000 frames (~15 min quiet;
                                                      # the A/B's readers add a few GiB RSS)
    python scripts/bench/bench_scale.py --frames 2000000    # smaller
    python scripts/bench/bench_scale.py --frames 3000 --distinct-frames 2000 --reps 5   # smoke run
    python scripts/bench/bench_scale.py --store-dir /tmp/big --reuse   # the A/B again, no refill

One single-env store (frame_stack=4, `cache_bytes = --cache-mib` MiB) is filled by cycling
through `--distinct-frames` real recorded frames (so compression reflects those distinct frames
only), with a progress line every `--report-every` frames. Then: sample(batch) latency on the
live writer; the A/B (`--compare-frames`): a second store of 1M frames filled the same way,
and `sample` of both live writers and of readers of both with and without a decoded-chunk
cache of `--ab-cache-mib`, timed in turn (`benchlib.alternate`) with page faults per call;
RSS growth; size on disk; and, after evicting the store's files from the page cache, open +
first batch and sample latency of the store reopened read-only. Writes `scale.json` under
`--out-dir`. Figures only: targets are read by people, never asserted.
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from ale_frames import CACHE_DIR, AleFrames, record_frames
from benchlib.alternate import alternate, mappings, max_mappings, ratio
from benchlib.core import bench_disk
from benchlib.harness import (
    evict,
    feed_timed,
    latency_ms,
    machine_info,
    memory_growth,
    memory_status,
    new_store,
    resident_fraction,
    steady_malloc,
    write_json,
)
from common import run_main

from mmreplay import ReplayStore


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """gymnasium id of the ALE game whose frames fill the store"""
    frames: int = 10_000_000
    """frames fed to (and held by) the store; its capacity"""
    distinct_frames: int = 200_000
    """real frames recorded (cached under --cache-dir) and cycled to reach --frames"""
    cache_mib: int = 0
    """the stores' decoded-chunk cache, MiB (`cache_bytes`); 0 is a pixel store's default
    (runs before the A/B used 512, which alone made sampling several times slower)"""
    compare_frames: int = 1_000_000
    """frames of the second store the A/B samples beside the first (fewer than --frames;
    0: no A/B)"""
    ab_cache_mib: int = 512
    """the A/B's cached arms: readers of both stores with this `cache_bytes`, MiB"""
    rounds: int = 10
    """A/B rounds; each times reps // rounds calls of every arm in turn"""
    reuse: bool = False
    """with --store-dir: reopen stores already there instead of filling them again"""
    batch_size: int = 32
    """transitions per sampled batch"""
    reps: int = 200
    """timed sample calls per latency figure"""
    warmup: int = 600
    """sample calls before the timed ones (the A/B times them apart as `first_calls`): a
    store maps a shard file when a batch first touches it, and a batch touches ~48 of the
    2,442 files of 10M frames, so ~500 batches pass before all are mapped"""
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


def fill(store: ReplayStore, rec: AleFrames, frames: int, args: Args) -> dict[str, Any]:
    """Feed `frames` stream positions, printing progress; rates count time inside add/reset."""
    start, adds, spent, progress = time.perf_counter(), 0, 0.0, []
    print(f"{'frames':>14}{'steps/s':>10}{'RSS MiB':>10}{'elapsed s':>11}", flush=True)
    for first in range(0, frames, args.report_every):
        stop = min(frames, first + args.report_every)
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
            "steps_per_s": adds / (spent + flush_s), "frames_per_s_wall": frames / wall,
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


def build(path: Path, frames: int, rec: AleFrames, args: Args
          ) -> tuple[ReplayStore, dict[str, Any] | None]:
    """A writer of a `frames`-frame store at `path`: the one there (--reuse) or a new one,
    filled; with the fill's figures (None when reused)."""
    cache = args.cache_mib << 20
    if args.reuse and (path / "manifest.json").exists():
        store = ReplayStore.open(path, mode="r+", cache_bytes=cache)
        if store.spec.capacity != frames:
            store.close()
            raise SystemExit(f"{path} holds {store.spec.capacity:,} frames, not {frames:,}: "
                             f"remove it or drop --reuse")
        print(f"reusing {path} ({len(store):,} sampleable)", flush=True)
        return store, None
    store = new_store(path, frames, args.seed, cache_bytes=cache)
    return store, fill(store, rec, frames, args)


def label(frames: int) -> str:
    return f"{frames / 1e6:g}M" if frames >= 1_000_000 else f"{frames / 1e3:g}k"


def compare(big: ReplayStore, path: Path, rec: AleFrames, args: Args) -> dict[str, Any]:
    """The A/B: the live writers of both stores, and readers of each with no decoded-chunk
    cache and with --ab-cache-mib, their `sample` timed in turn."""
    small_path = path.with_name(f"{path.name}_{args.compare_frames}")
    small, small_fill = build(small_path, args.compare_frames, rec, args)
    names = (label(args.frames), label(args.compare_frames))
    arms: dict[str, ReplayStore] = {f"live {names[0]}": big, f"live {names[1]}": small}
    readers = []
    try:
        for name, where in zip(names, (path, small_path), strict=True):
            for mib in dict.fromkeys((0, args.ab_cache_mib)):
                readers.append(ReplayStore.open(where, mode="r", cache_bytes=mib << 20))
                arms[f"reader {name}, cache {mib} MiB"] = readers[-1]
        maps = mappings()
        timed = alternate({k: partial(s.sample, args.batch_size) for k, s in arms.items()},
                          rounds=args.rounds, reps=args.reps, warmup=args.warmup)
        frames = sorted(p for p in (path / "frames").iterdir() if p.is_file())
        out = {"arms": timed, "fill_compared": small_fill, "names": names,
               "mappings": {"before": maps, "after": mappings(), "limit": max_mappings()},
               "resident_fraction": resident_fraction(frames, probe=400)}
    finally:
        for reader in readers:
            reader.close()
        small.close()
    out["ratios"] = ab_ratios(timed, names, args.ab_cache_mib)
    return out


def ab_ratios(timed: dict[str, Any], names: tuple[str, str], mib: int) -> dict[str, Any]:
    """Big / small store for each kind of arm, and the cache's cost on each store."""
    big, small = names
    out = {f"live {big} / live {small}": ratio(timed[f"live {big}"], timed[f"live {small}"])}
    for cache in dict.fromkeys((0, mib)):
        out[f"reader {big} / {small}, cache {cache} MiB"] = ratio(
            timed[f"reader {big}, cache {cache} MiB"], timed[f"reader {small}, cache {cache} MiB"])
    for name in names if mib else ():
        out[f"reader {name}: cache {mib} / 0 MiB"] = ratio(
            timed[f"reader {name}, cache {mib} MiB"], timed[f"reader {name}, cache 0 MiB"])
    return out


def run(path: Path, rec: AleFrames, args: Args) -> dict[str, Any]:
    gc.collect()
    before = memory_status()
    store, filled_by = build(path, args.frames, rec, args)
    out: dict[str, Any] = {"fill": filled_by}
    filled = memory_status()
    out["sample_live"] = alternate({"live": partial(store.sample, args.batch_size)},
                                   rounds=1, reps=args.reps, warmup=args.warmup)["live"]
    sampled = memory_status()
    out["sampleable"] = len(store)
    if 0 < args.compare_frames < args.frames:
        out["ab"] = compare(store, path, rec, args)
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


def print_ab(ab: dict[str, Any]) -> None:
    print(f"\nA/B, sample(32) timed in turn ({ab['mappings']['after']} mappings, limit "
          f"{ab['mappings']['limit']}; frame files {_pct(ab['resident_fraction'])} in the "
          f"page cache)")
    print(f"{'arm':<34}{'median ms':>10}{'p90 ms':>9}{'minflt':>8}{'majflt':>8}"
          f"{'first calls: median':>21}{'p90':>8}")
    for name, row in ab["arms"].items():
        first = row["first_calls"] or {"median_ms": float("nan"), "p90_ms": float("nan")}
        print(f"{name:<34}{row['median_ms']:>10.3f}{row['p90_ms']:>9.3f}"
              f"{row['minflt_per_call']:>8.1f}{row['majflt_per_call']:>8.2f}"
              f"{first['median_ms']:>21.3f}{first['p90_ms']:>8.3f}")
    for name, r in ab["ratios"].items():
        print(f"{name:<40} median {r['median']:5.2f}x  p90 {r['p90']:5.2f}x")


def _pct(fraction: float | None) -> str:
    return "?" if fraction is None else f"{100 * fraction:.1f}%"


def print_report(result: dict[str, Any], args: Args) -> None:
    fill_, rss, disk, again = (result[k] for k in ("fill", "rss", "disk", "reopened"))
    g = rss["growth_mib"]
    resident = again["evicted"]["resident_fraction"]
    print(f"\n{args.frames:,} frames cycled from {args.distinct_frames:,} distinct real "
          f"{args.game} frames, cache_bytes = {args.cache_mib} MiB")
    if fill_ is not None:
        print(f"add          {fill_['steps_per_s']:,.0f} steps/s in add/reset calls + final "
              f"flush ({fill_['frames_per_s_wall']:,.0f} frames/s wall incl. the feeding loop)")
        print(f"fill time    {fill_['wall_s']:.0f} s (final flush {fill_['flush_s']:.2f} s, "
              f"close {result['close_s']:.2f} s)")
    live, first = result["sample_live"], result["sample_live"]["first_calls"]
    print(f"sample({args.batch_size})   live writer: median {live['median_ms']:.3f} ms, p90 "
          f"{live['p90_ms']:.3f} ms over {result['sampleable']:,} sampleable"
          + ("" if first is None else f" (first {args.warmup} calls: median "
             f"{first['median_ms']:.3f} ms, p90 {first['p90_ms']:.3f})"))
    print(f"RSS growth   {g['VmRSS']:,.0f} MiB (anon {g.get('RssAnon', float('nan')):,.0f}, "
          f"peak {g['VmHWM']:,.0f}); raw frames would be {disk['raw_mib']:,.0f} MiB")
    print(f"disk         {disk['file_mib']:,.0f} MiB in files ({disk['file_pct']:.1f}% of raw), "
          f"{disk['allocated_mib']:,.0f} MiB allocated ({disk['allocated_pct']:.1f}%), "
          f"{disk['files']:,} files")
    how = "?" if resident is None else f"{100 * resident:.1f}% resident after eviction"
    print(f"reopened     page cache evicted ({how}): open {again['open_s']:.2f} s + first batch "
          f"{again['first_batch_s'] * 1e3:.0f} ms; sample median "
          f"{again['sample']['median_ms']:.3f} ms (p90 {again['sample']['p90_ms']:.3f})")
    if "ab" in result:
        print_ab(result["ab"])
    print(f"total        {result['seconds']:.0f} s")


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
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
