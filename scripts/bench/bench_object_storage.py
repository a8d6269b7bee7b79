"""Stores in object storage, measured against a local SeaweedFS server (`weed server -s3`).

    python scripts/bench/bench_object_storage.py                      # 1M frames (~10 min)
    python scripts/bench/bench_object_storage.py --frames 200000      # smaller
    python scripts/bench/bench_object_storage.py --frames 20000 --add-steps 5000 --kills 2  # smoke
    python scripts/bench/bench_object_storage.py --only read,cuts     # the read side (~5 min)

Figures (issue 20's targets; read by people, never asserted):

1. `add` throughput of a store mirroring every flush into the bucket, next to the same
   store without a mirror (one run, rounds alternated), the mirror's lag in generations,
   and the CPU seconds of the training thread with and without the mirror.
2. A `--frames` store pushed whole, then `--new-steps` more steps pushed: bytes uploaded.
3. The store opened from the bucket: open + first batch, next to a local open; bytes
   fetched per batch with an empty cache (on the wire, through a counting proxy) against
   the compressed chunks the batch touches; warm-cache `sample(32)` against the same store
   on local disk; learner wait in `batches(32, prefetch=8)` with `--rtt-ms` injected round
   trip (with the default cache filler: waits while it fills and after, apart; and without
   it), next to the one-thread prefetcher and plain `sample`, per `--learner-step-ms`; the
   cache filler alone: seconds to bring the whole store down, requests, bytes.
4. `--cuts` reads with their connections cut mid-transfer: reads cut, failed after the
   retries, wrong frames; the error once the server is gone for good.
5. `--kills` server kills (SIGKILL) mid-push: generations lost, frames wrong.

Frames are real Atari frames (`ale_frames`, Breakout, random policy) cycled. Writes
`object_storage.json` under `--out-dir`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from ale_frames import AleFrames, record_frames
from benchlib.harness import machine_info, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from s3_server import FaultProxy, S3Server, weed_binary  # noqa: E402

from mmreplay import ReplayStore  # noqa: E402
from mmreplay.errors import ObjectStoreError  # noqa: E402
from mmreplay.prefetch import BatchPrefetcher  # noqa: E402


@dataclass
class Args:
    frames: int = 1_000_000
    """frames in the store that is pushed and read from the bucket (its capacity)"""
    distinct_frames: int = 20_000
    """real frames recorded and cycled"""
    add_steps: int = 30_000
    """steps added per store in the with/without mirror comparison"""
    mirror_rounds: int = 8
    """rounds of (a plain store, then a mirrored one) in the with/without mirror comparison;
    the figure is the median of the rounds' ratios (each pair ran seconds apart, under the
    same load)"""
    flush_every: int = 10_000
    """steps between flushes (and mirror pushes) while adding"""
    new_steps: int = 10_000
    """steps added before the incremental push"""
    batch_size: int = 32
    """transitions per batch"""
    reps: int = 100
    """timed batches per latency figure"""
    rtt_ms: float = 30.0
    """round trip injected by the proxy for the prefetch figure"""
    learner_step_ms: str = "5,100"
    """learner steps (ms, comma-separated) of the learner-wait figure"""
    cuts: int = 20
    """reads from the bucket with their connections cut mid-transfer"""
    kills: int = 20
    """server kills mid-push (each restart of weed takes ~18 s)"""
    only: str = "mirror,push,read,cuts,kills"
    """phases to run (read and cuts push the store first); the others keep their figures
    in the JSON"""
    out_dir: str = "data/bench"
    """directory of object_storage.json"""
    store_dir: str = ""
    """read and cuts only: the `--frames` store they read, kept here between runs (built and
    filled the first time; later runs only push it); empty: built afresh in a temp dir"""


def feed(store: ReplayStore, rec: AleFrames, steps: int, start: int = 0, *,
         flush_every: int = 0, on_flush: Any = None) -> float:
    """Feed `steps` recorded steps (cycled); returns the seconds it took."""
    n = len(rec.frames)
    t0 = time.perf_counter()
    for k in range(start, start + steps):
        i = k % n
        if rec.is_first[i] or k == 0:  # a stream position after a reset, or the first
            store.reset(rec.frames[i])
        else:
            store.add(int(rec.actions[i]), float(rec.rewards[i]), rec.frames[i],
                      bool(rec.terminated[i]), bool(rec.truncated[i]))
        if flush_every and (k + 1) % flush_every == 0:
            store.flush()
            if on_flush is not None:
                on_flush()
    return time.perf_counter() - t0


def new_store(path: Path, capacity: int, **kw: Any) -> ReplayStore:
    return ReplayStore.create(path, capacity=capacity, obs_shape=(84, 84), frame_stack=4,
                              seed=0, **kw)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_feed(store: ReplayStore, rec: AleFrames, args: Args, server: S3Server,
               on_flush: Any = None) -> dict[str, float]:
    """`feed` with the wall rate, the CPU seconds of this (the training) thread and of the
    S3 server (it shares this machine's cores) while it ran."""
    assert server.process is not None
    cpu0, server0 = time.thread_time(), cpu_seconds(server.process.pid)
    wall = feed(store, rec, args.add_steps, flush_every=args.flush_every, on_flush=on_flush)
    return {"steps_per_s": args.add_steps / wall,
            "loop_cpu_s": time.thread_time() - cpu0,
            "server_cpu_s": cpu_seconds(server.process.pid) - server0}


def mirror_figures(server: S3Server, rec: AleFrames, tmp: Path, args: Args) -> dict[str, Any]:
    """add with and without a mirror, side by side: after a warm-up store, `mirror_rounds`
    rounds of a plain then a mirrored store (the median of the rounds' ratios, and the
    ratio of the median rates); the mirror's lag after each flush; the CPU the training
    thread and the S3 server spent in each (what the mirror costs the loop, and what the
    server, running on the same cores, costs it)."""
    with new_store(tmp / "warm", 4_000) as warm:  # compiles the kernels, fills caches
        feed(warm, rec, 4_000, flush_every=1_000)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "mirrored": []}
    lags: list[int] = []
    waits: list[float] = []
    push_s: list[float] = []
    for r in range(args.mirror_rounds):
        with new_store(tmp / f"plain{r}", args.add_steps) as plain:
            runs["plain"].append(timed_feed(plain, rec, args, server))
        with new_store(tmp / f"mirrored{r}", args.add_steps,
                       mirror=server.url(f"mirrored{r}")) as m:
            runs["mirrored"].append(timed_feed(
                m, rec, args, server, on_flush=lambda m=m: lags.append(m.mirror.lag)))
            t0 = time.perf_counter()
            m.flush(wait_mirror=True)
            waits.append(time.perf_counter() - t0)
            push_s += [p.seconds for p in m.mirror.reports]

    def median(kind: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[kind])

    plain_rate, mirror_rate = median("plain", "steps_per_s"), median("mirrored", "steps_per_s")
    paired = [m["steps_per_s"] / p["steps_per_s"] for p, m in
              zip(runs["plain"], runs["mirrored"], strict=True)]
    return {"add_steps_per_s_without_mirror": plain_rate,
            "add_steps_per_s_with_mirror": mirror_rate,
            "add_ratio_with_over_without": statistics.median(paired),
            "add_ratio_of_median_rates": mirror_rate / plain_rate,
            "add_ratio_per_round": paired,
            "loop_cpu_s_without_mirror": median("plain", "loop_cpu_s"),
            "loop_cpu_s_with_mirror": median("mirrored", "loop_cpu_s"),
            "server_cpu_s_with_mirror": median("mirrored", "server_cpu_s"),
            "push_s_median": statistics.median(push_s), "pushes": len(push_s),
            "rounds": runs, "final_wait_mirror_s": max(waits),
            "mirror_lag_generations_max": max(lags),
            "mirror_lag_generations_median": statistics.median(lags)}


