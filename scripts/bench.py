"""Figures for mmreplay on real Atari frames: speed, RAM and disk, side by side with baselines.

    python scripts/bench.py                       # every section (~10 min; frames cached)
    python scripts/bench.py --sections core,disk  # some sections
    python scripts/bench.py --quick               # tiny smoke run, writes core_quick.json

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

Every figure about a process (RSS, caches, open) comes from a fresh subprocess: this file
run as ``bench.py _worker JOB``. Page-cache eviction is `posix_fadvise(DONTNEED)` per file
after `os.sync()` (checked with `fincore`): it empties this machine's page cache for those
files, not a VM host's cache below it. Prints figures with their targets (PASS/SHORT) and
writes them, with machine info, as JSON under `--out-dir`. Targets are read by people, never
asserted.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import ctypes.util
import gc
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import zarr
from ale_frames import CACHE_DIR, AleFrames, cache_path, record_frames
from tqdm import tqdm

import mmreplay
from mmreplay import ReplayStore

FRAME_STACK = 4
FRAME_BYTES = 84 * 84
SECTIONS = ("core", "ram", "disk", "cold", "open", "flush")
SCALE_SECTIONS = {"ram", "cold", "open", "flush"}  # these need the scale store
WORKER = "_worker"
T = TypeVar("T")


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """gymnasium id of the ALE game whose frames the core and scale sections use"""
    frames: int = 100_000
    """core: frames recorded and held by the store that `sample` is timed on"""
    add_steps: int = 20_000
    """core: frames (steps plus episode starts) fed to a fresh store to time `add`"""
    batch_size: int = 32
    """transitions per sampled batch"""
    reps: int = 500
    """timed calls per warm latency figure"""
    warmup: int = 20
    """untimed calls before each latency figure"""
    seed: int = 0
    """seed of the recordings, the stores and the baselines' index draws"""
    out_dir: str = "data/bench"
    """directory of the JSON result"""
    cache_dir: str = str(CACHE_DIR)
    """where recorded frames are cached as .npz"""
    quick: bool = False
    """tiny run for smoke tests (few frames, few reps); writes core_quick.json"""
    sections: str = ",".join(SECTIONS)
    """comma-separated sections to run (see the module docstring)"""
    scale_frames: int = 1_000_000
    """ram/cold/open/flush: frames held by the scale stores"""
    distinct_frames: int = 200_000
    """real frames recorded for the scale stores, cycled to reach --scale-frames"""
    small_frames: int = 100_000
    """ram: frames held by SB3 and TorchRL (4-stacks per step) and by mmreplay/cpprb beside them"""
    disk_games: str = "Pong,Breakout,MsPacman,Seaquest,SpaceInvaders"
    """disk: ALE games (ALE/<Game>-v5), random policy"""
    disk_frames: int = 30_000
    """disk: real frames recorded and stored per game"""
    cold_reps: int = 200
    """cold: timed sample calls with cache_bytes=1, page cache warm"""
    page_cold_reps: int = 50
    """cold: timed sample calls after the frame files left the page cache"""
    naive_reps: int = 100
    """cold: timed naive-zarr calls on the scale store (slow)"""
    flush_steps: int = 10_000
    """flush: steps added before each timed flush"""
    flush_small: int = 100_000
    """flush: capacity of the small store the scale store is compared with"""
    flush_rounds: int = 3
    """flush: timed (add --flush-steps, flush) rounds per store; the median counts"""
    drop_caches: bool = False
    """also write 3 to /proc/sys/vm/drop_caches (whole machine, needs root) when evicting"""
    steady_malloc: bool = True
    """pin glibc's mmap/trim thresholds (see `steady_malloc`) in every bench process"""


QUICK = {"frames": 2000, "add_steps": 2000, "reps": 50, "warmup": 5, "scale_frames": 3000,
         "distinct_frames": 2000, "small_frames": 1000, "disk_frames": 300, "cold_reps": 20,
         "page_cold_reps": 5, "naive_reps": 3, "flush_steps": 500, "flush_small": 1000,
         "flush_rounds": 2}


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


