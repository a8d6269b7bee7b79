"""The compiled kernels against plain numpy twins, and every way a chunk can fail to decode."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import pytest

from mmreplay import ReplayStore
from mmreplay.kernels import numba_kernels as kernels
from mmreplay.kernels import tree_kernels

N = 2 * 84 * 84  # one decoded chunk: 2 frames of 84x84 uint8


def chunk_bytes(frames: np.ndarray, codec: str = "lz4") -> bytes:
    """One chunk as the store writes it: codec stream, then the crc32c of that stream."""
    inner = (numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.NOSHUFFLE,
                             blocksize=0) if codec == "lz4" else numcodecs.Zstd(level=3))
    payload = bytes(inner.encode(frames.tobytes()))
    return payload + struct.pack("<I", google_crc32c.value(payload))


def decode(chunks: list[bytes], zstd: bool = False, dest: list[int] | None = None, *,
           ddict: int = 0) -> tuple[np.ndarray, np.ndarray]:
    bufs = [np.frombuffer(c, np.uint8) for c in chunks]  # alive for the call
    src = np.array([b.ctypes.data for b in bufs], np.int64)
    size = np.array([b.size for b in bufs], np.int64)
    rows = np.zeros((len(chunks) + 1, N), np.uint8)
    where = np.arange(len(chunks), dtype=np.int64) if dest is None else np.array(dest)
    codec = kernels.ZSTD_DICT if ddict else kernels.ZSTD if zstd else kernels.LZ4
    return kernels.decode_chunks(src, size, rows, where, codec, ddict), rows


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_decode_chunks_into_chosen_rows(codec: str) -> None:
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 4, N, dtype=np.uint8) for _ in range(3)]
    status, rows = decode([chunk_bytes(f, codec) for f in frames], codec == "zstd", [2, 0, 3])
    assert status.tolist() == [0, 0, 0]
    for row, f in zip([2, 0, 3], frames, strict=True):
        np.testing.assert_array_equal(rows[row], f)
    assert not rows[1].any()  # untouched


def test_each_damage_has_its_status_and_writes_nothing_else() -> None:
    good = chunk_bytes(np.arange(N, dtype=np.uint8) // 97)  # compressible: blosc compresses
    payload = bytearray(good[:-4])
    flipped = bytes(payload[:20]) + bytes([payload[20] ^ 1]) + bytes(payload[21:])
    lying = bytearray(payload)
    lying[4:8] = struct.pack("<I", N + 1)  # the header claims a bigger chunk
    broken = bytearray(payload)
    broken[16:] = b"\xff" * (len(broken) - 16)  # a stream that does not decode
    reseal = [bytes(b) + struct.pack("<I", google_crc32c.value(bytes(b))) for b in
              (lying, broken)]
    status, _ = decode([good, good[:10], flipped + good[-4:], *reseal])
    assert status.tolist() == [kernels.OK, kernels.TOO_SHORT, kernels.BAD_CRC,
                               kernels.BAD_HEADER, kernels.NO_DECODE]


def test_decode_prefixes_decodes_each_chunk_up_to_its_last_wanted_frame() -> None:
    """lz4 chunks compressed, stored as they are (incompressible) and all zeros: each row
    holds its chunk's frames up to the last frame read from it, as a whole decode would."""
    rng = np.random.default_rng(3)
    chunks = [np.arange(N, dtype=np.uint8) // 97, rng.integers(0, 256, N, dtype=np.uint8),
              np.zeros(N, np.uint8)]
    data = [chunk_bytes(c) for c in chunks]
    bufs = [np.frombuffer(c, np.uint8) for c in data]
    src = np.array([b.ctypes.data for b in bufs], np.int64)
    size = np.array([b.size for b in bufs], np.int64)
    half = N // 2
    for frame_rows in ([0, 2, 4], [1, 3, 4], [5, 0, 5, 2]):  # rows of 2 frames a chunk
        rows = np.full((3, N), 7, np.uint8)
        status = kernels.decode_prefixes(src, size, rows, np.array([1, 2, 0]),
                                         np.array(frame_rows, np.int64), 2)
        assert status.tolist() == [0, 0, 0]
        for chunk, row in zip(chunks, [1, 2, 0], strict=True):
            end = max((r % 2 + 1) * half for r in frame_rows if r // 2 == row)
            np.testing.assert_array_equal(rows[row, :end], chunk[:end])


def test_decode_prefixes_checks_the_whole_chunk_and_the_stream_it_reads() -> None:
    """The crc32c covers the whole chunk even when only its first frame is read; a stream
    broken where the read needs it does not decode."""
    good = chunk_bytes(np.arange(N, dtype=np.uint8) // 97)
    payload = bytearray(good[:-4])
    flipped = bytes(payload[:-1]) + bytes([payload[-1] ^ 1]) + good[-4:]  # in the tail
    broken = bytearray(payload)
    broken[24:] = b"\xff" * (len(broken) - 24)  # the lz4 stream itself
    resealed = bytes(broken) + struct.pack("<I", google_crc32c.value(bytes(broken)))
    bufs = [np.frombuffer(c, np.uint8) for c in (good, flipped, resealed)]
    src = np.array([b.ctypes.data for b in bufs], np.int64)
    size = np.array([b.size for b in bufs], np.int64)
    rows = np.zeros((3, N), np.uint8)
    status = kernels.decode_prefixes(src, size, rows, np.arange(3), np.array([0, 2, 4]), 2)
    assert status.tolist() == [kernels.OK, kernels.BAD_CRC, kernels.NO_DECODE]


def test_gather_frames_equals_numpy_fancy_index() -> None:
    """Every read's one gather (`table_kernels.gather_frames`): sources in the table, in the
    RAM tails (``-1 - t``) and the zero frame (past the tails) against numpy's fancy index
    of the table, tails and a zero row stacked."""
    from mmreplay.kernels import tables

    rng = np.random.default_rng(1)
    table = rng.integers(0, 256, (40, 84 * 84), dtype=np.uint8)
    tails = rng.integers(0, 256, (6, 84 * 84), dtype=np.uint8)
    src = rng.integers(-7, 40, 300)  # -7: past the 6 tails, the zero frame
    out = np.empty((300, 84 * 84), np.uint8)
    tables().gather_frames(table, tails, src, out, 0)
    whole = np.concatenate([table, tails, np.zeros((1, 84 * 84), np.uint8)])
    at = np.where(src >= 0, src, table.shape[0] + np.minimum(-1 - src, 6))
    np.testing.assert_array_equal(out, whole[at])


def test_a_read_after_the_writer_replaced_a_shard_sees_the_new_file(tmp_path) -> None:
    """A writer's shard write unmaps the old file; the next read maps the new one."""
    store = ReplayStore.create(tmp_path / "s", capacity=64, obs_shape=(3,), frame_stack=1,
                               chunk_frames=2, shard_chunks=4, seed=0)
    store.reset(np.zeros(3, np.uint8))
    for i in range(1, 200):  # three laps of the ring: every shard rewritten
        store.add(0, 0.0, np.full(3, i % 251, np.uint8), False, False)
        if i % 17 == 0:
            ids = store.valid_ids()
            got = store.get(ids)
            want = ids % 251  # transition t starts at frame t, which holds t (one episode)
            np.testing.assert_array_equal(got.obs[:, 0, 0].numpy(), want)
    store.close()


def test_import_and_info_never_load_the_compiled_kernels(tmp_path) -> None:
    """numba (its import and its cache load) is paid on a store's first read, never by
    ``import mmreplay`` or ``mmreplay info``."""
    import subprocess
    import sys

    store = ReplayStore.create(tmp_path / "s", capacity=64, obs_shape=(84, 84),
                               frame_stack=4, sampler="prioritized", seed=0)
    store.reset(np.zeros((84, 84), np.uint8))
    for i in range(40):
        store.add(0, 0.0, np.full((84, 84), i, np.uint8), False, False)
    store.close()
    code = ("import sys; from mmreplay.tools.cli import main; code = main(['info', sys.argv[1]]); "
            "print('numba' in sys.modules, 'mmreplay.kernels.numba_kernels' in sys.modules); "
            "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False False"


def test_dictionary_chunks_decode_with_their_dictionary_only() -> None:
    """ZSTD_DICT: chunks made with a dictionary decode with it; with another, or as plain
    zstd, they fail (status 4) and nothing is written."""
    import zstandard

    rng = np.random.default_rng(2)
    base = rng.integers(0, 4, N, dtype=np.uint8) * 60
    samples = [np.roll(base, k).tobytes()[:2000] for k in range(200)]
    trained = zstandard.train_dictionary(1024, samples).as_bytes()
    other = zstandard.train_dictionary(1024, [s[::-1] for s in samples]).as_bytes()
    frames = [np.roll(base, 7 * k) for k in range(3)]
    zc = zstandard.ZstdCompressor(level=3, dict_data=zstandard.ZstdCompressionDict(trained))
    chunks = [(p := zc.compress(f.tobytes())) + struct.pack("<I", google_crc32c.value(p))
              for f in frames]
    ddict, wrong = kernels.create_ddict(trained), kernels.create_ddict(other)
    try:
        assert ddict and wrong
        status, rows = decode(chunks, dest=[1, 2, 0], ddict=ddict)
        assert status.tolist() == [0, 0, 0]
        for row, f in zip([1, 2, 0], frames, strict=True):
            np.testing.assert_array_equal(rows[row], f)
        status, rows = decode(chunks, ddict=wrong)
        assert status.tolist() == [kernels.NO_DECODE] * 3 and not rows.any()
        status, _ = decode(chunks, zstd=True)  # no dictionary at all
        assert status.tolist() == [kernels.NO_DECODE] * 3
    finally:
        kernels.free_ddict(ddict)
        kernels.free_ddict(wrong)


def test_create_ddict_refuses_a_damaged_trained_dictionary() -> None:
    import zstandard

    rng = np.random.default_rng(4)
    samples = [(rng.integers(0, 3, 3000, dtype=np.uint8) * 80).tobytes() for _ in range(100)]
    trained = bytearray(zstandard.train_dictionary(1024, samples).as_bytes())
    trained[8:40] = b"\xff" * 32  # its entropy tables
    assert kernels.create_ddict(bytes(trained)) == 0


@pytest.mark.parametrize("n", [0, 1, 2, 7, 256, 1000])
def test_group_order_puts_equal_keys_together_in_first_appearance_order(n: int) -> None:
    rng = np.random.default_rng(n)
    for high in (1, 3, 50, 1 << 40):
        keys = rng.integers(0, high, n)
        order = kernels.group_order(keys)
        assert np.array_equal(np.sort(order), np.arange(n))  # every position once
        grouped = keys[order]
        starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]]) if n else []
        firsts = grouped[starts] if n else grouped
        assert len(set(firsts.tolist())) == len(firsts)  # one run per key
        _, first_seen = np.unique(keys, return_index=True)
        assert np.array_equal(firsts, keys[np.sort(first_seen)])
        for key in firsts:  # a run keeps its positions increasing
            run = order[grouped == key]
            assert np.array_equal(run, np.flatnonzero(keys == key))