def push_figures(server: S3Server, rec: AleFrames, path: Path, args: Args) -> dict[str, Any]:
    """A `--frames` store pushed whole, then `--new-steps` more pushed incrementally (a
    store kept in `--store-dir` from an earlier run is only pushed)."""
    url = server.url("big")
    if (path / "manifest.json").exists():
        with ReplayStore.open(path, "r") as kept:
            return {"pushed_bytes": kept.push(url).uploaded_bytes}
    with new_store(path, args.frames) as store:
        fill_s = feed(store, rec, args.frames, flush_every=100_000)
        first = store.push(url)
        feed(store, rec, args.new_steps, start=args.frames)
        second = store.push(url)
    frame_bytes = sum(p.stat().st_size for p in (path / "frames").glob("c.*"))
    return {"fill_s": fill_s, "store_frame_bytes": frame_bytes,
            "full_push_bytes": first.uploaded_bytes, "full_push_s": first.seconds,
            "incremental_push_bytes": second.uploaded_bytes,
            "incremental_push_objects": second.uploaded_objects,
            "incremental_push_s": second.seconds,
            "incremental_over_full": second.uploaded_bytes / first.uploaded_bytes}


def read_figures(server: S3Server, path: Path, tmp: Path, args: Args) -> dict[str, Any]:
    url = server.url("big")
    out: dict[str, Any] = {"loadavg_1m_at_start": os.getloadavg()[0]}
    out.update(open_figures(url, path, tmp, args))
    counting = FaultProxy(server.ports[3])
    try:
        remote = ReplayStore.open(url, "r", cache_dir=tmp, cache_bytes=8 << 30,
                                  cache_fill=False,  # exact reads only: what a batch costs
                                  storage_options=server.options(counting.endpoint))
        remote.sample(args.batch_size)
        out.update(cold_figures(remote, counting, args))
        out.update(warm_figures(remote, path, args))
        remote.close()
    finally:
        counting.close()
    out.update(fill_figures(server, url, tmp))
    out.update(latency_figures(server, url, tmp, args))
    out["loadavg_1m_at_end"] = os.getloadavg()[0]
    return out