def build_parser(cls: type, description: str) -> argparse.ArgumentParser:
    """One flag per field of the args dataclass `cls`, documented by its field docstrings."""
    parser = argparse.ArgumentParser(description=description)
    docs = field_docs(cls)
    for f in fields(cls):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=docs.get(f.name))
        else:
            parser.add_argument(flag, type=type(default), default=default,
                                help=f"{docs.get(f.name)} (default: {default})")
    return parser


def parse_args() -> Args:
    parser = build_parser(Args, __doc__.splitlines()[0])
    args = Args(**vars(parser.parse_args()))
    if args.quick:
        args = replace(args, disk_games="Pong,Breakout",
                       **{name: min(getattr(args, name), value) for name, value in QUICK.items()})
    unknown = set(sections_of(args)) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; choose from {list(SECTIONS)}")
    return args


def sections_of(args: Args) -> list[str]:
    return [name.strip() for name in args.sections.split(",") if name.strip()]


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


def new_store(path: Path, capacity: int, seed: int, *,
              cache_bytes: int = 0, shard_chunks: int = 0) -> ReplayStore:
    return ReplayStore.create(path, capacity=capacity, obs_shape=(84, 84), obs_dtype=np.uint8,
                              frame_stack=FRAME_STACK, seed=seed, cache_bytes=cache_bytes,
                              shard_chunks=shard_chunks)


def feed(store: ReplayStore, rec: AleFrames, stop: int, *, desc: str) -> None:
    """Hand the first `stop` recorded frames to `store`, in the order an agent saw them."""
    for i in tqdm(range(stop), desc=desc, unit="frame", mininterval=1.0, leave=False):
        if rec.is_first[i]:
            store.reset(rec.frames[i])
        else:
            store.add(rec.actions[i], rec.rewards[i], rec.frames[i], rec.terminated[i],
                      rec.truncated[i])


def feed_timed(store: ReplayStore, rec: AleFrames, start: int, stop: int, *,
               desc: str, progress: bool = True) -> tuple[int, float]:
    """Feed stream positions start .. stop-1 of `rec` repeated end to end (position i is
    recorded frame i % len(rec)); returns (adds, seconds spent inside reset/add calls)."""
    frames, first, n = rec.frames, rec.is_first, len(rec)
    actions, rewards, term, trunc = rec.actions, rec.rewards, rec.terminated, rec.truncated
    clock, spent, adds = time.perf_counter, 0.0, 0
    for i in tqdm(range(start, stop), desc=desc, unit="frame", mininterval=2.0, leave=False,
                  disable=not progress):
        j = i % n
        if first[j]:
            begin = clock()
            store.reset(frames[j])
        else:
            action, reward, frame, te, tr = actions[j], rewards[j], frames[j], term[j], trunc[j]
            begin = clock()
            store.add(action, reward, frame, te, tr)
            adds += 1
        spent += clock() - begin
    return adds, spent


def window_starts(rng: np.random.Generator, n_frames: int, size: int) -> np.ndarray:
    """`size` random frames t whose window t-3 .. t+1 (obs and next stack) lies in [0, n)."""
    return rng.integers(FRAME_STACK - 1, n_frames - 1, size=size)


def numpy_gather(frames: np.ndarray, rng: np.random.Generator,
                 size: int) -> tuple[np.ndarray, np.ndarray]:
    """(obs stacks, next stacks) of `size` random windows, by fancy indexing in RAM."""
    t = window_starts(rng, len(frames), size)
    window = frames[t[:, None] + np.arange(-(FRAME_STACK - 1), 2)]  # (B, stack + 1, 84, 84)
    return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])


def dir_bytes(path: Path) -> tuple[int, int]:
    """Bytes under `path`: the files' sizes, and the filesystem blocks of files and folders."""
    paths = list(path.rglob("*"))
    files = sum(p.stat().st_size for p in paths if p.is_file())
    return files, sum(p.stat().st_blocks * 512 for p in paths)


