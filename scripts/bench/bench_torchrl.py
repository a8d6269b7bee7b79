"""TorchRL's `LazyMemmapStorage` buffer beside mmreplay's `FrameOnceStorage`, on one stream.

    python scripts/bench/bench_torchrl.py                       # 100k transitions
    python scripts/bench/bench_torchrl.py --transitions 1000000 # the issue's size (~56 GB of
                                                                # memmap files for TorchRL)

The stream is recorded Breakout frames (84x84 grayscale, `ale_frames`, looped end to end)
handed over as TorchRL's collector hands them to ``extend``: ``[batch]`` TensorDicts with
CatFrames 4-stacks in ``"pixels"`` and ``("next", "pixels")`` (first frame repeated at an
episode start), actions, rewards, flags and trajectory ids. Each buffer fills and samples in
a process of its own (``--side``), so its RSS is its own: after the fill, the disk it used
(file sizes and allocated blocks), then ``sample()`` of 32 with ``prefetch=3``. The figures
go to ``data/bench/torchrl.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from ale_frames import AleFrames, record_frames
from benchlib.harness import (
    disk_usage,
    latency_ms,
    machine_info,
    memory_growth,
    memory_status,
    write_json,
)

DATA_BENCH = Path(__file__).resolve().parents[2] / "data" / "bench"
SIDES = ("lazymemmap", "frame_once")
STACK = 4


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transitions", type=int, default=100_000,
                        help="transitions extended, also each buffer's max_size")
    parser.add_argument("--recorded", type=int, default=20_000,
                        help="recorded Breakout frames, looped to make the stream")
    parser.add_argument("--batch", type=int, default=1_000, help="steps per extend")
    parser.add_argument("--reps", type=int, default=300, help="sample(32) calls timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=SIDES, help="(internal) run one side, print JSON")
    parser.add_argument("--dir", type=Path, help="(internal) where the side writes")
    parser.add_argument("--out", type=Path, default=DATA_BENCH,
                        help="folder of torchrl.json")
    return parser.parse_args()


def batches(rec: AleFrames, total: int, size: int) -> Iterator[Any]:
    """Collector-like ``[size]`` TensorDicts of the recording looped (see module doc)."""
    import torch
    from tensordict import TensorDict

    n, traj, stack, pos, made = len(rec), 0, None, 0, 0
    while made < total:
        rows: dict[Any, list[Any]] = {}
        while len(rows.get("action", ())) < min(size, total - made):
            j = pos % n
            if rec.is_first[j] or stack is None:
                stack, traj, pos = np.stack([rec.frames[j]] * STACK), traj + 1, pos + 1
                continue
            nxt = np.concatenate([stack[1:], rec.frames[j][None]])
            for key, value in (("pixels", stack), (("next", "pixels"), nxt),
                               ("action", rec.actions[j]),
                               (("next", "reward"), rec.rewards[j:j + 1]),
                               (("next", "terminated"), rec.terminated[j:j + 1]),
                               (("next", "truncated"), rec.truncated[j:j + 1]),
                               (("next", "done"),
                                rec.terminated[j:j + 1] | rec.truncated[j:j + 1]),
                               (("collector", "traj_ids"), np.int64(traj))):
                rows.setdefault(key, []).append(value)
            stack, pos = nxt, pos + 1
            if rec.terminated[j] or rec.truncated[j]:
                stack = None
        count = len(rows["action"])
        td = TensorDict(batch_size=[count])
        for key, values in rows.items():
            td.set(key, torch.from_numpy(np.stack(values)))
        made += count
        yield td


def make_buffer(side: str, folder: Path, size: int, seed: int) -> Any:
    if side == "lazymemmap":
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

        return TensorDictReplayBuffer(storage=LazyMemmapStorage(size, scratch_dir=folder),
                                      batch_size=32, prefetch=3)
    from mmreplay.integrations.torchrl import make_replay_buffer

    return make_replay_buffer(folder, size, batch_size=32, prefetch=3, frame_stack=STACK,
                              seed=seed)


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    """Fill one buffer, measure disk and RSS, time ``sample()`` (one process)."""
    rec = record_frames("ALE/Breakout-v5", args.recorded, seed=args.seed)
    import torchrl  # noqa: F401  (both sides import both before the baseline RSS)

    import mmreplay.integrations.torchrl  # noqa: F401

    base = memory_status()
    rb = make_buffer(args.side, args.dir, args.transitions, args.seed)
    start, spent = time.perf_counter(), 0.0
    for td in batches(rec, args.transitions, args.batch):
        begin = time.perf_counter()
        rb.extend(td)
        spent += time.perf_counter() - begin
    fill_s = time.perf_counter() - start
    if args.side == "frame_once":
        rb.storage.store.flush()
    filled = memory_status()
    size_bytes, blocks = disk_usage(args.dir)
    sample = latency_ms(rb.sample, reps=args.reps, warmup=20)
    return {"side": args.side, "len": len(rb), "extend_s": spent, "fill_s": fill_s,
            "disk_bytes": size_bytes, "disk_blocks_bytes": blocks,
            "rss_after_fill_mib": memory_growth(base, filled),
            "rss_after_sampling_mib": memory_growth(base, memory_status()),
            "sample32_prefetch3": sample}


def main() -> None:
    args = parse()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    record_frames("ALE/Breakout-v5", args.recorded, seed=args.seed)  # cached for both sides
    sides = {}
    for side in SIDES:
        with tempfile.TemporaryDirectory(prefix=f"bench-{side}-", dir=args.out.parent) as tmp:
            proc = subprocess.run([sys.executable, __file__, "--side", side, "--dir", tmp,
                                   *_shared(args)], capture_output=True, text=True, check=True)
            sides[side] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(side, json.dumps(sides[side]), flush=True)
    result = {"what": "TorchRL LazyMemmapStorage vs mmreplay FrameOnceStorage (one stream)",
              "transitions": args.transitions, "recorded_frames": args.recorded,
              "sides": sides, "machine": machine_info()}
    print("wrote", write_json(result, args.out, "torchrl.json"))


def _shared(args: argparse.Namespace) -> list[str]:
    return ["--transitions", str(args.transitions), "--recorded", str(args.recorded),
            "--batch", str(args.batch), "--reps", str(args.reps), "--seed", str(args.seed)]


if __name__ == "__main__":
    main()