def cold_figures(remote: ReplayStore, counting: FaultProxy, args: Args) -> dict[str, Any]:
    """20 batches right after the open (every chunk new: the store is large): bytes on
    the wire per batch against the compressed chunks it touched, with and without the
    shard indexes first read by that batch (8 KB per shard, once each)."""
    ratios, without, requests = [], [], []
    chunks = remote.remote
    assert chunks is not None
    for _ in range(20):
        wire, used, index, asked = (counting.bytes_down, chunks.chunk_bytes,
                                    chunks.index_bytes, chunks.requests)
        remote.sample(args.batch_size)
        touched = max(1, chunks.chunk_bytes - used)
        ratios.append((counting.bytes_down - wire) / touched)
        without.append((counting.bytes_down - wire - (chunks.index_bytes - index)) / touched)
        requests.append(chunks.requests - asked)
    return {"cold_wire_bytes_over_chunk_bytes_median": statistics.median(ratios),
            "cold_wire_bytes_less_index_reads_over_chunk_bytes_median":
                statistics.median(without),
            "cold_requests_per_batch_median": statistics.median(requests)}


def open_figures(url: str, path: Path, tmp: Path, args: Args) -> dict[str, Any]:
    """open + first batch from the bucket, next to the same store on local disk
    (alternated, 3 rounds; kernels compiled first, so neither pays for that)."""
    with ReplayStore.open(path, "r") as local:
        local.sample(args.batch_size)  # numba's compiled kernels loaded once
    times: dict[str, list[float]] = {"bucket": [], "local": []}
    fetched: list[int] = []
    for _ in range(3):
        for name, where in (("bucket", url), ("local", str(path))):
            t0 = time.perf_counter()
            store = ReplayStore.open(where, "r", **({"cache_dir": tmp} if name == "bucket"
                                                    else {}))
            store.sample(args.batch_size)
            times[name].append(time.perf_counter() - t0)
            if store.remote is not None:
                fetched.append(store.remote.bytes_fetched)
            store.close()
    return {"open_and_first_batch_s_direct": statistics.median(times["bucket"]),
            "open_and_first_batch_s_local_disk": statistics.median(times["local"]),
            "open_and_first_batch_rounds": times,
            "first_batch_frame_bytes_fetched": statistics.median(fetched)}


