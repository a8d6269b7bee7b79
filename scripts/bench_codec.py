"""Frame codecs on real Atari frames: bytes, decode time, sample latency and add rate.

Compares, per game, on one recorded stream of real ALE frames (84x84, random policy):

    gzip -9      the whole frame stream in one gzip member (Dopamine's way; no random access)
    lz4          today's store: blosc-lz4 chunks of 8 frames
    zstd-dict    chunks of 8 or 4 frames, zstd level 1 or 3, a 16 or 64 KiB dictionary the
                 store trains on its first chunks (``dict_train_chunks``)

bytes are everything the frames cost on disk (``frames/``, whose ``zarr.json`` carries the
dictionary in base64, and the dictionary file; ``chunk_bytes`` counts the frame files alone);
decode µs is the compiled decode of one chunk (the store's own codec, batches of 64 chunks,
best of 5 passes interleaved across the configurations); add is steps/s while filling the
store. Then, on one game, ``sample(32)`` and ``add`` of lz4 and zstd-dict side by side in the
same run, at each store size (the recorded stream repeated): the stores are filled 5,000
steps each in turn and sampled in interleaved rounds, so machine drift hits all alike.

    python scripts/bench_codec.py                       # the issue's run: 30k frames a game
    python scripts/bench_codec.py --frames 2000 --sizes 20000 --reps 50   # a quick look

Writes ``data/bench/codec.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
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
    sample_game: str = "MsPacman"
    """the game of the sample/add comparison"""
    sizes: list[int] = field(default_factory=lambda: [200_000, 1_000_000])
    """store capacities (frames) of the sample/add comparison"""
    sample_dict_kib: int = 16
    """dictionary KiB of the zstd-dict stores in the sample/add comparison"""
    sample_level: int = 1
    """zstd level of the zstd-dict stores in the sample/add comparison"""
    reps: int = 2000
    """sample(32) calls timed per store"""
    out: str = "data/bench/codec.json"
    """where the JSON goes"""
    workdir: str = ""
    """where stores are built (default: a temp dir, removed after)"""
    cache_dir: str = ""
    """where ALE recordings are cached (default: data/cache)"""


CONFIGS: list[dict[str, Any]] = [
    {"codec": "lz4", "chunk_frames": 8},
    *[{"codec": "zstd-dict", "chunk_frames": c, "dict_bytes": d << 10, "codec_level": lv}
      for c in (8, 4) for d in (16, 64) for lv in (1, 3)],
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


def feed(store: ReplayStore, rec: AleFrames, stop: int, begin: int = 0) -> float:
    """Stream positions begin..stop-1 of `rec` repeated; returns steps/s (resets included)."""
    n = len(rec)
    start = time.perf_counter()
    for i in range(begin, stop):
        j = i % n
        if rec.is_first[j]:
            store.reset(rec.frames[j])
        else:
            store.add(rec.actions[j], rec.rewards[j], rec.frames[j], rec.terminated[j],
                      rec.truncated[j])
    return (stop - begin) / (time.perf_counter() - start)


def interleaved_fill(stores: dict[str, tuple[ReplayStore, Path]], rec: AleFrames,
                     capacity: int, block: int = 5000) -> dict[str, dict[str, Any]]:
    """Fill every store with the same `capacity` steps, `block` steps each in turn; add
    steps/s over the whole fill (training stall included), then the frame bytes."""
    spent = dict.fromkeys(stores, 0.0)
    for begin in range(0, capacity, block):
        stop = min(begin + block, capacity)
        for name, (store, _) in stores.items():
            spent[name] += (stop - begin) / feed(store, rec, stop, begin)
    out = {}
    for name, (store, root) in stores.items():
        store.flush()
        out[name] = {"add_steps_per_s": capacity / spent[name], "bytes": store_bytes(root)}
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
        start = time.perf_counter()
        for i in range(0, len(self.chunks), 64):
            n = min(64, len(self.chunks) - i)
            status = self.codec.decode_many(self.src[i:i + n], self.size[i:i + n], self.rows,
                                            self.dest[:n])
            assert not status.any()
        return (time.perf_counter() - start) / len(self.chunks) * 1e6


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
        rate = feed(store, rec, len(rec))
        store.flush()
        nbytes, chunks = store_bytes(root), chunk_bytes(root)
        out["codecs"][label(config)] = {
            **config, "bytes": nbytes, "ratio": raw / nbytes, "vs_gzip9": nbytes / gz,
            "chunk_bytes": chunks, "chunk_ratio": raw / chunks, "chunk_vs_gzip9": chunks / gz,
            "add_steps_per_s": rate}
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


def sample_configs(args: Args) -> dict[str, dict[str, Any]]:
    zd = {"codec": "zstd-dict", "dict_bytes": args.sample_dict_kib << 10,
          "codec_level": args.sample_level, "dict_train_chunks": args.dict_train_chunks}
    return {"lz4 c8": {"codec": "lz4", "chunk_frames": 8},
            "zstd-dict c8": {**zd, "chunk_frames": 8},
            "zstd-dict c4": {**zd, "chunk_frames": 4}}


def bench_sampling(args: Args, work: Path) -> dict[str, Any]:
    """sample(32) and add of lz4 and zstd-dict stores side by side, per store size."""
    rec = recording(args.sample_game, args)
    result: dict[str, Any] = {}
    for capacity in args.sizes:
        stores = {}
        for name, config in sample_configs(args).items():
            root = work / f"sample-{capacity}-{name.replace(' ', '-')}"
            stores[name] = (ReplayStore.create(root, capacity=capacity, obs_shape=(84, 84),
                                               frame_stack=FRAME_STACK, seed=0, **config), root)
        row = interleaved_fill(stores, rec, capacity)
        times: dict[str, list[float]] = {name: [] for name in stores}
        for _ in range(max(1, args.reps // 100)):  # interleaved rounds of 100
            for name, (store, _) in stores.items():
                for _ in range(min(100, args.reps)):
                    start = time.perf_counter_ns()
                    store.sample(32)
                    times[name].append((time.perf_counter_ns() - start) / 1e6)
        for name, (store, root) in stores.items():
            t = np.array(times[name][min(50, len(times[name]) // 10):])  # warm-up dropped
            row[name] |= {"sample_median_ms": float(np.median(t)),
                          "sample_mean_ms": float(t.mean()),
                          "sample_p90_ms": float(np.percentile(t, 90))}
            store.close()
            shutil.rmtree(root)
        base = row["lz4 c8"]
        for name, r in row.items():
            r["sample_vs_lz4"] = r["sample_median_ms"] / base["sample_median_ms"]
            r["add_vs_lz4"] = r["add_steps_per_s"] / base["add_steps_per_s"]
            print(f"{capacity:>9d} {name:14s} sample {r['sample_median_ms']:.3f} ms "
                  f"({r['sample_vs_lz4']:.2f}x)  add {r['add_steps_per_s']:7.0f}/s "
                  f"({r['add_vs_lz4']:.2f}x)  bytes {r['bytes']:,}", flush=True)
        result[str(capacity)] = row
    return result


def targets(games: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for each zstd-dict configuration."""
    out = {}
    for name in (label(c) for c in CONFIGS if c["codec"] != "lz4"):
        vs = [g["codecs"][name]["vs_gzip9"] for g in games.values()]
        alone = [g["codecs"][name]["chunk_vs_gzip9"] for g in games.values()]
        out[name] = {"games_at_or_below_gzip9": sum(v <= 1.0 for v in vs),
                     "worst_vs_gzip9": max(vs),
                     "games_at_or_below_gzip9_chunks_alone": sum(v <= 1.0 for v in alone)}
    for size, row in sampling.items():
        for name, r in row.items():
            out.setdefault(f"{name} @ {size}", {}).update(
                sample_vs_lz4=r["sample_vs_lz4"], add_vs_lz4=r["add_vs_lz4"])
    return out


def main() -> None:
    args = parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_codec_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        games = {g: bench_game(g, args, work) for g in args.games}
        sampling = bench_sampling(args, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result = {"args": asdict(args), "machine": {"platform": platform.platform(),
                                                 "python": platform.python_version()},
              "games": games, "sampling": sampling, "targets": targets(games, sampling)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["targets"], indent=1))


if __name__ == "__main__":
    main()
