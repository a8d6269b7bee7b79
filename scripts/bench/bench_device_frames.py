"""``device=`` stores: the open + fill time and ``sample(32)`` to device tensors.

    python scripts/bench/bench_device_frames.py                        # CPU device, 100k frames
    python scripts/bench/bench_device_frames.py --device cuda --frames 1000000

For each sampler (``--samplers``), a store of ``--frames`` 84x84 uint8 frames (Atari-like:
flat blocks of a few colours, each frame stamped with its number, so they compress as real
frames do) is built without a device, closed, then opened with ``device=--device`` (timed:
the open and the fill of the device ring from disk, ``--repeats`` times, with the fill decoded
by each count of ``--fill-threads``: ``open_fill_s`` by count, the default count, every core
this process may use, as ``"cores"``). On that open store:

- ``sample_us``: ``store.sample(--batch)`` per call, batch on the device, the device
  synchronized after each call (on CUDA: the time until the batch is usable);
- ``issue_us``: the same without the synchronize (the CPU's share: draw, lookup, one copy,
  the gather queued);
- ``plain_sample_us``: the same store opened without a device (frames read from disk into
  CPU tensors), for reference.

Medians and p90 over ``--samples`` calls after ``--warmup``. Prints and writes
``device_frames.json`` under ``--out-dir``. Figures only: the targets (issue 36: ``sample(32)``
to GPU tensors <= 100 us median, a 1M-frame open + fill <= 10 s) are for an H100 host.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tyro

from mmreplay import ReplayStore, StepRows, device_reader

OBS = (84, 84)
ROWS = 4096  # steps recorded per add_rows call while building


@dataclass
class Args:
    frames: int = 100_000
    """frames in the store (1,000,000 is the GPU target's size)"""
    device: str = "cpu"
    """device of the frame ring: cuda, cuda:0, cpu"""
    samplers: str = "uniform,prioritized"
    """comma-separated samplers, one store each"""
    batch: int = 32
    """transitions per sample"""
    samples: int = 2000
    """timed sample calls per arm"""
    warmup: int = 50
    """untimed sample calls first"""
    repeats: int = 2
    """opens with the device, each timed"""
    frame_stack: int = 4
    """frames per stack"""
    threads: int = 1
    """torch intra-op threads (a CPU device's gather runs in them; 0: torch's default)"""
    fill_threads: str = "1,cores"
    """comma-separated thread counts decoding the fill on open ("cores": the default)"""
    dir: str = ""
    """where the stores are built (default: a temp directory, removed after)"""
    out_dir: str = "data/bench"
    """directory of device_frames.json"""


def frame_maker(seed: int) -> np.ndarray:
    """256 Atari-like frames: 12x12 blocks of 7x7 pixels in a few colours."""
    rng = np.random.default_rng(seed)
    blocks = rng.choice(np.array([0, 0, 0, 87, 142, 200], np.uint8), (256, 12, 12))
    return blocks.repeat(7, axis=1).repeat(7, axis=2)


def build(path: Path, args: Args, sampler: str) -> float:
    """A store of `args.frames` frames at `path` (no device); returns the seconds it took."""
    start, pool = time.perf_counter(), frame_maker(0)
    rng = np.random.default_rng(1)
    with ReplayStore.create(path, capacity=args.frames, obs_shape=OBS,
                            frame_stack=args.frame_stack, sampler=sampler, seed=0) as store:
        store.reset(pool[:1])
        for lo in range(1, args.frames, ROWS):
            rows = min(ROWS, args.frames - lo)
            obs = pool[(np.arange(lo, lo + rows) * 7) % 256].copy()
            obs[:, 0, :4] = np.arange(lo, lo + rows, dtype="<u4").view(np.uint8).reshape(-1, 4)
            done = rng.random((rows, 1)) < 0.002
            done[-1] = False  # every block starts with the episode running
            auto = np.roll(done, 1, axis=0)  # the step after an end is o_0 of the next
            done &= ~auto
            store.add_rows(StepRows(
                env_ids=[0], action=rng.integers(0, 4, (rows, 1)),
                reward=rng.random((rows, 1)).astype(np.float32), next_obs=obs[:, None],
                terminated=done, truncated=np.zeros((rows, 1), bool), autoreset=auto))
    return time.perf_counter() - start


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_calls(call: Any, args: Args, sync: str | None) -> list[float]:
    """Microseconds of each of `args.samples` calls after `args.warmup` untimed ones."""
    for _ in range(args.warmup):
        call()
    out = []
    for _ in range(args.samples):
        start = time.perf_counter()
        call()
        if sync is not None:
            synchronize(sync)
        out.append((time.perf_counter() - start) * 1e6)
    return out


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median": round(statistics.median(ordered), 1),
            "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1)}


def measure(path: Path, args: Args) -> dict[str, Any]:
    """Open + fill times with the device, then the sample arms (see the module doc)."""
    opens: dict[str, list[float]] = {}
    cores = device_reader.fill_threads
    for _ in range(args.repeats):
        for count in args.fill_threads.split(","):
            device_reader.fill_threads = cores if count == "cores" else lambda c=int(count): c
            try:
                start = time.perf_counter()
                store = ReplayStore.open(path, device=args.device)
                synchronize(args.device)
                opens.setdefault(count, []).append(round(time.perf_counter() - start, 3))
            finally:
                device_reader.fill_threads = cores
            store.close()
            del store
    with ReplayStore.open(path, device=args.device) as store:
        sample = summary(time_calls(lambda: store.sample(args.batch), args, args.device))
        issue = summary(time_calls(lambda: store.sample(args.batch), args, None))
        on = str(store.sample(1).obs.device)
    with ReplayStore.open(path) as plain:
        plain_us = summary(time_calls(lambda: plain.sample(args.batch), args, None))
    return {"open_fill_s": opens, "fill_cores": cores(), "sample_us": sample,
            "issue_us": issue, "plain_sample_us": plain_us, "batch_device": on}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "torch": torch.__version__,
                            "cpus": len(os.sched_getaffinity(0)),
                            "torch_threads": torch.get_num_threads(),
                            "load_avg": list(os.getloadavg())}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-device-"))
    report: dict[str, Any] = {"args": vars(args), "machine": machine(), "runs": {}}
    ring_gib = (args.frames + 1) * OBS[0] * OBS[1] / 2**30
    print(f"{args.frames:,} frames of 84x84 on {args.device}: {ring_gib:.2f} GiB ring")
    try:
        for sampler in args.samplers.split(","):
            path = root / sampler
            built = build(path, args, sampler)
            run = {"build_s": round(built, 2), **measure(path, args)}
            report["runs"][sampler] = run
            print(f"{sampler}: build {built:.1f} s, open+fill {run['open_fill_s']} s, "
                  f"sample({args.batch}) {run['sample_us']['median']} us median "
                  f"(issue {run['issue_us']['median']}, plain store "
                  f"{run['plain_sample_us']['median']})")
            shutil.rmtree(path)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    out = Path(args.out_dir) / "device_frames.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