def memory_status() -> dict[str, int]:
    """This process's resident memory in bytes: VmRSS, VmHWM (peak), RssAnon, RssFile."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:  # not Linux: only the peak is known
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"VmRSS": peak, "VmHWM": peak}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0]) * 1024
    return out


def memory_growth(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """MiB grown per field; the peak (VmHWM) is measured from the RSS before."""
    base = {**before, "VmHWM": before["VmRSS"]}
    return {name: (after[name] - base[name]) / 2**20 for name in after if name in base}


def read_files(paths: Iterable[Path]) -> None:
    """Read every file once, so the page cache holds it."""
    for path in paths:
        path.read_bytes()


def evict(paths: list[Path], *, drop_caches: bool) -> dict[str, Any]:
    """Push `paths` out of the page cache; returns how, and what `fincore` then finds resident."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    out: dict[str, Any] = {"method": "posix_fadvise(DONTNEED) per file after os.sync()",
                           "files": len(paths), "resident_fraction": resident_fraction(paths)}
    if drop_caches:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            out["drop_caches"] = "allowed"
        except OSError as exc:
            out["drop_caches"] = f"refused: {exc}"
    return out


def resident_fraction(paths: list[Path], probe: int = 200) -> float | None:
    """Fraction of the bytes of (up to `probe` evenly spread) `paths` in the page cache."""
    tool = shutil.which("fincore")
    if tool is None or not paths:
        return None
    picked = paths[:: max(1, len(paths) // probe)][:probe]
    proc = subprocess.run([tool, "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE",
                           *map(str, picked)], capture_output=True, text=True, check=False)
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not rows:
        return None
    resident, size = (sum(int(row[k]) for row in rows) for k in (0, 1))
    return resident / size if size else 0.0


def steady_malloc() -> str:
    """Keep freed batch-sized buffers in the heap instead of handing them back to the OS.

    A fresh process's glibc maps each ~1-2 MiB batch array anew and unmaps it on free, so
    every sample call of every buffer pays ~700 page faults (~0.8 ms on this VM); a long-lived
    training process with a grown heap does not. Pinning the thresholds gives every process
    (parent and workers, every buffer alike) the long-lived behaviour. Linux/glibc only.
    """
    libc_name = ctypes.util.find_library("c")
    if libc_name is None or platform.system() != "Linux":
        return "unchanged (not glibc)"
    libc = ctypes.CDLL(libc_name)
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    if libc.mallopt(m_trim_threshold, 256 << 20) and libc.mallopt(m_mmap_threshold, 32 << 20):
        return "mallopt(M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=256 MiB)"
    return "unchanged (mallopt failed)"


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_info() -> dict[str, Any]:
    """Which mmreplay ran: its path, and the repository's HEAD and whether mmreplay/ differs."""
    root = Path(__file__).resolve().parents[1]

    def git(*argv: str) -> str | None:
        proc = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True,
                              check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    status = git("status", "--porcelain", "--", "mmreplay")
    return {"mmreplay_path": str(Path(mmreplay.__file__).parent),
            "git_head": git("rev-parse", "HEAD"),
            "git_mmreplay_modified": None if status is None else bool(status)}


def machine_info() -> dict[str, Any]:
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return {
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mem_total_gib": pages * page_size / 2**30,
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "mmreplay": getattr(mmreplay, "__version__", "unknown"),
        **source_info(),
        **{name: package_version(name) for name in ("cpprb", "stable-baselines3", "torchrl")},
        "tmp_dir": tempfile.gettempdir(),
        "loadavg_1m_at_start": os.getloadavg()[0],  # other work on the machine skews figures
    }


# -- core sections ------------------------------------------------------------------------------


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
            "disk_mib": dir_bytes(root / "add_store")[0] / 2**20}


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
    files, allocated = dir_bytes(path)
    frame_files, frame_allocated = dir_bytes(path / "frames")
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


# -- buffers under test (ram section, one per subprocess) ------------------------------------


@dataclass(frozen=True)
class Buffer:
    """A buffer under test: fill it with (stream, frames) -> (adds, seconds), sample, release."""

    fill: Callable[[AleFrames, int], tuple[int, float]]
    sample: Callable[[], object]
    close: Callable[[], dict[str, Any]]


@dataclass(frozen=True)
class Step:
    """One transition as a frame-stacking env wrapper hands it to an agent."""

    obs: np.ndarray
    action: int
    reward: float
    next_obs: np.ndarray
    terminated: bool
    truncated: bool
    new_episode: bool  # first transition of its episode


def push(stack: np.ndarray, frame: np.ndarray, channels_last: bool) -> np.ndarray:
    """`stack` shifted by one frame, with `frame` newest."""
    out = np.empty_like(stack)
    if channels_last:
        out[..., :-1], out[..., -1] = stack[..., 1:], frame
    else:
        out[:-1], out[-1] = stack[1:], frame
    return out


def stacked_steps(rec: AleFrames, count: int, *, channels_last: bool,
                  desc: str) -> Iterator[Step]:
    """Transitions of stream positions 0 .. count-1 (`rec` repeated end to end), with
    zero-padded `FRAME_STACK`-stacks: (4, 84, 84), or (84, 84, 4) when `channels_last`."""
    shape = (84, 84, FRAME_STACK) if channels_last else (FRAME_STACK, 84, 84)
    stack, new_episode = np.zeros(shape, np.uint8), True
    for i in tqdm(range(count), desc=desc, unit="frame", mininterval=2.0, leave=False):
        j = i % len(rec)
        if rec.is_first[j]:
            stack, new_episode = push(np.zeros(shape, np.uint8), rec.frames[j], channels_last), True
            continue
        nxt = push(stack, rec.frames[j], channels_last)
        yield Step(stack, int(rec.actions[j]), float(rec.rewards[j]), nxt,
                   bool(rec.terminated[j]), bool(rec.truncated[j]), new_episode)
        stack, new_episode = nxt, False


def timed_adds(items: Iterable[T], add: Callable[[T], object]) -> tuple[int, float]:
    """Call `add` on every item; (calls, seconds inside `add`). Building items is not timed."""
    clock, spent, calls = time.perf_counter, 0.0, 0
    for item in items:
        start = clock()
        add(item)
        spent += clock() - start
        calls += 1
    return calls, spent


def make_mmreplay(n: int, path: Path, args: Args) -> Buffer:
    store = new_store(path, n, args.seed)

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        adds, seconds = feed_timed(store, rec, 0, count, desc="fill mmreplay")
        start = time.perf_counter()
        store.flush()  # the closing commit is part of the fill
        return adds, seconds + time.perf_counter() - start

    def close() -> dict[str, Any]:
        store.close()
        return {"cache_bytes": 0, **bench_disk(path, n)}

    return Buffer(fill, lambda: store.sample(args.batch_size), close)


def make_cpprb(n: int, path: Path, args: Args) -> Buffer:
    from cpprb import ReplayBuffer

    # stack_compress wants the stack on the last axis (cpprb docs); next_obs shares memory.
    rb = ReplayBuffer(n, {"obs": {"shape": (84, 84, FRAME_STACK), "dtype": np.uint8},
                          "act": {"dtype": np.int64}, "rew": {}, "done": {}},
                      next_of="obs", stack_compress="obs")

    def add(step: Step) -> None:
        if step.new_episode and rb.get_stored_size():
            rb.on_episode_end()
        rb.add(obs=step.obs, act=step.action, rew=step.reward, next_obs=step.next_obs,
               done=float(step.terminated))

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        return timed_adds(stacked_steps(rec, count, channels_last=True, desc="fill cpprb"), add)

    return Buffer(fill, lambda: rb.sample(args.batch_size), lambda: {})


def make_numpy(n: int, path: Path, args: Args) -> Buffer:
    frames = np.empty((n, 84, 84), np.uint8)  # pages are touched (counted) as they are filled
    actions, rewards = np.zeros(n, np.int64), np.zeros(n, np.float32)
    done = np.zeros(n, bool)
    rng = np.random.default_rng(args.seed)

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        def put(i: int) -> None:
            j = i % len(rec)
            frames[i], actions[i], rewards[i] = rec.frames[j], rec.actions[j], rec.rewards[j]
            done[i] = rec.terminated[j]

        return timed_adds(range(count), put)

    return Buffer(fill, lambda: numpy_gather(frames, rng, args.batch_size), lambda: {})


def make_sb3(n: int, path: Path, args: Args) -> Buffer:
    import gymnasium as gym
    from stable_baselines3.common.buffers import ReplayBuffer

    rb = ReplayBuffer(n, gym.spaces.Box(0, 255, (FRAME_STACK, 84, 84), np.uint8),
                      gym.spaces.Discrete(18), device="cpu", optimize_memory_usage=True,
                      handle_timeout_termination=False)  # SB3 refuses both at once

    def prepared(rec: AleFrames, count: int) -> Iterator[tuple[Any, ...]]:
        for s in stacked_steps(rec, count, channels_last=False, desc="fill sb3"):
            yield (s.obs[None], s.next_obs[None], np.array([s.action]), np.array([s.reward]),
                   np.array([s.terminated]), [{}])

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        return timed_adds(prepared(rec, count), lambda item: rb.add(*item))

    return Buffer(fill, lambda: rb.sample(args.batch_size), lambda: {})


def make_torchrl(n: int, path: Path, args: Args) -> Buffer:
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyMemmapStorage(n, scratch_dir=path),
                      batch_size=args.batch_size)

    def prepared(rec: AleFrames, count: int) -> Iterator[TensorDict]:
        for s in stacked_steps(rec, count, channels_last=False, desc="fill torchrl"):
            yield TensorDict({
                "obs": torch.from_numpy(s.obs), "action": torch.tensor(s.action),
                "reward": torch.tensor(s.reward), "terminated": torch.tensor(s.terminated),
                "truncated": torch.tensor(s.truncated),
                "next": {"obs": torch.from_numpy(s.next_obs)}}, batch_size=[])

    def fill(rec: AleFrames, count: int) -> tuple[int, float]:
        return timed_adds(prepared(rec, count), rb.add)

    def close() -> dict[str, Any]:
        files, allocated = dir_bytes(path)
        return {"disk_file_mib": files / 2**20, "disk_allocated_mib": allocated / 2**20}

    return Buffer(fill, rb.sample, close)


