"""`mmreplay verify`: check every checksum and invariant of a store on disk, without writing.

A store is sound when its manifest parses, every file it names exists with the
right crc32, dtype and shape, every frame chunk holding a kept frame exists,
passes its crc32c and decodes to the right size, the zarr metadata matches the
spec, the step columns and sampler pass their ``check_valid``, and no file lies
outside the layout. Each problem is one line of the report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from mmreplay.errors import InvalidStoreError, MmreplayError
from mmreplay.index.ring import StepColumns, step_dtype
from mmreplay.spec import StoreSpec
from mmreplay.storage.codec import ChunkCodec
from mmreplay.storage.commit import LOCK, READERS
from mmreplay.storage.frame_store import FRAMES, FrameStore
from mmreplay.storage.layout import check_zarr, store_dictionary
from mmreplay.storage.manifest import MANIFEST, check_root, committed_generation, read_manifest
from mmreplay.storage.safe_io import TMP_DIR, TMP_SUFFIX, load_npy
from mmreplay.storage.zstd_dict import DICT_FILE
from mmreplay.store import ReplayStore
from mmreplay.tools.inspection import ZARR_JSON, Progress, files_under


# -- verify ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifyReport:
    """Outcome of `verify_store`; ``problems`` holds one line per problem found."""

    path: str
    generation: int | None
    problems: tuple[str, ...]
    files_checked: int = 0
    chunks_checked: int = 0
    frames_checked: int = 0
    sampleable: int | None = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(path: str | os.PathLike[str], *, progress: Progress | None = None,
                 attempts: int = 4) -> VerifyReport:
    """Check every invariant and checksum of the store at `path` without writing.

    Raises `InvalidStoreError` only when `path` is not a store at all (no directory or
    no manifest); damage is reported in the returned report. If a writer commits while
    a pass runs and that pass found problems, it runs another pass on the new generation.
    """
    root = Path(path)
    check_root(root)
    passes: list[VerifyReport] = []
    for _ in range(attempts):
        before = committed_generation(root)
        report = _verify_once(root, progress)
        if report.ok or committed_generation(root) == before:
            return report
        passes.append(report)
    # A writer committed during every pass: files it replaced look missing or stray for
    # one pass only. Damage persists, so keep the problems every pass saw.
    lasting = tuple(p for p in report.problems if all(p in r.problems for r in passes))
    return replace(report, problems=lasting, note=(
        f"a writer committed during each of {attempts} passes; reporting only the problems "
        f"every pass found"))


def _verify_once(root: Path, progress: Progress | None) -> VerifyReport:
    try:
        manifest = read_manifest(root)
        spec = StoreSpec.from_dict(manifest["spec"])
    except InvalidStoreError as exc:
        return VerifyReport(path=str(root), generation=None, problems=(str(exc),))
    problems = _manifest_cursor_problems(manifest, spec)
    cursors_ok = not problems  # chunk and tail checks need sound cursors
    files = _check_named_files(root, manifest, spec, problems, cursors_ok=cursors_ok)
    files_ok = not problems  # opening reads exactly these files: its error would repeat ours
    dictionary, dict_problems = _dictionary(root, manifest)
    problems += dict_problems or _zarr_problems(root, spec, dictionary)
    chunks, frames = (_check_chunks(root, manifest, spec, progress, problems, dictionary)
                      if cursors_ok and not dict_problems else (0, 0))
    sampleable = _check_open_store(root, problems, report_failure=files_ok)
    problems += _unexpected_files(root, manifest, spec)
    return VerifyReport(path=str(root), generation=int(manifest["generation"]),
                        problems=tuple(problems), files_checked=files, chunks_checked=chunks,
                        frames_checked=frames, sampleable=sampleable)


def _manifest_cursor_problems(manifest: dict[str, Any], spec: StoreSpec) -> list[str]:
    """Per-env cursors: right length, ints, ``kept_from <= written`` (checked first)."""
    for key in ("written", "kept_from"):
        values = manifest[key]
        if len(values) != spec.num_envs or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return [f"manifest field {key!r} must be {spec.num_envs} "
                    f"non-negative ints, got {values!r:.80}"]
    if len(manifest["running"]) != spec.num_envs:
        return [f"manifest field 'running' must have {spec.num_envs} entries"]
    bad = [e for e, (w, k) in enumerate(zip(manifest["written"], manifest["kept_from"],
                                            strict=True)) if k > w]
    if bad:
        return [f"manifest cursors: kept_from > written for envs {bad[:10]}"]
    return []


def _named_layout(manifest: dict[str, Any], spec: StoreSpec,
                  problems: list[str]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Every file the manifest should name, with the dtype and shape it must hold."""
    blocks_n = -(-spec.slots_per_env // spec.block_slots)
    rows = [min(spec.block_slots, spec.slots_per_env - b * spec.block_slots)
            for b in range(blocks_n)]
    want: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
        manifest["tail"]: (np.dtype(spec.obs_dtype),
                           (spec.num_envs, spec.chunk_frames, *spec.obs_shape))}
    lists = [("blocks", step_dtype(spec))]
    if spec.sampler != "uniform":
        lists.append(("prio_blocks", np.dtype("<f8")))
    for key, dtype in lists:
        names = manifest.get(key)
        if not isinstance(names, list) or (names and len(names) != blocks_n):
            problems.append(f"manifest field {key!r} must list {blocks_n} block files")
            continue
        for name, n in zip(names, rows, strict=False):
            if name is not None:
                want[name] = (dtype, (spec.num_envs, n))
    return want


