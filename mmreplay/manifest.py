"""The versioned on-disk metadata of a store, and every check an open makes before trusting it.

``manifest.json`` is the commit point: it is written to a temp file and renamed
into place only after every file it names is complete, so a reader sees either
the previous generation or the new one. It holds the spec, cursors, RNG state,
for each small ``.npy`` file (step blocks, RAM tail) its crc32, and its own
``checksum`` (crc32 of its canonical JSON without that field; manifests written
before it existed have none and are still read). It never touches frame bytes.

Opening treats the directory as hostile input:

* only JSON (parsed here under size, nesting and duplicate-key limits), zarr
  metadata compared field by field with what the spec implies (zarr parses
  nothing), and ``.npy`` files whose header is checked before their data is read
  are ever parsed; nothing is unpickled;
* every file is opened only if it is a regular file, without following symlinks
  and without blocking (a FIFO cannot hang an open), and read only up to the size
  the spec implies; directories must be real directories, so nothing outside the
  root is read or written;
* what the spec makes an open allocate is capped (``max_ram_bytes``).

Every problem is an `InvalidStoreError` with a one-line message.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.lib.format as npy_format

from .errors import InvalidStoreError
from .frame_store import FRAMES, TMP_DIR, fsync_dir, write_atomic
from .ring import step_dtype
from .spec import ALLOWED_DTYPES, StoreSpec

MANIFEST = "manifest.json"
ZARR_JSON = "zarr.json"
FORMAT = "mmreplay"
FORMAT_VERSION = 1
CHECKSUM = "checksum"
MAX_MANIFEST_BYTES = 16 << 20  # ~200k step blocks; parsing it costs at most ~250 MB
MAX_MANIFEST_CONTAINERS = 64  # a manifest has 13 JSON arrays and objects
MAX_ZARR_JSON_BYTES = 1 << 20
MAX_NPY_HEADER = 1 << 14
MAX_RAM_BYTES = 64 << 30  # default cap on what a manifest's spec may make an open allocate
MAX_COUNTER = 1 << 62  # ids, episodes, frames written, generations
MAX_ENVS = 1 << 20  # the spec's bound on num_envs
STEP_DIRS = ("steps", "tail", "prio")
REQUIRED: dict[str, type] = {
    "format": str, "format_version": int, "generation": int, "spec": dict,
    "written": list, "kept_from": list, "running": list, "next_id": int,
    "next_episode": int, "rng": dict, "blocks": list, "tail": str, "files": dict,
}
OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "prio_blocks": list, "max_priority": (int, float), CHECKSUM: int,
}
BLOCK_NAME = re.compile(r"(steps|prio)/b([0-9]{6,12})\.g([0-9]{8,19})\.npy")
TAIL_NAME = re.compile(r"tail/tail\.g([0-9]{8,19})\.npy")
Readable = io.RawIOBase | io.BufferedIOBase  # a file opened here, or a BytesIO of its head
# What building a StoreSpec from type-checked JSON may still raise, besides its own errors.
_SPEC_ERRORS = (ValueError, TypeError, KeyError, OverflowError, RecursionError)


# -- files: regular, not followed, bounded ------------------------------------------------
def check_root(root: Path) -> None:
    """`root` must be a real directory (not a symlink) that holds a ``manifest.json``."""
    info = _lstat(root, str(root))
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise InvalidStoreError(f"{root} is a symlink; open the directory it points to instead")
    if info is None or not stat.S_ISDIR(info.st_mode):
        raise InvalidStoreError(f"{root} is not a directory")
    if _lstat(root / MANIFEST, MANIFEST) is None:
        raise InvalidStoreError(f"{root} is not an mmreplay store (no {MANIFEST})")


def check_dir(root: Path, name: str, *, required: bool) -> None:
    """``root/name`` must be a real directory (or absent, when not `required`)."""
    info = _lstat(root / name, name)
    if info is None:
        if required:
            raise InvalidStoreError(f"directory {name}/ is missing")
        return
    if not stat.S_ISDIR(info.st_mode):
        raise InvalidStoreError(f"{name} is {_kind(info.st_mode)}; expected a real directory")


def read_small(path: Path, where: str, limit: int) -> bytearray:
    """All bytes of a regular file of at most `limit` bytes."""
    with _open_regular(path, where) as (f, size):
        if size > limit:
            raise InvalidStoreError(f"{where} is {size} bytes, more than the {limit} allowed")
        return _read_exact(f, size, where)


def _lstat(path: Path, where: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidStoreError(f"{where} cannot be examined: {_line(exc)}") from None


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")]
    return next((text for test, text in kinds if test(mode)), "not a regular file")


@contextmanager
def _open_regular(path: Path, where: str) -> Iterator[tuple[Readable, int]]:
    """Open a regular file for reading: never a symlink, FIFO or device, never blocking."""
    info = _lstat(path, where)
    if info is None:
        raise InvalidStoreError(f"{where} is missing")
    if not stat.S_ISREG(info.st_mode):
        raise InvalidStoreError(f"{where} is {_kind(info.st_mode)}; stores hold regular files")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise InvalidStoreError(f"{where} cannot be opened: {_line(exc)}") from None
    with io.FileIO(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped after the lstat
            raise InvalidStoreError(f"{where} is {_kind(info.st_mode)}; stores hold regular files")
        yield f, info.st_size


def _read_exact(f: Readable, size: int, where: str) -> bytearray:
    buf = bytearray(size)
    _read_into(f, memoryview(buf), where)
    return buf


def _read_into(f: Readable, view: memoryview, where: str) -> None:
    got = 0
    try:
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise InvalidStoreError(f"{where} shrank while it was read")
            got += n
    except OSError as exc:
        raise InvalidStoreError(f"{where} cannot be read: {_line(exc)}") from None


def _line(exc: BaseException) -> str:
    """An exception's message on one short line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def safe_path(root: Path, name: Any) -> Path:
    """`root/name` for a manifest-named file; refuses absolute, `..`, odd names and symlinks."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise InvalidStoreError(f"manifest names an invalid file {name!r:.80}")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts) or not name.isprintable():
        raise InvalidStoreError(f"manifest names an invalid file {name!r:.80}")
    for depth in range(1, len(parts)):
        check_dir(root, "/".join(parts[:depth]), required=True)
    path = root.joinpath(*parts)
    info = _lstat(path, name)
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise InvalidStoreError(f"{name} is a symlink; stores never contain symlinks")
    return path


# -- JSON ---------------------------------------------------------------------------------
def parse_json(data: bytes | bytearray, where: str) -> Any:
    """UTF-8 JSON with no duplicate keys, NaN or infinities."""
    try:
        return json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_unique_keys,
                          parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidStoreError(f"{where} is not valid JSON: {_line(exc)}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys in an object")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _strict_equal(a: Any, b: Any) -> bool:
    """JSON equality that tells bools from ints and ints from floats."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_strict_equal, a, b))
    return bool(a == b)


# -- the manifest -------------------------------------------------------------------------
def write_manifest(root: Path, manifest: dict[str, Any], tmp_dir: Path, *,
                   durable: bool) -> None:
    """Atomically replace ``manifest.json``, sealed with its checksum (then fsync the dir)."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    sealed = {**body, CHECKSUM: manifest_checksum(body)}
    data = json.dumps(sealed, indent=1, sort_keys=True, allow_nan=False).encode()
    write_atomic(root / MANIFEST, data, tmp_dir, durable=durable)
    if durable:
        fsync_dir(root)


def manifest_checksum(body: dict[str, Any]) -> int:
    """crc32 of the canonical JSON of a manifest without its checksum field."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return zlib.crc32(text.encode())


def read_manifest(root: Path) -> dict[str, Any]:
    """Load and check ``manifest.json`` on its own (no spec needed); returns it unsealed."""
    if _lstat(root / MANIFEST, MANIFEST) is None:
        raise InvalidStoreError(f"{root} is not an mmreplay store (no {MANIFEST})")
    return parse_manifest(read_small(root / MANIFEST, MANIFEST, MAX_MANIFEST_BYTES))


def parse_manifest(data: bytes | bytearray, where: str = MANIFEST) -> dict[str, Any]:
    """Parse manifest bytes: JSON limits, every field's type and range, the checksum."""
    containers = data.count(b"[") + data.count(b"{")
    if containers > MAX_MANIFEST_CONTAINERS:
        raise InvalidStoreError(f"{where} holds {containers} JSON arrays and objects; a "
                                f"manifest has at most {MAX_MANIFEST_CONTAINERS}")
    manifest = parse_json(data, where)
    check_fields(manifest, where)
    return _unseal(manifest, where)


def _unseal(manifest: dict[str, Any], where: str) -> dict[str, Any]:
    body = {k: v for k, v in manifest.items() if k != CHECKSUM}
    if CHECKSUM in manifest and manifest[CHECKSUM] != manifest_checksum(body):
        raise InvalidStoreError(f"{where} fails its checksum (damaged or edited by hand)")
    return body


def check_fields(manifest: Any, where: str | Path = MANIFEST) -> None:
    """Every field on its own: JSON types, ranges, file names, RNG state."""
    if not isinstance(manifest, dict):
        raise InvalidStoreError(f"{where} must hold a JSON object, got {_json_type(manifest)}")
    if manifest.get("format") != FORMAT:
        raise InvalidStoreError(f"{where} is not an mmreplay manifest")
    _check_version(manifest.get("format_version"), where)
    unknown = sorted(set(manifest) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise InvalidStoreError(f"{where} has unknown fields {unknown[:5]!r:.100}")
    for key, kind in [*REQUIRED.items(), *OPTIONAL.items()]:
        if (key in REQUIRED or key in manifest) and not _is(manifest.get(key), kind):
            raise InvalidStoreError(f"{where}: field {key!r} must be {_kind_name(kind)}, "
                                    f"got {_json_type(manifest.get(key))}")
    for key in ("generation", "next_id", "next_episode"):
        _check_range(where, key, manifest[key], low=1 if key == "generation" else 0)
    _check_cursors(manifest, where)
    _check_names(manifest, where)
    check_rng(manifest["rng"], where)
    _check_optional(manifest, where)


def _check_version(version: Any, where: str | Path) -> None:
    if not _is(version, int):
        raise InvalidStoreError(f"{where}: field 'format_version' must be int, "
                                f"got {_json_type(version)}")
    if version > FORMAT_VERSION:
        raise InvalidStoreError(
            f"{where} has format version {version}, newer than this mmreplay supports "
            f"({FORMAT_VERSION}); upgrade mmreplay")
    if version < 1:
        raise InvalidStoreError(f"{where} has invalid format version {version}")


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    """isinstance for JSON values, where a bool is neither an int nor a float."""
    return isinstance(value, kind) and not isinstance(value, bool)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return "a number" if isinstance(kind, tuple) else kind.__name__


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "bool", int: "int",
            float: "float", type(None): "null"}.get(type(value), type(value).__name__)


def _check_range(where: str | Path, key: str, value: Any, *, low: int = 0,
                 high: int = MAX_COUNTER) -> None:
    if not _is(value, int) or not low <= value <= high:
        raise InvalidStoreError(f"{where}: {key} must be an int in [{low}, {high}], "
                                f"got {value!r:.40}")


def _check_cursors(manifest: dict[str, Any], where: str | Path) -> None:
    for key in ("written", "kept_from", "running"):
        if len(manifest[key]) > MAX_ENVS:
            raise InvalidStoreError(f"{where}: {key} has {len(manifest[key])} entries, more "
                                    f"than the {MAX_ENVS} envs a store can have")
    for key in ("written", "kept_from"):
        for value in manifest[key]:
            _check_range(where, f"every entry of {key!r}", value)
    if not all(isinstance(v, bool) for v in manifest["running"]):
        raise InvalidStoreError(f"{where}: every entry of 'running' must be a bool")


def _check_names(manifest: dict[str, Any], where: str | Path) -> None:
    """Block, tail and crc entries name only ``steps/``, ``prio/`` and ``tail/`` files."""
    gen = manifest["generation"]
    for key, kind in (("blocks", "steps"), ("prio_blocks", "prio")):
        for b, name in enumerate(manifest.get(key, [])):
            if name is not None and _block_name(name, kind, gen) != b:
                raise InvalidStoreError(
                    f"{where}: {key}[{b}] must be null or '{kind}/b{b:06d}.gNNNNNNNN.npy' with "
                    f"1 <= NNNNNNNN <= generation {gen}, got {name!r:.60}")
    if _tail_generation(manifest["tail"]) not in range(1, gen + 1):
        raise InvalidStoreError(f"{where}: tail must be 'tail/tail.gNNNNNNNN.npy' of a past "
                                f"generation, got {manifest['tail']!r:.60}")
    for name, crc in manifest["files"].items():
        if _block_name(name, None, gen) is None and _tail_generation(name) is None:
            raise InvalidStoreError(f"{where}: files names an invalid file {name!r:.60}")
        _check_range(where, f"the crc32 of {name}", crc, high=0xFFFFFFFF)


def _block_name(name: Any, kind: str | None, generation: int) -> int | None:
    """Block number of a valid ``<kind>/bNNNNNN.gNNNNNNNN.npy`` name, else None."""
    match = BLOCK_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None or kind not in (None, match[1]) or not 1 <= int(match[3]) <= generation:
        return None
    return int(match[2])


def _tail_generation(name: Any) -> int | None:
    match = TAIL_NAME.fullmatch(name) if isinstance(name, str) else None
    return int(match[1]) if match else None


def check_rng(state: Any, where: str | Path = MANIFEST) -> None:
    """A PCG64 state exactly as ``Generator.bit_generator.state`` reports it."""
    ok = (isinstance(state, dict) and state.keys() == {"bit_generator", "state", "has_uint32",
                                                       "uinteger"}
          and state["bit_generator"] == "PCG64" and isinstance(state["state"], dict)
          and state["state"].keys() == {"state", "inc"}
          and all(_is(v, int) and 0 <= v < 1 << 128 for v in state["state"].values())
          and state["has_uint32"] in (0, 1) and _is(state["has_uint32"], int)
          and _is(state["uinteger"], int) and 0 <= state["uinteger"] < 1 << 32)
    if not ok:
        raise InvalidStoreError(f"{where}: rng must be a PCG64 state, got {state!r:.80}")


def _check_optional(manifest: dict[str, Any], where: str | Path) -> None:
    if "max_priority" in manifest and not 1.0 <= manifest["max_priority"] < math.inf:
        raise InvalidStoreError(f"{where}: max_priority must be a finite number >= 1")
    if CHECKSUM in manifest:
        _check_range(where, CHECKSUM, manifest[CHECKSUM], high=0xFFFFFFFF)


# -- the manifest against its spec --------------------------------------------------------
def parse_spec(manifest: dict[str, Any]) -> StoreSpec:
    """The manifest's spec, which must be complete and in the form `to_dict` writes."""
    data = manifest["spec"]
    missing = sorted(set(StoreSpec.__dataclass_fields__) - set(data))
    if missing:
        raise InvalidStoreError(f"invalid spec in manifest: fields {missing[:4]} are missing")
    for key in ("obs_dtype", "action_dtype"):
        if key in data and (not isinstance(data[key], str) or data[key] not in ALLOWED_DTYPES):
            raise InvalidStoreError(f"invalid spec in manifest: {key} must be one of "
                                    f"{list(ALLOWED_DTYPES)}, got {data[key]!r:.40}")
    try:
        spec = StoreSpec.from_dict(data)
    except InvalidStoreError:
        raise
    except _SPEC_ERRORS as exc:
        raise InvalidStoreError(f"invalid spec in manifest: {_line(exc)}") from None
    canonical = spec.to_dict()
    bad = [k for k in canonical if not _strict_equal(canonical[k], data.get(k))
           and not (k in ("gamma", "alpha", "priority_eps") and canonical[k] == data.get(k))]
    if bad:
        raise InvalidStoreError(f"invalid spec in manifest: fields {bad[:4]} are not as "
                                f"this spec writes them")
    return spec


def ram_demand(spec: StoreSpec) -> int:
    """Bytes an open of this spec allocates up front (errs high): step columns, masks,
    sampler trees and tables, the RAM tail (and its copy while loading)."""
    slots = spec.num_envs * spec.slots_per_env
    action = np.dtype(spec.action_dtype).itemsize * math.prod(spec.action_shape)
    per_slot = 31 + action + 9  # step record; validity mask and id map
    tree = 48 * (1 << max(slots - 1, 0).bit_length())  # sums, minima, prefix rows
    if spec.sampler != "uniform":
        per_slot += 25 if spec.sampler == "prioritized" else 58  # tables, loaded priorities
    frame = math.prod(spec.obs_shape) * np.dtype(spec.obs_dtype).itemsize
    return slots * per_slot + tree + 2 * spec.num_envs * spec.chunk_frames * frame


def check_ram(spec: StoreSpec, max_ram_bytes: int) -> None:
    demand = ram_demand(spec)
    if demand > max_ram_bytes:
        raise InvalidStoreError(
            f"the manifest's spec (capacity {spec.capacity}, obs_shape {spec.obs_shape}) needs "
            f"{demand / 2**30:.1f} GiB of RAM, more than the {max_ram_bytes / 2**30:.1f} GiB "
            f"allowed; pass a larger max_ram_bytes to open it")


def num_blocks(spec: StoreSpec) -> int:
    return -(-spec.slots_per_env // spec.block_slots)


def check_manifest(manifest: dict[str, Any], spec: StoreSpec) -> None:
    """Fields that depend on each other and on the spec (after `check_fields`)."""
    envs = spec.num_envs
    if not len(manifest["written"]) == len(manifest["kept_from"]) == len(
            manifest["running"]) == envs:
        raise InvalidStoreError(f"manifest: written, kept_from and running must each hold "
                                f"num_envs = {envs} entries")
    pairs = zip(manifest["written"], manifest["kept_from"], manifest["running"], strict=True)
    for env, (written, kept, running) in enumerate(pairs):
        if kept > written or (running and written == 0):
            raise InvalidStoreError(f"manifest cursors of env {env} are inconsistent: written "
                                    f"{written}, kept_from {kept}, running {running}")
    _check_block_lists(manifest, spec)
    named = set(named_layout(manifest, spec))
    if set(manifest["files"]) != named:
        odd = sorted(set(manifest["files"]) ^ named)[:3]
        raise InvalidStoreError(f"manifest files must give the crc32 of exactly the block and "
                                f"tail files it names; differs at {odd}")


def _check_block_lists(manifest: dict[str, Any], spec: StoreSpec) -> None:
    """One entry per block; a block is null iff no env has written a frame into it."""
    prioritized = spec.sampler != "uniform"
    if prioritized != ("prio_blocks" in manifest) or prioritized != ("max_priority" in manifest):
        raise InvalidStoreError(f"manifest of a {spec.sampler!r} store must "
                                f"{'' if prioritized else 'not '}hold prio_blocks/max_priority")
    used = max(min(w, spec.slots_per_env) for w in manifest["written"])
    for key in ("blocks", "prio_blocks") if prioritized else ("blocks",):
        names = manifest[key]
        if len(names) != num_blocks(spec):
            raise InvalidStoreError(f"manifest {key} must list {num_blocks(spec)} block files, "
                                    f"got {len(names)}")
        for b, name in enumerate(names):
            if (name is None) != (used <= b * spec.block_slots):
                raise InvalidStoreError(f"manifest {key}[{b}] is {name!r}, but frames were "
                                        f"written into {used} slots per env")


def named_layout(manifest: dict[str, Any],
                 spec: StoreSpec) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every file the manifest names, with the dtype and shape it must hold."""
    want: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
        manifest["tail"]: (np.dtype(spec.obs_dtype),
                           (spec.num_envs, spec.chunk_frames, *spec.obs_shape))}
    lists = [("blocks", step_dtype(spec)), ("prio_blocks", np.dtype("<f8"))]
    for key, dtype in lists:
        for b, name in enumerate(manifest.get(key, [])):
            if name is not None:
                rows = min(spec.block_slots, spec.slots_per_env - b * spec.block_slots)
                want[name] = (dtype, (spec.num_envs, rows))
    return want


def check_step_columns(steps: np.ndarray, manifest: dict[str, Any]) -> None:
    """Loaded step columns agree with the manifest's counters and cursors.

    Slots holding a frame have ``0 <= episode < next_episode`` and ``pos >= 0``; those
    with a step have ``0 <= id < next_id``, the others id -1; slots never written are blank.
    """
    slots = steps.shape[1]
    held = np.arange(slots)[None, :] < np.minimum(manifest["written"], slots)[:, None]
    has, ids, episode = steps["has_step"], steps["id"], steps["episode"]
    bad = (has & ((ids < 0) | (ids >= manifest["next_id"]))) | (~has & (ids != -1))
    bad |= held & ((episode < 0) | (episode >= manifest["next_episode"]) | (steps["pos"] < 0))
    bad |= ~held & (has | (episode != 0) | (steps["pos"] != 0))
    if bad.any():
        env, slot = np.argwhere(bad)[0].tolist()
        raise InvalidStoreError(
            f"step columns disagree with the manifest at env {env} slot {slot} (ids below "
            f"next_id={manifest['next_id']}, episodes below {manifest['next_episode']})")


# -- zarr metadata ------------------------------------------------------------------------
def check_zarr(root: Path, spec: StoreSpec) -> None:
    """The group's and the frames array's ``zarr.json``, read here with a size limit."""
    group = parse_json(read_small(root / ZARR_JSON, ZARR_JSON, MAX_ZARR_JSON_BYTES), ZARR_JSON)
    check_group_meta(group)
    where = f"{FRAMES}/{ZARR_JSON}"
    meta = parse_json(read_small(root / FRAMES / ZARR_JSON, where, MAX_ZARR_JSON_BYTES), where)
    check_frames_meta(meta, spec, where)


def check_group_meta(meta: Any, where: str = ZARR_JSON) -> None:
    ok = (isinstance(meta, dict)
          and set(meta) <= {"zarr_format", "node_type", "attributes", "consolidated_metadata"}
          and _strict_equal(meta.get("zarr_format"), 3) and meta.get("node_type") == "group"
          and isinstance(meta.get("attributes", {}), dict)
          and meta.get("consolidated_metadata") is None)
    if not ok:
        raise InvalidStoreError(f"{where} is not the zarr v3 group metadata of a store")


def frames_meta(spec: StoreSpec) -> dict[str, Any]:
    """The fields of ``frames/zarr.json`` exactly as ``create_frames_array`` writes them."""
    dtype = np.dtype(spec.obs_dtype)
    endian = {} if dtype.itemsize == 1 else {"configuration": {"endian": "little"}}
    zstd = {"level": spec.codec_level, "checksum": False}
    return {
        "zarr_format": 3, "node_type": "array",
        "shape": [spec.num_envs, spec.slots_per_env, *spec.obs_shape],
        "data_type": spec.obs_dtype,
        "chunk_grid": {"name": "regular",
                       "configuration": {"chunk_shape": [1, spec.chunk_frames, *spec.obs_shape]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "codecs": [{"name": "bytes", **endian}, {"name": "zstd", "configuration": zstd},
                   {"name": "crc32c"}],
        "storage_transformers": [],
    }


def check_frames_meta(meta: Any, spec: StoreSpec, where: str = f"{FRAMES}/{ZARR_JSON}") -> None:
    """Allow-listed codecs and dtype, and the shape, chunks and key encoding of the spec."""
    if not isinstance(meta, dict):
        raise InvalidStoreError(f"{where} must hold a JSON object, got {_json_type(meta)}")
    want = frames_meta(spec)
    unknown = sorted(set(meta) - set(want) - {"fill_value", "attributes", "dimension_names"})
    if unknown:
        raise InvalidStoreError(f"{where} has fields zarr metadata of a store never has: "
                                f"{unknown[:5]!r:.100}")
    meta = {"storage_transformers": [], **meta}
    if want["codecs"][0] == {"name": "bytes"} and _strict_equal(meta.get("codecs"), [
            {"name": "bytes", "configuration": {"endian": "little"}}, *want["codecs"][1:]]):
        want["codecs"][0] = {"name": "bytes", "configuration": {"endian": "little"}}
    for key, value in want.items():
        if not _strict_equal(meta.get(key), value):
            raise InvalidStoreError(f"{where}: {key} is {meta.get(key)!r:.100}, expected "
                                    f"{value!r:.100}")
    _check_frames_extras(meta, spec, where)


def _check_frames_extras(meta: dict[str, Any], spec: StoreSpec, where: str) -> None:
    fill = meta.get("fill_value")
    zero = fill is False if spec.obs_dtype == "bool" else (_is(fill, (int, float)) and fill == 0)
    names = meta.get("dimension_names")
    ndim = 2 + len(spec.obs_shape)
    names_ok = names is None or (isinstance(names, list) and len(names) == ndim and all(
        n is None or isinstance(n, str) for n in names))
    if not (zero and names_ok and isinstance(meta.get("attributes", {}), dict)):
        raise InvalidStoreError(f"{where}: fill_value must be 0, attributes an object and "
                                f"dimension_names null or {ndim} names")


# -- the directory as a whole -------------------------------------------------------------
def check_store_files(root: Path, manifest: dict[str, Any], spec: StoreSpec) -> None:
    """Everything an open reads, checked before it allocates: directories, zarr metadata,
    frame chunk files, and the header and size of every named ``.npy`` file."""
    check_dir(root, FRAMES, required=True)
    for name in (*STEP_DIRS, TMP_DIR):
        check_dir(root, name, required=False)
    check_zarr(root, spec)
    check_frames_dir(root, spec)
    for name, (dtype, shape) in named_layout(manifest, spec).items():
        with _open_regular(safe_path(root, name), name) as (f, size):
            _check_npy_header(f, size, name, dtype, shape)


def max_chunk_bytes(spec: StoreSpec) -> int:
    """Largest valid chunk file: zstd's compress bound of a raw chunk, plus the crc32c."""
    raw = spec.chunk_frames * math.prod(spec.obs_shape) * np.dtype(spec.obs_dtype).itemsize
    return raw + (raw >> 8) + max(0, (128 << 10) - raw) // 2048 + 4 + 512


def check_frames_dir(root: Path, spec: StoreSpec) -> None:
    """Every entry of ``frames/`` is a regular file no larger than a chunk can be."""
    limit = max_chunk_bytes(spec)
    try:
        with os.scandir(root / FRAMES) as entries:
            for entry in entries:
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    raise InvalidStoreError(f"{FRAMES}/{entry.name!r:.60} is "
                                            f"{_kind(info.st_mode)}; stores hold regular files")
                if info.st_size > limit and entry.name != ZARR_JSON:
                    raise InvalidStoreError(f"frame chunk {FRAMES}/{entry.name!r:.60} is "
                                            f"{info.st_size} bytes; a chunk holds at most {limit}")
    except OSError as exc:
        raise InvalidStoreError(f"{FRAMES}/ cannot be listed: {_line(exc)}") from None


# -- .npy files ---------------------------------------------------------------------------
def save_npy(root: Path, name: str, array: np.ndarray, tmp_dir: Path, *, durable: bool) -> int:
    """Write `array` as ``root/name`` (.npy, no pickle); returns its crc32."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    data = buf.getvalue()
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, tmp_dir, durable=durable)
    return zlib.crc32(data)


def load_npy(root: Path, name: str, crc: Any, *, dtype: np.dtype,
             shape: tuple[int, ...]) -> np.ndarray:
    """Read a small file the manifest names: header (dtype, shape) first, then at most the
    bytes that header implies, then crc32 and exact size."""
    with _open_regular(safe_path(root, name), name) as (f, size):
        head = _read_exact(f, min(size, MAX_NPY_HEADER + 64), name)
        offset = _check_npy_header(io.BytesIO(head), size, name, dtype, shape)
        data = bytearray(size)
        data[:len(head)] = head
        _read_into(f, memoryview(data)[len(head):], name)
    if zlib.crc32(data) != crc:
        raise InvalidStoreError(f"{name} fails its crc32 checksum (damaged or replaced)")
    if size != offset + dtype.itemsize * math.prod(shape):
        raise InvalidStoreError(f"{name} is {size} bytes, not the size its header implies")
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape)


def _check_npy_header(f: Readable, size: int, name: str, dtype: np.dtype,
                      shape: tuple[int, ...]) -> int:
    """Check a .npy header against the expected dtype and shape; returns the data offset.

    Refuses files larger than that header implies, so nothing big is ever read.
    """
    got_shape, fortran, got_dtype = _read_npy_header(f, name)
    if got_dtype.hasobject or got_dtype != dtype or tuple(got_shape) != shape or fortran:
        order = " (Fortran order)" if fortran else ""
        raise InvalidStoreError(f"{name} holds {got_dtype}{tuple(got_shape)!r:.60}{order}, "
                                f"expected {dtype}{shape}")
    offset = f.tell()
    if size > offset + dtype.itemsize * math.prod(shape):
        raise InvalidStoreError(f"{name} is {size} bytes, more than its header implies")
    return offset


def _read_npy_header(f: Readable, name: str) -> tuple[Any, bool, np.dtype]:
    head = io.BytesIO(f.read(MAX_NPY_HEADER + 64))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # headers that need Python 2 repair are refused
            version = npy_format.read_magic(head)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy format version {version}")
            reader = (npy_format.read_array_header_1_0 if version == (1, 0)
                      else npy_format.read_array_header_2_0)
            got_shape, fortran, got_dtype = reader(head, max_header_size=MAX_NPY_HEADER)
    except Exception as exc:  # noqa: BLE001 -- numpy parses untrusted bytes (ast, tokenize,
        # dtype); whatever it raises means the header is not one a store writes
        raise InvalidStoreError(f"{name} is not a valid .npy file: {_line(exc)}") from None
    f.seek(head.tell())
    return got_shape, fortran, got_dtype