MAX_KERNEL_PARAMS = 8


def _wide_kernels(source: str) -> list[str]:
    """The compiled functions (``@numba.njit``/``@njit``) in `source` taking more than
    `MAX_KERNEL_PARAMS` parameters, each as ``name(count)``."""
    wide = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        compiled = any("njit" in ast.unparse(d) for d in node.decorator_list)
        count = len(node.args.posonlyargs) + len(node.args.args) + len(node.args.kwonlyargs)
        if compiled and count > MAX_KERNEL_PARAMS:
            wide.append(f"{node.name}({count})")
    return wide


def test_no_kernel_takes_more_than_eight_parameters() -> None:
    """Kernel arguments come as named structures (`kernels.structs`), not long positional
    lists whose order every caller restates."""
    folder = Path(kernels.__file__).parent
    wide = {p.name: _wide_kernels(p.read_text()) for p in sorted(folder.glob("*.py"))}
    assert not {name: found for name, found in wide.items() if found}


def test_kernel_width_check_finds_a_wide_kernel() -> None:
    source = ("import numba\n@numba.njit(cache=True)\ndef wide(a, b, c, d, e, f, g, h, i):\n"
              "    pass\n@numba.njit\ndef narrow(a, b):\n    pass\n"
              "def plain(a, b, c, d, e, f, g, h, i):\n    pass\n")
    assert _wide_kernels(source) == ["wide(9)"]


def test_an_entry_asks_the_dispatcher_again_for_arrays_of_another_look() -> None:
    """`kernels.Entry` skips numba's typing only for arguments that look like its first
    call's: a strided array (whose strides the first call's compiled code would ignore)
    gets the dispatcher's own result, and so does an array of another dtype."""
    from mmreplay.kernels import Entry

    call = Entry(tree_kernels.tree_find)
    prefix = np.array([0.0, 1.0, 3.0, 6.0])  # one row of three children: masses 1, 2, 3
    off, fan = np.zeros(1, np.int64), np.array([3], np.int64)
    for targets in (np.array([0.5, 2.0, 5.9]),  # binds the entry
                    np.array([0.5, -1.0, 2.0, -1.0, 5.9, -1.0])[::2],  # strided
                    np.array([0.5, 2.0, 5.9], np.float32)):  # another dtype
        out = np.zeros(3, np.int64)
        call(prefix, off, fan, targets, out)
        assert out.tolist() == [0, 1, 2]
