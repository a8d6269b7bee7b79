"""The scale sections (ram, cold, open, flush) and disk: the parent side that starts the
workers, and their printed tables.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from ale_frames import record_frames

from benchlib.baselines import missing
from benchlib.config import Args
from benchlib.core import bench_disk
from benchlib.harness import feed, new_store
from benchlib.workers import run_worker


def ram_row(args: Args, root: Path, scale_store: Path | None, system: str,
            frames: int) -> dict[str, Any]:
    """One `ram` row: a worker filling `system` with `frames` frames (into `scale_store`, which
    the later sections read, or a directory of its own, removed after)."""
    reason = missing(system)
    if reason is not None:
        print(f"ram: skipping {system}: {reason}", file=sys.stderr)
        return {"system": system, "frames": frames, "skipped": reason}
    path = scale_store or root / f"ram_{system}_{frames}"
    print(f"ram: {system} with {frames:,} frames", file=sys.stderr)
    row = run_worker("ram", args, system=system, frames=frames, path=str(path))
    if scale_store is None:
        shutil.rmtree(path, ignore_errors=True)
    return row


def run_jobs(jobs: list[Callable[[], dict[str, Any]]], *, two_at_a_time: bool
             ) -> list[dict[str, Any]]:
    """The jobs' results, in order. `--quick` (a smoke run, whose figures nobody compares)
    runs two workers at a time; a real run, one: each figure gets the machine to itself."""
    if not two_at_a_time:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda job: job(), jobs))


def bench_scale(args: Args, root: Path, sections: list[str]) -> dict[str, Any]:
    record_frames(args.game, args.distinct_frames, args.seed, cache_dir=args.cache_dir,
                  progress=True)  # record once here, workers load the cache
    store = root / "scale_store"
    plan = [("mmreplay", args.scale_frames), ("cpprb", args.scale_frames),
            ("numpy", args.scale_frames), ("mmreplay", args.small_frames),
            ("cpprb", args.small_frames), ("sb3", args.small_frames),
            ("torchrl", args.small_frames)] if "ram" in sections else \
        [("mmreplay", args.scale_frames)]
    rows = [ram_row(args, root, store, *plan[0])]  # fills the store the sections below read
    jobs = [partial(ram_row, args, root, None, system, frames) for system, frames in plan[1:]]
    if "cold" in sections:  # reads the store only: beside the ram rows under --quick
        print("cold: sample with cache_bytes=1", file=sys.stderr)
        jobs.append(partial(run_worker, "cold", args, path=str(store),
                            frames_held=args.scale_frames))
    done = run_jobs(jobs, two_at_a_time=args.quick)
    cold = done.pop() if "cold" in sections else None
    out: dict[str, Any] = {"ram": rows + done} if "ram" in sections else {}
    if cold is not None:
        out["cold"] = cold
    if "open" in sections:  # evicts and reads the store's files: alone, as cold does
        out["open"] = run_worker("open", args, path=str(store))
    if "flush" in sections:  # writes to the store: last, alone
        print("flush: scale store vs small store", file=sys.stderr)
        out["flush"] = run_worker("flush", args, path=str(store),
                                  frames_held=args.scale_frames,
                                  small_path=str(root / "flush_small"))
    shutil.rmtree(store, ignore_errors=True)
    return out


def bench_disk_games(args: Args, root: Path) -> list[dict[str, Any]]:
    """Bytes on disk / raw bytes for a store of each game's frames (random policy)."""
    rows = []
    for game in (g.strip() for g in args.disk_games.split(",") if g.strip()):
        rec = record_frames(f"ALE/{game}-v5", args.disk_frames, args.seed,
                            cache_dir=args.cache_dir, progress=True)
        path = root / f"disk_{game}"
        with new_store(path, len(rec), args.seed) as store:
            feed(store, rec, len(rec), desc=f"disk {game}")
        rows.append({"game": game, "frames": len(rec), "episodes": rec.num_episodes,
                     **bench_disk(path, len(rec))})
        shutil.rmtree(path)
    return rows


