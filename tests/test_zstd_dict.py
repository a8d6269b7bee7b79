"""Codec "zstd-dict" (format 4): training, round trips against a naive reference, the golden
fixture, plain zarr reads through the registered codec, and every way its dictionary or a
chunk can be damaged."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import zstandard
from store_compare import (
    assert_golden_frames_through_zarr,
    assert_golden_reads_back,
    assert_golden_resumes,
)

import mmreplay.storage.zarr_codec  # noqa: F401  (registers the zarr codec in this process)
from mmreplay import InvalidInputError, InvalidStoreError, ReplayStore
from mmreplay.storage.manifest import manifest_checksum
from mmreplay.storage.zstd_dict import DICT_FILE, DICT_MAGIC
from mmreplay.tools.verify import verify_store

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_V4 = FIXTURES / "store_v4"
EXPECTED_V4 = json.loads((FIXTURES / "store_v4.expected.json").read_text())
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(FIXTURES))
from make_store_v4 import frame  # noqa: E402


def make(path: Path, **options) -> ReplayStore:
    args = {"capacity": 40, "obs_shape": (16, 16), "chunk_frames": 4, "frame_stack": 2,
            "seed": 0, "codec": "zstd-dict", "dict_bytes": 1024, "dict_train_chunks": 3}
    return ReplayStore.create(path, **{**args, **options})


def feed(store: ReplayStore, start: int, stop: int, env: int = 0) -> None:
    for t in range(start, stop):
        obs = frame(t, env)[None].repeat(store.spec.num_envs, 0)
        if t == 0:
            store.reset(obs)
        else:
            store.add(np.zeros(store.spec.num_envs, np.int64), np.zeros(store.spec.num_envs),
                      obs, np.zeros(store.spec.num_envs, bool), np.zeros(store.spec.num_envs,
                                                                             bool))


def newest_obs(store: ReplayStore, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(what the store returns, what a naive list of frames says) for every valid id: the
    newest frame of each transition's next_obs, which is frame ``id + 1`` of the stream."""
    ids = store.valid_ids()
    got = store.get(ids).next_obs[:, -1].numpy()
    want = np.stack([frame(int(i) + 1, 0) for i in ids])
    assert ids.max() == stop - 2
    return got, want


def seal(path: Path, manifest: dict) -> None:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    (path / "manifest.json").write_text(json.dumps({**body,
                                                    "checksum": manifest_checksum(body)}))


# -- round trips ----------------------------------------------------------------------------
@pytest.mark.parametrize("shard_chunks", [1, 4], ids=["chunk-files", "shards"])
def test_reads_equal_the_stream_before_and_after_training_wrap_flush_and_reopen(
        tmp_path: Path, shard_chunks: int) -> None:
    store = make(tmp_path / "s", shard_chunks=shard_chunks)
    feed(store, 0, 11)  # two chunks held in RAM, no dictionary yet
    assert not (tmp_path / "s" / DICT_FILE).exists()
    np.testing.assert_array_equal(*newest_obs(store, 11))
    feed(store, 11, 95)  # trained at the third chunk; the 40-slot ring wraps twice
    assert (tmp_path / "s" / DICT_FILE).exists()
    np.testing.assert_array_equal(*newest_obs(store, 95))
    store.close()
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    data = (tmp_path / "s" / DICT_FILE).read_bytes()
    assert manifest["format_version"] == 4
    assert manifest["dictionary"] == {"size": len(data), "crc32c": google_crc32c.value(data)}
    with ReplayStore.open(tmp_path / "s", "r") as again:
        np.testing.assert_array_equal(*newest_obs(again, 95))
    assert verify_store(tmp_path / "s").ok


def test_a_flush_before_enough_chunks_trains_on_what_there_is(tmp_path: Path) -> None:
    store = make(tmp_path / "s", dict_train_chunks=50)
    feed(store, 0, 10)
    store.flush()  # the manifest may name only chunks on disk: they need the dictionary
    assert (tmp_path / "s" / DICT_FILE).exists()
    feed(store, 10, 30)
    store.close()
    with ReplayStore.open(tmp_path / "s", "r") as again:
        np.testing.assert_array_equal(*newest_obs(again, 30))