def _check_named_files(root: Path, manifest: dict[str, Any], spec: StoreSpec,
                       problems: list[str], *, cursors_ok: bool) -> int:
    """crc32, dtype and shape of every small file the manifest names; returns how many."""
    want = _named_layout(manifest, spec, problems)
    crcs = manifest["files"]
    for name in sorted(set(crcs) - set(want), key=str):
        problems.append(f"manifest lists {name} with a crc but no block or tail uses it")
    for name, (dtype, shape) in want.items():
        try:
            array = load_npy(root, name, crcs.get(name), dtype=dtype, shape=shape)
        except InvalidStoreError as exc:
            problems.append(_file_problem(root, name, exc))
            continue
        if name == manifest["tail"] and cursors_ok:
            problems += _tail_problems(array, manifest, spec)
    return len(want)


def _file_problem(root: Path, name: str, exc: InvalidStoreError) -> str:
    """`load_npy`'s message, or a plainer one for an empty file."""
    try:
        empty = (root / name).stat().st_size == 0
    except (OSError, TypeError, ValueError):
        empty = False
    return f"{name} is empty (0 bytes)" if empty else str(exc)


def _tail_problems(tail: np.ndarray, manifest: dict[str, Any], spec: StoreSpec) -> list[str]:
    """Rows of the tail past each env's write cursor must be zeros."""
    fill = np.asarray(manifest["written"]) % spec.slots_per_env % spec.chunk_frames
    bad = [e for e in range(spec.num_envs) if tail[e, int(fill[e]):].any()]
    return [f"tail file {manifest['tail']} holds data past the write cursor of envs {bad[:10]}"
            ] if bad else []


def _dictionary(root: Path, manifest: dict[str, Any]) -> tuple[bytes | None, list[str]]:
    """A "zstd-dict" store's dictionary, checked against the manifest (or the problem)."""
    try:
        return store_dictionary(root, manifest), []
    except InvalidStoreError as exc:
        return None, [str(exc)]


def _zarr_problems(root: Path, spec: StoreSpec, dictionary: bytes | None = None) -> list[str]:
    """The zarr metadata must describe the frames array this spec implies."""
    try:
        check_zarr(root, spec, dictionary)
    except InvalidStoreError as exc:
        return [str(exc)]
    return []