BUFFERS: dict[str, Callable[[int, Path, Args], Buffer]] = {
    "mmreplay": make_mmreplay, "cpprb": make_cpprb, "numpy": make_numpy,
    "sb3": make_sb3, "torchrl": make_torchrl}
MODULES = {"cpprb": "cpprb", "sb3": "stable_baselines3", "torchrl": "torchrl"}
PIP_NAMES = {"cpprb": "cpprb", "sb3": "stable-baselines3", "torchrl": "torchrl"}


# -- workers: each runs in a fresh interpreter ------------------------------------------------


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
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), WORKER, payload],
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


# -- scale sections (parent side) -------------------------------------------------------------


def missing(system: str) -> str | None:
    """Why `system` cannot be benchmarked here, or None."""
    module = MODULES.get(system)
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return (f"{PIP_NAMES[system]} is not installed (`pip install --dry-run "
            f"{PIP_NAMES[system]}` shows whether it keeps the installed torch)")


def bench_ram(args: Args, root: Path, scale_store: Path) -> list[dict[str, Any]]:
    plan = [("mmreplay", args.scale_frames), ("cpprb", args.scale_frames),
            ("numpy", args.scale_frames), ("mmreplay", args.small_frames),
            ("cpprb", args.small_frames), ("sb3", args.small_frames),
            ("torchrl", args.small_frames)]
    rows = []
    for i, (system, frames) in enumerate(plan):
        reason = missing(system)
        if reason is not None:
            print(f"ram: skipping {system}: {reason}", file=sys.stderr)
            rows.append({"system": system, "frames": frames, "skipped": reason})
            continue
        path = scale_store if i == 0 else root / f"ram_{system}_{frames}"
        print(f"ram: {system} with {frames:,} frames", file=sys.stderr)
        rows.append(run_worker("ram", args, system=system, frames=frames, path=str(path)))
        if path != scale_store:
            shutil.rmtree(path, ignore_errors=True)
    return rows


