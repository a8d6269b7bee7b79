"""Frame codecs on real Atari frames: bytes, decode time, sample latency and add rate.

Compares, per game, on one recorded stream of real ALE frames (84x84, random policy):

    gzip -9      the whole frame stream in one gzip member (Dopamine's way; no random access)
    lz4          blosc-lz4 chunks of 8 frames (clevel 9, the store's default)
    zstd-dict    chunks of 8 frames at zstd level 1, 3 or 5, or of 4 frames at level 1 or 3,
                 a 16 or 64 KiB dictionary the store trains on its first chunks
                 (``dict_train_chunks``)

bytes are everything the frames cost on disk (``frames/``, whose ``zarr.json`` carries the
dictionary in base64, and the dictionary file; ``chunk_bytes`` counts the frame files alone);
decode µs is the compiled decode of one chunk in thread CPU time (the store's own codec,
batches of 64 chunks, best of 5 passes interleaved across the configurations); add is steps/s
while filling the store. Then ``sample(32)`` and ``add`` of lz4 and zstd-dict side by side in
the same run, for each game and store size of ``--sample-plan`` (the recorded stream
repeated): the stores are filled 5,000 steps each in turn and sampled in interleaved rounds,
so machine drift hits all alike. Times are given twice: wall clock, and the CPU time of the
calling thread (``time.thread_time``; `sample` and `add` run in the caller's thread). On a
machine shared with other jobs the wall clock mostly measures the waits for a core; the CPU
time does not, so the ratios of CPU times are the ones to compare there. Inside `sample`, the
compiled decode is timed too (CPU µs per chunk, chunks per batch), and the decoded-chunk
cache's state is recorded (84x84 stores this size cache nothing: every chunk a batch touches
is decoded).

    python scripts/bench/bench_codec.py                       # the issue's run: 30k frames a game
    python scripts/bench/bench_codec.py --frames 2000 --sample-plan MsPacman:20000 --reps 200
    python scripts/bench/bench_codec.py --part games --out /tmp/games.json & # the two parts at once
    python scripts/bench/bench_codec.py --part sampling --out /tmp/sampling.json
    python scripts/bench/bench_codec.py --merge /tmp/games.json /tmp/sampling.json

Writes ``data/bench/codec.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ale_frames import AleFrames, record_frames  # noqa: E402

from mmreplay import ReplayStore  # noqa: E402
from mmreplay.storage.codec import ChunkCodec  # noqa: E402

FRAME_STACK = 4


@dataclass
class Args:
    games: list[str] = field(default_factory=lambda: [
        "Pong", "Breakout", "MsPacman", "Seaquest", "SpaceInvaders"])
    """ALE games (``ALE/<game>-v5``)"""
    frames: int = 30_000
    """frames recorded per game (random policy, seed 0)"""
    dict_train_chunks: int = 256
    """chunks a zstd-dict store trains its dictionary on"""
    sample_plan: list[str] = field(default_factory=lambda: [
        "MsPacman:200000", "Pong:200000", "MsPacman:1000000:3"])
    """GAME:CAPACITY[:LEVEL,...] of each sample/add comparison (levels: `sample_levels`)"""
    sample_dict_kib: int = 16
    """dictionary KiB of the zstd-dict stores in the sample/add comparison"""
    sample_levels: list[int] = field(default_factory=lambda: [1, 3])
    """zstd levels of the 8-frame zstd-dict stores in the sample/add comparison"""
    c4_sizes: list[int] = field(default_factory=lambda: [200_000])
    """capacities whose comparison adds a 4-frame zstd-dict store (first level)"""
    reps: int = 2000
    """sample(32) calls timed per store"""
    out: str = "data/bench/codec.json"
    """where the JSON goes"""
    workdir: str = ""
    """where stores are built (default: a temp dir, removed after)"""
    cache_dir: str = ""
    """where ALE recordings are cached (default: data/cache)"""
    transport_level: int = 3
    """zstd level of the zstd-dict stores of the transport part"""
    push_steps: int = 10_000
    """steps of each push in the transport part (pushed whole, then as many more)"""
    part: str = "all"
    """all, games, sampling or transport: one part alone (several at once, then --merge)"""
    merge: list[str] = field(default_factory=lambda: [""])
    """JSON files of parts to merge into `out` (nothing is measured)"""


CONFIGS: list[dict[str, Any]] = [
    {"codec": "lz4", "chunk_frames": 8},
    *[{"codec": "zstd-dict", "chunk_frames": c, "dict_bytes": d << 10, "codec_level": lv}
      for c, levels in ((8, (1, 3, 5)), (4, (1, 3))) for d in (16, 64) for lv in levels],
]


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Args):
        default = getattr(Args(), f.name)
        kind = type(default[0]) if isinstance(default, list) else type(default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=default,
                            nargs="+" if isinstance(default, list) else None)
    return Args(**vars(parser.parse_args()))


def label(config: dict[str, Any]) -> str:
    if config["codec"] == "lz4":
        return f"lz4 c{config['chunk_frames']}"
    return (f"zstd-dict c{config['chunk_frames']} {config['dict_bytes'] >> 10}K "
            f"l{config['codec_level']}")


def feed(store: ReplayStore, rec: AleFrames, stop: int, begin: int = 0) -> tuple[float, float]:
    """Stream positions begin..stop-1 of `rec` repeated; returns the seconds spent, wall
    clock and this thread's CPU (resets included)."""
    n = len(rec)
    start, cpu = time.perf_counter(), time.thread_time()
    for i in range(begin, stop):
        j = i % n
        if rec.is_first[j]:
            store.reset(rec.frames[j])
        else:
            store.add(rec.actions[j], rec.rewards[j], rec.frames[j], rec.terminated[j],
                      rec.truncated[j])
    return time.perf_counter() - start, time.thread_time() - cpu


