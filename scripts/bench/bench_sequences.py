"""Sequence replay at scale: `sample_sequences` over a store of real Atari frames, beside
TorchRL's `SliceSampler` over a `LazyMemmapStorage` of the same frames.

    python scripts/bench/bench_sequences.py                           # 1,000,000 frames
    python scripts/bench/bench_sequences.py --frames 3000 --distinct-frames 2000 --reps 3 \\
        --torchrl-frames 3000 --length 20                       # smoke run

One single-env store (frame_stack=4) is filled by cycling `--distinct-frames` recorded
Breakout frames (random policy) up to `--frames`. Timed: ``sample_sequences(batch, length)``
within episodes (R2D2) and across episodes (DreamerV3), on the live writer, and the frames
one batch reads: frames the batch holds (B*T*k + B*k stacks), distinct frames among them,
and the frames of the distinct chunks decoded (a chunk is decoded whole). TorchRL (if
installed; not a dependency) holds the same stream as single frames with episode ids and
samples `batch` slices of `length + k - 1` frames (the frames the stacks need; TorchRL
does not stack them). Writes `sequences.json` under `--out-dir`. Figures only.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from ale_frames import CACHE_DIR, AleFrames, record_frames
from benchlib.harness import (
    feed_timed,
    latency_ms,
    machine_info,
    memory_growth,
    memory_status,
    new_store,
    write_json,
)
from common import run_main

from mmreplay import ReplayStore

FRAME_STACK = 4


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """gymnasium id of the ALE game whose frames fill the store"""
    frames: int = 1_000_000
    """frames fed to (and held by) the store; its capacity"""
    distinct_frames: int = 100_000
    """real frames recorded (cached under --cache-dir) and cycled to reach --frames"""
    batch_size: int = 32
    """sequences per batch"""
    length: int = 80
    """steps per sequence"""
    reps: int = 50
    """timed calls per latency figure"""
    warmup: int = 5
    """untimed calls before each latency figure"""
    torchrl_frames: int = 1_000_000
    """frames in TorchRL's LazyMemmapStorage (0: skip TorchRL)"""
    seed: int = 0
    """seed of the recording and the store"""
    out_dir: str = "data/bench"
    """directory of sequences.json"""
    cache_dir: str = str(CACHE_DIR)
    """where recorded frames are cached as .npz"""
    work_dir: str = ""
    """where to build the stores (removed at the end); empty: a temp dir"""
    reuse_buffers: bool = True
    """let batches reuse freed frame buffers (--no-reuse-buffers: a fresh array each batch)"""


