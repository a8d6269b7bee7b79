"""Chunk layouts against the cost of decoding a batch, on real Atari frames.

The default store keeps 8 frames a chunk as one lz4 stream, each frame matched against the
ones before it, so a batch that takes frame k of a chunk decodes frames 0..k (and the first
frame of a chunk, matched against nothing, costs ~3x a later one). On one recorded stream,
this measures what other layouts would change: bytes a frame, encode µs a frame, and the
compiled gather of sampled batches (32 four-frame stacks and their next stacks, grouped by
chunk, each chunk decoded only as far as the batch reads it, then copied out), every layout
alternated with the others in blocks of `--block` batches in one process:

    chained-8   the store's layout: one lz4 stream over 8 frames
    chained-4   one lz4 stream over 4 frames
    keyed-8     frame 0 of a chunk alone, every other frame an lz4 stream against frame 0
                as its dictionary: a read decodes frame 0 and the frames it takes
    dict-8      one lz4 stream over 8 frames against a 64 KiB dictionary of frames from the
                start of the run (raw content, as ``zstd-dict`` falls back to)
    hc3-8       the store's layout encoded by LZ4HC at level 3 (the same lz4 format: the
    hc9-8       store's reads decode it as it is), and at level 9

The streams are bare lz4 (no blosc header, no crc32c: the store adds ~0.2-0.5 µs of checks a
chunk to each alike). Every layout's batches are checked against the frames first.

    python scripts/bench/bench_chunk_layout.py                          # 40,000 Breakout frames
    python scripts/bench/bench_chunk_layout.py --frames 2000 --batches 200 --out-dir /tmp/cl

Writes ``chunk_layout.json`` under `--out-dir`. Figures only.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np
import scripts_path  # noqa: F401  (scripts/ on sys.path)
import tyro
from ale_frames import CACHE_DIR, record_frames
from benchlib.harness import machine_info, write_json
from common import run_main
from numba import types
from numcodecs import blosc

from mmreplay.kernels import compiled

KERNELS = compiled()  # binds c-blosc's lz4 symbols for the kernels below
LIB = ctypes.CDLL(blosc.__file__)
_partial = types.ExternalFunction(
    "LZ4_decompress_safe_partial",
    types.int32(types.int64, types.int64, types.int32, types.int32, types.int32))
_partial_dict = types.ExternalFunction(
    "LZ4_decompress_safe_partial_usingDict",
    types.int32(types.int64, types.int64, types.int32, types.int32, types.int32, types.int64,
                types.int32))
STACK, BATCH, DICT_BYTES = 4, 32, 64 << 10


@dataclass
class Args:
    game: str = "ALE/Breakout-v5"
    """the Atari game recorded (random policy)"""
    frames: int = 40_000
    """real frames recorded (cached under --cache-dir)"""
    batches: int = 3_000
    """timed batches per layout"""
    block: int = 50
    """batches per layout in a row before the next layout's turn"""
    seed: int = 0
    """seed of the recording and of the batches"""
    cache_dir: str = str(CACHE_DIR)
    """where recorded frames are cached"""
    out_dir: str = "data/bench"
    """where chunk_layout.json goes"""


@dataclass(frozen=True)
class Layout:
    """Streams of one layout: stream ``i`` is ``data[start[i]:start[i + 1]]``; `per` streams
    a chunk of `chunk` frames (1: one stream a chunk; `chunk`: one a frame, keyed)."""

    chunk: int
    per: int
    data: np.ndarray
    start: np.ndarray
    encode_us_per_frame: float


LIB.LZ4_createStream.restype = ctypes.c_void_p
_VOID = ctypes.c_void_p


def _compress(src: np.ndarray, dst: np.ndarray, dictionary: np.ndarray | None,
              hc_level: int = 0) -> int:
    """lz4 of `src` into `dst` (against `dictionary` if given; LZ4HC at `hc_level` if not
    0); the bytes written."""
    if hc_level:
        return int(LIB.LZ4_compress_HC(_VOID(src.ctypes.data), _VOID(dst.ctypes.data),
                                       src.size, dst.size, hc_level))
    if dictionary is None:
        return int(LIB.LZ4_compress_default(_VOID(src.ctypes.data), _VOID(dst.ctypes.data),
                                            src.size, dst.size))
    stream = _VOID(_stream())
    LIB.LZ4_loadDict(stream, _VOID(dictionary.ctypes.data), dictionary.size)  # resets it
    return int(LIB.LZ4_compress_fast_continue(stream, _VOID(src.ctypes.data),
                                              _VOID(dst.ctypes.data), src.size, dst.size, 1))


