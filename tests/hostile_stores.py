"""Small valid stores and malformed directories made from them, for the hostile-input tests.

`build_store` records a small store of one of three kinds (``uniform``: 2 envs, uint8 frames,
wrapped rings; ``prio``: 1 env, uint16 frames, prioritized; ``zstd_dict``: like ``uniform``
with codec "zstd-dict", format 4, a dictionary in ``zstd.dict``). `cases` lists several hundred
`Case`s, each a named damage applied to a fresh copy of a valid store: malformed manifests
(bytes, JSON types of every field, spec fields, version skew, names), zarr metadata, ``.npy``
headers (pickles with a canary, huge shapes), symlinks, FIFOs and huge files. Every case must be
refused by ``ReplayStore.open`` in the listed modes without touching anything outside the root.

Run as a script (``python hostile_stores.py PATH...``) it opens each store in both modes and
prints JSON with the outcome, time and memory of each: the RSS check runs out of process.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import resource
import shutil
import sys
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.lib.format as npy_format

from mmreplay import ReplayStore
from mmreplay.storage.manifest import manifest_checksum

GiB = 1 << 30
BAD_JSON = [None, True, False, 0, -1, 1.5, "x", "", [], {}, [None], {"a": 1}, 2**64, -(2**70)]


# -- valid stores -----------------------------------------------------------------------
def build_store(path: Path, kind: str) -> None:
    """A small valid store: ``uniform`` (2 envs, wrapped, shard files; ``zstd_dict`` and
    ``lz4hc`` the same with those codecs) or ``prio`` (prioritized, uint16, a file per
    chunk)."""
    rng = np.random.default_rng(11)
    if kind in ("uniform", "zstd_dict", "lz4hc"):
        codec = {"zstd_dict": {"codec": "zstd-dict", "dict_bytes": 1024, "dict_train_chunks": 4},
                 "lz4hc": {"codec": "lz4hc"}}.get(kind, {})
        store = ReplayStore.create(path, capacity=24, obs_shape=(4, 3), num_envs=2,
                                   frame_stack=2, n_step=2, gamma=0.9, chunk_frames=4,
                                   block_slots=5, seed=7, **codec)
        shape, dtype, envs, steps = (2, 4, 3), np.uint8, 2, 30
    else:
        store = ReplayStore.create(path, capacity=20, obs_shape=(3,), obs_dtype=np.uint16,
                                   frame_stack=3, n_step=3, chunk_frames=3, block_slots=4,
                                   sampler="prioritized", seed=5, shard_chunks=1)  # format 1
        shape, dtype, envs, steps = (3,), np.uint16, 1, 40
    store.reset(rng.integers(0, 255, shape).astype(dtype))
    done = np.zeros(envs, bool)
    for i in range(steps):
        term, trunc = rng.random(envs) < 0.15, rng.random(envs) < 0.05
        args = (rng.integers(0, 6, envs), rng.normal(size=envs).round(3), term, trunc)
        if envs == 1:
            args = tuple(a[0] for a in args)
        obs = rng.integers(0, 255, shape).astype(dtype)
        store.add(args[0], args[1], obs, args[2], args[3],
                  autoreset=done if envs > 1 else bool(done[0]))
        done = term | trunc
        if kind == "prio" and i % 7 == 6 and len(store):
            batch = store.sample(4)
            store.update_priorities(batch.ids, rng.random(4) * 3)
    store.close()
    (path / "lock").unlink()


# -- helpers for damage -------------------------------------------------------------------
@dataclass(frozen=True)
class Env:
    """Where a case works: the store to damage and a sibling that must stay untouched."""

    root: Path
    outside: Path
    canary: Path


@dataclass(frozen=True)
class Case:
    name: str
    damage: Callable[[Env], None]
    base: str = "uniform"
    modes: tuple[str, ...] = ("r", "r+")
    huge: bool = False  # measured out of process (RSS)


def manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / "manifest.json").read_text())


def save_manifest(root: Path, m: dict[str, Any], *, seal: bool = True) -> None:
    """Write a manifest; `seal` recomputes its checksum so the damage itself is what is seen."""
    if seal:
        body = {k: v for k, v in m.items() if k != "checksum"}
        m = {**body, "checksum": manifest_checksum(body)}
    (root / "manifest.json").write_text(json.dumps(m, indent=1))


def edit(fn: Callable[[dict[str, Any]], Any], *, seal: bool = True) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        m = manifest(env.root)
        fn(m)
        save_manifest(env.root, m, seal=seal)
    return damage


def set_path(keys: tuple[Any, ...], value: Any, *, seal: bool = True) -> Callable[[Env], None]:
    """Set (or, with value DELETE, remove) one nested manifest field."""
    def fn(m: dict[str, Any]) -> None:
        node = m
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return edit(fn, seal=seal)


DELETE = object()


def write_bytes(rel: str, data: bytes) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        (env.root / rel).write_bytes(data)
    return damage


def named(env: Env, what: str) -> str:
    """A file the manifest names: ``block``, ``tail``, ``prio`` or ``chunk`` (a kept one)."""
    m = manifest(env.root)
    if what == "chunk":
        return "frames/" + sorted(p.name for p in (env.root / "frames").glob("c.*"))[0]
    return {"block": m["blocks"][1], "tail": m["tail"],
            "prio": (m.get("prio_blocks") or [None, None])[1]}[what]


def replace_named(what: str, data: Callable[[Env, str], bytes], *,
                  reseal: bool = True) -> Callable[[Env], None]:
    """Replace a named .npy file and (if `reseal`) its crc in the manifest."""
    def damage(env: Env) -> None:
        name = named(env, what)
        blob = data(env, name)
        (env.root / name).write_bytes(blob)
        if reseal:
            m = manifest(env.root)
            m["files"][name] = zlib.crc32(blob)
            save_manifest(env.root, m)
    return damage


def npy_bytes(array: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def npy_header(header: str | dict[str, Any], payload: bytes = b"",
               version: tuple[int, int] = (1, 0)) -> bytes:
    """A .npy file with an arbitrary header (a dict, or raw header text)."""
    text = repr(header) if isinstance(header, dict) else header
    text += " " * (63 - (len(text) + 10) % 64) + "\n"
    size = len(text).to_bytes(2 if version == (1, 0) else 4, "little")
    return npy_format.magic(*version) + size + text.encode("latin1") + payload


class Canary:
    """Unpickling this creates the file `path`: it proves nothing was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def canary_npy(env: Env, name: str) -> bytes:
    return npy_bytes(np.array([Canary(env.canary)], dtype=object), allow_pickle=True)


