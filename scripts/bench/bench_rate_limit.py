"""Rate limiting, measured: achieved samples per insert against the target, and the
limiter's cost when it never blocks. Writes ``data/bench/rate_limit.json``.

1. Ratio: an env thread adds steps to an in-process store while a learner thread draws
   batches from it (`ReplayStore.batches`), under `RateLimiter.sample_to_insert_ratio`.
   Two cases: actors ~10x faster than the learner (the learner "trains" `learner_ms` per
   batch) and the learner ~10x faster than the actors (each env step "takes" `env_ms`).
   After `min_size` steps: the achieved samples per insert over the run, and Reverb's
   error at every learner batch (`error_min` / `error_max`) and after every admission
   (`error_low` / `error_high`, from `RateLimiter.stats`), against the band.
2. The same two cases through Ray (`--sections ray`, module `bench_rate_limit_ray`): an
   env actor sends `BlockWriter` blocks to the store actor, the learner draws
   `RemoteBatches` from it; the limiter lives in the store actor and records the lowest and
   highest error after every admission (`error_low`, `error_high`).
3. Overhead: `add` steps/s and `sample` batches/s without a limiter and with one that never
   blocks (`RateLimiter.min_size(1)`, an endless lease; and a ratio band too wide to
   reach, a finite lease: both admit inserts inside `add`, without the limiter's lock), on
   one store whose limiter is switched on and off chunk by chunk (alternated, so the
   machine's drift falls on every arm). Sections 3 and 4 add real Breakout frames (`ale_frames`).
4. Per call (`--sections percall`): each `add` timed alone, arms (none, `min_size(1)`, the
   wide band) alternated in chunks of 50 calls, percentiles per arm. Low percentiles leave
   out the calls that compress a chunk and the machine's stalls: the admission's own cost
   inside `add`; the costs are also given as a share of the mean `add` without a limiter.

    python scripts/bench/bench_rate_limit.py                      # ~3 minutes, every section
    python scripts/bench/bench_rate_limit.py --sections overhead  # one section; the others are kept
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
from mmreplay.admission import LimiterSlot
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
    rounds: int = 40
    """overhead rounds (each: a chunk without, then one with the limiter, order alternated)"""
    block_steps: int = 8
    """steps per block of the Ray env actor"""
    sections: str = "threads,ray,overhead"
    """sections to run; the others keep their figures from `out`"""
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


def atari_frames(n: int = 1500) -> np.ndarray:
    """`n` consecutive real Breakout frames (cached by `ale_frames`): what the overhead
    sections add, so an `add` compresses as much as an Atari run's does (random frames
    do not compress, which makes every `add` slower and the limiter's share smaller)."""
    from ale_frames import record_frames
    return record_frames("ALE/Breakout-v5", n, seed=0).frames


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
        end, end_stats = lim.state(), lim.stats()
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
            "error_low": end_stats["error_low"], "error_high": end_stats["error_high"],
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


# "with": `RateLimiter.min_size(1)` (no upper edge: an endless lease);
# "with_band": a ratio band far wider than the run (a finite lease, never spent);
# "without_again": the noise floor (A/A)
ARMS = ("without", "with", "with_band", "without_again")


def overhead(args: Args, root: Path) -> dict[str, Any]:
    """add steps/s and sample batches/s without and with a never-blocking limiter
    (`RateLimiter.min_size(1)`, and a ratio band too wide to reach) on one store whose
    limiter is switched chunk by chunk, the arms in a seeded random order per round. A last
    arm repeats "without": its distance to the first is the noise floor. Medians of
    per-chunk times (a shared machine stalls a chunk now and then, for seconds). Samples
    are timed on the filled store with no adds in between, so every chunk draws from the
    same store. The first call of each chunk is not timed (see the loop)."""
    pool, rng = atari_frames(), np.random.default_rng(0)
    store = make_store(root / "o", None)
    limiters = {"with": RateLimiter.min_size(1),
                "with_band": RateLimiter.sample_to_insert_ratio(1.0, 1, 1e12)}
    adds_per_chunk, batches_per_chunk = 173, 29  # primes: unaligned with frame chunks
    adds_per_s(store, pool, 3000)  # warm up (and enough steps to sample)
    chunks: dict[tuple[str, str], list[float]] = {}
    for what, count in (("add", adds_per_chunk), ("sample", batches_per_chunk)):
        for _ in range(args.rounds):
            for name in rng.permutation(ARMS):
                store.set_rate_limiter(limiters.get(str(name)))
                rate = chunk_rate(store, what, count, pool, args.batch_size)
                chunks.setdefault((what, str(name)), []).append(rate)
    store.close()
    out: dict[str, Any] = {"rounds": args.rounds, "adds_per_chunk": adds_per_chunk,
                           "batches_per_chunk": batches_per_chunk}
    for what, key, unit in (("add", "ingest", "steps"), ("sample", "learner", "batches")):
        rate = {name: statistics.median(chunks[what, name]) for name in ARMS}
        for name in ARMS:
            out[f"{key}_{unit}_per_s_{name}"] = rate[name]
        out[f"{key}_overhead"] = 1 - rate["with"] / rate["without"]
        out[f"{key}_overhead_band"] = 1 - rate["with_band"] / rate["without"]
        out[f"{key}_noise_floor"] = 1 - rate["without_again"] / rate["without"]
        for name, label in (("with", "overhead"), ("with_band", "overhead_band"),
                            ("without_again", "noise_floor")):
            out[f"{key}_{label}_paired"] = paired(chunks[what, name], chunks[what, "without"])
    out.update(call_costs(args, out))
    return out


