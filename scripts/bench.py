"""Core figures for mmreplay on real Atari frames: add throughput and sample latency vs baselines.

    python scripts/bench.py                  # 100k Breakout frames (recorded once, then cached)
    python scripts/bench.py --frames 20000   # smaller
    python scripts/bench.py --quick          # tiny smoke run, writes core_quick.json

Sections, each a function that returns a dict of figures:

    add          `ReplayStore.add` steps/s into a single-env store (frame_stack=4)
    sample       `ReplayStore.sample(batch)` latency, from a store holding all recorded frames:
                 on the live writer (its chunk cache warm from writing), then reopened "r"
    disk         that store's size on disk against the raw frame bytes
    numpy_floor  the same batch gathered from an in-RAM numpy array with fancy indexing
    naive_zarr   the same batch read per sample from the store's zarr `frames` array

Prints a table and writes it, with machine info, as JSON under `--out-dir`. Figures only: speed
targets are read by people, never asserted. Later sections (prioritized sampling, cpprb) are
more functions of the same shape, called from `main`.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from ale_frames import CACHE_DIR, AleFrames, cache_path, record_frames
from tqdm import tqdm

import mmreplay
from mmreplay import ReplayStore

FRAME_STACK = 4


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """gymnasium id of the ALE game whose frames are used"""
    frames: int = 100_000
    """frames recorded and held by the store that `sample` is timed on"""
    add_steps: int = 20_000
    """frames (steps plus episode starts) fed to a fresh store to time `add`"""
    batch_size: int = 32
    """transitions per sampled batch"""
    reps: int = 500
    """timed calls per latency figure"""
    warmup: int = 20
    """untimed calls before each latency figure"""
    seed: int = 0
    """seed of the recording, the stores and the baselines' index draws"""
    out_dir: str = "data/bench"
    """directory of the JSON result"""
    cache_dir: str = str(CACHE_DIR)
    """where recorded frames are cached as .npz"""
    quick: bool = False
    """tiny run for smoke tests (2k frames, few reps); writes core_quick.json"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, for `--help`."""
    body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
    return {
        node.target.id: doc.value.value
        for node, doc in zip(body, body[1:], strict=False)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    docs = field_docs(Args)
    for f in fields(Args):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=docs.get(f.name))
        else:
            parser.add_argument(flag, type=type(default), default=default,
                                help=f"{docs.get(f.name)} (default: {default})")
    args = Args(**vars(parser.parse_args()))
    if args.quick:
        args = replace(args, frames=min(args.frames, 2000), add_steps=min(args.add_steps, 2000),
                       reps=min(args.reps, 50), warmup=min(args.warmup, 5))
    return args


# -- helpers ------------------------------------------------------------------------------------


def latency_ms(fn: Callable[[], object], *, reps: int, warmup: int) -> dict[str, float]:
    """Median, p90 and mean wall time of `fn()` in milliseconds."""
    for _ in range(warmup):
        fn()
    times = np.empty(reps)
    for i in range(reps):
        start = time.perf_counter_ns()
        fn()
        times[i] = (time.perf_counter_ns() - start) / 1e6
    return {"median_ms": float(np.median(times)), "p90_ms": float(np.percentile(times, 90)),
            "mean_ms": float(times.mean()), "reps": reps}


def new_store(path: Path, capacity: int, seed: int) -> ReplayStore:
    return ReplayStore.create(path, capacity=capacity, obs_shape=(84, 84), obs_dtype=np.uint8,
                              frame_stack=FRAME_STACK, seed=seed)


def feed(store: ReplayStore, rec: AleFrames, stop: int, *, desc: str) -> None:
    """Hand the first `stop` recorded frames to `store`, in the order an agent saw them."""
    for i in tqdm(range(stop), desc=desc, unit="frame", mininterval=1.0, leave=False):
        if rec.is_first[i]:
            store.reset(rec.frames[i])
        else:
            store.add(rec.actions[i], rec.rewards[i], rec.frames[i], rec.terminated[i],
                      rec.truncated[i])


def window_starts(rng: np.random.Generator, n_frames: int, size: int) -> np.ndarray:
    """`size` random frames t whose window t-3 .. t+1 (obs and next stack) lies in [0, n)."""
    return rng.integers(FRAME_STACK - 1, n_frames - 1, size=size)


def dir_bytes(path: Path) -> tuple[int, int]:
    """Bytes under `path`: the files' sizes, and the filesystem blocks of files and folders."""
    paths = list(path.rglob("*"))
    files = sum(p.stat().st_size for p in paths if p.is_file())
    return files, sum(p.stat().st_blocks * 512 for p in paths)


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "mmreplay": getattr(mmreplay, "__version__", "unknown"),
        "loadavg_1m_at_start": os.getloadavg()[0],  # other work on the machine skews figures
    }