def sparse(rel: str, size: int = 8 * GiB,
           head: Callable[[Env, str], bytes] | None = None) -> Callable[[Env], None]:
    """Replace a file by a sparse one of `size` bytes (optionally starting with `head`)."""
    def damage(env: Env) -> None:
        name = named(env, rel) if rel in ("block", "tail", "prio", "chunk") else rel
        path = env.root / name
        data = head(env, name) if head else b""
        path.unlink()
        with open(path, "wb") as f:
            f.write(data)
            f.truncate(size)
    return damage


# -- cases --------------------------------------------------------------------------------
def cases() -> list[Case]:
    out = [*manifest_byte_cases(), *field_cases(), *spec_cases(), *cursor_cases(),
           *name_cases(), *rng_cases(), *version_cases(), *zarr_cases(), *npy_cases(),
           *link_cases(), *fifo_cases(), *huge_cases(), *dict_cases()]
    names = [c.name for c in out]
    assert len(names) == len(set(names)), "case names must be unique"
    return out


def manifest_byte_cases() -> Iterator[Case]:
    small = [b"", b" \n", b"null", b"[]", b"{}", b"0", b'"mmreplay"', b"true", b"\x00" * 64,
             b'{"format": "mmreplay"}', b'{"format": "mmreplay", "format_version": 1}']
    for i, data in enumerate(small):
        yield Case(f"manifest-small-{i}", write_bytes("manifest.json", data))
    rng = np.random.default_rng(1)
    for i in range(12):
        yield Case(f"manifest-garbage-{i}", write_bytes(
            "manifest.json", rng.integers(0, 256, int(rng.integers(1, 4096)), np.uint8).tobytes()))
    for i, frac in enumerate(np.linspace(0.02, 0.98, 16)):
        yield Case(f"manifest-truncated-{i}", _truncate_manifest(float(frac)))
    yield Case("manifest-twice", _manifest_transform(lambda t: t + t))
    yield Case("manifest-duplicate-key", _manifest_transform(
        lambda t: t.replace('"next_id"', '"next_id": 0,\n "next_id"', 1)))
    yield Case("manifest-utf16", _manifest_transform(lambda t: t, encoding="utf-16"))
    yield Case("manifest-bad-utf8", _manifest_transform(
        lambda t: t.replace('"mmreplay"', '"mm\udcffreplay"'), errors="surrogateescape"))
    yield Case("manifest-nan", _manifest_transform(lambda t: t.replace("0.9", "NaN", 1)))
    yield Case("manifest-infinity", _manifest_transform(lambda t: t.replace("0.9", "1e999", 1)))
    yield Case("manifest-trailing-garbage", _manifest_transform(lambda t: t + "\nx"))
    yield Case("manifest-bigint", _manifest_transform(
        lambda t: re.sub(r'"next_id": [0-9]+', '"next_id": ' + "9" * 5000, t)))
    yield Case("manifest-unsealed-edit", set_path(("next_episode",), 13, seal=False))
    yield Case("manifest-checksum-wrong", set_path(("checksum",), 12345, seal=False))
    yield Case("manifest-is-dir", _replace_with_dir("manifest.json"))
    yield Case("manifest-missing", lambda env: (env.root / "manifest.json").unlink())


def _manifest_transform(fn: Callable[[str], str], *, encoding: str = "utf-8",
                        errors: str = "strict") -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        path = env.root / "manifest.json"
        path.write_bytes(fn(path.read_text()).encode(encoding, errors))
    return damage


def _truncate_manifest(frac: float) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        path = env.root / "manifest.json"
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * frac)])
    return damage


def _replace_with_dir(rel: str) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        name = named(env, rel) if rel in ("block", "tail", "prio", "chunk") else rel
        (env.root / name).unlink()
        (env.root / name).mkdir()
    return damage