_STREAM: list[int] = []


def _stream() -> int:
    """One ``LZ4_stream_t`` for every dictionary compression (made on first use)."""
    if not _STREAM:
        _STREAM.append(int(LIB.LZ4_createStream()))
    return _STREAM[0]


def encode(frames: np.ndarray, chunk: int, keyed: bool,
           dictionary: np.ndarray | None = None, hc_level: int = 0) -> Layout:
    """`frames` (n, bytes) in chunks of `chunk`: one stream a chunk (against `dictionary` if
    given; LZ4HC at `hc_level` if not 0) or, `keyed`, frame 0 alone and each other frame
    against frame 0."""
    dst, parts = np.empty(2 * chunk * frames.shape[1] + 1024, np.uint8), []
    began = time.perf_counter()
    for c in range(frames.shape[0] // chunk):
        block = np.ascontiguousarray(frames[c * chunk:(c + 1) * chunk])
        pieces = [(block, dictionary)] if not keyed else (
            [(block[:1], None)] + [(block[k:k + 1], block[0]) for k in range(1, chunk)])
        for src, against in pieces:
            parts.append(dst[:_compress(src, dst, against, hc_level)].copy())
    took = time.perf_counter() - began
    start = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([p.size for p in parts], out=start[1:])
    return Layout(chunk, chunk if keyed else 1, np.concatenate(parts), start,
                  took / (frames.shape[0] // chunk * chunk) * 1e6)


@numba.njit(nogil=True)
def gather_streams(idx, data, start, chunk, dictionary, scratch, out):  # type: ignore[no-untyped-def]
    """One stream a chunk: each chunk decoded up to the last frame the batch takes."""
    fb = out.shape[1]
    order = np.argsort(idx // chunk, kind="mergesort")
    j = 0
    while j < order.size:
        c, last, stop = idx[order[j]] // chunk, 0, j
        while stop < order.size and idx[order[stop]] // chunk == c:
            last = max(last, idx[order[stop]] % chunk)
            stop += 1
        src, size = data.ctypes.data + start[c], start[c + 1] - start[c]
        if dictionary.size:
            _partial_dict(src, scratch.ctypes.data, size, (last + 1) * fb, chunk * fb,
                          dictionary.ctypes.data, dictionary.size)
        else:
            _partial(src, scratch.ctypes.data, size, (last + 1) * fb, chunk * fb)
        for k in range(j, stop):
            i = order[k]
            KERNELS.memcpy(out.ctypes.data + i * fb, scratch.ctypes.data + (idx[i] % chunk) * fb,
                           fb)
        j = stop


@numba.njit(nogil=True)
def gather_keyed(idx, data, start, chunk, dictionary, scratch, out):  # type: ignore[no-untyped-def]
    """One stream a frame: a chunk's frame 0 decoded once, each frame taken decoded straight
    into its first row against it, repeats copied from that row."""
    fb = out.shape[1]
    order = np.argsort(idx, kind="mergesort")
    j, key = 0, -1
    while j < order.size:
        f, stop = idx[order[j]], j + 1
        while stop < order.size and idx[order[stop]] == f:
            stop += 1
        first = out.ctypes.data + order[j] * fb
        if f // chunk != key:
            key = f // chunk
            _partial(data.ctypes.data + start[key * chunk], scratch.ctypes.data,
                     start[key * chunk + 1] - start[key * chunk], fb, fb)
        if f % chunk == 0:
            KERNELS.memcpy(first, scratch.ctypes.data, fb)
        else:
            _partial_dict(data.ctypes.data + start[f], first, start[f + 1] - start[f], fb, fb,
                          scratch.ctypes.data, fb)
        for k in range(j + 1, stop):
            KERNELS.memcpy(out.ctypes.data + order[k] * fb, first, fb)
        j = stop


def batches(n: int, count: int, seed: int) -> list[np.ndarray]:
    """`count` batches of frame indices: 32 stacks of 4 frames, then their next stacks."""
    rng, steps = np.random.default_rng(seed), np.arange(-STACK + 1, 1)
    out = []
    for _ in range(count):
        obs = rng.integers(STACK - 1, n - 1, BATCH)[:, None] + steps[None]
        out.append(np.concatenate([obs.ravel(), (obs + 1).ravel()]).astype(np.int64))
    return out


def timed_gathers(layouts: dict[str, tuple[Layout, np.ndarray]], frames: np.ndarray,
                  args: Args) -> dict[str, list[int]]:
    """Each layout's gather of the same batches, checked first, then timed in turns."""
    scratch = np.empty(8 * frames.shape[1], np.uint8)
    out = np.empty((2 * BATCH * STACK, frames.shape[1]), np.uint8)
    calls: dict[str, Callable[[np.ndarray], None]] = {}
    for name, (lay, dictionary) in layouts.items():
        gather = gather_keyed if lay.per > 1 else gather_streams
        calls[name] = (lambda idx, g=gather, lay=lay, d=dictionary: g(
            idx, lay.data, lay.start, lay.chunk, d, scratch, out))
    usable = frames.shape[0] // 8 * 8  # frames every layout holds
    work = batches(usable, args.batches + args.block, args.seed + 1)
    for name, call in calls.items():
        for idx in work[:args.block]:
            call(idx)
            if not np.array_equal(out, frames[idx]):
                raise RuntimeError(f"{name}: a batch read back other frames than were encoded")
    times: dict[str, list[int]] = {name: [] for name in calls}
    for lo in range(args.block, len(work), args.block):
        for name, call in calls.items():
            for idx in work[lo:lo + args.block]:
                began = time.perf_counter_ns()
                call(idx)
                times[name].append(time.perf_counter_ns() - began)
    return times


def main() -> None:
    args = tyro.cli(Args, description=__doc__)
    rec = record_frames(args.game, args.frames, seed=args.seed, cache_dir=args.cache_dir)
    frames = rec.frames.reshape(len(rec.frames), -1)
    picks = np.linspace(0, min(len(frames), 2048) - 1, DICT_BYTES // frames.shape[1] + 1)
    dictionary = np.ascontiguousarray(frames[picks.astype(int)].reshape(-1)[-DICT_BYTES:])
    none = np.empty(0, np.uint8)
    layouts = {"chained-8": (encode(frames, 8, False), none),
               "chained-4": (encode(frames, 4, False), none),
               "keyed-8": (encode(frames, 8, True), none),
               "dict-8": (encode(frames, 8, False, dictionary), dictionary),
               "hc3-8": (encode(frames, 8, False, hc_level=3), none),
               "hc9-8": (encode(frames, 8, False, hc_level=9), none)}
    load_start = os.getloadavg()[0]
    times = timed_gathers(layouts, frames, args)
    base_bytes = layouts["chained-8"][0].data.size
    micros = {name: np.asarray(t) / 1e3 for name, t in times.items()}
    base_us = float(np.median(micros["chained-8"]))
    rows: dict[str, Any] = {}
    for name, (lay, _) in layouts.items():
        us = micros[name]
        rows[name] = {"bytes_per_frame": lay.data.size / (len(frames) // lay.chunk * lay.chunk),
                      "bytes_vs_chained_8": lay.data.size / base_bytes,
                      "encode_us_per_frame": lay.encode_us_per_frame,
                      "gather_us": {"median": float(np.median(us)),
                                    "p25": float(np.percentile(us, 25)),
                                    "p90": float(np.percentile(us, 90))},
                      "gather_vs_chained_8": float(np.median(us)) / base_us}
        print(f"{name:10s} {rows[name]['bytes_per_frame']:7.1f} B/frame "
              f"({rows[name]['bytes_vs_chained_8']:.2f}x)  encode "
              f"{lay.encode_us_per_frame:5.1f} µs/frame  batch {np.median(us):7.1f} µs "
              f"(p90 {np.percentile(us, 90):7.1f}; {rows[name]['gather_vs_chained_8']:.2f}x)")
    result = {"machine": machine_info(), "config": asdict(args), "game": args.game,
              "frame_bytes": int(frames.shape[1]), "dictionary_bytes": int(dictionary.size),
              "load": {"start": load_start, "end": os.getloadavg()[0]}, "layouts": rows}
    out = write_json(result, Path(args.out_dir), "chunk_layout.json")
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    run_main(main)
