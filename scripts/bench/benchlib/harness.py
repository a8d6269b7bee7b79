"""Measuring tools every bench section shares: latency, feeding a store from recorded
frames, process memory, page-cache eviction, machine info, JSON output.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import zarr
from ale_frames import AleFrames
from common import dir_blocks, dir_bytes
from tqdm import tqdm

import mmreplay
from mmreplay import ReplayStore

FRAME_STACK = 4


FRAME_BYTES = 84 * 84


T = TypeVar("T")


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
    root = Path(__file__).resolve().parents[3]

    def git(*argv: str) -> str | None:
        proc = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True,
                              check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    status = git("status", "--porcelain", "--", "mmreplay")
    return {"mmreplay_path": str(Path(mmreplay.__file__).parent),
            "git_head": git("rev-parse", "HEAD"),
            "git_mmreplay_modified": None if status is None else bool(status)}


def machine_info() -> dict[str, Any]:
    import torch  # here only: the bench workers never need it

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


def write_json(result: dict[str, Any], out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def disk_usage(path: Path) -> tuple[int, int]:
    """Bytes under `path`: the files' sizes, and the filesystem blocks of files and folders."""
    return dir_bytes(path), dir_blocks(path)
