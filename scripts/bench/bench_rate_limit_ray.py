"""The Ray section of `bench_rate_limit.py`: the limiter held by a store actor.

An env actor (one env, 32x32 frames, frame stack 4: the ratio does not depend on the frame
size, and small frames let a short run hold enough steps on a loaded machine) sends
`BlockWriter` blocks to a `StoreActor` whose `RateLimiter.sample_to_insert_ratio` paces it
against a learner (this process) drawing `RemoteBatches`. First the natural rates through
Ray (no limiter), then two cases: the env actor ~10x faster than the learner needs (the
learner "trains" `learner_ms` per batch) and the learner ~10x faster (each env step "takes"
`env_ms`). Per case, after `min_size`: the achieved samples per insert over the run and the
lowest and highest error the limiter saw after any admission (`RateLimiter.stats`), against
the band; a call of n items may pass an edge by n - 1 items (a block of `block_steps` steps
on the insert side, a batch on the sample side), and the worst deviation past the band is
logged.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from mmreplay.integrations.ray import BlockWriter, RemoteBatches, start_store_actor
from mmreplay.rate_limit import RateLimiter

OBS = (32, 32)


class EnvFeeder:
    """A Ray actor stepping one env: a step every `env_ms` (after `min_size`), until `stop`."""

    def __init__(self, store: Any, block_steps: int) -> None:
        self.writer = BlockWriter(store, [0], block_steps=block_steps, max_in_flight=2,
                                  compress=True, insert_timeout_s=300.0)
        rng = np.random.default_rng(0)
        self.pool = rng.integers(0, 255, (256, 1, *OBS), dtype=np.uint8)
        self.stopped = threading.Event()

    def run(self, env_ms: float, min_size: int) -> int:
        w, pool, i = self.writer, self.pool, 0
        w.reset(pool[0])
        zero = np.zeros(1, bool)
        while not self.stopped.is_set():
            if env_ms and i >= min_size:
                time.sleep(env_ms / 1000)
            w.add(np.array([i % 4]), np.ones(1, np.float32), pool[i % 256], zero, zero)
            i += 1
        w.drain()
        return w.stats.steps_acked

    def stop(self) -> None:
        self.stopped.set()


def start(path: Path, limiter: RateLimiter | None, args: Any) -> tuple[Any, Any]:
    store = start_store_actor(path, {"capacity": 50_000, "obs_shape": OBS, "num_envs": 1,
                                     "frame_stack": 4, "seed": 0},
                              flush_every_steps=10**9, flush_every_s=3600.0,
                              rate_limiter=limiter)
    feeder = ray.remote(num_cpus=0, max_concurrency=2)(EnvFeeder).remote(store,
                                                                        args.block_steps)
    return store, feeder


def stop(store: Any, feeder: Any, run: Any, batches: RemoteBatches | None) -> int:
    """Stop the env actor (limiting off so that a waiting block goes), close everything."""
    ray.get(feeder.stop.remote())
    ray.get(store.set_rate_limiting.remote(False))
    steps = ray.get(run)
    if batches is not None:
        batches.close()
    ray.get(store.close.remote())
    ray.kill(feeder)
    ray.kill(store)
    return steps


def natural_rates(args: Any, path: Path, seconds: float = 3.0) -> dict[str, float]:
    """Env actor steps/s and learner samples/s through the store actor, unlimited."""
    store, feeder = start(path, None, args)
    run = feeder.run.remote(0.0, 0)
    while ray.get(store.counts.remote()).transitions < 500:  # the actors have started
        time.sleep(0.05)
    t0, n0 = time.perf_counter(), ray.get(store.counts.remote()).transitions
    time.sleep(seconds)
    env = (ray.get(store.counts.remote()).transitions - n0) / (time.perf_counter() - t0)
    batches = RemoteBatches(store, args.batch_size, prefetch=2, background=False)
    next(batches)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(batches)
        count += 1
    learner = count * args.batch_size / (time.perf_counter() - t0)
    stop(store, feeder, run, batches)
    return {"env_steps_per_s": env, "learner_samples_per_s": learner}


def ratio_case(args: Any, path: Path, *, env_ms: float, learner_ms: float) -> dict[str, Any]:
    lim = RateLimiter.sample_to_insert_ratio(args.samples_per_insert, args.min_size,
                                             args.error_buffer, timeout_s=300)
    store, feeder = start(path, lim, args)
    run = feeder.run.remote(env_ms, args.min_size)
    batches = RemoteBatches(store, args.batch_size, prefetch=2, background=False)
    next(batches)  # waits for min size
    first, t0 = ray.get(store.rate_limiter_stats.remote()), time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        next(batches)
        if learner_ms:
            time.sleep(learner_ms / 1000)
    last = ray.get(store.rate_limiter_stats.remote())
    stop(store, feeder, run, batches)
    since_min_size = last["achieved_samples_per_insert"]
    inserts, samples = last["inserts"] - first["inserts"], last["samples"] - first["samples"]
    achieved = samples / inserts
    low, high, half = last["error_low"], last["error_high"], args.error_buffer
    return {"env_ms_per_step": env_ms, "learner_ms_per_batch": learner_ms,
            "inserts": inserts, "samples": samples, "seconds": args.seconds,
            "target": args.samples_per_insert, "achieved": achieved,
            "relative_error": achieved / args.samples_per_insert - 1,
            "since_min_size": since_min_size,
            "since_min_size_relative_error": since_min_size / args.samples_per_insert - 1,
            "error_low": low, "error_high": high, "band": [-half, half],
            "worst_past_band": max(0.0, high - half, -half - low),
            "allowed_past_band": {"insert_side": (args.block_steps - 1) * args.samples_per_insert,
                                  "sample_side": args.batch_size - 1},
            "insert_wait_s": last["insert_wait_s"] - first["insert_wait_s"],
            "sample_wait_s": last["sample_wait_s"] - first["sample_wait_s"]}


def ray_section(args: Any, root: Path) -> dict[str, Any]:
    """Natural rates, then both cases, on one local Ray cluster (2 CPUs)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False, object_store_memory=300 << 20)
    try:
        rates = natural_rates(args, root / "rates")
        need = rates["env_steps_per_s"] * args.samples_per_insert / 10
        fast_actors = ratio_case(args, root / "a", env_ms=0.0,
                                 learner_ms=1000 * args.batch_size / need)
        env_rate = rates["learner_samples_per_s"] / args.samples_per_insert / 10
        fast_learner = ratio_case(args, root / "b", env_ms=1000 / env_rate, learner_ms=0.0)
    finally:
        ray.shutdown()
    for name, case in (("actors 10x faster", fast_actors), ("learner 10x faster",
                                                            fast_learner)):
        print(f"ray, {name}: {case['achieved']:.3f} samples per insert "
              f"({case['relative_error']:+.1%}), error {case['error_low']:g} .. "
              f"{case['error_high']:g} in band ±{args.error_buffer:g}", flush=True)
    return {"natural_rates": rates, "block_steps": args.block_steps,
            "actors_10x_faster": fast_actors, "learner_10x_faster": fast_learner}
