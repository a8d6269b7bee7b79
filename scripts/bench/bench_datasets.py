"""Sizes and speeds of the dataset tools on a Dopamine-format checkpoint of real ALE frames.

    python scripts/bench/bench_datasets.py --records 1000000       # writes data/bench/datasets.json

1. Records `distinct_frames` Breakout frames (random policy, cached by `ale_frames`), keeps
   their finished episodes and lays them end to end, with Dopamine's 3 zero records before
   each episode, until `records` records: the checkpoint is a full, wrapped circular buffer
   (``add_count = records + records // 3``) written exactly as Dopamine writes it (gzip level
   9 of one ``np.save`` per array), streamed so it never sits in RAM.
2. Times ``mmreplay import-dopamine`` in a child process (peak RSS of that process) and
   compares the store's size on disk with the gzip files.
3. Times ``mmreplay export-minari`` of that store (child process, peak RSS, dataset size).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from ale_frames import record_frames
from common import dir_bytes, run_main
from numpy.lib import format as npy_format

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """ALE game whose frames fill the checkpoint"""
    distinct_frames: int = 250_000
    """frames recorded (and cached); the checkpoint repeats their episodes to reach `records`"""
    records: int = 1_000_000
    """records (Dopamine's capacity) in the checkpoint"""
    workdir: str = "runs/bench_datasets"
    """scratch directory (checkpoint, store, Minari dataset); removed first"""
    minari: bool = True
    """also time export-minari (needs the minari extra)"""
    gzip_level: int = 9
    """gzip level of the checkpoint files (Dopamine's GzipFile default is 9)"""
    out: str = "data/bench/datasets.json"
    """where the figures go"""


def dopamine_source(game: str, distinct: int) -> dict[str, np.ndarray]:
    """One period of Dopamine records: padding (frame -1) + each finished episode's steps."""
    rec = record_frames(game, distinct, seed=0, progress=True)
    frame, action, reward, terminal = [], [], [], []
    starts = np.flatnonzero(rec.is_first)
    for a, b in zip(starts, np.r_[starts[1:], len(rec)], strict=True):
        if not (rec.terminated[b - 1] or rec.truncated[b - 1]):
            continue  # unfinished: its last step has no terminal record
        frame += [-1] * 3 + list(range(a, b - 1))
        action += [0] * 3 + rec.actions[a + 1:b].tolist()
        reward += [0.0] * 3 + rec.rewards[a + 1:b].tolist()
        terminal += [0] * 3 + [0] * (b - a - 2) + [1]
    return {"frames": rec.frames, "frame": np.array(frame), "action": np.array(action, np.int32),
            "reward": np.array(reward, np.float32), "terminal": np.array(terminal, np.uint8)}


def write_npy_gz(path: Path, shape: tuple[int, ...], dtype: np.dtype, blocks, level: int) -> None:
    with gzip.open(path, "wb", compresslevel=level) as f:
        npy_format.write_array_header_1_0(f, {"descr": npy_format.dtype_to_descr(dtype),
                                              "fortran_order": False, "shape": shape})
        for block in blocks:
            f.write(np.ascontiguousarray(block, dtype).tobytes())


def write_checkpoint(src: dict[str, np.ndarray], directory: Path, records: int,
                     level: int) -> None:
    """Row i holds the record added ``L`` with ``L % records == i`` among the newest."""
    add_count = records + records // 3
    cursor = add_count % records
    rows = np.arange(records)
    linear = add_count - records + (rows - cursor) % records
    source = linear % src["frame"].size
    directory.mkdir(parents=True)
    for key in ("action", "reward", "terminal"):
        arr = src[key][source]
        write_npy_gz(directory / f"$store$_{key}_ckpt.0.gz", arr.shape, arr.dtype, [arr], level)
    write_npy_gz(directory / "add_count_ckpt.0.gz", (), np.dtype(np.int64),
                 [np.array(add_count)], level)
    invalid = np.array([(cursor - 1 + i) % records for i in range(5)])
    write_npy_gz(directory / "invalid_range_ckpt.0.gz", invalid.shape, invalid.dtype,
                 [invalid], level)
    frames, index = src["frames"], src["frame"][source]

    def blocks():
        for lo in range(0, records, 8192):
            idx = index[lo:lo + 8192]
            block = frames[np.maximum(idx, 0)]
            block[idx < 0] = 0
            yield block

    write_npy_gz(directory / "$store$_observation_ckpt.0.gz", (records, 84, 84),
                 np.dtype(np.uint8), blocks(), level)


# The child reports its own peak RSS (VmHWM belongs to its address space, fresh at exec;
# ru_maxrss of a child would inherit this process's peak from before the exec).
CHILD = ("import sys; from mmreplay.tools.cli import main; rc = main(sys.argv[1:]); "
         "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM')][0]; "
         "print('peak_rss_kib', hwm.split()[1]); sys.exit(rc)")


def timed_child(args: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """Wall time and peak RSS (MiB) of one ``mmreplay`` command in a child process."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                          env=env, check=False)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"mmreplay {' '.join(args)} failed:\n{proc.stderr}")
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[:-1]))
    peak_kib = int(lines[-1].split()[1])
    return {"seconds": round(wall, 1), "peak_rss_mib": round(peak_kib / 1024, 1)}


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    work = ROOT / args.workdir
    shutil.rmtree(work, ignore_errors=True)
    src = dopamine_source(args.game, args.distinct_frames)
    print(f"source: {src['frame'].size} records per period from {args.distinct_frames} frames")
    start = time.perf_counter()
    write_checkpoint(src, work / "logs", args.records, args.gzip_level)
    print(f"wrote the checkpoint in {time.perf_counter() - start:.0f} s")
    del src  # the children's figures should not share the machine with 2 GB of frames
    gz = {p.name: p.stat().st_size for p in (work / "logs").iterdir()}
    result = {"args": asdict(args), "checkpoint_gzip_bytes": sum(gz.values()),
              "observation_gzip_bytes": gz["$store$_observation_ckpt.0.gz"],
              "raw_frame_bytes": args.records * 84 * 84}
    result["baseline_rss_mib"] = timed_child(["--version"])["peak_rss_mib"]  # python + torch
    for codec in ("lz4", "zstd"):
        store = work / f"store_{codec}"
        result[f"import_{codec}"] = timed_child(
            ["import-dopamine", str(work / "logs"), str(store), "--codec", codec])
        result[f"store_{codec}_bytes"] = dir_bytes(store)
        result[f"store_{codec}_frame_bytes"] = dir_bytes(store / "frames")
    if args.minari:
        env = {**os.environ, "MINARI_DATASETS_PATH": str(work / "minari")}
        result["export_minari"] = timed_child(
            ["export-minari", str(work / "store_lz4"), "bench/breakout-v0", "--env-id",
             args.game], env=env)
        result["minari_bytes"] = dir_bytes(work / "minari")
    Path(ROOT / args.out).parent.mkdir(parents=True, exist_ok=True)
    (ROOT / args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    run_main(main)