def warm_figures(remote: ReplayStore, path: Path, args: Args) -> dict[str, Any]:
    """sample(32) once every chunk is in the cache, next to the local store."""
    ids = remote.valid_ids()[::4]  # a transition reads frames t-3..t+1: every frame
    t0 = time.perf_counter()
    for part in np.array_split(ids, max(1, ids.size // 20_000)):
        remote.get(part)  # fetch every chunk
    warm_up_s = time.perf_counter() - t0
    with ReplayStore.open(path, "r") as local:
        times: dict[str, list[float]] = {"local": [], "bucket": []}
        for _ in range(args.reps):
            for name, store in (("local", local), ("bucket", remote)):
                t = time.perf_counter()
                store.sample(args.batch_size)
                times[name].append(time.perf_counter() - t)
    local_ms = statistics.median(times["local"]) * 1e3
    bucket_ms = statistics.median(times["bucket"]) * 1e3
    return {"cache_fill_s": warm_up_s, "warm_sample_ms_local": local_ms,
            "warm_sample_ms_bucket": bucket_ms, "warm_bucket_over_local": bucket_ms / local_ms}


def fill_figures(server: S3Server, url: str, tmp: Path) -> dict[str, Any]:
    """The cache filler alone, started right after an open (no reads): seconds until every
    shard file is in the cache, its requests and bytes, and the bytes that came down the
    counting proxy meanwhile against the bucket's frame bytes."""
    counting = FaultProxy(server.ports[3])
    try:
        with ReplayStore.open(url, "r", cache_dir=tmp, cache_fill=False,
                              storage_options=server.options(counting.endpoint)) as remote:
            chunks = remote.remote
            assert chunks is not None
            wire, t0 = counting.bytes_down, time.perf_counter()
            chunks.start_filling()
            assert chunks.filler is not None
            chunks.filler.wait()
            seconds = time.perf_counter() - t0
            listed = sum(info.size for info in chunks.listed.values())
            return {"fill_s": seconds, "fill_requests": chunks.fill_requests,
                    "fill_bytes": chunks.fill_bytes, "fill_files_kept": chunks.filler.filled,
                    "fill_wire_bytes_over_store_bytes": (counting.bytes_down - wire) / listed,
                    "store_frame_object_bytes": listed}
    finally:
        counting.close()


def latency_figures(server: S3Server, url: str, tmp: Path, args: Args) -> dict[str, Any]:
    """Learner wait with an injected round trip: `batches(32, prefetch=8)` (the pipeline,
    with its default cache filler and without it), the one-thread prefetcher it replaced,
    and plain `sample`, alternated; for each learner step of `--learner-step-ms`. Each run
    opens the store afresh (a cold cache)."""
    slow = FaultProxy(server.ports[3], latency_s=args.rtt_ms / 1e3)
    out: dict[str, Any] = {"rtt_ms": args.rtt_ms}
    try:
        for step_ms in (float(x) for x in args.learner_step_ms.split(",")):
            for kind in ("pipeline", "pipeline_no_fill", "one_thread", "sample"):
                with ReplayStore.open(url, "r", cache_dir=tmp,
                                      cache_fill=False if kind != "pipeline" else None,
                                      storage_options=server.options(slow.endpoint)) as remote:
                    out[f"step_{step_ms:g}ms_{kind}"] = learner_waits(remote, kind, step_ms,
                                                                      args)
    finally:
        slow.close()
    five = out.get("step_5ms_pipeline")
    if five is not None:
        out["learner_wait_ms_median"] = five["wait_ms_median"]
        out["learner_wait_ms_p90"] = five["wait_ms_p90"]
        out["learner_wait_ms_median_while_filling"] = five["filling"]["wait_ms_median"]
    return out


def learner_waits(remote: ReplayStore, kind: str, step_ms: float,
                  args: Args) -> dict[str, Any]:
    """A learner that takes a batch, then works `step_ms`: its waits once 16 batches
    went by (the pipeline is full), the batches/s it got and the requests/s it caused.
    With the cache filler, the waits while it fills (warm-up) and `--reps` waits after it
    finished are kept apart; the headline figures are those after."""
    chunks = remote.remote
    assert chunks is not None
    if kind.startswith("pipeline"):
        it: Any = remote.batches(args.batch_size, prefetch=8)
    elif kind == "one_thread":  # what batches() did before: one sample() at a time
        it = BatchPrefetcher(remote.sample, args.batch_size, prefetch=8)
    else:
        it = None
    filler = chunks.filler
    waits: dict[str, list[float]] = {"filling": [], "after": []}
    asked, t0, k = chunks.requests, time.perf_counter(), 0
    while len(waits["after"]) < args.reps and k < 20 * args.reps:
        filling = filler is not None and not filler.done
        t = time.perf_counter()
        next(it) if it is not None else remote.sample(args.batch_size)
        if k >= 16:
            waits["filling" if filling else "after"].append(time.perf_counter() - t)
        time.sleep(step_ms / 1e3)  # the learner's step
        k += 1
    seconds = time.perf_counter() - t0
    if it is not None:
        it.close()
    out: dict[str, Any] = {**wait_stats(waits["after"]), "batches": k,
                           "batches_per_s": k / seconds,
                           "requests_per_s": (chunks.requests - asked) / seconds,
                           "read_requests": chunks.requests - asked,
                           "read_bytes": chunks.bytes_fetched}
    if filler is not None:
        out.update({"filling": wait_stats(waits["filling"]), "fill_requests":
                    chunks.fill_requests, "fill_bytes": chunks.fill_bytes,
                    "fill_error": filler.error})
    return out


def wait_stats(waits: list[float]) -> dict[str, float | int | None]:
    if not waits:
        return {"waits": 0, "wait_ms_median": None, "wait_ms_p90": None}
    return {"waits": len(waits), "wait_ms_median": statistics.median(waits) * 1e3,
            "wait_ms_p90": float(np.percentile(waits, 90)) * 1e3}


def cut_figures(server: S3Server, path: Path, tmp: Path, args: Args) -> dict[str, Any]:
    """`--cuts` reads from the bucket, each with its connections cut mid-transfer (the
    proxy aborts every open connection once 16 KB more came down): frames compared with
    the local store's; then a server gone for good."""
    url = server.url("big")
    proxy = FaultProxy(server.ports[3])
    cut = wrong = errors = checked = 0
    error_lines: list[str] = []
    rng = np.random.default_rng(1)
    try:
        with ReplayStore.open(path, "r") as local, \
                ReplayStore.open(url, "r", cache_dir=tmp,
                                 storage_options=server.options(proxy.endpoint)) as remote:
            ids = local.valid_ids()
            for _ in range(args.cuts):
                part = rng.choice(ids, args.batch_size)  # cold: new chunks each time
                proxy.cut_after_down = proxy.bytes_down + (16 << 10)
                try:
                    got = remote.get(part)
                except ObjectStoreError as exc:  # retried, then a clear error
                    errors += 1
                    error_lines.append(str(exc)[:200])
                    continue
                finally:
                    cut += proxy.cut_after_down is None
                    proxy.cut_after_down = None
                want = local.get(part)
                checked += part.size
                wrong += int(((np.asarray(got.obs) != np.asarray(want.obs)).any(axis=(1, 2, 3))
                              | (np.asarray(got.next_obs) != np.asarray(want.next_obs)).any(
                                  axis=(1, 2, 3))).sum())
            gone = dead_server_error(server, url, tmp)
    finally:
        proxy.close()
    return {"reads": args.cuts, "reads_cut": cut, "reads_failed_after_retries": errors,
            "transitions_checked": checked, "wrong_frames": wrong,
            "failed_read_errors": error_lines[:3], "server_gone_error": gone}


def dead_server_error(server: S3Server, url: str, tmp: Path) -> str:
    """The error a read gives once the server is unreachable for good (after retries)."""
    dead = FaultProxy(server.ports[3])
    remote = ReplayStore.open(url, "r", cache_dir=tmp, storage_options=server.options(
        dead.endpoint))
    dead.close()
    try:
        remote.sample(64)
        return "no error (wrong: the server is gone)"
    except ObjectStoreError as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        remote.close()


def kill_figures(server: S3Server, rec: AleFrames, tmp: Path, args: Args) -> dict[str, Any]:
    """Kill the server mid-push `--kills` times; count lost generations and wrong frames.

    A generation is lost when the bucket, after the restart, holds one older than the last
    push that returned (its manifest PUT was acknowledged). Not `store.generation - 1`: once
    the ring wraps, `add` commits give-up generations that no push uploaded.
    """
    url = server.url("kills")
    lost = wrong = completed = old_lost = 0
    log: list[dict[str, int | bool]] = []
    with new_store(tmp / "kills", 50_000) as store:
        feed(store, rec, 20_000)
        acked = store.push(url).generation
        for k in range(args.kills):
            feed(store, rec, 2_000, start=20_000 + 2_000 * k)
            store.flush()
            flushed = store.generation  # the old reference was flushed - 1
            slow = FaultProxy(server.ports[3], bandwidth=2_000_000)
            reports: list[Any] = []
            pusher = threading.Thread(target=_push, args=(store, url, server, slow, reports))
            pusher.start()
            time.sleep(0.2)
            server.kill()
            pusher.join(120)
            slow.close()
            acked = reports[0].generation if reports else acked  # it may have finished
            server.start()
            with ReplayStore.open(url, "r", cache_dir=tmp) as remote:
                lost += remote.generation < acked
                old_lost += remote.generation < flushed - 1
                log.append({"acked": acked, "flushed": flushed, "pushed": store.generation,
                            "killed_push_returned": bool(reports),
                            "bucket_after_restart": remote.generation})
                with ReplayStore.open(tmp / "kills", "r") as local:  # ids both still hold
                    ids = np.intersect1d(remote.valid_ids(), local.valid_ids())[::11]
                    wrong += int((np.asarray(remote.get(ids).obs)
                                  != np.asarray(local.get(ids).obs)).any(axis=(1, 2, 3)).sum())
            acked = store.push(url, take_over=True).generation
            completed += acked == store.generation
    return {"kills": args.kills, "generations_lost": lost, "wrong_frames": wrong,
            "next_push_completed": completed,
            "lost_against_local_generation_minus_1": old_lost, "per_kill": log}


def _push(store: ReplayStore, url: str, server: S3Server, proxy: FaultProxy,
          reports: list[Any]) -> None:
    try:
        reports.append(store.push(url, storage_options=server.options(proxy.endpoint)))
    except Exception:  # noqa: BLE001,S110 -- the server is killed under it
        pass


def main() -> None:
    args = tyro.cli(Args, description=__doc__.splitlines()[0])
    rec = record_frames("ALE/Breakout-v5", args.distinct_frames, seed=0)
    path = Path(args.out_dir) / "object_storage.json"
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    result.update({"machine": machine_info(),
                   "note": "one 2-core machine shared with other jobs (loaded); the S3 "
                           "server runs on the same machine"})
    phases = args.only.split(",")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        server = S3Server(weed_binary() or "weed", tmp / "weed" / "data")
        server.start()
        os.environ.update(server.env())
        try:
            implied = {"read", "cuts"} & set(phases) and "push" not in phases
            if implied:  # they read the store the push phase builds (its figures not kept)
                phases.insert(0, "push")
            big = Path(args.store_dir) if implied and args.store_dir else tmp / "big"
            for name, run in (("mirror", lambda: mirror_figures(server, rec, tmp, args)),
                              ("push", lambda: push_figures(server, rec, big, args)),
                              ("read", lambda: read_figures(server, big, tmp, args)),
                              ("cuts", lambda: cut_figures(server, big, tmp, args)),
                              ("kills", lambda: kill_figures(server, rec, tmp, args))):
                if name not in phases:
                    continue
                t0 = time.perf_counter()
                figures = {**run(), "args": asdict(args)}
                print(f"{name} ({time.perf_counter() - t0:.0f} s): {figures}", flush=True)
                if not (implied and name == "push"):
                    result[name] = figures
        finally:
            server.stop()
    print(f"wrote {write_json(result, Path(args.out_dir), 'object_storage.json')}")


if __name__ == "__main__":
    main()
