"""Figures about a process (RSS, caches, open, flush) come from a fresh interpreter:
``bench.py _worker JOB`` runs one of `WORKERS` and prints its result as JSON.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from ale_frames import AleFrames, record_frames

from benchlib.baselines import BUFFERS
from benchlib.config import Args
from benchlib.core import bench_naive_zarr
from benchlib.harness import (
    evict,
    feed_timed,
    latency_ms,
    memory_growth,
    memory_status,
    new_store,
    read_files,
    steady_malloc,
)
from mmreplay import ReplayStore

WORKER = "_worker"
BENCH = Path(__file__).resolve().parents[1] / "bench.py"  # `bench.py _worker JOB` runs one


def load_distinct(args: Args) -> AleFrames:
    return record_frames(args.game, args.distinct_frames, args.seed, cache_dir=args.cache_dir)


def worker_ram(args: Args, *, system: str, frames: int, path: str) -> dict[str, Any]:
    """Fill one buffer with `frames` frames and sample it; RSS before, filled, sampled."""
    rec = load_distinct(args)
    gc.collect()
    before = memory_status()
    start = time.perf_counter()
    buffer = BUFFERS[system](frames, Path(path), args)
    create_s = time.perf_counter() - start
    adds, seconds = buffer.fill(rec, frames)
    filled = memory_status()
    sample = latency_ms(buffer.sample, reps=args.reps, warmup=args.warmup)
    sampled = memory_status()
    return {"system": system, "frames": frames, "distinct_frames": len(rec), "adds": adds,
            "add_seconds": seconds, "steps_per_s": adds / seconds, "create_s": create_s,
            "sample": sample, "rss_before": before, "rss_filled": filled,
            "rss_sampled": sampled, "growth_filled_mib": memory_growth(before, filled),
            "growth_mib": memory_growth(before, sampled), **buffer.close()}


def worker_cold(args: Args, *, path: str, frames_held: int) -> dict[str, Any]:
    """sample() of a store reopened with cache_bytes=1, page cache warm then evicted."""
    root = Path(path)
    chunks = sorted((root / "frames").glob("c.*"))
    store = ReplayStore.open(root, mode="r", cache_bytes=1)
    draw: Callable[[], object] = lambda: store.sample(args.batch_size)  # noqa: E731
    naive = replace(args, reps=args.naive_reps, warmup=1)
    read_files(chunks)
    out: dict[str, Any] = {"chunk_files": len(chunks),
                           "warm": latency_ms(draw, reps=args.cold_reps, warmup=args.warmup),
                           "naive_warm": bench_naive_zarr(root, frames_held, naive)}
    store.close()  # its mappings would keep the frame files' pages resident
    out["evicted"] = evict(chunks, drop_caches=args.drop_caches)
    store = ReplayStore.open(root, mode="r", cache_bytes=1)
    out["page_cold"] = latency_ms(draw, reps=args.page_cold_reps, warmup=0)
    store.close()
    out["naive_evicted"] = evict(chunks, drop_caches=args.drop_caches)
    out["naive_page_cold"] = bench_naive_zarr(root, frames_held, replace(naive, warmup=0))
    return out


def open_first_batch(root: Path, batch_size: int) -> dict[str, float]:
    start = time.perf_counter()
    store = ReplayStore.open(root, mode="r")
    opened = time.perf_counter()
    store.sample(batch_size)
    done = time.perf_counter()
    store.close()
    return {"open_s": opened - start, "first_batch_s": done - opened, "total_s": done - start}


def worker_open(args: Args, *, path: str) -> dict[str, Any]:
    """Open + first batch with every file of the store evicted, then again (warm)."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    evicted = evict(files, drop_caches=args.drop_caches)
    cold = open_first_batch(root, args.batch_size)
    return {"evicted": evicted, "cold": cold, "warm": open_first_batch(root, args.batch_size)}


def flush_rounds(store: ReplayStore, rec: AleFrames, start: int, args: Args) -> dict[str, Any]:
    """Add --flush-steps stream positions then time flush(), --flush-rounds times."""
    times = []
    for r in range(args.flush_rounds):
        first = start + r * args.flush_steps
        feed_timed(store, rec, first, first + args.flush_steps, desc="steps", progress=False)
        begin = time.perf_counter()
        store.flush()
        times.append(time.perf_counter() - begin)
    store.close()
    return {"capacity": store.spec.capacity, "flush_s": times,
            "median_s": float(np.median(times))}


def worker_flush(args: Args, *, path: str, frames_held: int, small_path: str) -> dict[str, Any]:
    """Flush cost on the (full) scale store vs on a full --flush-small store."""
    rec = load_distinct(args)
    begin = time.perf_counter()
    store = ReplayStore.open(path, mode="r+")
    open_s = time.perf_counter() - begin
    big = flush_rounds(store, rec, frames_held, args)  # continues the stream the fill left
    small_store = new_store(Path(small_path), args.flush_small, args.seed)
    feed_timed(small_store, rec, 0, args.flush_small, desc="fill small store")
    small_store.flush()
    small = flush_rounds(small_store, rec, args.flush_small, args)
    return {"open_rw_s": open_s, "big": big, "small": small,
            "ratio": big["median_s"] / small["median_s"]}


WORKERS: dict[str, Callable[..., dict[str, Any]]] = {
    "ram": worker_ram, "cold": worker_cold, "open": worker_open, "flush": worker_flush}


def run_worker(kind: str, args: Args, **job: Any) -> dict[str, Any]:
    """`WORKERS[kind](args, **job)` in a fresh interpreter; progress and errors go to stderr."""
    payload = json.dumps({"kind": kind, "args": asdict(args), **job})
    proc = subprocess.run([sys.executable, str(BENCH), WORKER, payload],
                          stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker {kind} {job} exited with {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_main(payload: str) -> None:
    job = json.loads(payload)
    args, kind = Args(**job.pop("args")), job.pop("kind")
    if args.steady_malloc:
        steady_malloc()
    saved = os.dup(1)
    os.dup2(2, 1)  # library chatter goes to stderr; stdout carries only the result
    try:
        result = WORKERS[kind](args, **job)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(json.dumps(result), flush=True)
