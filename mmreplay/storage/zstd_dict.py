"""The per-store zstd dictionary of codec ``"zstd-dict"``: training, its file, its checks.

A ``"zstd-dict"`` store compresses every frame chunk with one zstd dictionary, trained from
the first chunks the store receives (or given at create) and fixed for the store's life::

    <root>/manifest.json        "dictionary": {"size": 65536, "crc32c": 1234}  (format 4)
    <root>/zstd.dict            the dictionary's bytes, exactly as libzstd takes them
    <root>/frames/zarr.json     the same bytes in base64 (codec ``mmreplay.zstd_dict``), so
                                that zarr alone reads the array with mmreplay installed

Until the dictionary exists, finished chunks wait in RAM (`DictionaryTrainer`); when
``dict_train_chunks`` of them have arrived (or the ring would overwrite one of them, or a
flush needs them on disk) the dictionary is trained on their frames (one sample a frame)
and they are written. Training on frames rather than chunks gave ~25% smaller Pong chunks.
Training stalls that one `add` (~0.3 s for 2,048 Atari frames on a loaded 2-core machine).
When zstd cannot train (too few or too uniform samples) the dictionary is raw content: the
last frames seen, which zstd uses as a prefix to match against.

This module knows dictionaries and the one file holding one; no slots, shards or manifests
beyond the record it checks.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import zstandard

from mmreplay.errors import InvalidInputError, InvalidStoreError
from mmreplay.storage.safe_io import read_small, write_atomic

DICT_FILE = "zstd.dict"
MIN_DICT_BYTES = 256
MAX_DICT_BYTES = 512 << 10  # what an open reads at most; zarr.json holds it in base64 too
MAX_ZARR_JSON_BYTES = 1 << 20  # as `layout` reads it: the largest dictionary fits in base64
# fastcover's segment and d-mer sizes: on 30k Atari frames of five games (2,048 training
# frames, 64 KiB) they gave 46-151x where the parameter search gave 46-141x, in 0.3 s not 1.3 s
TRAIN_K, TRAIN_D = 2048, 6
DICT_MAGIC = b"\x37\xa4\x30\xec"  # a trained zstd dictionary starts so; else raw content


def dictionary_record(data: bytes) -> dict[str, int]:
    """What the manifest records of a dictionary: its size and crc32c."""
    return {"size": len(data), "crc32c": google_crc32c.value(data)}


def check_record(record: Any, where: str | Path) -> None:
    """A manifest's ``dictionary`` field on its own: ``{"size": int, "crc32c": int}``."""
    ok = (isinstance(record, dict) and set(record) == {"size", "crc32c"}
          and all(type(v) is int for v in record.values())
          and 8 <= record["size"] <= MAX_DICT_BYTES and 0 <= record["crc32c"] <= 0xFFFFFFFF)
    if not ok:
        raise InvalidStoreError(f"{where}: dictionary must be {{'size': 8..{MAX_DICT_BYTES}, "
                                f"'crc32c': uint32}}, got {record!r:.80}")


def read_dictionary(root: Path, record: dict[str, int]) -> bytes:
    """The dictionary file, checked against the manifest's record (`InvalidStoreError`)."""
    data = read_small(root / DICT_FILE, f"zstd dictionary {DICT_FILE}", MAX_DICT_BYTES)
    if len(data) != record["size"]:
        raise InvalidStoreError(f"zstd dictionary {DICT_FILE} is {len(data)} bytes; the "
                                f"manifest says {record['size']} (truncated or replaced)")
    if google_crc32c.value(data) != record["crc32c"]:
        raise InvalidStoreError(f"zstd dictionary {DICT_FILE} fails its crc32c checksum")
    if data[:4] == DICT_MAGIC:
        try:  # libzstd parses a trained dictionary's entropy tables here
            zstandard.ZstdCompressionDict(
                bytes(data), dict_type=zstandard.DICT_TYPE_FULLDICT).precompute_compress(level=1)
        except zstandard.ZstdError as exc:
            raise InvalidStoreError(f"zstd dictionary {DICT_FILE} is damaged: libzstd refuses "
                                    f"it ({exc})") from None
    return bytes(data)


def write_dictionary(root: Path, data: bytes, tmp_dir: Path, *, durable: bool) -> None:
    write_atomic(root / DICT_FILE, data, tmp_dir, durable=durable)