def disk_chunks(lo: int, hi: int, slots: int, chunk: int) -> list[int]:
    """Chunk numbers holding frames ``lo..hi-1`` of one env's ring of `slots` slots."""
    count = -(-slots // chunk)
    if hi <= lo:
        return []
    if hi - lo >= slots:
        return list(range(count))
    a, b = lo % slots // chunk, (hi - 1) % slots // chunk
    if lo % slots <= (hi - 1) % slots:
        return list(range(a, b + 1))
    return sorted(set(range(a, count)) | set(range(0, b + 1)))


def _check_chunks(root: Path, manifest: dict[str, Any], spec: StoreSpec,
                  progress: Progress | None, problems: list[str],
                  dictionary: bytes | None = None) -> tuple[int, int]:
    """Every chunk holding a kept frame exists, passes crc32c and decodes to full size."""
    S, C = spec.slots_per_env, spec.chunk_frames
    written = np.asarray(manifest["written"], np.int64)
    oldest = np.minimum(np.maximum(np.asarray(manifest["kept_from"], np.int64), written - S),
                        written)
    on_disk_end = written - written % S % C  # later frames live in the tail file
    work = [(e, c) for e in range(spec.num_envs)
            for c in disk_chunks(int(oldest[e]), int(on_disk_end[e]), S, C)]
    store = FrameStore(root, spec, writable=False, cache_bytes=0, dictionary=dictionary)
    codec = ChunkCodec(spec, dictionary)
    try:
        for env, chunk in (progress(work, len(work)) if progress else work):
            problem = _chunk_problem(store, codec, root, env, chunk)
            if problem:
                problems.append(problem)
    finally:
        store.close()  # shard files it keeps open
    return len(work), int(np.maximum(on_disk_end - oldest, 0).sum())


def _chunk_problem(frames: FrameStore, codec: ChunkCodec, root: Path, env: int,
                   chunk: int) -> str | None:
    path = frames.file_path(env, chunk)
    if not os.path.lexists(path):
        where = path.relative_to(root).as_posix()
        return f"frame file {where} is missing (it holds kept frames of chunk {chunk})"
    try:
        codec.check(*frames.chunk_bytes(env, chunk))  # numcodecs: no numba to load
    except InvalidStoreError as exc:
        return str(exc).replace(f"{root}/", "")  # paths relative to the store, as elsewhere
    return None


def _check_open_store(root: Path, problems: list[str], *, report_failure: bool) -> int | None:
    """Open read-only and run the ring's and sampler's own invariant checks."""
    try:
        store = ReplayStore.open(root, mode="r", cache_bytes=0)
    except (MmreplayError, OSError) as exc:
        if report_failure:
            problems.append(f"store does not open: {exc}")
        return None
    with store:
        try:
            store.views.check_valid()
        except RuntimeError as exc:
            problems.append(f"invariant broken: {exc}")
        problems += ring_problems(store.views.step_columns())
        return len(store)


def ring_problems(ring: StepColumns) -> list[str]:
    """Invariants of the kept step columns that `StepRing.check_valid` does not cover."""
    env, f = ring.kept_frames()
    if (ring.written - ring.oldest > ring.slots_per_env).any():
        return [f"cursors keep more than {ring.slots_per_env} frames per env: "
                f"written {ring.written}, oldest {ring.oldest}"]
    c = ring.steps[env, f % ring.slots_per_env]
    has_next = f + 1 < ring.written[env]
    n = ring.steps[env, (f + 1) % ring.slots_per_env]
    cont = has_next & (n["pos"] == c["pos"] + 1) & (n["episode"] == c["episode"])
    ended = c["has_step"] & (c["terminated"] | c["truncated"])
    checks = [
        (has_next & ~cont & (n["pos"] != 0), "is followed by a frame that neither continues "
         "its episode nor starts one"),
        (c["has_step"] != cont, "has a step iff its episode continues: violated"),
        ((c["terminated"] | c["truncated"]) & ~c["has_step"], "carries an end flag but no step"),
        (ended & n["has_step"] & has_next, "ends its episode, but the episode goes on"),
        (c["has_step"] & ((c["id"] < 0) | (c["id"] >= ring.next_id)),
         f"has a transition id outside [0, next_id={ring.next_id})"),
        (~c["has_step"] & (c["id"] != -1), "has no step but a transition id"),
        ((c["episode"] < 0) | (c["episode"] >= ring.next_episode) | (c["pos"] < 0),
         f"has an episode number outside [0, next_episode={ring.next_episode}) or pos < 0"),
    ]
    out = [_frames_problem(env[bad], f[bad], what) for bad, what in checks if bad.any()]
    ids = c["id"][c["has_step"]]
    if np.unique(ids).size != ids.size:
        out.append("transition ids of kept steps are not unique")
    return out + _running_problems(ring)


def _running_problems(ring: StepColumns) -> list[str]:
    bad = np.flatnonzero(ring.running & (ring.written == 0))
    return [f"envs {bad[:10].tolist()} are marked running but have no frame"] if bad.size else []


def _frames_problem(env: np.ndarray, frames: np.ndarray, what: str) -> str:
    where = ", ".join(f"env {e} frame {t}" for e, t in zip(env[:3].tolist(), frames[:3].tolist(),
                                                           strict=True))
    more = f" and {env.size - 3} more" if env.size > 3 else ""
    return f"step columns: {where}{more} {what}"


def _unexpected_files(root: Path, manifest: dict[str, Any], spec: StoreSpec) -> list[str]:
    """Files that are neither named by the manifest nor part of the fixed layout."""
    named = set(manifest["files"]) | {MANIFEST, LOCK, READERS}
    if "dictionary" in manifest:
        named.add(DICT_FILE)
    out = []
    for path, _ in files_under(root):
        rel = path.relative_to(root).as_posix()
        if rel in named or _allowed(rel.split("/"), spec):
            continue
        kind = "symlink" if path.is_symlink() else "file"
        out.append(f"unexpected {kind} {rel}: not named by the manifest")
    return out


def _allowed(parts: list[str], spec: StoreSpec) -> bool:
    """zarr metadata, temp files of in-flight writes, and frame chunks of this layout."""
    if parts[-1] == ZARR_JSON:
        return True
    if len(parts) == 2 and parts[0] == TMP_DIR and parts[1].endswith(TMP_SUFFIX):
        return True
    if len(parts) != 2 or parts[0] != FRAMES:
        return False
    key = parts[1].split(".")  # c.<env>.<chunk or shard>.0.0 (zarr default key, "." separator)
    zeros = ["0"] * len(spec.obs_shape)
    if len(key) != 3 + len(zeros) or key[0] != "c" or key[3:] != zeros:
        return False
    if not (key[1].isdigit() and key[2].isdigit()):
        return False
    return int(key[1]) < spec.num_envs and int(key[2]) < spec.num_shards