def field_cases() -> Iterator[Case]:
    """Every top-level field: each wrong JSON type or value, and its absence."""
    keys = ["format", "format_version", "generation", "spec", "written", "kept_from", "running",
            "next_id", "next_episode", "rng", "blocks", "tail", "files"]
    for key in keys:
        yield Case(f"field-{key}-missing", set_path((key,), DELETE))
        for i, value in enumerate(BAD_JSON):
            yield Case(f"field-{key}-bad{i}", set_path((key,), value))
    for key in ("prio_blocks", "max_priority"):
        yield Case(f"field-{key}-missing", set_path((key,), DELETE), base="prio")
        for i, value in enumerate([None, True, "x", [], {}, 0.5, -1, [None] * 5]):
            yield Case(f"field-{key}-bad{i}", set_path((key,), value), base="prio")
    yield Case("field-max_priority-in-uniform", set_path(("max_priority",), 1.0))
    yield Case("field-unknown", set_path(("pickle",), "cos\nsystem\n"))
    for i, value in enumerate(["1", 1.5, None, True, -1, 2**32]):
        yield Case(f"field-checksum-bad{i}", set_path(("checksum",), value, seal=False))


SPEC_BAD: dict[str, list[Any]] = {
    "capacity": [0, 1, 23, 2**41, 1.5, "24", None, True],
    "obs_shape": [[], [4], [4, 3, 1], [0, 3], [-4, 3], [2**21, 3], "4,3", [4.0, 3], [[4], 3],
                  None, [1] * 9],
    "obs_dtype": ["object", "O", "|O", "<u1", "uint16", "V12", "S4", "str", "float128", 0, None,
                  ["uint8"], {"names": ["a"], "formats": ["O"]}, "(2147483647,)u1"],
    "num_envs": [0, 1, 3, -1, 2**21, True, "2", None],
    "frame_stack": [0, 65, 1.0, None, "2", True],
    "n_step": [0, 1001, None, True, 2.0],
    "gamma": [-0.1, 1.5, None, "0.9", True, [0.9]],
    "stack_padding": ["none", 0, None, ["zero"]],
    "action_shape": [[0], [-1], "x", None, [2**21], [1] * 9, [2]],
    "action_dtype": ["object", "O", "int", None, 5, "float128", "<i8", "int32"],
    "chunk_frames": [-1, 2**17, None, 0, 3, 8],
    "codec": ["gzip", "pickle", None, 1],
    "codec_level": [-6, 23, None, 1.5, True, 2],
    "block_slots": [0, 2**25, None, 4, 6],
    "sampler": ["prioritized", "rank", "x", None],
    "alpha": [-1, 11, None, "0.6"],
    "priority_eps": [-1, 2e6, None],
}


def spec_cases() -> Iterator[Case]:
    for key, values in SPEC_BAD.items():
        yield Case(f"spec-{key}-missing", set_path(("spec", key), DELETE))
        for i, value in enumerate(values):
            yield Case(f"spec-{key}-bad{i}", set_path(("spec", key), value))
    yield Case("spec-unknown-field", set_path(("spec", "pickle"), 1))
    yield Case("spec-prio-as-uniform", set_path(("spec", "sampler"), "uniform"), base="prio")


def cursor_cases() -> Iterator[Case]:
    bad = {
        "written": [[31], [31, 31, 31], [-1, 31], [2**63, 31], [31.0, 31], ["31", 31],
                    [True, 31], [None, 31], [0, 31]],
        "kept_from": [[32, 19], [19], [-1, 19], [19.5, 19], [None, 19]],
        "running": [["true", True], [1, 1], [True], [True, True, True], [None, True],
                    [True, 1]],
        "next_id": [0],
        "next_episode": [0],
        "generation": [0, 1],
    }
    for key, values in bad.items():
        for i, value in enumerate(values):
            yield Case(f"cursor-{key}-{i}", set_path((key,), value))
    for key in ("next_id", "next_episode", "generation"):
        yield Case(f"cursor-{key}-minus-1", edit(lambda m, k=key: m.update({k: m[k] - 1})))
    yield Case("cursor-block-null-while-written", set_path(("blocks", 1), None))
    yield Case("cursor-empty-running", edit(_empty_running))
    yield Case("cursor-prio-null", set_path(("prio_blocks", 0), None), base="prio")


def _empty_running(m: dict[str, Any]) -> None:
    m["written"], m["kept_from"], m["running"] = [0, 31], [0, 19], [True, True]


def name_cases() -> Iterator[Case]:
    names = ["../outside/x.npy", "/etc/passwd", "steps/../../outside/b.npy", "steps//b.npy",
             "./steps/b000001.g00000010.npy", "steps\\b000001.g00000010.npy",
             "steps/b000000.g00000010.npy", "steps/b000001.g99999999.npy",
             "prio/b000001.g00000010.npy", "steps/b000001.g00000010.npy\x00",
             "steps/b\u0661\u0660\u0660\u0660\u0660\u0661.g00000010.npy",
             "steps/b000001.g00000000.npy", "steps/b000001.g00000010.npz", "steps", "",
             "tail/tail.g00000001.npy", "steps/b000001.g00000001.npy"]
    for i, name in enumerate(names):
        yield Case(f"name-block-{i}", edit(_rename_block(name)))
        yield Case(f"name-tail-{i}", edit(_rename_tail(name)))
    for i, name in enumerate(["../x", "/etc/passwd", "steps/b000009.g00000001.npy", "x", ""]):
        yield Case(f"name-files-extra-{i}", set_path(("files", name), 0))
    for i, value in enumerate([-1, 2**32, "crc", 1.5, None, True, 7]):
        yield Case(f"name-files-crc-{i}", edit(_set_block_crc(value)))
    yield Case("name-files-missing", edit(lambda m: m["files"].pop(m["blocks"][0])))


