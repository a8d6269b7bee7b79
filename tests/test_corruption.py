"""Corruption is always detected: seeded byte-level damage to every file of small valid stores.

Each mutation (a byte flip, a truncation, a deletion, an emptied file or appended garbage, on
any file: frame chunks, step and priority blocks, the tail, the manifest, both zarr.json, a
"zstd-dict" store's dictionary; an "lz4hc" store too) is
applied to a pristine store, which is then opened read-only. The outcome is one of:

* ``open``: the open raises `InvalidStoreError`;
* ``verify``: it opens, and `verify_store` reports a problem;
* ``unread``: it opens, verify finds nothing, and the damage touched bytes never read: every
  field of every sampleable transition and the next sampled batch equal the original's.

Whatever the outcome, a store that opened never returns a wrong frame or field:
``store.get(store.valid_ids())`` and ``store.sample`` equal the original or raise
`InvalidStoreError`. The manifest, zarr metadata and ``.npy`` files are all checksummed or
checked field by field, so damage to them is refused at open unless their parsed content is
unchanged (whitespace). ``MMREPLAY_LONG=1`` runs 10x more mutations.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile_stores import build_store

from mmreplay import ReplayStore
from mmreplay.errors import InvalidStoreError
from mmreplay.storage.commit import LOCK, READERS

try:
    from mmreplay.tools.verify import verify_store
except ImportError:  # before verify moved out of inspect
    from mmreplay.tools.inspection import verify_store  # type: ignore[attr-defined,no-redef]

LONG = os.environ.get("MMREPLAY_LONG") == "1"
MUTATIONS = 24_000 if LONG else 2_400
LOCK_FILES = (LOCK, READERS)
KINDS = ("flip", "truncate", "delete", "empty", "append")
FIELDS = ("ids", "obs", "next_obs", "action", "reward", "discount", "terminated", "truncated",
          "weights")
FIGURES: Counter[tuple[str, str, str]] = Counter()


@dataclass(frozen=True)
class Pristine:
    """A valid store, the bytes of each of its files, and what reading it returns."""

    root: Path
    files: dict[str, bytes]
    ids: np.ndarray
    batch: dict[str, np.ndarray]
    sample: dict[str, np.ndarray]


def fields(batch: Any) -> dict[str, np.ndarray]:
    return {f: getattr(batch, f).numpy().copy() for f in FIELDS}


def build_gave_up(path: Path) -> None:
    """A store as a crash leaves it: its committed manifest gave up frames that chunk writes
    after it overwrote, so some chunk files hold bytes no reader may use."""
    live = path.with_name(path.name + "-live")
    store = ReplayStore.create(live, capacity=32, obs_shape=(5,), chunk_frames=2, block_slots=8,
                               frame_stack=2, n_step=2, seed=3)
    rng = np.random.default_rng(0)
    store.reset(rng.integers(0, 255, 5).astype(np.uint8))
    done = False
    for i in range(44):
        term = bool(rng.random() < 0.1)
        store.add(int(rng.integers(3)), float(rng.normal()),
                  rng.integers(0, 255, 5).astype(np.uint8), term, False, autoreset=done)
        done = term
        if i == 30:
            store.flush()
    store._frames.drain()  # every chunk written so far is on disk: a crash now
    shutil.copytree(live, path, ignore=shutil.ignore_patterns(*LOCK_FILES))
    store.close()


def pristine(root: Path, kind: str) -> Pristine:
    if kind == "gave-up":
        build_gave_up(root)
    else:
        build_store(root, kind)
    files = {p.relative_to(root).as_posix(): p.read_bytes()  # lock files hold no data
             for p in sorted(root.rglob("*")) if p.is_file() and p.name not in LOCK_FILES}
    with ReplayStore.open(root, "r") as store:
        ids = store.valid_ids()
        batch = fields(store.get(ids))
        sample = fields(store.sample(8))
    assert ids.size > 10 and verify_store(root).ok
    return Pristine(root, files, ids, batch, sample)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> list[Pristine]:
    base = tmp_path_factory.mktemp("corruption")
    return [pristine(base / kind, kind) for kind in ("uniform", "prio", "gave-up", "zstd_dict",
                                                     "lz4hc")]


def target_kind(rel: str) -> str:
    if rel.startswith("frames/c."):
        return "chunk"
    return {"manifest.json": "manifest", "zarr.json": "group zarr.json",
            "frames/zarr.json": "frames zarr.json", "zstd.dict": "dictionary"}.get(
                rel, rel.split("/")[0])


def mutate(path: Path, kind: str, rng: np.random.Generator) -> None:
    data = bytearray(path.read_bytes())
    if kind == "delete":
        path.unlink()
        return
    if kind == "flip" and data:
        data[int(rng.integers(len(data)))] ^= int(rng.integers(1, 256))
    elif kind == "truncate" and data:
        data = data[: int(rng.integers(len(data)))]
    elif kind == "empty":
        data = bytearray()
    elif kind == "append":
        data += rng.integers(0, 256, int(rng.integers(1, 65)), np.uint8).tobytes()
    path.write_bytes(bytes(data))


def same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return all(np.array_equal(got[f], want[f]) for f in FIELDS)


def read_back(root: Path, orig: Pristine, what: str) -> bool:
    """Read everything through a fresh read-only open; True if all equals the original.

    A raise of InvalidStoreError is fine (returns False); a wrong value fails the test.
    """
    with ReplayStore.open(root, "r") as store:
        ids = store.valid_ids()
        assert np.array_equal(ids, orig.ids), f"{what}: sampleable ids changed silently"
        try:
            batch = fields(store.get(ids))
            sample = fields(store.sample(8))
        except InvalidStoreError as exc:
            assert "\n" not in str(exc)
            return False
    assert same(batch, orig.batch), f"{what}: get returned a wrong frame or field"
    assert same(sample, orig.sample), f"{what}: sample returned a wrong frame or field"
    return True


def outcome(orig: Pristine, rel: str, what: str) -> str:
    try:
        ReplayStore.open(orig.root, "r").close()
    except InvalidStoreError as exc:
        assert str(exc) and "\n" not in str(exc), repr(str(exc))
        return "open"
    intact = read_back(orig.root, orig, what)
    report = verify_store(orig.root)
    if not report.ok:
        return "verify"
    assert intact, f"{what}: reading raised, but verify found nothing"
    return "unread"


def check_metadata_unread(orig: Pristine, rel: str, what: str) -> None:
    """Damage to checksummed or fully checked files is unread only if their content is."""
    kind = target_kind(rel)
    if kind in ("steps", "tail", "prio", "dictionary"):
        raise AssertionError(f"{what}: a damaged checksummed file was not refused")
    if kind in ("manifest", "group zarr.json", "frames zarr.json"):
        now = json.loads((orig.root / rel).read_bytes())
        assert now == json.loads(orig.files[rel]), f"{what}: changed metadata was accepted"


def restore(orig: Pristine, rel: str) -> None:
    (orig.root / rel).write_bytes(orig.files[rel])


@pytest.mark.integration  # a loop over every mutation of a store
def test_every_mutation_is_detected_or_unread(stores: list[Pristine]) -> None:
    rng = np.random.default_rng(2024)
    for i in range(MUTATIONS):
        orig = stores[i % len(stores)]
        rel = list(orig.files)[int(rng.integers(len(orig.files)))]
        kind = KINDS[int(rng.integers(len(KINDS)))]
        what = f"mutation {i}: {kind} {orig.root.name}/{rel}"
        mutate(orig.root / rel, kind, rng)
        try:
            result = outcome(orig, rel, what)
            if result == "unread":
                check_metadata_unread(orig, rel, what)
        finally:
            restore(orig, rel)
        FIGURES[(target_kind(rel), kind, result)] += 1
    assert sum(FIGURES.values()) == MUTATIONS


@pytest.mark.integration  # reads the figures of the loop above
def test_mutations_reach_every_file_and_kind(stores: list[Pristine],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The figures: outcome per target and kind (printed with -s)."""
    if not FIGURES:
        pytest.skip("run with test_every_mutation_is_detected_or_unread")
    targets = {t for t, _, _ in FIGURES}
    assert targets == {"chunk", "steps", "tail", "prio", "manifest", "group zarr.json",
                       "frames zarr.json", "dictionary"}
    assert {k for _, k, _ in FIGURES} == set(KINDS)
    assert {o for _, _, o in FIGURES} == {"open", "verify", "unread"}
    rows = sorted({(t, k) for t, k, _ in FIGURES})
    with capsys.disabled():
        print(f"\n{MUTATIONS} mutations: " + ", ".join(
            f"{o} {sum(n for (_, _, oo), n in FIGURES.items() if oo == o)}"
            for o in ("open", "verify", "unread")))
        for t, k in rows:
            counts = {o: FIGURES[(t, k, o)] for o in ("open", "verify", "unread")}
            print(f"  {t:17s} {k:9s} " + " ".join(f"{o}={n}" for o, n in counts.items()))


def test_restored_stores_are_pristine(stores: list[Pristine]) -> None:
    """The loop above restores every file: each store still reads as at the start."""
    for orig in stores:
        files = {p.relative_to(orig.root).as_posix() for p in orig.root.rglob("*")
                 if p.is_file() and p.name not in LOCK_FILES}
        assert files == set(orig.files)
        assert read_back(orig.root, orig, "pristine")
        assert verify_store(orig.root).ok


def test_a_silent_change_would_be_caught(stores: list[Pristine], tmp_path: Path) -> None:
    """Control: a frame changed with a recomputed checksum reads back wrong, and the
    comparison above notices it (so the test can fail)."""
    orig = stores[0]
    copy = tmp_path / "copy"
    shutil.copytree(orig.root, copy)
    with ReplayStore.open(copy, "r") as store:
        batch = fields(store.get(orig.ids))
    batch["reward"][0] += 1.0
    assert not same(batch, orig.batch)
