"""What a store directory must look like: zarr metadata and the files beside the manifest.

An open compares ``zarr.json`` of the group and of the frames array field by
field with what the spec implies (zarr itself parses nothing), and checks that
``frames/`` holds only regular frame files no larger than one chunk (or shard) can encode to.
A ``"zstd-dict"`` store's dictionary file is checked against the manifest's record, and
``zarr.json`` must carry exactly those bytes.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import InvalidStoreError
from mmreplay.spec import StoreSpec
from mmreplay.storage.frame_store import FRAMES, max_file_bytes
from mmreplay.storage.manifest import STEP_DIRS, named_layout
from mmreplay.storage.safe_io import (
    TMP_DIR,
    check_dir,
    check_npy_header,
    error_line,
    file_kind,
    is_json,
    json_type,
    open_regular,
    parse_json,
    read_small,
    safe_path,
    strict_equal,
)
from mmreplay.storage.zstd_dict import NAME as ZSTD_DICT_CODEC
from mmreplay.storage.zstd_dict import configuration, read_dictionary, with_dictionary

ZARR_JSON = "zarr.json"
MAX_ZARR_JSON_BYTES = 1 << 20


# -- zarr metadata ------------------------------------------------------------------------
def check_zarr(root: Path, spec: StoreSpec, dictionary: bytes | None = None) -> None:
    """The group's and the frames array's ``zarr.json``, read here with a size limit."""
    group = parse_json(read_small(root / ZARR_JSON, ZARR_JSON, MAX_ZARR_JSON_BYTES), ZARR_JSON)
    check_group_meta(group)
    where = f"{FRAMES}/{ZARR_JSON}"
    meta = parse_json(read_small(root / FRAMES / ZARR_JSON, where, MAX_ZARR_JSON_BYTES), where)
    check_frames_meta(meta, spec, where, dictionary)


def store_dictionary(root: Path, manifest: dict[str, Any]) -> bytes | None:
    """The dictionary of a "zstd-dict" store, checked against its manifest's record; None
    for other codecs and before one was trained."""
    record = manifest.get("dictionary")
    return None if record is None else read_dictionary(root, record)


def check_group_meta(meta: Any, where: str = ZARR_JSON) -> None:
    ok = (isinstance(meta, dict)
          and set(meta) <= {"zarr_format", "node_type", "attributes", "consolidated_metadata"}
          and strict_equal(meta.get("zarr_format"), 3) and meta.get("node_type") == "group"
          and isinstance(meta.get("attributes", {}), dict)
          and meta.get("consolidated_metadata") is None)
    if not ok:
        raise InvalidStoreError(f"{where} is not the zarr v3 group metadata of a store")


def frames_meta(spec: StoreSpec, dictionary: bytes | None = None) -> dict[str, Any]:
    """The fields of ``frames/zarr.json`` exactly as ``create_frames_array`` writes them
    (and a "zstd-dict" store rewrites them once its dictionary exists)."""
    dtype = np.dtype(spec.obs_dtype)
    endian = {} if dtype.itemsize == 1 else {"configuration": {"endian": "little"}}
    chunk = [1, spec.chunk_frames, *spec.obs_shape]
    codecs: list[dict[str, Any]] = [{"name": "bytes", **endian}, compressor_meta(spec, dictionary),
                                    {"name": "crc32c"}]
    if spec.shard_chunks > 1:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": chunk, "codecs": codecs,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}],
            "index_location": "end"}}]
        chunk = [1, spec.chunk_frames * spec.shard_chunks, *spec.obs_shape]
    return {
        "zarr_format": 3, "node_type": "array",
        "shape": [spec.num_envs, spec.slots_per_env, *spec.obs_shape],
        "data_type": spec.obs_dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "codecs": codecs,
        "storage_transformers": [],
    }


def compressor_meta(spec: StoreSpec, dictionary: bytes | None = None) -> dict[str, Any]:
    """The compressor entry of ``frames/zarr.json`` for the spec's codec."""
    if spec.codec == "zstd-dict":
        return {"name": ZSTD_DICT_CODEC,
                "configuration": configuration(spec.codec_level, dictionary)}
    if spec.codec == "zstd":
        return {"name": "zstd", "configuration": {"level": spec.codec_level, "checksum": False}}
    return {"name": "blosc", "configuration": {"typesize": 1, "cname": spec.codec,
                                               "clevel": spec.codec_level,
                                               "shuffle": "noshuffle", "blocksize": 0}}


