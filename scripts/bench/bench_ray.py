"""Ingest and sampling through Ray against the in-process store, on real ALE frames.

    python scripts/bench/bench_ray.py        # ~4 min; prints a table, writes data/bench/ray.json

Ingest: one store of `num_envs` envs (frame stack 4, n-step 3) fed the recorded Breakout stream
(each env replays it from its own offset) by (a) `store.add` of every env in this process, and
(b) 1, 2 and 4 Ray actors, each owning `num_envs / actors` envs and sending `BlockWriter`
blocks (raw or zstd-1 frames) to a `StoreActor`. Every rate ends with a flush of the store.
Learner: `sample(batch)` in this process against `RemoteBatches` (prefetch; raw or lz4 stacks;
one or 4 batches per call) from a store actor on the same store: batches per second and the
median wait for a batch, with nothing else to do and with a DQN gradient step per batch.
All on one local Ray cluster (`num_cpus` CPUs) started once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import torch
import torch.nn as nn
import tyro
from ale_frames import record_frames
from common import run_main

from mmreplay import ReplayStore
from mmreplay.integrations.ray import BlockWriter, RemoteBatches, start_store_actor


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """ALE game whose frames are recorded (cached under data/cache/)"""
    distinct_frames: int = 20_000
    """frames recorded once; every env replays them from its own offset"""
    steps: int = 60_000
    """steps (summed over envs) per ingest measurement"""
    num_envs: int = 4
    """envs of the store; split evenly over the actors"""
    actors: str = "1,2,4"
    """actor counts to measure"""
    block_steps: int = 128
    """steps per block (rows x the actor's envs)"""
    max_in_flight: int = 2
    """blocks per actor waiting for the store actor"""
    batch_sizes: str = "32,256"
    """learner batch sizes"""
    sample_seconds: float = 4.0
    """seconds per learner measurement"""
    prefetch: int = 4
    """`sample` calls the iterator keeps in flight"""
    num_cpus: int = 2
    """CPUs of the local Ray cluster"""
    repeats: int = 3
    """rounds of every ingest measurement (interleaved; the best round of each is kept)"""
    seed: int = 0
    """seed of the recording and the stores"""
    ingest_only: bool = False
    """measure ingest only (no learner section)"""
    out: str = "data/bench/ray.json"
    """where the figures go (JSON)"""


def env_rows(rec: Any, num_envs: int, rows: int) -> dict[str, np.ndarray]:
    """(rows, num_envs) step arrays: env e replays the recording from offset e * n / E.

    A frame that starts an episode becomes an autoreset row; row 0 of every env is o_0.
    """
    n = len(rec)
    idx = (np.arange(rows)[:, None] + np.arange(num_envs)[None, :] * (n // num_envs)) % n
    auto = rec.is_first[idx].copy()
    auto[0] = True
    return {"action": rec.actions[idx], "reward": rec.rewards[idx], "frames": rec.frames[idx],
            "terminated": rec.terminated[idx] & ~auto, "truncated": rec.truncated[idx] & ~auto,
            "autoreset": auto}


def store_args(args: Args, **kw: Any) -> dict[str, Any]:
    return {"capacity": 100_000, "obs_shape": (84, 84), "num_envs": args.num_envs,
            "frame_stack": 4, "n_step": 3, "seed": args.seed, **kw}


def ingest_in_process(path: Path, rows: dict[str, np.ndarray], args: Args) -> float:
    """Steps per second of `store.add` of every env, flush included."""
    store = ReplayStore.create(path, **store_args(args))
    store.reset(rows["frames"][0])
    count = rows["reward"].shape[0]
    start = time.perf_counter()
    for t in range(1, count):
        store.add(rows["action"][t], rows["reward"][t], rows["frames"][t],
                  rows["terminated"][t], rows["truncated"][t], autoreset=rows["autoreset"][t])
    store.flush()
    rate = (count - 1) * args.num_envs / (time.perf_counter() - start)
    store.close()
    return rate


class Feeder:
    """A Ray actor that replays its envs' rows through a BlockWriter."""

    def __init__(self, store: Any, env_ids: list[int], rows: dict[str, np.ndarray],
                 block_steps: int, max_in_flight: int, compress: bool) -> None:
        self.rows = {k: np.ascontiguousarray(v[:, env_ids]) for k, v in rows.items()}
        self.writer = BlockWriter(store, env_ids, block_steps=block_steps,
                                  max_in_flight=max_in_flight, compress=compress)

    def run(self) -> dict[str, float]:
        r, w = self.rows, self.writer
        cpu = time.process_time()
        w.reset(r["frames"][0])
        for t in range(1, r["reward"].shape[0]):
            w.add(r["action"][t], r["reward"][t], r["frames"][t], r["terminated"][t],
                  r["truncated"][t], r["autoreset"][t])
        w.drain()
        return {"steps": w.stats.steps_acked, "bytes": w.stats.bytes_sent,
                "blocks": w.stats.blocks_sent, "wait_s": w.stats.wait_s,
                "cpu_s": time.process_time() - cpu}


def ingest_ray(path: Path, rows_ref: Any, args: Args, actors: int,
               compress: bool) -> dict[str, float]:
    store = start_store_actor(path, store_args(args), flush_every_steps=10**9)
    ray.get(store.info.remote())
    per = args.num_envs // actors
    feeder = ray.remote(num_cpus=0)(Feeder)
    feeders = [feeder.remote(store, list(range(i * per, (i + 1) * per)), rows_ref,
                             max(1, args.block_steps // per), args.max_in_flight, compress)
               for i in range(actors)]
    ray.get([f.__ray_ready__.remote() for f in feeders])
    before = ray.get(store.take_times.remote())
    start = time.perf_counter()
    reports = ray.get([f.run.remote() for f in feeders])
    ray.get(store.flush.remote())
    seconds = time.perf_counter() - start
    after = ray.get(store.take_times.remote())
    counts = ray.get(store.counts.remote())
    ray.get(store.close.remote())
    for f in [*feeders, store]:
        ray.kill(f)
    steps = sum(r["steps"] for r in reports)
    assert counts.transitions == steps, (counts, steps)
    blocks = sum(r["blocks"] for r in reports)
    return {"actors": actors, "compress": compress, "steps_per_s": steps / seconds,
            "bytes_per_step": sum(r["bytes"] for r in reports) / steps,
            "block_steps": max(1, args.block_steps // per) * per, "block_bytes":
            sum(r["bytes"] for r in reports) / blocks,
            "writer_wait_share": sum(r["wait_s"] for r in reports) / actors / seconds,
            "profile": store_profile(before, after, reports, seconds, steps)}


def store_profile(before: dict[str, float], after: dict[str, float],
                  reports: list[dict[str, float]], seconds: float,
                  steps: int) -> dict[str, float]:
    """The store actor's share of an ingest run: its writer thread's time in checking
    (zstd decoding included), applying and flushing blocks, per step and as a share of the
    wall time; the CPU seconds of the store process and of the writers against the
    `seconds` x cores the machine had."""
    d = {k: after[k] - before[k] for k in after}
    busy = d["check_s"] + d["apply_s"] + d["flush_s"]
    writers_cpu = sum(r["cpu_s"] for r in reports)
    return {"store_busy_share": busy / seconds,
            "check_us_per_step": 1e6 * d["check_s"] / steps,
            "apply_us_per_step": 1e6 * d["apply_s"] / steps,
            "flush_us_per_step": 1e6 * d["flush_s"] / steps,
            "store_cpu_share": d["process_cpu_s"] / seconds,
            "writers_cpu_share": writers_cpu / seconds,
            "cores_busy": (d["process_cpu_s"] + writers_cpu) / seconds}


def ingest_rounds(tmp: Path, rows: dict[str, np.ndarray], rows_ref: Any,
                  args: Args) -> tuple[list[dict[str, Any]], float]:
    """Every configuration `repeats` times, interleaved, keeping each one's best round: the
    machine is shared, so a slow round says more about the neighbours than about the code."""
    best: dict[tuple[int, bool], dict[str, Any]] = {}
    base = 0.0
    for rep in range(args.repeats):
        base = max(base, ingest_in_process(tmp / f"local{rep}", rows, args))
        if rep + 1 < args.repeats:
            shutil.rmtree(tmp / f"local{rep}")
        for actors in [int(a) for a in args.actors.split(",")]:
            for compress in (False, True):
                path = tmp / f"ray{actors}{compress}"
                r = ingest_ray(path, rows_ref, args, actors, compress)
                shutil.rmtree(path)
                key = (actors, compress)
                if key not in best or r["steps_per_s"] > best[key]["steps_per_s"]:
                    best[key] = r
    (tmp / f"local{args.repeats - 1}").rename(tmp / "local")
    return list(best.values()), base


def make_train_step(batch: int) -> Any:
    """A DQN gradient step (Nature CNN, Adam, one torch thread): the learner's own work."""
    torch.set_num_threads(1)
    net = nn.Sequential(
        nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512),
        nn.ReLU(), nn.Linear(512, 4))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)

    def step(b: Any) -> None:
        with torch.no_grad():
            target = b.reward + b.discount * net(b.next_obs.float() / 255).max(1).values
        q = net(b.obs.float() / 255).gather(1, b.action.view(-1, 1)).squeeze(1)
        loss = torch.nn.functional.smooth_l1_loss(q, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def learner_in_process(path: Path, batch: int, seconds: float,
                       train: bool) -> dict[str, float]:
    step = make_train_step(batch) if train else None
    with ReplayStore.open(path) as store:
        waits, count, start = [], 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            b = store.sample(batch)
            waits.append(time.perf_counter() - t)
            if step is not None:
                step(b)
            count += 1
        rate = count / (time.perf_counter() - start)
    return {"batches_per_s": rate, "wait_median_ms": 1e3 * float(np.median(waits))}


def learner_ray(path: Path, batch: int, seconds: float, *, prefetch: int, compress: bool,
                per_call: int, train: bool) -> dict[str, float]:
    step = make_train_step(batch) if train else None
    store = start_store_actor(path)
    ray.get(store.info.remote())
    batches = RemoteBatches(store, batch, prefetch=prefetch, compress=compress,
                            batches_per_call=per_call)
    next(batches)
    count, start, waits = 0, time.perf_counter(), []
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        b = next(batches)  # the wait includes decoding, as in-process sampling does
        waits.append(time.perf_counter() - t)
        if step is not None:
            step(b)
        count += 1
    rate = count / (time.perf_counter() - start)
    batches.close()
    ray.get(store.close.remote())
    ray.kill(store)
    return {"batches_per_s": rate, "wait_median_ms": 1e3 * float(np.median(waits))}


LEARNER_RUNS = [  # (label, compress, batches per call)
    ("raw", False, 1), ("lz4", True, 1), ("lz4 x4 per call", True, 4)]


def learner_rows(path: Path, batch: int, train: bool, args: Args) -> dict[str, Any]:
    local = learner_in_process(path, batch, args.sample_seconds, train)
    what = f"batch {batch}{' + DQN step' if train else ''}"
    print(f"learner {what}: in-process {local['batches_per_s']:,.1f} b/s "
          f"(median sample {local['wait_median_ms']:.2f} ms)")
    row: dict[str, Any] = {"batch": batch, "train_step": train, "in_process": local}
    for label, compress, per_call in LEARNER_RUNS if not train else LEARNER_RUNS[1:2]:
        remote = learner_ray(path, batch, args.sample_seconds, prefetch=args.prefetch,
                             compress=compress, per_call=per_call, train=train)
        row[f"ray {label}"] = remote
        print(f"  ray {label}: {remote['batches_per_s']:,.1f} b/s "
              f"({remote['batches_per_s'] / local['batches_per_s']:.0%}), median wait "
              f"{remote['wait_median_ms']:.2f} ms")
    return row


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rec = record_frames(args.game, args.distinct_frames, args.seed)
    rows = env_rows(rec, args.num_envs, args.steps // args.num_envs + 1)
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False, object_store_memory=1 << 30)
    rows_ref = ray.put(rows)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    results: dict[str, Any] = {"args": vars(args), "ingest": [], "learner": []}
    try:
        results["ingest"], base = ingest_rounds(tmp, rows, rows_ref, args)
        results["in_process_steps_per_s"] = base
        print(f"in-process add: {base:,.0f} steps/s ({args.num_envs} envs per add), "
              f"best of {args.repeats}")
        for r in results["ingest"]:
            r["share_of_in_process"] = r["steps_per_s"] / base
            print(f"ray {r['actors']} actor(s) {'zstd' if r['compress'] else 'raw'}: "
                  f"{r['steps_per_s']:,.0f} steps/s ({r['share_of_in_process']:.0%}), "
                  f"block {r['block_steps']} steps / {r['block_bytes'] / 1024:,.0f} KiB, "
                  f"{r['bytes_per_step']:,.0f} B/step, writers blocked "
                  f"{r['writer_wait_share']:.0%}; store busy "
                  f"{r['profile']['store_busy_share']:.0%}, cores busy "
                  f"{r['profile']['cores_busy']:.2f}")
        if not args.ingest_only:
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                results["learner"].append(learner_rows(tmp / "local", batch, False, args))
            results["learner"].append(learner_rows(tmp / "local", 32, True, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        ray.shutdown()
    out = Path(__file__).resolve().parents[2] / args.out  # relative to the repository
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
