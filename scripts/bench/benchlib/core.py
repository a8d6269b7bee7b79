"""The core section: add, sample (live and reopened), disk, the numpy floor and naive zarr,
on `--frames` recorded Breakout frames.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from ale_frames import AleFrames, cache_path, record_frames

from benchlib.config import Args
from benchlib.harness import (
    FRAME_BYTES,
    FRAME_STACK,
    disk_usage,
    feed,
    feed_timed,
    latency_ms,
    new_store,
    numpy_gather,
    window_starts,
)
from mmreplay import ReplayStore


def bench_record(args: Args, n_frames: int) -> tuple[AleFrames, dict[str, Any]]:
    """Recorded frames (cached after the first run) and how fast they were recorded."""
    cached = cache_path(args.game, n_frames, args.seed, Path(args.cache_dir)).exists()
    start = time.perf_counter()
    rec = record_frames(args.game, n_frames, args.seed, cache_dir=args.cache_dir,
                        progress=True)
    seconds = time.perf_counter() - start
    return rec, {"frames": len(rec), "episodes": rec.num_episodes, "cached": cached,
                 "seconds": seconds, "frames_per_s": None if cached else len(rec) / seconds}


def bench_add(rec: AleFrames, n_frames: int, root: Path, seed: int) -> dict[str, Any]:
    """`add` (and `reset`) throughput into a fresh single-env store big enough for every frame."""
    n_frames = min(n_frames, len(rec))
    store = new_store(root / "add_store", n_frames, seed)
    start = time.perf_counter()
    feed(store, rec, n_frames, desc="add")
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    store.flush()
    flush_s = time.perf_counter() - start
    store.close()
    adds = int((~rec.is_first[:n_frames]).sum())
    return {"frames": n_frames, "adds": adds, "seconds": seconds, "flush_s": flush_s,
            "steps_per_s": adds / seconds, "frames_per_s": n_frames / seconds,
            "disk_mib": disk_usage(root / "add_store")[0] / 2**20}


def bench_add_wrapped(rec: AleFrames, root: Path, seed: int) -> dict[str, Any]:
    """`add` once the ring has wrapped (what a long run sees): a store of a quarter of the
    recorded frames is filled once, then timed over the other three quarters."""
    capacity = len(rec) // 4
    store = new_store(root / "wrapped_store", capacity, seed)
    feed_timed(store, rec, 0, capacity, desc="first lap")
    adds, seconds = feed_timed(store, rec, capacity, len(rec), desc="laps 2-4")
    store.close()
    return {"capacity": capacity, "adds": adds, "seconds": seconds,
            "steps_per_s": adds / seconds}


def bench_sample(store: ReplayStore, args: Args) -> dict[str, Any]:
    """`sample(batch_size)` latency of `store`."""
    batch = store.sample(args.batch_size)
    out = latency_ms(lambda: store.sample(args.batch_size), reps=args.reps, warmup=args.warmup)
    return {**out, "sampleable": len(store), "obs_shape": list(batch.obs.shape),
            "next_obs_shape": list(batch.next_obs.shape)}


def bench_disk(path: Path, frames_held: int) -> dict[str, Any]:
    """Store size: file bytes (what zstd achieved) and allocated blocks (what the disk pays)."""
    raw = frames_held * FRAME_BYTES
    files, allocated = disk_usage(path)
    frame_files, frame_allocated = disk_usage(path / "frames")
    return {"raw_mib": raw / 2**20, "file_mib": files / 2**20,
            "frame_file_mib": frame_files / 2**20, "allocated_mib": allocated / 2**20,
            "frame_allocated_mib": frame_allocated / 2**20,
            "ratio_files": raw / files, "ratio_allocated": raw / allocated,
            "file_pct": 100 * files / raw, "allocated_pct": 100 * allocated / raw}


def bench_numpy_floor(frames: np.ndarray, args: Args) -> dict[str, Any]:
    """Gather (obs stack, next stack) windows from RAM: the cost of the bytes alone."""
    rng = np.random.default_rng(args.seed)
    return latency_ms(lambda: numpy_gather(frames, rng, args.batch_size), reps=args.reps,
                      warmup=args.warmup)


def bench_naive_zarr(path: Path, frames_held: int, args: Args) -> dict[str, Any]:
    """Per-sample slicing of the store's zarr `frames` array, as a user without mmreplay would."""
    arr = zarr.open_group(str(path), mode="r")["frames"]
    if not isinstance(arr, zarr.Array):
        raise TypeError(f"{path}/frames is a {type(arr).__name__}, expected a zarr array")
    chunk = arr.chunks[1]
    # Only whole chunks are in the array; the unfinished last one lives in the store's tail.
    on_disk = min(frames_held, arr.shape[1]) // chunk * chunk
    rng = np.random.default_rng(args.seed)

    def gather() -> tuple[np.ndarray, np.ndarray]:
        t = window_starts(rng, on_disk, args.batch_size)
        window = np.stack([arr[0, i - (FRAME_STACK - 1):i + 2] for i in t.tolist()])
        return window[:, :-1], window[:, 1:]

    out = latency_ms(gather, reps=args.reps, warmup=args.warmup)
    return {**out, "array_shape": list(arr.shape), "chunks": list(arr.chunks)}