def _rename_block(name: str) -> Callable[[dict[str, Any]], None]:
    def fn(m: dict[str, Any]) -> None:
        old = m["blocks"][1]
        m["blocks"][1] = name
        m["files"][name] = m["files"].pop(old)
    return fn


def _rename_tail(name: str) -> Callable[[dict[str, Any]], None]:
    def fn(m: dict[str, Any]) -> None:
        m["files"][name] = m["files"].pop(m["tail"])
        m["tail"] = name
    return fn


def _set_block_crc(value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(m: dict[str, Any]) -> None:
        m["files"][m["blocks"][0]] = value
    return fn


def rng_cases() -> Iterator[Case]:
    values: list[Any] = [
        ("bit_generator", "MT19937"), ("bit_generator", "PCG64DXSM"), ("bit_generator", None),
        ("state", {"state": 1}), ("state", {"state": -1, "inc": 1}),
        ("state", {"state": 2**128, "inc": 1}), ("state", {"state": "1", "inc": 1}),
        ("state", []), ("has_uint32", 2), ("has_uint32", True), ("uinteger", -1),
        ("uinteger", 2**32), ("uinteger", 1.5), ("extra", 1), ("state", DELETE),
        ("has_uint32", DELETE),
    ]
    for i, (key, value) in enumerate(values):
        yield Case(f"rng-{i}", set_path(("rng", key), value))
    yield Case("rng-nested-state-extra", set_path(("rng", "state", "pickle"), 1))


def version_cases() -> Iterator[Case]:
    # the base store is sharded (format 2): 1 contradicts its spec, 3 is from the future
    for i, value in enumerate([3, 99, 0, -1, 1.0, "1", True, None, 2**70, 1]):
        yield Case(f"version-{i}", set_path(("format_version",), value))
        yield Case(f"version-unsealed-{i}", set_path(("format_version",), value, seal=False))
    yield Case("version-format-name", set_path(("format",), "mmreplay2"))


ZARR_BAD: list[tuple[str, Any]] = [
    ("shape", [2, 13, 4, 3]), ("shape", [2, 2**40, 4, 3]), ("shape", [2, 12, 4]),
    ("shape", [2, 12, 4, 3.0]), ("shape", [2, True, 4, 3]), ("shape", None), ("shape", "x"),
    ("shape", [2, 2**64, 4, 3]), ("shape", [-2, 12, 4, 3]),
    ("data_type", "object"), ("data_type", "|O"), ("data_type", "float32"),
    ("data_type", "V12"), ("data_type", {"name": "struct"}), ("data_type", None),
    ("data_type", "string"),
    ("chunk_grid", {"name": "regular", "configuration": {"chunk_shape": [1, 2**40, 4, 3]}}),
    ("chunk_grid", {"name": "regular", "configuration": {"chunk_shape": [2, 4, 4, 3]}}),
    ("chunk_grid", {"name": "rectilinear", "configuration": {"chunk_shape": [1, 4, 4, 3]}}),
    ("chunk_grid", None), ("chunk_grid", []),
    ("chunk_key_encoding", {"name": "default", "configuration": {"separator": "/"}}),
    ("chunk_key_encoding", {"name": "v2", "configuration": {"separator": "."}}),
    ("chunk_key_encoding", {"name": "default"}),
    ("fill_value", 1), ("fill_value", "NaN"), ("fill_value", None), ("fill_value", [0]),
    ("fill_value", True),
    ("storage_transformers", [{"name": "pickle"}]), ("storage_transformers", None),
    ("zarr_format", 2), ("zarr_format", "3"), ("node_type", "group"),
    ("attributes", []), ("dimension_names", ["a"]), ("dimension_names", "abcd"),
    ("pickle", "cos\nsystem\n"), ("zarr_format", DELETE), ("codecs", DELETE),
    ("shape", DELETE),
]
CODECS_BAD: list[Any] = [
    [{"name": "bytes"}, {"name": "numcodecs.pickle"}, {"name": "crc32c"}],
    [{"name": "bytes"}, {"name": "gzip", "configuration": {"level": 1}}, {"name": "crc32c"}],
    [{"name": "bytes"}, {"name": "blosc"}, {"name": "crc32c"}],
    [{"name": "sharding_indexed", "configuration": {}}],
    [{"name": "transpose", "configuration": {"order": [3, 2, 1, 0]}}, {"name": "bytes"},
     {"name": "zstd", "configuration": {"level": 1, "checksum": False}}, {"name": "crc32c"}],
    [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 1, "checksum": True}},
     {"name": "crc32c"}],
    [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 2, "checksum": False}},
     {"name": "crc32c"}],
    [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 1, "checksum": False}}],
    [{"name": "bytes"}, {"name": "crc32c"},
     {"name": "zstd", "configuration": {"level": 1, "checksum": False}}],
    [{"name": "bytes", "configuration": {"endian": "big"}},
     {"name": "zstd", "configuration": {"level": 1, "checksum": False}}, {"name": "crc32c"}],
    [], None, "bytes", [None], [{"name": None}],
]