# -- sections -----------------------------------------------------------------------------------


def bench_record(args: Args) -> tuple[AleFrames, dict[str, Any]]:
    """Recorded frames (cached after the first run) and how fast they were recorded."""
    cached = cache_path(args.game, args.frames, args.seed, Path(args.cache_dir)).exists()
    start = time.perf_counter()
    rec = record_frames(args.game, args.frames, args.seed, cache_dir=args.cache_dir,
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
            "disk_mib": dir_bytes(root / "add_store")[0] / 2**20}


def bench_sample(store: ReplayStore, args: Args) -> dict[str, Any]:
    """`sample(batch_size)` latency of `store`."""
    batch = store.sample(args.batch_size)
    out = latency_ms(lambda: store.sample(args.batch_size), reps=args.reps, warmup=args.warmup)
    return {**out, "sampleable": len(store), "obs_shape": list(batch.obs.shape),
            "next_obs_shape": list(batch.next_obs.shape)}


def bench_disk(path: Path, frames_held: int) -> dict[str, Any]:
    """Store size: file bytes (what zstd achieved) and allocated blocks (what the disk pays)."""
    raw = frames_held * 84 * 84
    files, allocated = dir_bytes(path)
    frame_files, _ = dir_bytes(path / "frames")
    return {"raw_mib": raw / 2**20, "file_mib": files / 2**20,
            "frame_file_mib": frame_files / 2**20, "allocated_mib": allocated / 2**20,
            "ratio_files": raw / files, "ratio_allocated": raw / allocated}


def bench_numpy_floor(frames: np.ndarray, args: Args) -> dict[str, Any]:
    """Gather (obs stack, next stack) windows from RAM: the cost of the bytes alone."""
    rng = np.random.default_rng(args.seed)
    offsets = np.arange(-(FRAME_STACK - 1), 2)

    def gather() -> tuple[np.ndarray, np.ndarray]:
        t = window_starts(rng, len(frames), args.batch_size)
        window = frames[t[:, None] + offsets]  # (B, stack + 1, 84, 84)
        return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])

    return latency_ms(gather, reps=args.reps, warmup=args.warmup)


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


# -- report -------------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    rec, add = result["record"], result["add"]
    how = "from cache" if rec["cached"] else f"{rec['frames_per_s']:.0f} frames/s"
    print(f"\nframes   {rec['frames']} {result['config']['game']} frames, "
          f"{rec['episodes']} episodes ({how})")
    print(f"add      {add['steps_per_s']:.0f} steps/s over {add['adds']} steps "
          f"(flush {add['flush_s'] * 1e3:.0f} ms, {add['disk_mib']:.1f} MiB on disk)")
    disk = result["disk"]
    print(f"disk     {disk['raw_mib']:.0f} MiB raw -> {disk['file_mib']:.1f} MiB in files "
          f"({disk['ratio_files']:.0f}x), {disk['allocated_mib']:.1f} MiB allocated incl. folders "
          f"({disk['ratio_allocated']:.1f}x)")
    floor = result["numpy_floor"]["median_ms"]
    print(f"\nsample({result['config']['batch_size']}) of {FRAME_STACK}-frame obs + next_obs "
          f"stacks, {result['sample']['sampleable']} sampleable:")
    print(f"  {'':<18}{'median ms':>10}{'p90 ms':>10}{'x numpy':>10}")
    for name in ("sample", "sample_reopened", "numpy_floor", "naive_zarr"):
        row = result[name]
        print(f"  {name:<18}{row['median_ms']:>10.3f}{row['p90_ms']:>10.3f}"
              f"{row['median_ms'] / floor:>10.1f}")
    print(f"  naive zarr / mmreplay: {result['ratios']['naive_zarr_over_sample']:.1f}x")


def write_json(result: dict[str, Any], out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def main() -> None:
    args = parse_args()
    rec, record = bench_record(args)
    result: dict[str, Any] = {"machine": machine_info(), "config": asdict(args), "record": record}
    with tempfile.TemporaryDirectory(prefix="mmreplay_bench_") as tmp:
        root = Path(tmp)
        result["add"] = bench_add(rec, args.add_steps, root, args.seed)
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
    median = {name: result[name]["median_ms"]
              for name in ("sample", "sample_reopened", "numpy_floor", "naive_zarr")}
    result["ratios"] = {
        "sample_over_numpy": median["sample"] / median["numpy_floor"],
        "sample_reopened_over_numpy": median["sample_reopened"] / median["numpy_floor"],
        "naive_zarr_over_numpy": median["naive_zarr"] / median["numpy_floor"],
        "naive_zarr_over_sample": median["naive_zarr"] / median["sample"],
    }
    print_table(result)
    path = write_json(result, Path(args.out_dir), "core_quick.json" if args.quick else "core.json")
    print(f"\nwrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