def chunk_rate(store: ReplayStore, what: str, count: int, pool: np.ndarray,
               batch_size: int) -> float:
    """Steps/s of `count` adds, or batches/s of `count` samples, after one call untimed: the
    first after a switch takes the limiter's lock (a new lease), which a run that keeps its
    limiter pays once."""
    if what == "add":
        adds_per_s(store, pool, 1)
        return adds_per_s(store, pool, count)
    batches_per_s(store, batch_size, 1)
    return batches_per_s(store, batch_size, count)


def paired(arm: list[float], base: list[float]) -> float:
    """The median over rounds of ``1 - arm / base``, each round's chunks side by side
    (steadier than the ratio of medians when the machine's load drifts between rounds)."""
    return statistics.median(1 - a / b for a, b in zip(arm, base, strict=True))


def per_call(args: Args, root: Path) -> dict[str, Any]:
    """Microseconds of single `add` calls (10th, 25th, 50th percentile and mean) without a
    limiter, with `RateLimiter.min_size(1)` ("with") and with a ratio band too wide to reach
    ("with_band"), the arms alternated in chunks of 50 calls in a seeded random order,
    `rounds` chunks each; the percentile differences to "without", and each as a share of
    the mean `add` without a limiter."""
    pool, rng = atari_frames(), np.random.default_rng(0)
    store = make_store(root, None)
    arms = {"without": None, "with": RateLimiter.min_size(1),
            "with_band": RateLimiter.sample_to_insert_ratio(1.0, 1, 1e12)}
    adds_per_s(store, pool, 3000)  # warm up
    times: dict[str, list[int]] = {name: [] for name in arms}
    clock, i = time.perf_counter_ns, 0
    for _ in range(args.rounds):
        for name in rng.permutation(list(arms)):
            store.set_rate_limiter(arms[str(name)])
            spent = times[str(name)]
            for _ in range(50):
                start = clock()
                store.add(i % 4, 1.0, pool[i % len(pool)], False, False)
                spent.append(clock() - start)
                i += 1
    store.close()
    out: dict[str, Any] = {"calls_per_arm": 50 * args.rounds}
    for name, spent in times.items():
        us = np.asarray(spent) / 1000
        out[name] = {"p10_us": float(np.percentile(us, 10)),
                     "p25_us": float(np.percentile(us, 25)),
                     "p50_us": float(np.median(us)), "mean_us": float(us.mean())}
    mean = out["without"]["mean_us"]
    for arm, key in (("with", "cost"), ("with_band", "cost_band")):
        for q in ("p10_us", "p25_us", "p50_us"):
            out[f"{key}_{q}"] = out[arm][q] - out["without"][q]
            out[f"{key}_{q}_share_of_mean_add"] = out[f"{key}_{q}"] / mean
    return out


def call_costs(args: Args, rates: dict[str, Any]) -> dict[str, float]:
    """What admitting a sample costs per batch with a limiter that admits at once, less
    what it costs without one (best of 15 repeats: steadier than the rates above on a
    shared machine), against the time of one `sample`: the `LimiterSlot.sampling` context
    manager that `sample` enters. (An insert's admission is the slot's lease check in
    `LimiterSlot.insert`, which `add` calls: `per_call` times it there.)"""
    with_limiter, without = LimiterSlot(threading.RLock(), 1), LimiterSlot(threading.RLock(), 1)
    with_limiter.limiter = RateLimiter.min_size(1)
    with_limiter.limiter.await_insert(1)  # min size: samples go from here

    def sample(slot: LimiterSlot) -> None:
        with slot.sampling(args.batch_size):
            pass

    def cost(slot: LimiterSlot) -> float:
        calls = 50_000
        return min(timeit.repeat(lambda: sample(slot), number=calls, repeat=15)) / calls

    sample_s = cost(with_limiter) - cost(without)
    return {"admit_sample_us": sample_s * 1e6,
            "admit_sample_share_of_batch": sample_s * rates["learner_batches_per_s_without"]}


def parse() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in asdict(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return Args(**vars(parser.parse_args()))


def run_sections(args: Args, root: Path, result: dict[str, Any]) -> None:
    """The sections asked for, into `result` (the others stay as they were)."""
    sections = set(args.sections.split(","))
    if "threads" in sections:
        rates = natural_rates(args, root / "rates")
        # actors ~10x faster: the learner's batches cost what makes it 10x slower
        need = rates["env_steps_per_s"] * args.samples_per_insert / 10  # learner samples/s
        learner_ms = 1000 * args.batch_size / need
        result["natural_rates"] = rates
        result["actors_10x_faster"] = ratio_case(args, root / "a", env_ms=0.0,
                                                 learner_ms=learner_ms)
        # learner ~10x faster: each env step costs what makes the env 10x too slow
        env_rate = rates["learner_samples_per_s"] / args.samples_per_insert / 10
        result["learner_10x_faster"] = ratio_case(args, root / "b", env_ms=1000 / env_rate,
                                                  learner_ms=0.0)
    if "ray" in sections:
        from bench_rate_limit_ray import ray_section  # Ray only when asked for

        result["ray"] = ray_section(args, root / "ray")
    if "overhead" in sections:
        result["never_blocking_overhead"] = overhead(args, root / "o")
    if "percall" in sections:
        result["per_call"] = per_call(args, root / "p")


def main() -> None:
    args = parse()
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        run_sections(args, Path(tmp), result)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_average": os.getloadavg(),
                         "note": "2 cores shared with other work: figures drift"}
    result["args"] = asdict(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
