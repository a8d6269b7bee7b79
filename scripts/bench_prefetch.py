"""How long a learner waits for a batch, with and without `store.batches(prefetch=...)`.

    python scripts/bench_prefetch.py                  # 100k real Breakout frames
    python scripts/bench_prefetch.py --frames 20000

The learner does real work between batches: a Nature-CNN forward/backward/Adam step on the
CPU (batch 32 of 4x84x84 uint8 stacks). Prints the median time spent waiting for `sample`
(plain) and for `next(it)` (prefetched), and the learner step itself, alone and while the
prefetch thread draws the next batches beside it. Figures only.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from ale_frames import record_frames
from common import QNetwork, parse_args, run_main
from torch import nn

from mmreplay import ReplayStore


@dataclass
class Args:
    frames: int = 100_000
    """real Breakout frames in the store"""
    steps: int = 150
    """timed learner steps per figure"""
    prefetch: int = 2
    """batches `store.batches` keeps ready"""
    threads: int = 1
    """torch intra-op threads"""
    seed: int = 0
    """seed of the recording and the store"""


def build_store(path: Path, frames: int, seed: int) -> ReplayStore:
    data = record_frames("ALE/Breakout-v5", frames, seed)
    store = ReplayStore.create(path, capacity=frames, obs_shape=(84, 84), frame_stack=4,
                               seed=seed)
    for i in range(frames):
        if data.is_first[i]:
            store.reset(data.frames[i])
        else:
            store.add(int(data.actions[i]), float(data.rewards[i]), data.frames[i],
                      bool(data.terminated[i]), bool(data.truncated[i]))
    store.flush()
    return store


def learner_step(net: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
    q = net(batch.obs).gather(1, batch.action[:, None].clamp(max=3)).squeeze(1)
    loss = nn.functional.smooth_l1_loss(q, batch.reward)
    opt.zero_grad()
    loss.backward()
    opt.step()


def main() -> None:
    args = parse_args(Args, description=__doc__)
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="mmreplay-prefetch-"))
    try:
        store = build_store(root / "store", args.frames, args.seed)
        net = QNetwork((4, 84, 84), 4)
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)
        plain, work = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            batch = store.sample(32)
            t1 = time.perf_counter()
            learner_step(net, opt, batch)
            plain.append(t1 - t0)
            work.append(time.perf_counter() - t1)
        waits, work_beside = [], []  # the learner step with the prefetch thread decoding
        with store.batches(32, prefetch=args.prefetch) as it:
            next(it)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                batch = next(it)
                t1 = time.perf_counter()
                waits.append(t1 - t0)
                learner_step(net, opt, batch)
                work_beside.append(time.perf_counter() - t1)
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = lambda xs: np.median(xs) * 1e3  # noqa: E731
    print(f"{args.frames:,} real Breakout frames, batch 32, torch threads {args.threads}")
    print(f"learner step (Nature CNN fwd/bwd/Adam)  median {ms(work):8.3f} ms")
    print(f"learner step beside the prefetch thread median {ms(work_beside):8.3f} ms")
    print(f"wait for store.sample(32)               median {ms(plain):8.3f} ms")
    print(f"wait for next(store.batches(prefetch={args.prefetch}))  median {ms(waits):8.3f} ms"
          f"   p90 {np.percentile(waits, 90) * 1e3:.3f} ms")


if __name__ == "__main__":
    run_main(main)