def test_frames_zstd_cannot_train_on_give_a_raw_content_dictionary(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (9, 5), dtype=np.uint8)
    store = ReplayStore.create(tmp_path / "s", capacity=16, obs_shape=(5,), chunk_frames=2,
                               codec="zstd-dict", dict_train_chunks=2, seed=0)
    store.reset(frames[0])
    for f in frames[1:]:
        store.add(0, 0.0, f, False, False)
    store.close()
    data = (tmp_path / "s" / DICT_FILE).read_bytes()
    assert data[:4] != DICT_MAGIC and data[:1] == b"\0"  # raw content, never a magic number
    with ReplayStore.open(tmp_path / "s", "r") as again:
        assert again.get(again.valid_ids()).next_obs[:, -1].tolist() == frames[1:].tolist()


def test_a_dictionary_given_at_create_is_the_stores(tmp_path: Path) -> None:
    samples = [frame(t, 0).tobytes() for t in range(64)]
    given = zstandard.train_dictionary(1024, samples).as_bytes()
    store = make(tmp_path / "s", dictionary=given)
    assert (tmp_path / "s" / DICT_FILE).read_bytes() == given  # before any frame arrives
    feed(store, 0, 30)
    store.close()
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["dictionary"][
        "crc32c"] == google_crc32c.value(given)
    chunk = (tmp_path / "s" / "frames" / "c.0.0.0.0").read_bytes()
    assert zstandard.get_frame_parameters(chunk[:-4]).dict_id == \
        zstandard.ZstdCompressionDict(given).dict_id()
    with ReplayStore.open(tmp_path / "s", "r") as again:
        np.testing.assert_array_equal(*newest_obs(again, 30))