class CountingReads:
    """Wraps the store's frame reader to record the slots of each read (instrumentation)."""

    def __init__(self, store: ReplayStore) -> None:
        self.frames = store._frames
        self.inner = self.frames.read
        self.slots: list[np.ndarray] = []
        self.frames.read = self  # type: ignore[method-assign]

    def __call__(self, flat: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        self.slots.append(np.asarray(flat).copy())
        return self.inner(flat, out=out)

    def restore(self) -> None:
        self.frames.read = self.inner  # type: ignore[method-assign]


def read_figures(store: ReplayStore, args: Args, cross: bool) -> dict[str, Any]:
    """Frames in one batch, distinct frames, frames of the distinct chunks decoded."""
    counter = CountingReads(store)
    try:
        store.sample_sequences(args.batch_size, args.length, cross_episodes=cross)
    finally:
        counter.restore()
    (slots,) = counter.slots  # one frame read per batch
    real = slots[slots >= 0]
    chunk = store.spec.chunk_frames
    distinct = np.unique(real)
    chunks = np.unique(distinct // chunk)
    return {"frame_reads_per_batch": len(counter.slots), "frames_in_batch": int(slots.size),
            "distinct_frames": int(distinct.size), "distinct_chunks": int(chunks.size),
            "frames_decoded": int(chunks.size * chunk),
            "decoded_over_distinct": float(chunks.size * chunk / max(1, distinct.size)),
            "batch_over_distinct": float(slots.size / max(1, distinct.size))}


def bench_mmreplay(rec: AleFrames, args: Args, root: Path) -> dict[str, Any]:
    before = memory_status()
    store = new_store(root / "store", args.frames, args.seed)
    if not args.reuse_buffers:
        store._sequences._buffers.min_bytes = 1 << 62  # A/B switch: never pool
    start = time.perf_counter()
    adds, spent = feed_timed(store, rec, 0, args.frames, desc="fill")
    out: dict[str, Any] = {"fill_s": time.perf_counter() - start,
                           "add_steps_per_s": adds / max(spent, 1e-9)}
    for cross in (False, True):
        name = "across_episodes" if cross else "within_episodes"
        began = time.perf_counter()
        store.sample_sequences(args.batch_size, args.length, cross_episodes=cross)
        first = time.perf_counter() - began  # builds the index of valid starts once
        lat = latency_ms(lambda c=cross: store.sample_sequences(
            args.batch_size, args.length, cross_episodes=c), reps=args.reps, warmup=args.warmup)
        out[name] = {"first_call_s": first, **lat, **read_figures(store, args, cross)}
        print(f"mmreplay {name}: median {lat['median_ms']:.2f} ms, p90 {lat['p90_ms']:.2f} ms, "
              f"first call {first:.2f} s; {out[name]}", flush=True)
    out["rss_growth"] = memory_growth(before, memory_status())
    store.close()
    return out


def bench_torchrl(rec: AleFrames, args: Args, root: Path) -> dict[str, Any]:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import SliceSampler

    n = args.torchrl_frames
    slice_len = args.length + FRAME_STACK - 1
    buffer = ReplayBuffer(
        storage=LazyMemmapStorage(n, scratch_dir=str(root / "torchrl")),
        sampler=SliceSampler(num_slices=args.batch_size, traj_key="episode", strict_length=True),
        batch_size=args.batch_size * slice_len)
    episode = np.cumsum(rec.is_first) - 1
    start, block = time.perf_counter(), 10_000
    for first in range(0, n, block):
        idx = np.arange(first, min(n, first + block)) % len(rec)
        laps = np.arange(first, min(n, first + block)) // len(rec)
        buffer.extend(TensorDict({
            "pixels": torch.from_numpy(rec.frames[idx]),
            "action": torch.from_numpy(rec.actions[idx]),
            "reward": torch.from_numpy(rec.rewards[idx]),
            "episode": torch.from_numpy(episode[idx] + laps * (int(episode[-1]) + 1)),
        }, batch_size=[idx.size]))
    fill = time.perf_counter() - start
    lat = latency_ms(buffer.sample, reps=args.reps, warmup=args.warmup)
    print(f"torchrl SliceSampler at {n} frames: median {lat['median_ms']:.2f} ms, "
          f"p90 {lat['p90_ms']:.2f} ms", flush=True)
    return {"frames": n, "slice_len": slice_len, "fill_s": fill, **lat,
            "frames_in_batch": args.batch_size * slice_len,
            "note": "single frames, no stacking: the learner still builds k-stacks"}


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    rec = record_frames(args.game, args.distinct_frames, seed=args.seed,
                        cache_dir=args.cache_dir, progress=True)
    root = Path(tempfile.mkdtemp(prefix="bench_seq_", dir=args.work_dir or None))
    try:
        result: dict[str, Any] = {"args": asdict(args), "machine": machine_info()}
        result["mmreplay"] = bench_mmreplay(rec, args, root)
        if args.torchrl_frames and importlib.util.find_spec("torchrl") is not None:
            result["torchrl"] = bench_torchrl(rec, args, root)
        elif args.torchrl_frames:
            print("torchrl is not installed: skipped", file=sys.stderr)
        path = write_json(result, Path(args.out_dir), "sequences.json")
        print(f"wrote {path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_main(main)