def interleaved_fill(stores: dict[str, tuple[ReplayStore, Path]], rec: AleFrames,
                     capacity: int, block: int = 5000) -> dict[str, dict[str, Any]]:
    """Fill every store with the same `capacity` steps, `block` steps each in turn; add
    steps/s over the whole fill (training stall included; wall and CPU), then the frame
    bytes."""
    spent = {name: np.zeros(2) for name in stores}
    for begin in range(0, capacity, block):
        stop = min(begin + block, capacity)
        for name, (store, _) in stores.items():
            spent[name] += feed(store, rec, stop, begin)
    out = {}
    for name, (store, root) in stores.items():
        store.flush()
        out[name] = {"add_steps_per_s": capacity / spent[name][0],
                     "add_steps_per_cpu_s": capacity / spent[name][1], "bytes": store_bytes(root)}
    return out


def store_bytes(root: Path) -> int:
    """Bytes the frames cost: ``frames/`` (``zarr.json`` with its base64 copy of the
    dictionary included) and the dictionary file."""
    files = [*(root / "frames").iterdir(), root / "zstd.dict"]
    return sum(p.stat().st_size for p in files if p.exists())


def chunk_bytes(root: Path) -> int:
    """Bytes of the frame files alone (chunks and shard indexes, no metadata)."""
    return sum(p.stat().st_size for p in (root / "frames").glob("c.*"))


def recording(game: str, args: Args) -> AleFrames:
    cache = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    return record_frames(f"ALE/{game}-v5", args.frames, seed=0, **cache)


class Decoder:
    """The store's compiled decode over the stream's chunks, encoded as the store encodes
    them; `time` is one pass in batches of 64 chunks (µs per chunk)."""

    def __init__(self, store: ReplayStore, root: Path, frames: np.ndarray) -> None:
        spec = store.spec
        dictionary = (root / "zstd.dict").read_bytes() if spec.codec == "zstd-dict" else None
        self.codec = ChunkCodec(spec, dictionary)
        c = spec.chunk_frames
        self.chunks = [self.codec.encode(frames[i:i + c])
                       for i in range(0, len(frames) - c + 1, c)]
        bufs = [np.frombuffer(b, np.uint8) for b in self.chunks]
        self.src = np.array([b.ctypes.data for b in bufs], np.int64)
        self.size = np.array([b.size for b in bufs], np.int64)
        self.rows = np.empty((64, self.codec.nbytes), np.uint8)
        self.dest = np.arange(64, dtype=np.int64)

    def time(self) -> float:
        start = time.thread_time()
        for i in range(0, len(self.chunks), 64):
            n = min(64, len(self.chunks) - i)
            status = self.codec.decode_many(self.src[i:i + n], self.size[i:i + n], self.rows,
                                            self.dest[:n])
            assert not status.any()
        return (time.thread_time() - start) / len(self.chunks) * 1e6