def zarr_cases() -> Iterator[Case]:
    for i, (key, value) in enumerate(ZARR_BAD):
        yield Case(f"zarr-{key}-{i}", _edit_zarr("frames/zarr.json", key, value))
    for i, codecs in enumerate(CODECS_BAD):
        yield Case(f"zarr-codecs-{i}", _pickle_codec(codecs) if i == 0 else
                   _edit_zarr("frames/zarr.json", "codecs", codecs))
    yield Case("zarr-prio-endian-big", _edit_zarr("frames/zarr.json", "codecs", [
        {"name": "bytes", "configuration": {"endian": "big"}},
        {"name": "zstd", "configuration": {"level": 1, "checksum": False}}, {"name": "crc32c"}]),
        base="prio")
    for i, (key, value) in enumerate([("node_type", "array"), ("zarr_format", 2),
                                      ("consolidated_metadata", {"metadata": {}}),
                                      ("pickle", 1), ("attributes", None)]):
        yield Case(f"zarr-group-{key}-{i}", _edit_zarr("zarr.json", key, value))
    for rel in ("zarr.json", "frames/zarr.json"):
        tag = rel.replace("/", "-")
        yield Case(f"zarr-{tag}-missing", lambda env, rel=rel: (env.root / rel).unlink())
        yield Case(f"zarr-{tag}-empty", write_bytes(rel, b""))
        yield Case(f"zarr-{tag}-garbage", write_bytes(rel, bytes(range(256)) * 4))
        yield Case(f"zarr-{tag}-list", write_bytes(rel, b"[1, 2, 3]"))
        yield Case(f"zarr-{tag}-deep", write_bytes(rel, b"[" * 200_000 + b"]" * 200_000))
        yield Case(f"zarr-{tag}-dup-key", _zarr_transform(
            rel, lambda t: t.replace('"zarr_format"', '"zarr_format": 2, "zarr_format"', 1)))
        yield Case(f"zarr-{tag}-dir", _replace_with_dir(rel))


def _edit_zarr(rel: str, key: str, value: Any) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        path = env.root / rel
        meta = json.loads(path.read_text())
        if value is DELETE:
            del meta[key]
        else:
            meta[key] = value
        path.write_text(json.dumps(meta))
    return damage


def _zarr_transform(rel: str, fn: Callable[[str], str]) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        path = env.root / rel
        path.write_text(fn(path.read_text()))
    return damage


def _pickle_codec(codecs: Any) -> Callable[[Env], None]:
    """A pickle codec in zarr.json and pickled canaries as chunks: zarr would unpickle them."""
    def damage(env: Env) -> None:
        _edit_zarr("frames/zarr.json", "codecs", codecs)(env)
        for chunk in (env.root / "frames").glob("c.*"):
            chunk.write_bytes(pickle.dumps(Canary(env.canary)))
    return damage


def npy_cases() -> Iterator[Case]:
    for what, base in (("block", "uniform"), ("tail", "uniform"), ("prio", "prio")):
        for label, make in NPY_DAMAGE.items():
            yield Case(f"npy-{what}-{label}", replace_named(what, make), base=base)
        yield Case(f"npy-{what}-crc-only", replace_named(what, _flip_last, reseal=False),
                   base=base)
        yield Case(f"npy-{what}-missing", lambda env, w=what: (env.root / named(env, w)).unlink(),
                   base=base)
        yield Case(f"npy-{what}-dir", _replace_with_dir(what), base=base)


def _flip_last(env: Env, name: str) -> bytes:
    data = bytearray((env.root / name).read_bytes())
    data[-1] ^= 0x55
    return bytes(data)


def _original(env: Env, name: str) -> np.ndarray:
    return np.load(env.root / name)


def _other_dtype(array: np.ndarray) -> np.ndarray:
    if array.dtype.names:
        return array.astype([(n, "<f8") for n in array.dtype.names])
    return array.astype(np.float32 if array.dtype == np.float64 else np.float64)


def _big_endian(array: np.ndarray) -> np.ndarray:
    dtype = array.dtype.newbyteorder(">")
    return array.astype(dtype if dtype != array.dtype else np.dtype(">f8"))


def _fortran(array: np.ndarray) -> bytes:
    """The same bytes under a header that claims Fortran order."""
    header = {"descr": npy_format.dtype_to_descr(array.dtype), "fortran_order": True,
              "shape": array.shape}
    return npy_header(header, array.tobytes())


def _raw_header(header: str, version: tuple[int, int] = (1, 0)) -> Callable[[Env, str], bytes]:
    return lambda env, name: npy_header(header, b"\x00" * 64, version)


