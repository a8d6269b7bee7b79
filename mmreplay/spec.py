"""The frozen configuration of a store, its validation and its JSON form.

`StoreSpec` is everything fixed at ``ReplayStore.create`` time. It owns the
derived sizes (slots per env, chunk length) and round-trips through plain JSON
dicts; it never touches files.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from mmreplay.errors import InvalidInputError, InvalidStoreError

STACK_PADDINGS = ("zero", "first")
# "lz4" is zarr's core blosc codec with cname lz4; "lz4hc" the same with cname lz4hc (LZ4HC
# writes the lz4 format: smaller chunks that decode faster, encoded ~5x slower); "zstd-dict"
# is zstd with a dictionary trained per store (docs/compression.md has the measurements).
CODECS = ("lz4", "lz4hc", "zstd", "zstd-dict")
# codec: (lowest level, highest, default)
CODEC_LEVELS = {"lz4": (1, 9, 9), "lz4hc": (1, 9, 3), "zstd": (-5, 22, 1),
                "zstd-dict": (1, 19, 3)}
DICT_FIELDS = ("dict_bytes", "dict_train_chunks")  # in a spec (format 4) only for "zstd-dict"
DEFAULT_DICT_BYTES = 16 << 10
DEFAULT_DICT_TRAIN_CHUNKS = 256
SAMPLERS = ("uniform", "prioritized", "rank")
# Dtypes a store may hold; anything else (object, void, strings) is refused.
ALLOWED_DTYPES = (
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "bool",
)
MAX_CAPACITY = 1 << 40
MAX_EXTRAS = 16  # per-step extra columns a store may declare
MAX_EXTRA_BYTES = 1 << 16  # bytes of all extras of one step together
EXTRA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
TARGET_CHUNK_BYTES = 64 * 1024
TARGET_SHARD_FRAMES = 4096  # frames per shard file when chunks are small (512 chunks of 8)


@dataclass(frozen=True)
class StoreSpec:
    """Configuration of a store; all sizes count frames (observations)."""

    capacity: int
    obs_shape: tuple[int, ...]
    obs_dtype: str = "uint8"
    num_envs: int = 1
    frame_stack: int = 1
    n_step: int = 1
    gamma: float = 0.99
    stack_padding: str = "zero"
    action_shape: tuple[int, ...] = ()
    action_dtype: str = "int64"
    chunk_frames: int = 0  # 0 = chosen from the frame size at create time
    shard_chunks: int = 0  # chunks per frame file; 0 = chosen at create; 1 = a file per chunk
    codec: str = "lz4"
    codec_level: int = 9
    block_slots: int = 4096
    sampler: str = "uniform"
    alpha: float = 0.6
    priority_eps: float = 1e-6
    # per-step extra columns: (name, shape, dtype), sorted by name; empty for most stores
    extras: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    # "zstd-dict" only (0 otherwise): the dictionary's size, and the chunks it is trained on
    dict_bytes: int = 0
    dict_train_chunks: int = 0

    @property
    def extra_bytes(self) -> int:
        """Bytes of all declared extras of one step together."""
        return extra_bytes(self.extras)

    @property
    def slots_per_env(self) -> int:
        """Frames each env keeps: ``capacity // num_envs``."""
        return self.capacity // self.num_envs

    @property
    def num_chunks(self) -> int:
        """Chunks per env: ``ceil(slots_per_env / chunk_frames)``; the last may be short."""
        return -(-self.slots_per_env // self.chunk_frames)

    @property
    def num_shards(self) -> int:
        """Frame files per env: ``ceil(num_chunks / shard_chunks)``."""
        return -(-self.num_chunks // self.shard_chunks)

    @property
    def frame_bytes(self) -> int:
        return int(np.prod(self.obs_shape, dtype=np.int64)) * np.dtype(self.obs_dtype).itemsize

    @property
    def decoded_bytes(self) -> int:
        """Bytes of every frame chunk decoded (the ring's last chunk counted whole): the
        smallest `cache_bytes` that keeps every decoded frame in RAM, as cpprb does."""
        return self.num_envs * self.num_chunks * self.chunk_frames * self.frame_bytes

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["obs_shape"] = list(self.obs_shape)
        out["action_shape"] = list(self.action_shape)
        if self.shard_chunks == 1:
            del out["shard_chunks"]  # the format-1 layout, readable by format-1 readers
        if self.extras:
            out["extras"] = [[name, list(shape), dtype] for name, shape, dtype in self.extras]
        else:
            del out["extras"]  # stores without extras keep the format they always had
        if self.codec != "zstd-dict":
            for key in DICT_FIELDS:
                del out[key]
        return out

    @property
    def format_version(self) -> int:
        """1: a file per chunk; 2: shard files (zarr ``sharding_indexed``); 3: per-step
        extras in the step blocks (either frame layout, told apart by ``shard_chunks``); 4:
        codec ``"zstd-dict"``, a dictionary beside the manifest (with or without extras); 5:
        codec ``"lz4hc"`` (chunks in the lz4 format, zarr's blosc codec with cname lz4hc)."""
        if self.codec == "lz4hc":
            return 5
        if self.codec == "zstd-dict":
            return 4
        if self.extras:
            return 3
        return 1 if self.shard_chunks == 1 else 2

    @classmethod
    def from_dict(cls, data: Any) -> StoreSpec:
        """Parse a manifest's spec; any problem is an `InvalidStoreError`."""
        if not isinstance(data, dict):
            raise InvalidStoreError(f"spec must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidStoreError(f"spec has unknown fields {sorted(unknown)}")
        try:
            return make_spec(**{"shard_chunks": 1, **data})  # format 1: a file per chunk
        except (InvalidInputError, TypeError) as exc:
            raise InvalidStoreError(f"invalid spec in manifest: {exc}") from None


def make_spec(**kwargs: Any) -> StoreSpec:
    """Validate user-facing arguments and return a complete `StoreSpec`."""
    codec = parse_choice("codec", kwargs.pop("codec", "lz4"), CODECS)
    spec = StoreSpec(
        capacity=parse_int("capacity", kwargs.pop("capacity"), low=2, high=MAX_CAPACITY),
        obs_shape=parse_shape("obs_shape", kwargs.pop("obs_shape")),
        obs_dtype=parse_dtype("obs_dtype", kwargs.pop("obs_dtype", "uint8")),
        num_envs=parse_int("num_envs", kwargs.pop("num_envs", 1), low=1, high=1 << 20),
        frame_stack=parse_int("frame_stack", kwargs.pop("frame_stack", 1), low=1, high=64),
        n_step=parse_int("n_step", kwargs.pop("n_step", 1), low=1, high=1000),
        gamma=parse_float("gamma", kwargs.pop("gamma", 0.99), low=0.0, high=1.0),
        stack_padding=parse_choice("stack_padding", kwargs.pop("stack_padding", "zero"),
                                   STACK_PADDINGS),
        action_shape=parse_shape("action_shape", kwargs.pop("action_shape", ()), allow_empty=True),
        action_dtype=parse_dtype("action_dtype", kwargs.pop("action_dtype", "int64")),
        chunk_frames=parse_int("chunk_frames", kwargs.pop("chunk_frames", 0), low=0, high=1 << 16),
        shard_chunks=parse_int("shard_chunks", kwargs.pop("shard_chunks", 0), low=0, high=1 << 16),
        codec=codec,
        codec_level=parse_codec_level(codec, kwargs.pop("codec_level", None)),
        block_slots=parse_int("block_slots", kwargs.pop("block_slots", 4096), low=1, high=1 << 24),
        sampler=parse_choice("sampler", kwargs.pop("sampler", "uniform"), SAMPLERS),
        alpha=parse_float("alpha", kwargs.pop("alpha", 0.6), low=0.0, high=10.0),
        priority_eps=parse_float("priority_eps", kwargs.pop("priority_eps", 1e-6), low=0.0,
                                 high=1e6),
        extras=parse_extras(kwargs.pop("extras", None)),
        **parse_dict_options(codec, kwargs),
    )
    if kwargs:
        raise InvalidInputError(f"unknown store options {sorted(kwargs)}")
    return _complete(spec)


def _complete(spec: StoreSpec) -> StoreSpec:
    if spec.slots_per_env < 2:
        raise InvalidInputError(
            f"capacity // num_envs must be >= 2 frames per env, got "
            f"{spec.capacity} // {spec.num_envs} = {spec.slots_per_env}")
    chunk = spec.chunk_frames or default_chunk_frames(spec.frame_bytes)
    chunk = min(chunk, spec.slots_per_env)
    shard = spec.shard_chunks or max(1, TARGET_SHARD_FRAMES // chunk)
    shard = min(shard, -(-spec.slots_per_env // chunk))  # a shard never outgrows the ring
    return replace(spec, chunk_frames=chunk, shard_chunks=shard)


def parse_extras(value: Any) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """``{name: (shape, dtype)}`` (or the manifest's ``[[name, shape, dtype], ...]``) ->
    a tuple sorted by name. Names are identifiers; shapes may be ``()``."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple) and all(
            isinstance(v, list | tuple) and len(v) == 3 for v in value):
        items = [(v[0], (v[1], v[2])) for v in value]
    else:
        raise InvalidInputError(
            f"extras must be a dict {{name: (shape, dtype)}}, got {value!r:.80}")
    if len(items) > MAX_EXTRAS:
        raise InvalidInputError(f"at most {MAX_EXTRAS} extras, got {len(items)}")
    out = []
    for name, decl in items:
        if not isinstance(name, str) or not EXTRA_NAME.fullmatch(name):
            raise InvalidInputError(f"extra name must be an identifier, got {name!r:.80}")
        if not isinstance(decl, list | tuple) or len(decl) != 2:
            raise InvalidInputError(f"extra {name!r} must be declared as (shape, dtype), "
                                    f"got {decl!r:.80}")
        shape = parse_shape(f"extra {name!r} shape", decl[0], allow_empty=True)
        out.append((name, shape, parse_dtype(f"extra {name!r} dtype", decl[1])))
    if len({name for name, _, _ in out}) != len(out):
        raise InvalidInputError(f"extras has duplicate names: {[n for n, _, _ in out]}")
    size = extra_bytes(out)
    if size > MAX_EXTRA_BYTES:
        raise InvalidInputError(f"extras take {size} bytes per step, more than "
                                f"{MAX_EXTRA_BYTES}")
    return tuple(sorted(out))


def extra_bytes(extras: Any) -> int:
    """Bytes per step of ``(name, shape, dtype)`` extras."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype in extras)


def default_chunk_frames(frame_bytes: int) -> int:
    """Largest power of two whose chunk stays within ~64 KiB raw (8 for 84x84 uint8)."""
    frames = max(1, TARGET_CHUNK_BYTES // max(1, frame_bytes))
    return min(4096, 1 << int(math.log2(frames)))


def parse_dict_options(codec: str, kwargs: dict[str, Any]) -> dict[str, int]:
    """``dict_bytes`` and ``dict_train_chunks`` (popped from `kwargs`): for "zstd-dict" only."""
    given = {key: kwargs.pop(key) for key in DICT_FIELDS if key in kwargs}
    if codec != "zstd-dict":
        if given:
            raise InvalidInputError(f"{sorted(given)} apply to codec 'zstd-dict' only, "
                                    f"not {codec!r}")
        return {}
    return {
        "dict_bytes": parse_int("dict_bytes", given.get("dict_bytes", DEFAULT_DICT_BYTES),
                                low=1 << 10, high=512 << 10),
        "dict_train_chunks": parse_int(
            "dict_train_chunks", given.get("dict_train_chunks", DEFAULT_DICT_TRAIN_CHUNKS),
            low=1, high=1 << 16),
    }


def parse_codec_level(codec: str, value: Any) -> int:
    low, high, default = CODEC_LEVELS[codec]
    return default if value is None else parse_int(f"codec_level for {codec}", value, low=low,
                                                   high=high)


def parse_int(name: str, value: Any, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidInputError(f"{name} must be an int, got {value!r}")
    if not low <= int(value) <= high:
        raise InvalidInputError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def parse_float(name: str, value: Any, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise InvalidInputError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(float(value)) and low <= float(value) <= high):
        raise InvalidInputError(f"{name} must be a finite number in [{low}, {high}], got {value}")
    return float(value)


def parse_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidInputError(f"{name} must be one of {list(choices)}, got {value!r}")
    return str(value)


def parse_shape(name: str, value: Any, *, allow_empty: bool = False) -> tuple[int, ...]:
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, tuple | list) or len(value) > 8:
        raise InvalidInputError(f"{name} must be a tuple of at most 8 ints, got {value!r}")
    dims = tuple(parse_int(f"{name} dimension", d, low=1, high=1 << 20) for d in value)
    if not dims and not allow_empty:
        raise InvalidInputError(f"{name} must have at least one dimension, got ()")
    return dims


def parse_dtype(name: str, value: Any) -> str:
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise InvalidInputError(f"{name} must be a numpy dtype, got {value!r}") from None
    if dtype.name not in ALLOWED_DTYPES:
        raise InvalidInputError(f"{name} must be one of {list(ALLOWED_DTYPES)}, got {dtype}")
    return dtype.name