@pytest.mark.parametrize(("options", "match"), [
    ({"codec": "lz4", "dict_bytes": 1024}, "zstd-dict"),
    ({"codec": "zstd", "dictionary": b"x" * 512}, "zstd-dict"),
    ({"dictionary": "not bytes"}, "bytes"),
    ({"dictionary": b"short"}, "256"),
    ({"dict_bytes": 10}, "dict_bytes"),
    ({"dict_train_chunks": 0}, "dict_train_chunks"),
    ({"codec_level": 0}, "codec_level"),
])
def test_options_are_checked_before_anything_is_written(tmp_path: Path, options: dict,
                                                        match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        make(tmp_path / "s", **options)
    assert not (tmp_path / "s").exists()


# -- the golden fixture and plain zarr ------------------------------------------------------
def test_golden_v4_reads_back_identically() -> None:
    manifest = json.loads((GOLDEN_V4 / "manifest.json").read_text())
    assert manifest["format_version"] == 4 and manifest["spec"]["codec"] == "zstd-dict"
    assert manifest["dictionary"] == EXPECTED_V4["dictionary"]
    assert (GOLDEN_V4 / DICT_FILE).read_bytes()[:4] == DICT_MAGIC  # a trained dictionary
    assert_golden_reads_back(GOLDEN_V4, EXPECTED_V4)


def test_golden_v4_frames_read_through_plain_zarr() -> None:
    meta = json.loads((GOLDEN_V4 / "frames" / "zarr.json").read_text())
    (shard,) = meta["codecs"]
    inner = shard["configuration"]["codecs"]
    assert [c["name"] for c in inner] == ["bytes", "mmreplay.zstd_dict", "crc32c"]
    assert base64.b64decode(inner[1]["configuration"]["dictionary"]) == \
        (GOLDEN_V4 / DICT_FILE).read_bytes()
    assert_golden_frames_through_zarr(GOLDEN_V4, frame)


def test_golden_v4_can_be_resumed(tmp_path: Path) -> None:
    # past a ring lap: chunks rewritten with the same dictionary
    assert_golden_resumes(GOLDEN_V4, tmp_path / "copy", frame)
    assert (tmp_path / "copy" / DICT_FILE).read_bytes() == (GOLDEN_V4 / DICT_FILE).read_bytes()


def test_the_entry_point_lets_zarr_alone_read_the_frames(tmp_path: Path) -> None:
    """An installed mmreplay declares ``zarr.codecs`` -> `ZstdDictCodec`; a process that
    never imports mmreplay itself reads the array through it (the entry point of
    pyproject.toml, installed here as a bare dist-info)."""
    points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    target = points["zarr.codecs"]["mmreplay.zstd_dict"]
    info = tmp_path / "site" / "mmreplay_codec_probe-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mmreplay-codec-probe\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(f"[zarr.codecs]\nmmreplay.zstd_dict = {target}\n")
    code = ("import sys, zarr; a = zarr.open_array(sys.argv[1], mode='r'); "
            "print(a[1, 24:].sum())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code, str(GOLDEN_V4 / "frames")], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout) == int(np.stack([frame(t, 1) for t in range(24, 48)]).sum())
    bare = subprocess.run([sys.executable, "-I", "-c", code, str(GOLDEN_V4 / "frames")],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if "mmreplay.zstd_dict" not in {e.name for e in _installed_codecs()}:
        assert bare.returncode != 0 and "mmreplay.zstd_dict" in bare.stderr


def _installed_codecs():
    from importlib.metadata import entry_points
    return entry_points(group="zarr.codecs")


# -- damage ---------------------------------------------------------------------------------
@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    shutil.copytree(GOLDEN_V4, tmp_path / "s")
    return tmp_path / "s"


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "match"), [
    (lambda p: _flip(p / DICT_FILE, 100), "crc32c"),
    (lambda p: (p / DICT_FILE).write_bytes((p / DICT_FILE).read_bytes()[:-9]), "truncated"),
    (lambda p: (p / DICT_FILE).write_bytes(b""), "truncated"),
    (lambda p: (p / DICT_FILE).unlink(), DICT_FILE),
    (lambda p: (p / DICT_FILE).symlink_to(p / "manifest.json") if (p / DICT_FILE).unlink()
     is None else None, DICT_FILE),
], ids=["crc", "truncated", "empty", "missing", "symlink"])
def test_a_damaged_dictionary_file_is_refused_at_open(damaged: Path, damage, match: str) -> None:
    damage(damaged)
    for mode in ("r", "r+"):
        with pytest.raises(InvalidStoreError, match=match):
            ReplayStore.open(damaged, mode)
    assert not verify_store(damaged).ok


def _reseal_dictionary(root: Path, data: bytes, *, zarr_json: bool) -> None:
    """Replace the dictionary and its record (and, if asked, zarr.json's copy): damage an
    attacker made consistent, so only decoding can tell."""
    (root / DICT_FILE).write_bytes(data)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["dictionary"] = {"size": len(data), "crc32c": google_crc32c.value(data)}
    seal(root, manifest)
    if zarr_json:
        meta = json.loads((root / "frames" / "zarr.json").read_text())
        meta = mmreplay.storage.zstd_dict.with_dictionary(meta, data)
        (root / "frames" / "zarr.json").write_text(json.dumps(meta))


def test_a_resealed_dictionary_that_zarr_json_does_not_carry_is_refused(damaged: Path) -> None:
    _reseal_dictionary(damaged, b"\0" + os.urandom(600), zarr_json=False)
    with pytest.raises(InvalidStoreError, match="codecs"):
        ReplayStore.open(damaged, "r")


def test_a_resealed_damaged_trained_dictionary_is_refused(damaged: Path) -> None:
    data = bytearray((damaged / DICT_FILE).read_bytes())
    data[8:40] = b"\xff" * 32  # entropy tables
    _reseal_dictionary(damaged, bytes(data), zarr_json=True)
    with pytest.raises(InvalidStoreError, match="libzstd refuses"):
        ReplayStore.open(damaged, "r")


def test_a_resealed_wrong_dictionary_fails_on_read_not_silently(damaged: Path) -> None:
    _reseal_dictionary(damaged, b"\0" + os.urandom(600), zarr_json=True)  # raw content
    with ReplayStore.open(damaged, "r") as store:
        with pytest.raises(InvalidStoreError, match="does not decode .* dictionary"):
            store.get(store.valid_ids())
    assert not verify_store(damaged).ok


def test_a_chunk_that_decodes_to_the_wrong_size_is_refused(damaged: Path) -> None:
    dictionary = (damaged / DICT_FILE).read_bytes()
    zc = zstandard.ZstdCompressor(level=3, dict_data=zstandard.ZstdCompressionDict(dictionary))
    small = zc.compress(bytes(4 * 256 - 1))  # one byte short of a chunk
    for sealed in (small, zstandard.ZstdCompressor(
            level=3, dict_data=zstandard.ZstdCompressionDict(dictionary),
            write_content_size=False).compress(bytes(4 * 256 - 1))):
        path = damaged / "frames" / "c.0.0.0.0"
        shard = path.read_bytes()
        # a shard holds 4 chunks and an index: rebuild it with chunk 0 replaced
        index = np.frombuffer(shard[-(4 * 16 + 4):-4], "<u8").reshape(4, 2).copy()
        chunks = [shard[o:o + n] for o, n in index.tolist()]
        chunks[0] = sealed + google_crc32c.value(sealed).to_bytes(4, "little")
        offsets = np.cumsum([0] + [len(c) for c in chunks[:-1]])
        index = np.stack([offsets, [len(c) for c in chunks]], 1).astype("<u8").tobytes()
        path.write_bytes(b"".join(chunks) + index + google_crc32c.value(index).to_bytes(4,
                                                                                      "little"))
        with ReplayStore.open(damaged, "r") as store:
            with pytest.raises(InvalidStoreError, match="1024 bytes"):
                store.get(store.valid_ids())


@pytest.mark.parametrize("edit", ["missing", "on-lz4", "bad"])
def test_the_manifest_record_is_checked(tmp_path: Path, damaged: Path, edit: str) -> None:
    root = damaged
    if edit == "on-lz4":
        root = tmp_path / "lz4"
        ReplayStore.create(root, capacity=8, obs_shape=(2,), seed=0).close()
    manifest = json.loads((root / "manifest.json").read_text())
    if edit == "missing":
        del manifest["dictionary"]  # while chunks are on disk
    else:
        manifest["dictionary"] = {"size": 531, "crc32c": -1} if edit == "bad" else \
            EXPECTED_V4["dictionary"]
    seal(root, manifest)
    with pytest.raises(InvalidStoreError, match="dictionary"):
        ReplayStore.open(root, "r")


def test_a_kept_zstd_context_decodes_as_a_fresh_one_also_from_threads_at_once() -> None:
    """The codec keeps one ``ZSTD_DCtx`` across decodes; a second thread decoding at the same
    time gets a fresh one, and every result equals the frames (a shared context would mix
    two threads' chunks)."""
    import threading

    from mmreplay.spec import make_spec
    from mmreplay.storage.codec import ChunkCodec
    from mmreplay.storage.zstd_dict import train

    rng = np.random.default_rng(3)
    frames = rng.integers(0, 3, (64, 8, 84, 84), dtype=np.uint8).cumsum(axis=1, dtype=np.uint8)
    spec = make_spec(capacity=1024, obs_shape=(84, 84), chunk_frames=8, codec="zstd-dict")
    codec = ChunkCodec(spec, train(frames[:16].reshape(-1, 84, 84), 4096, 1))
    chunks = [np.frombuffer(codec.encode(f), np.uint8) for f in frames]
    src = np.array([c.ctypes.data for c in chunks], np.int64)
    size = np.array([c.size for c in chunks], np.int64)
    failures: list[str] = []

    def decode_all(turns: int) -> None:
        rows = np.empty((len(chunks), codec.nbytes), np.uint8)
        for _ in range(turns):
            rows[...] = 0
            status = codec.decode_many(src, size, rows, np.arange(len(chunks)))
            if status.any() or not np.array_equal(rows.reshape(frames.shape), frames):
                failures.append("a decode differs")

    decode_all(1)
    kept = codec._dctx_address()
    assert kept and codec._dctx_address() == kept  # made once, then reused
    workers = [threading.Thread(target=decode_all, args=(20,)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures
