"""The versioned on-disk metadata of a store, and every check an open makes before trusting it.

``manifest.json`` is the commit point: it is written to a temp file and renamed
into place only after every file it names is complete, so a reader sees either
the previous generation or the new one. It holds the spec, cursors, RNG state,
for each small ``.npy`` file (step blocks, RAM tail) its crc32, and its own
``checksum`` (crc32 of its canonical JSON without that field; manifests written
before it existed have none and are still read). A ``"zstd-dict"`` store's manifest (format
4) records its dictionary file's size and crc32c (``dictionary``; see `zstd_dict`) once the
dictionary exists. It never touches frame bytes.

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

Every problem is an `InvalidStoreError` with a one-line message. The file-level
rules live in `safe_io`, the zarr metadata and directory checks in `layout`; this
module owns the manifest's fields and their consistency with the spec.
"""

from __future__ import annotations

import json
import math
import re
import stat
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import InvalidStoreError
from mmreplay.index.ring import step_dtype
from mmreplay.spec import ALLOWED_DTYPES, DICT_FIELDS, StoreSpec
from mmreplay.storage.safe_io import (
    error_line,
    fsync_dir,
    is_json,
    json_type,
    lstat_or_none,
    parse_json,
    read_small,
    strict_equal,
    write_atomic,
)
from mmreplay.storage.zstd_dict import check_record

MANIFEST = "manifest.json"
FORMAT = "mmreplay"
FORMAT_VERSION = 5  # the newest this version reads (4: codec "zstd-dict"; 5: "lz4hc")
CHECKSUM = "checksum"
MAX_MANIFEST_BYTES = 16 << 20  # ~200k step blocks; parsing it costs at most ~250 MB
MAX_MANIFEST_CONTAINERS = 100  # a manifest has 13 JSON arrays and objects, +1 +2 per extra
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
    "prio_blocks": list, "max_priority": (int, float), CHECKSUM: int, "rate_limiter": dict,
    "dictionary": dict,
}
MAX_RATE_LIMITER_FIELDS = 32  # a rate limiter's counters: a flat object of numbers
BLOCK_NAME = re.compile(r"(steps|prio)/b([0-9]{6,12})\.g([0-9]{8,19})\.npy")
TAIL_NAME = re.compile(r"tail/tail\.g([0-9]{8,19})\.npy")
# What building a StoreSpec from type-checked JSON may still raise, besides its own errors.
_SPEC_ERRORS = (ValueError, TypeError, KeyError, OverflowError, RecursionError)


def check_root(root: Path) -> None:
    """`root` must be a real directory (not a symlink) that holds a ``manifest.json``."""
    info = lstat_or_none(root, str(root))
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise InvalidStoreError(f"{root} is a symlink; open the directory it points to instead")
    if info is None or not stat.S_ISDIR(info.st_mode):
        raise InvalidStoreError(f"{root} is not a directory")
    if lstat_or_none(root / MANIFEST, MANIFEST) is None:
        raise InvalidStoreError(f"{root} is not an mmreplay store (no {MANIFEST})")


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
    if lstat_or_none(root / MANIFEST, MANIFEST) is None:
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
        raise InvalidStoreError(f"{where} must hold a JSON object, got {json_type(manifest)}")
    if manifest.get("format") != FORMAT:
        raise InvalidStoreError(f"{where} is not an mmreplay manifest")
    _check_version(manifest.get("format_version"), where)
    unknown = sorted(set(manifest) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise InvalidStoreError(f"{where} has unknown fields {unknown[:5]!r:.100}")
    for key, kind in [*REQUIRED.items(), *OPTIONAL.items()]:
        if (key in REQUIRED or key in manifest) and not is_json(manifest.get(key), kind):
            raise InvalidStoreError(f"{where}: field {key!r} must be {_kind_name(kind)}, "
                                    f"got {json_type(manifest.get(key))}")
    for key in ("generation", "next_id", "next_episode"):
        _check_range(where, key, manifest[key], low=1 if key == "generation" else 0)
    _check_cursors(manifest, where)
    _check_names(manifest, where)
    check_rng(manifest["rng"], where)
    _check_optional(manifest, where)


def _check_version(version: Any, where: str | Path) -> None:
    if not is_json(version, int):
        raise InvalidStoreError(f"{where}: field 'format_version' must be int, "
                                f"got {json_type(version)}")
    if version > FORMAT_VERSION:
        raise InvalidStoreError(
            f"{where} has format version {version}, newer than this mmreplay supports "
            f"({FORMAT_VERSION}); upgrade mmreplay")
    if version < 1:
        raise InvalidStoreError(f"{where} has invalid format version {version}")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return "a number" if isinstance(kind, tuple) else kind.__name__


def _check_range(where: str | Path, key: str, value: Any, *, low: int = 0,
                 high: int = MAX_COUNTER) -> None:
    if not is_json(value, int) or not low <= value <= high:
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
          and all(is_json(v, int) and 0 <= v < 1 << 128 for v in state["state"].values())
          and state["has_uint32"] in (0, 1) and is_json(state["has_uint32"], int)
          and is_json(state["uinteger"], int) and 0 <= state["uinteger"] < 1 << 32)
    if not ok:
        raise InvalidStoreError(f"{where}: rng must be a PCG64 state, got {state!r:.80}")


def _check_optional(manifest: dict[str, Any], where: str | Path) -> None:
    if "max_priority" in manifest and not 1.0 <= manifest["max_priority"] < math.inf:
        raise InvalidStoreError(f"{where}: max_priority must be a finite number >= 1")
    if CHECKSUM in manifest:
        _check_range(where, CHECKSUM, manifest[CHECKSUM], high=0xFFFFFFFF)
    if "rate_limiter" in manifest:
        check_rate_limiter(manifest["rate_limiter"], where)
    if "dictionary" in manifest:
        check_record(manifest["dictionary"], where)


def check_rate_limiter(state: dict[str, Any], where: str | Path = MANIFEST) -> None:
    """A rate limiter's committed counters: a small flat object of finite numbers and
    booleans (their meaning is checked by the limiter that takes them)."""
    if len(state) > MAX_RATE_LIMITER_FIELDS or not all(
            isinstance(v, bool) or (is_json(v, (int, float)) and math.isfinite(v))
            for v in state.values()):
        raise InvalidStoreError(f"{where}: rate_limiter must be at most "
                                f"{MAX_RATE_LIMITER_FIELDS} finite numbers or booleans, got "
                                f"{state!r:.80}")


# -- the manifest against its spec --------------------------------------------------------
def parse_spec(manifest: dict[str, Any]) -> StoreSpec:
    """The manifest's spec, which must be complete and in the form `to_dict` writes."""
    data = manifest["spec"]
    missing = sorted(set(StoreSpec.__dataclass_fields__) - set(data)
                     - {"shard_chunks", "extras", *DICT_FIELDS})
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
        raise InvalidStoreError(f"invalid spec in manifest: {error_line(exc)}") from None
    canonical = spec.to_dict()
    bad = [k for k in canonical if not strict_equal(canonical[k], data.get(k))
           and not (k in ("gamma", "alpha", "priority_eps") and canonical[k] == data.get(k))]
    if bad or set(data) != set(canonical):
        bad = bad or sorted(set(data) ^ set(canonical))
        raise InvalidStoreError(f"invalid spec in manifest: fields {bad[:4]} are not as "
                                f"this spec writes them")
    if manifest["format_version"] != spec.format_version:
        raise InvalidStoreError(
            f"manifest says format version {manifest['format_version']}, but its spec is of "
            f"format {spec.format_version} (shard_chunks={spec.shard_chunks})")
    return spec


def ram_demand(spec: StoreSpec) -> int:
    """Bytes an open of this spec allocates up front (errs high): step columns, masks,
    sampler trees and tables, the RAM tail (and its copy while loading)."""
    slots = spec.num_envs * spec.slots_per_env
    action = np.dtype(spec.action_dtype).itemsize * math.prod(spec.action_shape)
    per_slot = 31 + action + spec.extra_bytes + 9 + 17  # step record; masks, id map; step ordinals
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
    _check_dictionary(manifest, spec)
    named = set(named_layout(manifest, spec))
    if set(manifest["files"]) != named:
        odd = sorted(set(manifest["files"]) ^ named)[:3]
        raise InvalidStoreError(f"manifest files must give the crc32 of exactly the block and "
                                f"tail files it names; differs at {odd}")


def _check_dictionary(manifest: dict[str, Any], spec: StoreSpec) -> None:
    """Only a "zstd-dict" store has a dictionary, and it has one once a chunk is on disk."""
    has = "dictionary" in manifest
    if has and spec.codec != "zstd-dict":
        raise InvalidStoreError(f"manifest of a {spec.codec!r} store records a dictionary")
    if not has and spec.codec == "zstd-dict" and max(manifest["written"]) >= spec.chunk_frames:
        raise InvalidStoreError("manifest of a 'zstd-dict' store with frame chunks on disk "
                                "records no dictionary")


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


def committed_generation(root: Path) -> int | None:
    """Generation of the manifest on disk now; None if it cannot be read."""
    try:
        return int(read_manifest(root)["generation"])
    except (OSError, InvalidStoreError):
        return None