def check_frames_meta(meta: Any, spec: StoreSpec, where: str = f"{FRAMES}/{ZARR_JSON}",
                      dictionary: bytes | None = None) -> None:
    """Allow-listed codecs and dtype, and the shape, chunks and key encoding of the spec.

    A "zstd-dict" store's codec carries `dictionary`; with none recorded (none trained, or
    one trained but not yet committed when a writer stopped) it may carry any, unused."""
    if not isinstance(meta, dict):
        raise InvalidStoreError(f"{where} must hold a JSON object, got {json_type(meta)}")
    want = frames_meta(spec, dictionary)
    if dictionary is None and spec.codec == "zstd-dict":
        want = _with_uncommitted_dictionary(want, meta)
    unknown = sorted(set(meta) - set(want) - {"fill_value", "attributes", "dimension_names"})
    if unknown:
        raise InvalidStoreError(f"{where} has fields zarr metadata of a store never has: "
                                f"{unknown[:5]!r:.100}")
    meta = {"storage_transformers": [], **meta}
    if spec.shard_chunks == 1 and want["codecs"][0] == {"name": "bytes"} and strict_equal(
            meta.get("codecs"), [{"name": "bytes", "configuration": {"endian": "little"}},
                                 *want["codecs"][1:]]):
        want["codecs"][0] = {"name": "bytes", "configuration": {"endian": "little"}}
    for key, value in want.items():
        if not strict_equal(meta.get(key), value):
            raise InvalidStoreError(f"{where}: {key} is {meta.get(key)!r:.100}, expected "
                                    f"{value!r:.100}")
    _check_frames_extras(meta, spec, where)


def _with_uncommitted_dictionary(want: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """`want` with the dictionary `meta`'s codec holds, if it holds valid base64."""
    text = _dictionary_text(meta.get("codecs"))
    try:
        return want if text is None else with_dictionary(want, base64.b64decode(
            text, validate=True))
    except (binascii.Error, ValueError):
        return want


def _dictionary_text(codecs: Any) -> str | None:
    for codec in codecs if isinstance(codecs, list) else []:
        config = codec.get("configuration") if isinstance(codec, dict) else None
        if not isinstance(config, dict):
            continue
        if codec.get("name") == "sharding_indexed":
            return _dictionary_text(config.get("codecs"))
        if codec.get("name") == ZSTD_DICT_CODEC and isinstance(config.get("dictionary"), str):
            return str(config["dictionary"])
    return None


def _check_frames_extras(meta: dict[str, Any], spec: StoreSpec, where: str) -> None:
    fill = meta.get("fill_value")
    zero = fill is False if spec.obs_dtype == "bool" else (
        is_json(fill, (int, float)) and fill == 0)
    names = meta.get("dimension_names")
    ndim = 2 + len(spec.obs_shape)
    names_ok = names is None or (isinstance(names, list) and len(names) == ndim and all(
        n is None or isinstance(n, str) for n in names))
    if not (zero and names_ok and isinstance(meta.get("attributes", {}), dict)):
        raise InvalidStoreError(f"{where}: fill_value must be 0, attributes an object and "
                                f"dimension_names null or {ndim} names")


# -- the directory as a whole -------------------------------------------------------------
def check_store_files(root: Path, manifest: dict[str, Any], spec: StoreSpec) -> bytes | None:
    """Everything an open reads, checked before it allocates: directories, zarr metadata,
    frame files, the dictionary, and the header and size of every named ``.npy`` file.
    Returns the store's dictionary (None for codecs without one)."""
    check_dir(root, FRAMES, required=True)
    for name in (*STEP_DIRS, TMP_DIR):
        check_dir(root, name, required=False)
    dictionary = store_dictionary(root, manifest)
    check_zarr(root, spec, dictionary)
    check_frames_dir(root, spec)
    for name, (dtype, shape) in named_layout(manifest, spec).items():
        with open_regular(safe_path(root, name), name) as (f, size):
            check_npy_header(f, size, name, dtype, shape)
    return dictionary


def check_frames_dir(root: Path, spec: StoreSpec) -> None:
    """Every entry of ``frames/`` is a regular file no larger than a chunk (or a shard of
    them) can be."""
    limit = max_file_bytes(spec)
    try:
        with os.scandir(root / FRAMES) as entries:
            for entry in entries:
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    raise InvalidStoreError(f"{FRAMES}/{entry.name!r:.60} is "
                                            f"{file_kind(info.st_mode)}; stores hold regular files")
                if info.st_size > limit and entry.name != ZARR_JSON:
                    raise InvalidStoreError(f"frame file {FRAMES}/{entry.name!r:.60} is "
                                            f"{info.st_size} bytes; a frame file holds at most "
                                            f"{limit}")
    except OSError as exc:
        raise InvalidStoreError(f"{FRAMES}/ cannot be listed: {error_line(exc)}") from None