def parse_dictionary(codec: str, value: Any) -> bytes:
    """A dictionary given at create: bytes-like, ``MIN_DICT_BYTES..MAX_DICT_BYTES``, for
    codec "zstd-dict" only."""
    if codec != "zstd-dict":
        raise InvalidInputError(f"dictionary applies to codec 'zstd-dict' only, not {codec!r}")
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidInputError(f"dictionary must be bytes, got {type(value).__name__}")
    data = bytes(value)
    if not MIN_DICT_BYTES <= len(data) <= MAX_DICT_BYTES:
        raise InvalidInputError(f"dictionary must hold {MIN_DICT_BYTES}..{MAX_DICT_BYTES} "
                                f"bytes, got {len(data)}")
    return data


def train(frames: np.ndarray, size: int, level: int) -> bytes:
    """A zstd dictionary of at most `size` bytes for chunks like these frames' (one sample a
    frame); raw content (the last frames) when zstd cannot train on them."""
    samples: list[bytes | bytearray | memoryview] = [
        f.tobytes() for f in frames.reshape(len(frames), -1)]
    try:  # fastcover with fixed k, d: as small as its parameter search, 4x faster to train
        trained = zstandard.train_dictionary(size, samples, k=min(TRAIN_K, size), d=TRAIN_D,
                                             level=level).as_bytes()
    except zstandard.ZstdError:
        trained = b""
    if len(trained) >= MIN_DICT_BYTES:
        return trained
    raw = b"".join(samples)[-(size - 1):]  # a leading zero byte: never a trained dict's magic
    return b"\0" * max(1, MIN_DICT_BYTES - len(raw)) + raw


class DictionaryTrainer:
    """Finished chunks held in RAM, in arrival order, until the dictionary is trained.

    A key may arrive twice (the ring wrapped before training): both are kept, in order, so
    the writes after training replay exactly what the store would have written."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self._items: list[tuple[tuple[int, int], np.ndarray]] = []
        self._latest: dict[tuple[int, int], np.ndarray] = {}

    def add(self, key: tuple[int, int], frames: np.ndarray) -> bool:
        """Hold a chunk; True when the dictionary should be trained now (enough chunks, or
        the ring came back to a held chunk)."""
        again = key in self._latest
        self._items.append((key, frames))
        self._latest[key] = frames
        return again or len(self._items) >= self.chunks

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        """The newest held frames of chunk `key`, if held."""
        return self._latest.get(key)

    def keys(self) -> list[tuple[int, int]]:
        return list(self._latest)

    def frames(self) -> np.ndarray:
        """Every held chunk's frames, one row a frame."""
        return np.concatenate([frames for _, frames in self._items])

    def take(self) -> list[tuple[tuple[int, int], np.ndarray]]:
        """Every held chunk, in arrival order; none is held after."""
        items, self._items, self._latest = self._items, [], {}
        return items

    def __len__(self) -> int:
        return len(self._items)


def install(root: Path, dictionary: bytes, tmp_dir: Path, *, durable: bool) -> None:
    """Write the dictionary file, then set it in ``frames/zarr.json`` (both atomically)."""
    write_dictionary(root, dictionary, tmp_dir, durable=durable)
    path = root / "frames" / "zarr.json"
    meta = json.loads(read_small(path, "frames/zarr.json", MAX_ZARR_JSON_BYTES))
    write_atomic(path, json.dumps(with_dictionary(meta, dictionary), indent=2).encode(),
                 tmp_dir, durable=durable)


NAME = "mmreplay.zstd_dict"  # the zarr codec's name (`zarr_codec`; zarr is not imported here)


def configuration(level: int, dictionary: bytes | None) -> dict[str, Any]:
    """The codec's configuration in ``zarr.json``."""
    if dictionary is None:
        return {"level": level}
    return {"level": level, "dictionary": base64.b64encode(dictionary).decode("ascii")}


def with_dictionary(meta: dict[str, Any], dictionary: bytes) -> dict[str, Any]:
    """``frames/zarr.json`` metadata with `dictionary` set in its ``mmreplay.zstd_dict``
    codec (also inside ``sharding_indexed``)."""
    def walk(codecs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for codec in codecs:
            config = codec.get("configuration", {})
            if codec.get("name") == NAME:
                codec = {**codec, "configuration": configuration(config["level"], dictionary)}
            elif codec.get("name") == "sharding_indexed":
                codec = {**codec, "configuration": {**config, "codecs": walk(config["codecs"])}}
            out.append(codec)
        return out

    return {**meta, "codecs": walk(meta["codecs"])}
