"""How long a learner waits for a batch, with and without `store.batches(prefetch=...)`.

    python scripts/bench/bench_prefetch.py                  # 100k real Breakout frames
    python scripts/bench/bench_prefetch.py --frames 20000 --distinct-frames 20000

The learner does real work between batches: a Nature-CNN forward/backward/Adam step on the
CPU (batch 32 of 4x84x84 uint8 stacks). The arms, timed in turn for `--rounds` rounds of
`--steps // --rounds` steps each (the machine is shared: its load drifts, and alternation
spreads the drift over all arms):

- ``premade``: the learner step on a batch drawn before, nothing else running (the step's
  own time);
- ``plain``: ``store.sample(32)`` then the step;
- ``prefetch``: ``next(it)`` of ``store.batches(32, prefetch=--prefetch)`` then the step,
  while the prefetch thread draws the next batches beside it (a fresh iterator per round;
  its first batch is not timed);
- ``waiting``: the same with the former design of that thread (`WaitingPrefetcher`, here):
  it waits on the full queue, so the learner's ``get`` wakes it inside ``next()``.

Prints and writes (`prefetch.json` under `--out-dir`) the wait for a batch and the step time
of each arm, median and p90, the step beside each prefetch thread over the step alone, and the
load average at start and end. Figures only.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import torch
import tyro
from ale_frames import CACHE_DIR, record_frames
from benchlib.harness import feed_timed, machine_info, new_store, write_json
from common import QNetwork, run_main
from torch import nn

from mmreplay import ReplayStore

ARMS = ("premade", "plain", "prefetch", "waiting")


@dataclass
class Args:
    frames: int = 100_000
    """frames in the store (real Breakout frames, cycled from --distinct-frames)"""
    distinct_frames: int = 200_000
    """real frames recorded (cached under --cache-dir; bench_scale.py records the same)"""
    steps: int = 150
    """timed learner steps per arm"""
    rounds: int = 5
    """rounds of the arms in turn"""
    prefetch: int = 2
    """batches `store.batches` keeps ready"""
    threads: int = 1
    """torch intra-op threads"""
    seed: int = 0
    """seed of the recording and the store"""
    out_dir: str = "data/bench"
    """directory of prefetch.json"""
    cache_dir: str = str(CACHE_DIR)
    """where recorded frames are cached as .npz"""


def build_store(path: Path, args: Args) -> ReplayStore:
    data = record_frames("ALE/Breakout-v5", min(args.frames, args.distinct_frames), args.seed,
                         cache_dir=args.cache_dir)
    store = new_store(path, args.frames, args.seed)
    feed_timed(store, data, 0, args.frames, desc="fill", progress=False)
    store.flush()
    return store


def learner_step(net: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
    q = net(batch.obs).gather(1, batch.action[:, None].clamp(max=3)).squeeze(1)
    loss = nn.functional.smooth_l1_loss(q, batch.reward)
    opt.zero_grad()
    loss.backward()
    opt.step()


def timed_steps(get: Callable[[], Any], step: Callable[[Any], None], n: int,
                waits: list[float], work: list[float]) -> None:
    """`n` learner steps, each on the batch `get()` returns: the wait and the step, seconds."""
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        batch = get()
        t1 = clock()
        step(batch)
        waits.append(t1 - t0)
        work.append(clock() - t1)


class WaitingPrefetcher:
    """The former `store.batches` thread, for comparison: it blocks on the full queue."""

    def __init__(self, store: ReplayStore, prefetch: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store,), daemon=True)
        self._thread.start()

    def _run(self, store: ReplayStore) -> None:
        while not self._stop.is_set():
            batch = store.sample(32)
            while not self._stop.is_set():
                try:
                    self._queue.put(batch, timeout=0.05)
                    break
                except queue.Full:
                    continue

    def __next__(self) -> Any:
        return self._queue.get()

    def __enter__(self) -> WaitingPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(store: ReplayStore, args: Args) -> dict[str, dict[str, list[float]]]:
    """The four arms in turn, `--rounds` times; each arm's waits and step times."""
    net = QNetwork((4, 84, 84), 4)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    step = lambda batch: learner_step(net, opt, batch)  # noqa: E731
    premade = store.sample(32)
    for _ in range(3):  # warm up torch's kernels
        step(premade)
    arms: dict[str, dict[str, list[float]]] = {
        name: {"wait": [], "step": []} for name in ARMS}
    per = max(1, args.steps // max(1, args.rounds))
    for _ in range(max(1, args.rounds)):
        timed_steps(lambda: premade, step, per, **_lists(arms["premade"]))
        timed_steps(lambda: store.sample(32), step, per, **_lists(arms["plain"]))
        for name, make in (("prefetch", lambda: store.batches(32, prefetch=args.prefetch)),
                           ("waiting", lambda: WaitingPrefetcher(store, args.prefetch))):
            with make() as it:
                next(it)
                timed_steps(lambda it=it: next(it), step, per, **_lists(arms[name]))
    return arms


def _lists(arm: dict[str, list[float]]) -> dict[str, list[float]]:
    return {"waits": arm["wait"], "work": arm["step"]}


def summarize(arms: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    def stats(xs: list[float]) -> dict[str, float]:
        a = np.asarray(xs) * 1e3
        return {"median_ms": float(np.median(a)), "p90_ms": float(np.percentile(a, 90)),
                "mean_ms": float(a.mean()), "n": int(a.size)}

    out: dict[str, Any] = {name: {k: stats(v) for k, v in arm.items()}
                           for name, arm in arms.items()}
    alone = out["premade"]["step"]
    for name in ("prefetch", "waiting"):
        out[f"step_ratio_{name}_over_premade"] = {
            q: out[name]["step"][f"{q}_ms"] / alone[f"{q}_ms"] for q in ("median", "p90")}
    return out


def report(result: dict[str, Any], args: Args) -> None:
    s, load = result["summary"], result["load"]
    print(f"{args.frames:,} real Breakout frames, batch 32, torch threads {args.threads}, "
          f"{args.rounds} rounds of the arms in turn; load average {load['start']:.2f} at "
          f"start, {load['end']:.2f} at end ({os.cpu_count()} cores)")
    print(f"{'arm':<10}{'wait median':>13}{'wait p90':>10}{'step median':>13}{'step p90':>10}"
          "   (ms)")
    for name in ARMS:
        w, st = s[name]["wait"], s[name]["step"]
        print(f"{name:<10}{w['median_ms']:>13.3f}{w['p90_ms']:>10.3f}"
              f"{st['median_ms']:>13.2f}{st['p90_ms']:>10.2f}")
    for name in ("prefetch", "waiting"):
        r = s[f"step_ratio_{name}_over_premade"]
        print(f"learner step beside the {name} thread / alone: median {r['median']:.3f}x, "
              f"p90 {r['p90']:.3f}x")


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="mmreplay-prefetch-"))
    result: dict[str, Any] = {"machine": machine_info(), "config": asdict(args)}
    try:
        store = build_store(root / "store", args)
        start = os.getloadavg()[0]
        arms = measure(store, args)
        result["load"] = {"start": start, "end": os.getloadavg()[0]}
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["summary"] = summarize(arms)
    report(result, args)
    out = write_json(result, Path(args.out_dir), "prefetch.json")
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