def bench_core(args: Args, root: Path) -> dict[str, Any]:
    rec, record = bench_record(args, args.frames)
    result: dict[str, Any] = {"record": record}
    result["add"] = bench_add(rec, args.add_steps, root, args.seed)
    result["add_wrapped"] = bench_add_wrapped(rec, root, args.seed)
    path = root / "sample_store"
    with new_store(path, len(rec), args.seed) as store:
        feed(store, rec, len(rec), desc="build")
        store.flush()
        result["sample"] = bench_sample(store, args)
    with ReplayStore.open(path, mode="r") as store:
        result["sample_reopened"] = bench_sample(store, args)
    result["disk"] = bench_disk(path, len(rec))
    result["numpy_floor"] = bench_numpy_floor(rec.frames, args)
    result["naive_zarr"] = bench_naive_zarr(path, len(rec), args)
    shutil.rmtree(path)
    # zarr reads a shard's index on every call: naive slicing of a file-per-chunk store
    # (format 1) is the fairer baseline, so it is measured too
    with new_store(path, len(rec), args.seed, shard_chunks=1) as store:
        feed(store, rec, len(rec), desc="build format 1")
    result["naive_zarr_format1"] = bench_naive_zarr(path, len(rec), args)
    shutil.rmtree(path)
    median = {name: result[name]["median_ms"]
              for name in ("sample", "sample_reopened", "numpy_floor", "naive_zarr")}
    result["ratios"] = {
        "sample_over_numpy": median["sample"] / median["numpy_floor"],
        "sample_reopened_over_numpy": median["sample_reopened"] / median["numpy_floor"],
        "naive_zarr_over_numpy": median["naive_zarr"] / median["numpy_floor"],
        "naive_zarr_over_sample": median["naive_zarr"] / median["sample"],
        "naive_zarr_format1_over_sample": result["naive_zarr_format1"]["median_ms"]
        / median["sample"],
    }
    return result


def print_core(result: dict[str, Any]) -> None:
    rec, add = result["record"], result["add"]
    how = "from cache" if rec["cached"] else f"{rec['frames_per_s']:.0f} frames/s"
    print(f"\nframes   {rec['frames']} {result['config']['game']} frames, "
          f"{rec['episodes']} episodes ({how})")
    print(f"add      {add['steps_per_s']:.0f} steps/s over {add['adds']} steps "
          f"(flush {add['flush_s'] * 1e3:.0f} ms, {add['disk_mib']:.1f} MiB on disk)")
    wrapped = result["add_wrapped"]
    print(f"add      {wrapped['steps_per_s']:.0f} steps/s once the ring wrapped "
          f"({wrapped['capacity']:,}-frame store fed three more laps)")
    disk = result["disk"]
    print(f"disk     {disk['raw_mib']:.0f} MiB raw -> {disk['file_mib']:.1f} MiB in files "
          f"({disk['ratio_files']:.0f}x), {disk['allocated_mib']:.1f} MiB allocated incl. folders "
          f"({disk['ratio_allocated']:.1f}x)")
    floor = result["numpy_floor"]["median_ms"]
    print(f"\nsample({result['config']['batch_size']}) of {FRAME_STACK}-frame obs + next_obs "
          f"stacks, {result['sample']['sampleable']} sampleable:")
    print(f"  {'':<18}{'median ms':>10}{'p90 ms':>10}{'x numpy':>10}")
    for name in ("sample", "sample_reopened", "numpy_floor", "naive_zarr", "naive_zarr_format1"):
        row = result[name]
        print(f"  {name:<18}{row['median_ms']:>10.3f}{row['p90_ms']:>10.3f}"
              f"{row['median_ms'] / floor:>10.1f}")
    ratios = result["ratios"]
    print(f"  naive zarr / mmreplay: {ratios['naive_zarr_over_sample']:.1f}x (shard files), "
          f"{ratios['naive_zarr_format1_over_sample']:.1f}x (a file per chunk)")