NPY_DAMAGE: dict[str, Callable[[Env, str], bytes]] = {
    "pickle-canary": canary_npy,
    "object-dtype": lambda env, name: npy_bytes(
        np.array([[None] * 3] * 2, dtype=object), allow_pickle=True),
    "wrong-dtype": lambda env, name: npy_bytes(_other_dtype(_original(env, name))),
    "wrong-shape": lambda env, name: npy_bytes(_original(env, name)[:, :-1]),
    "fortran": lambda env, name: _fortran(_original(env, name)),
    "big-endian": lambda env, name: npy_bytes(_big_endian(_original(env, name))),
    "huge-shape-header": lambda env, name: npy_header(
        {"descr": npy_format.dtype_to_descr(_original(env, name).dtype),
         "fortran_order": False, "shape": (2**40, 5)}, b"\x00" * 64),
    "huge-subarray-descr": _raw_header(
        "{'descr': ('<u1', (1073741824, 1073741824)), 'fortran_order': False, 'shape': (2,)}"),
    "negative-shape": _raw_header("{'descr': '<u1', 'fortran_order': False, 'shape': (-2, 5)}"),
    "literal-eval-canary": _raw_header(
        "{'descr': __import__('os').system('touch canary'), 'fortran_order': False, "
        "'shape': (2, 5)}"),
    "extra-key": _raw_header(
        "{'descr': '<u1', 'fortran_order': False, 'shape': (2, 5), 'pickle': 1}"),
    "python2-header": _raw_header("{'descr': '<u1', 'fortran_order': False, 'shape': (2L, 5L)}"),
    "version-3": _raw_header("{'descr': '<u1', 'fortran_order': False, 'shape': (2, 5)}",
                             (3, 0)),
    "version-9": _raw_header("{'descr': '<u1', 'fortran_order': False, 'shape': (2, 5)}",
                             (9, 0)),
    "header-bigint": _raw_header(
        "{'descr': '<u1', 'fortran_order': False, 'shape': (" + "9" * 6000 + ",)}"),
    "header-long": _raw_header("{'descr': '<u1', 'fortran_order': False, 'shape': (2, 5)"
                               + " " * 60000 + "}"),
    "header-not-dict": _raw_header("[1, 2, 3]"),
    "bad-magic": lambda env, name: b"\x93NUMPX\x01\x00" + b"x" * 100,
    "truncated-header": lambda env, name: (env.root / name).read_bytes()[:20],
    "empty": lambda env, name: b"",
    "garbage": lambda env, name: bytes(np.random.default_rng(len(name)).integers(
        0, 256, 300, np.uint8)),
    "appended": lambda env, name: (env.root / name).read_bytes() + b"\x00" * 16,
    "truncated-data": lambda env, name: (env.root / name).read_bytes()[:-8],
    "zip": lambda env, name: b"PK\x03\x04" + b"\x00" * 100,
}


def link_cases() -> Iterator[Case]:
    for what in ("manifest.json", "zarr.json", "frames/zarr.json", "block", "tail", "chunk"):
        tag = what.replace("/", "-")
        for target in ("copy", "/dev/zero", "/dev/urandom", "fifo", "dangling"):
            yield Case(f"link-{tag}-{target.replace('/dev/', '')}", _link_file(what, target))
    yield Case("link-prio-copy", _link_file("prio", "copy"), base="prio")
    for sub in ("frames", "steps", "tail", "tmp"):
        yield Case(f"link-dir-{sub}", _link_dir(sub))
    yield Case("link-root", _link_root)
    yield Case("link-lock", _link_file("lock", "copy"), modes=("r+",))
    yield Case("link-lock-fifo", _link_file("lock", "fifo"), modes=("r+",))
    yield Case("link-readers", _link_file("readers", "copy"), modes=("r+",))
    yield Case("link-readers-fifo", _link_file("readers", "fifo"), modes=("r+",))


def _target(env: Env, target: str, source: Path) -> Path:
    if target.startswith("/dev/"):
        return Path(target)
    path = env.outside / f"target-{source.name}"
    if target == "fifo":
        os.mkfifo(path)
    elif target == "copy" and source.exists():
        shutil.copyfile(source, path)
    elif target == "copy":
        path.write_bytes(b"")
    return path  # "dangling": never created


def _link_file(what: str, target: str) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        name = named(env, what) if what in ("block", "tail", "prio", "chunk") else what
        path = env.root / name
        dest = _target(env, target, path)
        path.unlink(missing_ok=True)
        path.symlink_to(dest)
    return damage


def _link_dir(sub: str) -> Callable[[Env], None]:
    """A directory of the store replaced by a symlink to an outside copy (plus strays)."""
    def damage(env: Env) -> None:
        src, dest = env.root / sub, env.outside / f"dir-{sub}"
        shutil.copytree(src, dest)
        (dest / "b999999.g00000001.npy").write_bytes(b"stray: a sweep must not delete this")
        (dest / "x.mmtmp").write_bytes(b"stray: a sweep must not delete this")
        shutil.rmtree(src)
        src.symlink_to(dest)
    return damage


def _link_root(env: Env) -> None:
    """The root itself is a symlink to a valid store outside."""
    dest = env.outside / "real-store"
    shutil.copytree(env.root, dest)
    shutil.rmtree(env.root)
    env.root.symlink_to(dest)


def fifo_cases() -> Iterator[Case]:
    for what in ("manifest.json", "zarr.json", "frames/zarr.json", "block", "tail", "chunk"):
        yield Case(f"fifo-{what.replace('/', '-')}", _fifo(what))
    yield Case("fifo-prio", _fifo("prio"), base="prio")
    yield Case("fifo-frames-dir", _fifo_dir("frames"))
    yield Case("fifo-steps-dir", _fifo_dir("steps"))
    yield Case("fifo-lock", _fifo("lock"), modes=("r+",))
    yield Case("fifo-readers", _fifo("readers"), modes=("r+",))


def _fifo(what: str) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        name = named(env, what) if what in ("block", "tail", "prio", "chunk") else what
        (env.root / name).unlink(missing_ok=True)
        os.mkfifo(env.root / name)
    return damage