def bench_scale(args: Args, root: Path, sections: list[str]) -> dict[str, Any]:
    record_frames(args.game, args.distinct_frames, args.seed, cache_dir=args.cache_dir,
                  progress=True)  # record once here, workers load the cache
    store = root / "scale_store"
    out: dict[str, Any] = {}
    if "ram" in sections:
        out["ram"] = bench_ram(args, root, store)
    else:
        run_worker("ram", args, system="mmreplay", frames=args.scale_frames, path=str(store))
    if "cold" in sections:
        print("cold: sample with cache_bytes=1", file=sys.stderr)
        out["cold"] = run_worker("cold", args, path=str(store), frames_held=args.scale_frames)
    if "open" in sections:
        out["open"] = run_worker("open", args, path=str(store))
    if "flush" in sections:
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


# -- targets and report -----------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "SHORT"


def find_row(rows: list[dict[str, Any]], system: str, frames: int) -> dict[str, Any] | None:
    for row in rows:
        if row["system"] == system and row["frames"] == frames and "skipped" not in row:
            return row
    return None


def ram_targets(result: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The add-rate target always; RAM and add ratios only when cpprb (`bench` extra) ran."""
    mm, cp = (find_row(result.get("ram", []), s, n) for s in ("mmreplay", "cpprb"))
    if mm is None:
        return []
    x = mm["steps_per_s"]
    rows = [target(f"add: mmreplay steps/s, {n:,}-frame fill", f"{x:,.0f}", ">= 50,000",
                   x >= 50e3)]
    if cp is None:
        return rows
    a, b = mm["growth_mib"]["VmRSS"], cp["growth_mib"]["VmRSS"]
    y = cp["steps_per_s"]
    return [
        target(f"RAM: RSS growth mmreplay / cpprb, {n:,} frames",
               f"{a:,.0f} / {b:,.0f} MiB = {100 * a / b:.1f}%", "<= 10%", a <= 0.1 * b),
        *rows,
        target("add: mmreplay / cpprb steps/s", f"{x:,.0f} / {y:,.0f} = {x / y:.2f}x",
               ">= 2.5x", x >= 2.5 * y),
    ]


def sample_targets(result: dict[str, Any], n: int) -> list[dict[str, Any]]:
    cold, cp = result.get("cold"), find_row(result.get("ram", []), "cpprb", n)
    if cold is None:
        return []
    mm = cold["warm"]["median_ms"]
    naive = cold["naive_warm"]["median_ms"]
    rows = [target(f"sample: naive zarr / mmreplay cold, {n:,} frames",
                   f"{naive:.1f} / {mm:.2f} ms = {naive / mm:.0f}x", ">= 30x", naive >= 30 * mm)]
    if cp is not None:
        c = cp["sample"]["median_ms"]
        rows.insert(0, target(f"sample: mmreplay cold / cpprb, {n:,} frames",
                              f"{mm:.2f} / {c:.2f} ms = {mm / c:.1f}x", "<= 3x", mm <= 3 * c))
    return rows


def target(figure: str, measured: str, goal: str, ok: bool) -> dict[str, Any]:
    return {"figure": figure, "measured": measured, "target": goal, "verdict": verdict(ok)}


def targets(result: dict[str, Any], args: Args) -> list[dict[str, Any]]:
    rows = ram_targets(result, args.scale_frames) + sample_targets(result, args.scale_frames)
    for game in result.get("disk_games", []):
        rows.append(target(f"disk: {game['game']} files / raw",
                           f"{game['file_pct']:.1f}%", "<= 10%", game["file_pct"] <= 10))
        rows.append(target(f"disk: {game['game']} allocated blocks / raw",
                           f"{game['allocated_pct']:.1f}%", "<= 10%",
                           game["allocated_pct"] <= 10))
    if "open" in result:
        s = result["open"]["cold"]["total_s"]
        rows.append(target(f"open + first batch, {args.scale_frames:,} frames, evicted",
                           f"{s:.2f} s", "<= 2 s", s <= 2))
    if "flush" in result:
        f = result["flush"]
        rows.append(target(
            f"flush after {args.flush_steps:,} steps: {f['big']['capacity']:,} / "
            f"{f['small']['capacity']:,} store",
            f"{f['big']['median_s'] * 1e3:.0f} / {f['small']['median_s'] * 1e3:.0f} ms = "
            f"{f['ratio']:.1f}x", "<= 2x (O(steps))", f["ratio"] <= 2))
    return rows


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


def print_targets(rows: list[dict[str, Any]]) -> None:
    print("\ntargets (measured on this machine; SHORT = target not met):")
    for r in rows:
        print(f"  {r['figure']:<52}{r['measured']:>34}  {r['target']:<18}{r['verdict']}")


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


def write_json(result: dict[str, Any], out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == WORKER:
        worker_main(sys.argv[2])
        return
    args = parse_args()
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
    main()