def bench_game(game: str, args: Args, work: Path) -> dict[str, Any]:
    """Every configuration's store of the game's stream (filled in turn), then their decode
    times in interleaved passes (best of 5 each), so machine drift hits all alike."""
    rec = recording(game, args)
    raw = rec.frames.nbytes
    start = time.perf_counter()
    gz = len(gzip.compress(rec.frames.tobytes(), compresslevel=9))
    out: dict[str, Any] = {"frames": len(rec), "raw_bytes": raw, "gzip9_bytes": gz,
                           "gzip9_ratio": raw / gz, "gzip9_s": time.perf_counter() - start,
                           "codecs": {}}
    decoders = {}
    for config in CONFIGS:
        root = work / f"{game}-{label(config).replace(' ', '-')}"
        extra = {"dict_train_chunks": args.dict_train_chunks} if config["codec"] != "lz4" else {}
        store = ReplayStore.create(root, capacity=len(rec), obs_shape=(84, 84),
                                   frame_stack=FRAME_STACK, seed=0, **config, **extra)
        wall, cpu = feed(store, rec, len(rec))
        store.flush()
        nbytes, chunks = store_bytes(root), chunk_bytes(root)
        out["codecs"][label(config)] = {
            **config, "bytes": nbytes, "ratio": raw / nbytes, "vs_gzip9": nbytes / gz,
            "chunk_bytes": chunks, "chunk_ratio": raw / chunks, "chunk_vs_gzip9": chunks / gz,
            "add_steps_per_s": len(rec) / wall, "add_steps_per_cpu_s": len(rec) / cpu}
        decoders[label(config)] = Decoder(store, root, rec.frames)
        store.close()
        shutil.rmtree(root)
    best = {name: d.time() for name, d in decoders.items()}
    for _ in range(4):
        for name, d in decoders.items():
            best[name] = min(best[name], d.time())
    for name, row in out["codecs"].items():
        row["decode_us_per_chunk"] = best[name]
        print(f"{game:14s} {name:24s} ratio {row['ratio']:6.1f} (chunks alone "
              f"{row['chunk_ratio']:6.1f}; gzip {out['gzip9_ratio']:6.1f}) decode "
              f"{best[name]:5.1f} µs  add {row['add_steps_per_s']:7.0f}/s", flush=True)
    return out


def sample_configs(args: Args, capacity: int, levels: list[int]) -> dict[str, dict[str, Any]]:
    zd = {"codec": "zstd-dict", "dict_bytes": args.sample_dict_kib << 10,
          "dict_train_chunks": args.dict_train_chunks}
    out: dict[str, dict[str, Any]] = {"lz4 c8": {"codec": "lz4", "chunk_frames": 8}}
    for lv in levels:
        out[f"zstd-dict c8 l{lv}"] = {**zd, "chunk_frames": 8, "codec_level": lv}
    if capacity in args.c4_sizes:
        lv = levels[0]
        out[f"zstd-dict c4 l{lv}"] = {**zd, "chunk_frames": 4, "codec_level": lv}
    return out


