"""Rate limiting, measured: achieved samples per insert against the target, and the
limiter's cost when it never blocks. Writes ``data/bench/rate_limit.json``.

1. Ratio: an env thread adds steps to an in-process store while a learner thread draws
   batches from it (`ReplayStore.batches`), under `RateLimiter.sample_to_insert_ratio`.
   Two cases: actors ~10x faster than the learner (the learner "trains" `learner_ms` per
   batch) and the learner ~10x faster than the actors (each env step "takes" `env_ms`).
   After `min_size` steps: the achieved samples per insert over the run, and Reverb's
   error at every learner batch (min / max, against the band).
2. Overhead: `add` steps/s and `sample` batches/s without a limiter and with one that never
   blocks (`RateLimiter.min_size(1)`), alternated round by round in one run.

    python scripts/bench_rate_limit.py            # ~1.5 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
import timeit
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay import ReplayStore
from mmreplay.rate_limit import RateLimiter

OBS = (84, 84)


@dataclass
class Args:
    samples_per_insert: float = 4.0
    """target samples per inserted step"""
    batch_size: int = 32
    """learner batch size"""
    min_size: int = 1000
    """steps before the learner may sample"""
    error_buffer: float = 64.0
    """half width of the band around the target (Reverb's error_buffer)"""
    seconds: float = 15.0
    """length of each ratio case after min size"""
    rounds: int = 9
    """overhead rounds (each: without, then with the limiter)"""
    out: str = "data/bench/rate_limit.json"
    """where the figures go"""


def make_store(root: Path, limiter: RateLimiter | None) -> ReplayStore:
    store = ReplayStore.create(root, capacity=50_000, obs_shape=OBS, frame_stack=4, seed=0,
                               rate_limiter=limiter)
    store.reset(np.zeros(OBS, np.uint8))
    return store


def frames(n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, (n, *OBS), dtype=np.uint8)


def ratio_case(args: Args, root: Path, *, env_ms: float, learner_ms: float) -> dict[str, Any]:
    """One run: env thread and learner at the given per-step / per-batch costs."""
    lim = RateLimiter.sample_to_insert_ratio(args.samples_per_insert, args.min_size,
                                             args.error_buffer, timeout_s=60)
    store = make_store(root, lim)
    pool, stop = frames(256), threading.Event()

    def env() -> None:
        i = 0
        while not stop.is_set():
            if env_ms and i >= args.min_size:  # min size fills at full speed
                time.sleep(env_ms / 1000)
            store.add(i % 4, 1.0, pool[i % 256], False, False)
            i += 1

    thread = threading.Thread(target=env, daemon=True)
    thread.start()
    errors: list[float] = []
    with store.batches(args.batch_size, prefetch=2) as it:
        next(it)
        start, t0 = lim.state(), time.perf_counter()
        while time.perf_counter() - t0 < args.seconds:
            next(it)
            errors.append(lim.stats()["error"])
            if learner_ms:
                time.sleep(learner_ms / 1000)
        end = lim.state()
        stop.set()
        lim.disable()  # let the env thread see `stop`
        thread.join(timeout=30)
    store.close()
    inserts, samples = end["inserts"] - start["inserts"], end["samples"] - start["samples"]
    achieved = samples / inserts
    return {"env_ms_per_step": env_ms, "learner_ms_per_batch": learner_ms,
            "inserts": inserts, "samples": samples, "seconds": args.seconds,
            "target": args.samples_per_insert, "achieved": achieved,
            "relative_error": achieved / args.samples_per_insert - 1,
            "error_min": min(errors), "error_max": max(errors),
            "band": [-args.error_buffer, args.error_buffer],
            "insert_wait_s": end["insert_wait_s"], "sample_wait_s": end["sample_wait_s"]}


def adds_per_s(store: ReplayStore, pool: np.ndarray, steps: int) -> float:
    """Steps/s of `steps` one-env adds of frames from `pool`."""
    t0 = time.perf_counter()
    for i in range(steps):
        store.add(i % 4, 1.0, pool[i % len(pool)], False, False)
    return steps / (time.perf_counter() - t0)


def batches_per_s(store: ReplayStore, batch_size: int, batches: int) -> float:
    """`sample(batch_size)` calls per second over `batches` calls."""
    t0 = time.perf_counter()
    for _ in range(batches):
        store.sample(batch_size)
    return batches / (time.perf_counter() - t0)


def natural_rates(args: Args, root: Path) -> dict[str, float]:
    """Unlimited env steps/s and learner samples/s of this machine (no sleeps)."""
    store = make_store(root, None)
    env = adds_per_s(store, frames(256), 3000)
    learner = batches_per_s(store, args.batch_size, 200) * args.batch_size
    store.close()
    return {"env_steps_per_s": env, "learner_samples_per_s": learner}


def overhead(args: Args, root: Path) -> dict[str, Any]:
    """add steps/s and sample batches/s, without and with a never-blocking limiter."""
    pool, rows = frames(256), {"without": [], "with": []}  # type: ignore[var-annotated]
    for r in range(args.rounds):
        for name in ("without", "with"):
            limiter = RateLimiter.min_size(1) if name == "with" else None
            store = make_store(root / f"o{r}{name}", limiter)
            rows[name].append((adds_per_s(store, pool, 4000),
                               batches_per_s(store, args.batch_size, 300)))
            store.close()
    out: dict[str, Any] = {}
    for name, values in rows.items():
        out[f"ingest_steps_per_s_{name}"] = statistics.median(v[0] for v in values)
        out[f"learner_batches_per_s_{name}"] = statistics.median(v[1] for v in values)
    out["ingest_overhead"] = 1 - out["ingest_steps_per_s_with"] / out["ingest_steps_per_s_without"]
    out["learner_overhead"] = 1 - (out["learner_batches_per_s_with"]
                                   / out["learner_batches_per_s_without"])
    out["rounds"] = args.rounds
    out.update(call_costs(args, out))
    return out


def call_costs(args: Args, rates: dict[str, Any]) -> dict[str, float]:
    """The limiter's own cost per call when it admits at once, against the time of one
    `add` and one `sample` (steadier than the rates above on a shared machine)."""
    lim = RateLimiter.min_size(1)
    lim.await_insert(1)
    calls = 200_000
    insert_s = timeit.timeit(lambda: lim.await_insert(1), number=calls) / calls
    sample_s = timeit.timeit(lambda: lim.await_sample(args.batch_size), number=calls) / calls
    return {"await_insert_us": insert_s * 1e6, "await_sample_us": sample_s * 1e6,
            "await_insert_share_of_add": insert_s * rates["ingest_steps_per_s_without"],
            "await_sample_share_of_batch": sample_s * rates["learner_batches_per_s_without"]}


def parse() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return Args(**vars(parser.parse_args()))


def main() -> None:
    args = parse()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rates = natural_rates(args, root / "rates")
        # actors ~10x faster: the learner's batches cost what makes it 10x slower
        need = rates["env_steps_per_s"] * args.samples_per_insert / 10  # learner samples/s
        learner_ms = 1000 * args.batch_size / need
        fast_actors = ratio_case(args, root / "a", env_ms=0.0, learner_ms=learner_ms)
        # learner ~10x faster: each env step costs what makes the env 10x too slow
        env_rate = rates["learner_samples_per_s"] / args.samples_per_insert / 10
        fast_learner = ratio_case(args, root / "b", env_ms=1000 / env_rate, learner_ms=0.0)
        cost = overhead(args, root / "o")
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "note": "2 cores shared with other work: figures drift"},
              "args": asdict(args), "natural_rates": rates,
              "actors_10x_faster": fast_actors, "learner_10x_faster": fast_learner,
              "never_blocking_overhead": cost}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