def _fifo_dir(sub: str) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        shutil.rmtree(env.root / sub)
        os.mkfifo(env.root / sub)
    return damage


def huge_cases() -> Iterator[Case]:
    """Damage that would make a careless open allocate or read gigabytes."""
    specs: list[tuple[str, Any]] = [
        ("capacity", 2**40), ("capacity", 2**36), ("obs_shape", [2**20, 2**20]),
        ("obs_shape", [2**20] * 8), ("chunk_frames", 2**16),
    ]
    for i, (key, value) in enumerate(specs):
        yield Case(f"huge-spec-{key}-{i}", set_path(("spec", key), value), huge=True)
    yield Case("huge-spec-consistent", _huge_consistent, huge=True)
    yield Case("huge-envs", _huge_envs, huge=True)
    yield Case("huge-zarr-shape", _edit_zarr("frames/zarr.json", "shape", [2, 2**40, 4, 3]),
               huge=True)
    yield Case("huge-npy-shape", replace_named("block", NPY_DAMAGE["huge-shape-header"]),
               huge=True)
    for what in ("block", "tail", "chunk", "manifest.json", "zarr.json", "frames/zarr.json"):
        head = _valid_head if what in ("block", "tail") else None
        yield Case(f"huge-sparse-{what.replace('/', '-')}", sparse(what, head=head), huge=True)
    yield Case("huge-manifest-ints", _manifest_list("written", "257", 15 << 20), huge=True)
    yield Case("huge-manifest-strings", _manifest_list("blocks", '"ab"', 15 << 20), huge=True)
    yield Case("huge-manifest-nesting", write_bytes("manifest.json", b"[" * (15 << 20)),
               huge=True)
    yield Case("huge-manifest-containers", write_bytes(
        "manifest.json", b'{"a": [' + b"{}," * (5 << 20) + b"{}]}"), huge=True)
    yield Case("huge-manifest-padded", _manifest_transform(lambda t: t + " " * (17 << 20)),
               huge=True)


def _valid_head(env: Env, name: str) -> bytes:
    """The header of the file as it is (so only its size is wrong)."""
    data = (env.root / name).read_bytes()
    return data[: len(data) - np.load(env.root / name).nbytes]