class DecodeClock:
    """CPU time and chunks of every compiled decode, charged to the store being sampled
    (`ChunkCodec.decode_many` wrapped for the benchmark's life)."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.spent: dict[str, list[int]] = {}
        self._decode_many = ChunkCodec.decode_many
        clock = self

        def timed(codec: ChunkCodec, *a: Any) -> np.ndarray:
            start = time.thread_time_ns()
            status = clock._decode_many(codec, *a)
            if clock.current is not None:
                row = clock.spent.setdefault(clock.current, [0, 0])
                row[0] += time.thread_time_ns() - start
                row[1] += len(a[0])
            return status

        ChunkCodec.decode_many = timed  # type: ignore[method-assign]

    def close(self) -> None:
        ChunkCodec.decode_many = self._decode_many  # type: ignore[method-assign]


def time_samples(stores: dict[str, tuple[ReplayStore, Path]], reps: int,
                 clock: DecodeClock) -> dict[str, dict[str, float]]:
    """`sample(32)` of every store in interleaved rounds of 100: wall and CPU ms (medians,
    warm-up dropped), and the decode's CPU µs per chunk and chunks per batch."""
    wall: dict[str, list[float]] = {name: [] for name in stores}
    cpu: dict[str, list[float]] = {name: [] for name in stores}
    for r in range(max(2, reps // 100 + 1)):  # the first round warms up
        for name, (store, _) in stores.items():
            clock.current = name if r else None
            for _ in range(100):
                start, spent = time.perf_counter_ns(), time.thread_time_ns()
                store.sample(32)
                if r:
                    cpu[name].append((time.thread_time_ns() - spent) / 1e6)
                    wall[name].append((time.perf_counter_ns() - start) / 1e6)
    clock.current = None
    out = {}
    for name, (store, _) in stores.items():
        ns, chunks = clock.spent.pop(name, [0, 0])
        cache = store.views.memory().cache
        out[name] = {"sample_median_ms": float(np.median(wall[name])),
                     "sample_mean_ms": float(np.mean(wall[name])),
                     "sample_cpu_median_ms": float(np.median(cpu[name])),
                     "sample_cpu_mean_ms": float(np.mean(cpu[name])),
                     "decode_cpu_us_per_chunk": ns / max(1, chunks) / 1e3,
                     "chunks_per_sample": chunks / len(cpu[name]),
                     "decode_cpu_ms_per_sample": ns / len(cpu[name]) / 1e6,
                     "cache_budget_bytes": cache.budget_bytes, "cache_chunks": cache.chunks}
    return out


def bench_sampling(args: Args, work: Path) -> dict[str, Any]:
    """sample(32) and add of lz4 and zstd-dict stores side by side, per game and size."""
    result: dict[str, Any] = {}
    clock = DecodeClock()
    try:
        for plan in args.sample_plan:
            game, capacity, *levels = plan.split(":")
            chosen = [int(v) for v in levels[0].split(",")] if levels else args.sample_levels
            result[f"{game}:{capacity}"] = sample_one(args, work, game, int(capacity), chosen,
                                                      clock)
    finally:
        clock.close()
    return result


def sample_one(args: Args, work: Path, game: str, capacity: int, levels: list[int],
               clock: DecodeClock) -> dict[str, Any]:
    rec = recording(game, args)
    stores = {}
    for name, config in sample_configs(args, capacity, levels).items():
        root = work / f"sample-{game}-{capacity}-{name.replace(' ', '-')}"
        stores[name] = (ReplayStore.create(root, capacity=capacity, obs_shape=(84, 84),
                                           frame_stack=FRAME_STACK, seed=0, **config), root)
    row = interleaved_fill(stores, rec, capacity)
    for name, timed in time_samples(stores, args.reps, clock).items():
        row[name] |= timed
    for store, root in stores.values():
        store.close()
        shutil.rmtree(root)
    base = row["lz4 c8"]
    for name, r in row.items():
        for key, ratio in (("sample_median_ms", "sample_vs_lz4"),
                           ("sample_cpu_median_ms", "sample_cpu_vs_lz4"),
                           ("add_steps_per_s", "add_vs_lz4"),
                           ("add_steps_per_cpu_s", "add_cpu_vs_lz4")):
            r[ratio] = r[key] / base[key]
        print(f"{game:9s} {capacity:>8d} {name:16s} sample {r['sample_median_ms']:.3f} ms "
              f"({r['sample_vs_lz4']:.2f}x) cpu {r['sample_cpu_median_ms']:.3f} ms "
              f"({r['sample_cpu_vs_lz4']:.3f}x) decode {r['decode_cpu_us_per_chunk']:.1f} "
              f"µs x {r['chunks_per_sample']:.1f}  add {r['add_steps_per_s']:6.0f}/s "
              f"({r['add_vs_lz4']:.2f}x, cpu {r['add_cpu_vs_lz4']:.2f}x)  "
              f"bytes {r['bytes']:,}", flush=True)
    return row


def bench_transport(args: Args, work: Path) -> dict[str, Any]:
    """Bytes where frames travel, per game: a store's push to object storage (a file://
    bucket: 10k steps pushed whole, then 10k more pushed incrementally) for lz4 and
    zstd-dict stores; Ray blocks (64 steps of one env, as `BlockWriter` sends them) and
    sampled stacks (``obs`` of 32 transitions, as `StoreActor.sample` sends them) in lz4,
    next to plain zstd levels 1 and 3 of the same arrays (CPU µs per step to compress and
    to decode)."""
    out: dict[str, Any] = {}
    for game in args.games:
        rec = recording(game, args)
        row: dict[str, Any] = {"push": {}}
        for name, config in (("lz4 c8", {"codec": "lz4"}),
                             (f"zstd-dict c8 l{args.transport_level}",
                              {"codec": "zstd-dict", "codec_level": args.transport_level,
                               "dict_bytes": args.sample_dict_kib << 10})):
            row["push"][name] = push_bytes(rec, work / f"push-{game}", config,
                                           args.push_steps)
        row["ray_block_64"] = wire_bytes([rec.frames[i:i + 64]
                                          for i in range(0, len(rec) - 64, 640)], 64)
        rng = np.random.default_rng(0)
        stacks = [rec.frames[p[:, None] + np.arange(-3, 1)]
                  for p in (rng.integers(3, len(rec), 32) for _ in range(50))]
        row["sampled_obs_32"] = wire_bytes(stacks, 32)
        print(game, json.dumps(row), flush=True)
        out[game] = row
    return out


def push_bytes(rec: AleFrames, root: Path, config: dict[str, Any],
               steps: int) -> dict[str, Any]:
    bucket = root.with_name(root.name + "-bucket")
    with ReplayStore.create(root, capacity=10 * steps, obs_shape=(84, 84),
                            frame_stack=FRAME_STACK, seed=0, chunk_frames=8, **config) as store:
        feed(store, rec, steps)
        full = store.push(f"file://{bucket}")
        feed(store, rec, 2 * steps, steps)
        step = store.push(f"file://{bucket}")
    shutil.rmtree(root)
    shutil.rmtree(bucket)
    return {"steps": steps, "first_push_bytes": full.uploaded_bytes,
            "next_push_bytes": step.uploaded_bytes, "next_push_objects": step.uploaded_objects}


def wire_bytes(arrays: list[np.ndarray], steps: int) -> dict[str, Any]:
    """Bytes per step and CPU µs per step (compress, decode) of lz4 as the Ray paths send
    frames (`compress_frames`), and of plain zstd levels 1 and 3."""
    import zstandard
    from numcodecs import blosc

    from mmreplay.integrations.blocks import compress_frames

    def lz4_decode(data: bytes, like: np.ndarray) -> None:
        blosc.decompress(data, np.empty_like(like))

    codecs: dict[str, tuple[Any, Any]] = {"lz4": (compress_frames, lz4_decode)}
    for level in (1, 3):
        z, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        codecs[f"zstd-{level}"] = (lambda a, z=z: z.compress(np.ascontiguousarray(a)),
                                   lambda data, like, d=d: np.frombuffer(d.decompress(data),
                                                                         like.dtype))
    out = {}
    n = len(arrays) * steps
    for name, (encode, decode) in codecs.items():
        nbytes, spent = 0, np.zeros(2)
        for a in arrays:
            t = time.thread_time()
            data = encode(a)
            spent[0] += time.thread_time() - t
            t = time.thread_time()
            decode(data, a)
            spent[1] += time.thread_time() - t
            nbytes += len(data)
        out[name] = {"bytes_per_step": nbytes / n, "encode_cpu_us_per_step": spent[0] / n * 1e6,
                     "decode_cpu_us_per_step": spent[1] / n * 1e6}
    return out


def targets(games: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for each zstd-dict configuration."""
    out = {}
    for name in (label(c) for c in CONFIGS if c["codec"] != "lz4"):
        vs = [g["codecs"][name]["vs_gzip9"] for g in games.values()]
        alone = [g["codecs"][name]["chunk_vs_gzip9"] for g in games.values()]
        out[name] = {"games_at_or_below_gzip9": sum(v <= 1.0 for v in vs),
                     "worst_vs_gzip9": max(vs),
                     "games_at_or_below_gzip9_chunks_alone": sum(v <= 1.0 for v in alone)}
    for plan, row in sampling.items():
        for name, r in row.items():
            out.setdefault(f"{name} @ {plan}", {}).update(
                {k: r[k] for k in ("sample_vs_lz4", "sample_cpu_vs_lz4", "add_vs_lz4",
                                   "add_cpu_vs_lz4")})
    return out


def main() -> None:
    args = parse_args()
    if any(args.merge):
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        games = {k: v for p in parts for k, v in p["games"].items()}
        sampling = {k: v for p in parts for k, v in p["sampling"].items()}
        transport = {k: v for p in parts for k, v in p.get("transport", {}).items()}
        write(args, games, sampling, transport, {"parts": [p["run"] for p in parts]})
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_codec_"))
    work.mkdir(parents=True, exist_ok=True)
    load, start = os.getloadavg(), time.time()
    try:
        games = ({g: bench_game(g, args, work) for g in args.games}
                 if args.part in ("all", "games") else {})
        sampling = bench_sampling(args, work) if args.part in ("all", "sampling") else {}
        transport = (bench_transport(args, work) if args.part in ("all", "transport")
                     else {})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    write(args, games, sampling, transport, {"args": asdict(args), "load_avg_start": load,
                                  "load_avg_end": os.getloadavg(),
                                  "minutes": (time.time() - start) / 60})


def write(args: Args, games: dict[str, Any], sampling: dict[str, Any],
          transport: dict[str, Any], run: dict[str, Any]) -> None:
    result = {"run": run, "machine": {"platform": platform.platform(),
                                      "python": platform.python_version(),
                                      "cpus": os.cpu_count()},
              "games": games, "sampling": sampling, "transport": transport,
              "targets": targets(games, sampling) if games and sampling else {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["targets"], indent=1))


if __name__ == "__main__":
    main()