def print_ram(rows: list[dict[str, Any]], args: Args) -> None:
    print(f"\nRAM: RSS growth of a fresh process holding N frames (after the fill and "
          f"{args.warmup + args.reps} sample({args.batch_size}) calls);")
    print(f"     frames cycled from {args.distinct_frames:,} distinct real {args.game} frames; "
          f"mmreplay with its default cache_bytes=0 (the OS page cache holds the frame files)")
    print(f"  {'system':<10}{'frames':>11}{'RSS MiB':>10}{'anon':>9}{'file':>9}{'peak':>9}"
          f"{'B/frame':>9}{'add steps/s':>13}{'sample ms':>11}")
    for row in rows:
        if "skipped" in row:
            print(f"  {row['system']:<10}{row['frames']:>11,}  skipped: {row['skipped']}")
            continue
        g = row["growth_mib"]
        print(f"  {row['system']:<10}{row['frames']:>11,}{g['VmRSS']:>10,.0f}"
              f"{g.get('RssAnon', float('nan')):>9,.0f}{g.get('RssFile', float('nan')):>9,.0f}"
              f"{g['VmHWM']:>9,.0f}{g['VmRSS'] * 2**20 / row['frames']:>9,.0f}"
              f"{row['steps_per_s']:>13,.0f}{row['sample']['median_ms']:>11.3f}")
    for row in rows:
        if row["system"] == "torchrl" and "disk_file_mib" in row:
            print(f"  torchrl memmap files: {row['disk_file_mib']:,.0f} MiB on disk")


def print_disk_games(rows: list[dict[str, Any]]) -> None:
    print("\ndisk per game (random policy; frames + step columns + manifest):")
    print(f"  {'game':<15}{'frames':>8}{'raw MiB':>9}{'files MiB':>11}{'% raw':>7}"
          f"{'alloc MiB':>11}{'% raw':>7}")
    for r in rows:
        print(f"  {r['game']:<15}{r['frames']:>8,}{r['raw_mib']:>9.0f}{r['file_mib']:>11.2f}"
              f"{r['file_pct']:>7.1f}{r['allocated_mib']:>11.2f}{r['allocated_pct']:>7.1f}")


def print_cold(result: dict[str, Any], args: Args) -> None:
    cold, n, b = result["cold"], args.scale_frames, args.batch_size
    resident = cold["evicted"]["resident_fraction"]
    how = "unchecked (no fincore)" if resident is None else f"{100 * resident:.1f}% resident"
    print(f"\nsample({b}) at {n:,} frames ({cold['chunk_files']:,} frame files), median ms:")
    rows = [("mmreplay, cache_bytes=1, page cache warm (decode-cold)", cold["warm"]),
            (f"mmreplay, cache_bytes=1, page cache evicted ({how})", cold["page_cold"]),
            ("naive zarr, page cache warm", cold["naive_warm"]),
            ("naive zarr, page cache evicted", cold["naive_page_cold"])]
    for row in result.get("ram", []):
        if row["frames"] == n and "skipped" not in row:
            label = {"mmreplay": "mmreplay live writer, cache_bytes=0",
                     "cpprb": "cpprb (RAM)", "numpy": "numpy gather (RAM floor)"}[row["system"]]
            rows.append((label, row["sample"]))
    for label, lat in rows:
        print(f"  {label:<62}{lat['median_ms']:>9.3f}  (p90 {lat['p90_ms']:.3f}, "
              f"{lat['reps']} calls)")
    if "drop_caches" in cold["evicted"]:
        print(f"  /proc/sys/vm/drop_caches: {cold['evicted']['drop_caches']}")


def print_open_flush(result: dict[str, Any], args: Args) -> None:
    if "open" in result:
        o = result["open"]
        print(f"\nopen + first batch, {args.scale_frames:,}-frame store (imports excluded):")
        for name in ("cold", "warm"):
            print(f"  {name:<5} open {o[name]['open_s']:.3f} s + first batch "
                  f"{o[name]['first_batch_s'] * 1e3:.1f} ms = {o[name]['total_s']:.3f} s")
    if "flush" in result:
        f = result["flush"]
        print(f"\nflush after {args.flush_steps:,} new steps (open r+ of the big store: "
              f"{f['open_rw_s']:.2f} s):")
        for name in ("big", "small"):
            times = ", ".join(f"{t * 1e3:.0f}" for t in f[name]["flush_s"])
            print(f"  {f[name]['capacity']:>11,}-frame store: median "
                  f"{f[name]['median_s'] * 1e3:.0f} ms ({times} ms)")