def _manifest_list(key: str, item: str, size: int) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        m = manifest(env.root)
        m[key] = []
        text = json.dumps(m)
        filler = ",".join([item] * (size // (len(item) + 1)))
        text = text.replace(f'"{key}": []', f'"{key}": [{filler}]')
        (env.root / "manifest.json").write_text(text)
    return damage


def _huge_consistent(env: Env) -> None:
    """capacity 2**36 in the spec and zarr.json alike, blocks list to match: only the RAM
    cap refuses it (an open would need ~5 TiB)."""
    m = manifest(env.root)
    m["spec"]["capacity"] = 2**36
    m["spec"]["block_slots"] = 2**24
    blocks = -(-(2**35) // 2**24)
    m["blocks"] = [None] * blocks
    m["files"] = {m["tail"]: m["files"][m["tail"]]}
    m["written"], m["kept_from"], m["running"] = [0, 0], [0, 0], [False, False]
    save_manifest(env.root, m)
    _edit_zarr("frames/zarr.json", "shape", [2, 2**35, 4, 3])(env)


def _huge_envs(env: Env) -> None:
    m = manifest(env.root)
    m["spec"]["num_envs"] = 2**20
    m["spec"]["capacity"] = 2**21
    save_manifest(env.root, m)


# -- making and opening cases -------------------------------------------------------------
def make_case(case: Case, bases: dict[str, Path], where: Path) -> Env:
    """A fresh copy of the case's base store under `where`, damaged."""
    env = Env(root=where / "store", outside=where / "outside", canary=where / "canary")
    env.outside.mkdir(parents=True)
    (env.outside / "keep.txt").write_text("outside the root: never read or written")
    shutil.copytree(bases[case.base], env.root)
    case.damage(env)
    return env


def snapshot(path: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under `path` (not followed): type, size, mtime, content hash."""
    out: dict[str, tuple[Any, ...]] = {}
    for p in sorted([path, *path.rglob("*")]):
        st = os.lstat(p)
        data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        out[str(p.relative_to(path))] = (st.st_mode, st.st_size, st.st_mtime_ns,
                                         zlib.crc32(data))
    return out


def age_atimes(path: Path) -> None:
    """Set every atime two days back, so that any read shows (relatime updates it)."""
    old = time.time() - 2 * 86400
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            st = os.lstat(p)
            os.utime(p, ns=(int(old * 1e9), st.st_mtime_ns), follow_symlinks=False)


def open_outcome(path: Path, mode: str) -> tuple[str, str, float]:
    """(exception type name or "opened", message, seconds) of one open."""
    start = time.perf_counter()
    try:
        store = ReplayStore.open(path, mode)
    except Exception as exc:  # the caller checks the type
        return type(exc).__name__, str(exc), time.perf_counter() - start
    store.close()
    return "opened", "", time.perf_counter() - start


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(paths: list[str]) -> None:
    """Open each store in both modes; print outcomes, times, RSS growth and the traced peak
    (a second pass under tracemalloc, which slows allocation, so it is not timed)."""
    warm = Path(paths[0]).parent.parent / "warm"
    if not warm.exists():
        build_store(warm, "uniform")
    ReplayStore.open(warm, "r").close()  # imports and caches warmed up
    base = _rss_mib()
    results = []
    for path in paths:
        for mode in ("r", "r+"):
            kind, message, seconds = open_outcome(Path(path), mode)
            results.append({"path": path, "mode": mode, "kind": kind, "message": message,
                            "seconds": seconds})
    growth = _rss_mib() - base
    tracemalloc.start()
    for path in paths:
        open_outcome(Path(path), "r")
    peak = tracemalloc.get_traced_memory()[1]
    print(json.dumps({"results": results, "rss_growth_mib": growth,
                      "traced_peak_mib": peak / 2**20}))


if __name__ == "__main__":
    main(sys.argv[1:])


# -- format 4: the zstd dictionary ----------------------------------------------------------
DICT = "zstd.dict"


def dict_cases() -> Iterator[Case]:
    """A "zstd-dict" store's dictionary file, its manifest record, its copy in zarr.json and
    its spec fields."""
    def on_dict(name: str, damage: Callable[[Env], None], **kw: Any) -> Case:
        return Case(f"dict-{name}", damage, base="zstd_dict", **kw)

    yield on_dict("file-flip", _dict_bytes(lambda d: d[:40] + bytes([d[40] ^ 1]) + d[41:]))
    yield on_dict("file-truncated", _dict_bytes(lambda d: d[:-1]))
    yield on_dict("file-half", _dict_bytes(lambda d: d[: len(d) // 2]))
    yield on_dict("file-empty", write_bytes(DICT, b""))
    yield on_dict("file-appended", _dict_bytes(lambda d: d + b"\0"))
    yield on_dict("file-missing", lambda env: (env.root / DICT).unlink())
    yield on_dict("file-dir", _replace_with_dir(DICT))
    yield on_dict("file-fifo", _fifo(DICT))
    for target in ("copy", "/dev/zero", "fifo", "dangling"):
        yield on_dict(f"file-link-{target.replace('/dev/', '')}", _link_file(DICT, target))
    yield on_dict("file-huge", sparse(DICT), huge=True)
    for i, value in enumerate([*BAD_JSON, {"size": 1, "crc32c": 0}, {"size": 2**21, "crc32c": 0},
                               {"size": 100, "crc32c": 2**32}, {"crc32c": 0}]):
        yield on_dict(f"record-{i}", set_path(("dictionary",), value))
    yield on_dict("record-size", _edit_record("size", 1))
    yield on_dict("record-crc", _edit_record("crc32c", 1))
    yield on_dict("record-extra-key", edit(lambda m: m["dictionary"].update(name="x.dict")))
    yield on_dict("record-missing", set_path(("dictionary",), DELETE))
    yield on_dict("record-unsealed", _edit_record("size", 1, seal=False))
    yield Case("dict-record-on-lz4", set_path(("dictionary",), {"size": 600, "crc32c": 1}))
    for i, config in enumerate([{"level": 3}, {"level": 4, "dictionary": None},
                                {"level": 3, "dictionary": "AAAA"},
                                {"level": 3, "dictionary": "not base64!"},
                                {"level": 3, "dictionary": 12}, {"level": "3"}]):
        yield on_dict(f"zarr-config-{i}", _dict_zarr_set("configuration", config))
    yield on_dict("zarr-codec-zstd", _dict_zarr_set("name", "zstd"))
    yield on_dict("zarr-codec-other", _dict_zarr_set("name", "numcodecs.zstd"))
    yield on_dict("version-3", set_path(("format_version",), 3))
    yield on_dict("version-5", set_path(("format_version",), 5))
    for key, value in [("codec", "lz4"), ("codec", "zstd"), ("dict_bytes", 10),
                       ("dict_bytes", 2**20), ("dict_bytes", DELETE), ("dict_bytes", "1024"),
                       ("dict_train_chunks", 0), ("dict_train_chunks", DELETE),
                       ("codec_level", 0), ("codec_level", 20)]:
        tag = "del" if value is DELETE else str(value)
        yield on_dict(f"spec-{key}-{tag}", set_path(("spec", key), value))
    yield Case("dict-spec-on-lz4", set_path(("spec", "dict_bytes"), 1024))


def _dict_bytes(fn: Callable[[bytes], bytes]) -> Callable[[Env], None]:
    def damage(env: Env) -> None:
        path = env.root / DICT
        path.write_bytes(fn(path.read_bytes()))
    return damage


def _edit_record(key: str, delta: int, *, seal: bool = True) -> Callable[[Env], None]:
    return edit(lambda m: m["dictionary"].update({key: m["dictionary"][key] + delta}),
                seal=seal)


def _dict_codec(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``mmreplay.zstd_dict`` entry of frames/zarr.json (inside sharding_indexed)."""
    return meta["codecs"][0]["configuration"]["codecs"][1]


def _dict_zarr_set(key: str, value: Any) -> Callable[[Env], None]:
    """Set `key` ("configuration" or "name") of the dictionary codec in frames/zarr.json."""
    def damage(env: Env) -> None:
        path = env.root / "frames/zarr.json"
        meta = json.loads(path.read_text())
        _dict_codec(meta)[key] = value
        path.write_text(json.dumps(meta))
    return damage
