"""What `import mmreplay` and the inspecting `mmreplay` verbs load: no torch, numba or partners.

torch alone costs over a second; the CLI pays it only where a torch batch is built (`sample`,
`show ID`). `verify` checks chunks with `ChunkCodec.check`, the numcodecs twin of the
compiled decode, whose verdicts must be the kernel's.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import pytest

from mmreplay import Batch, ReplayStore, SequenceBatch
from mmreplay.errors import InvalidStoreError
from mmreplay.kernels import numba_kernels
from mmreplay.spec import make_spec
from mmreplay.storage.codec import ChunkCodec

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numba", "llvmlite", "ray", "minari", "stable_baselines3", "gymnasium", "zarr")
PROBE = f"""
import json, sys
from mmreplay.tools.cli import main
code = main(sys.argv[1:])
loaded = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps({{"code": code, "loaded": loaded}}), file=sys.stderr)
"""


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def loaded_by(argv: list[str]) -> dict[str, object]:
    proc = run_python("-c", PROBE, *argv)
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "s"
    with ReplayStore.create(path, capacity=64, obs_shape=(8, 8), frame_stack=2,
                            chunk_frames=4, seed=0) as store:
        store.reset(np.zeros((8, 8), np.uint8))
        for i in range(40):
            store.add(i % 3, 1.0, np.full((8, 8), i, np.uint8), i % 13 == 12, False,
                      autoreset=i % 13 == 0 and i > 0)
    return path


def test_import_mmreplay_loads_no_torch() -> None:
    proc = run_python("-c", "import mmreplay, sys; "
                            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("verb", ["info", "episodes", "verify", "--version"])
def test_inspecting_verbs_load_no_torch_numba_or_partners(small_store: Path, verb: str) -> None:
    argv = [verb] if verb == "--version" else [verb, str(small_store)]
    got = loaded_by(argv)
    assert got == {"code": 0, "loaded": []}


@pytest.mark.integration
def test_sample_still_builds_torch_batches(small_store: Path) -> None:
    """torch is loaded where a batch is built, and the batch is torch tensors."""
    got = loaded_by(["sample", str(small_store), "--batch-size", "4"])
    assert got["code"] == 0 and "torch" in got["loaded"]  # type: ignore[operator]
    with ReplayStore.open(small_store, mode="r") as store:
        batch = store.sample(4)
        seqs = store.sample_sequences(2, 3)
    import torch

    assert isinstance(batch, Batch) and isinstance(batch.obs, torch.Tensor)
    assert isinstance(seqs, SequenceBatch) and seqs.obs.dtype == torch.uint8


# -- the numcodecs twin of the compiled decode ------------------------------------------------
def chunk(frames: np.ndarray, codec: str) -> bytes:
    inner = (numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.NOSHUFFLE,
                             blocksize=0) if codec == "lz4" else numcodecs.Zstd(level=3))
    payload = bytes(inner.encode(frames.tobytes()))
    return payload + struct.pack("<I", google_crc32c.value(payload))


def damaged(good: bytes) -> list[bytes]:
    """Too short, a flipped bit, a header that lies about the size, a stream that does not
    decode (the last two resealed with a right crc32c)."""
    payload = bytearray(good[:-4])
    flipped = bytes(payload[:20]) + bytes([payload[20] ^ 1]) + bytes(payload[21:]) + good[-4:]
    lying = bytearray(payload)
    lying[4:8] = struct.pack("<I", struct.unpack_from("<I", payload, 4)[0] + 1)
    broken = bytearray(payload)
    broken[16:] = b"\xff" * (len(broken) - 16)
    reseal = [bytes(b) + struct.pack("<I", google_crc32c.value(bytes(b))) for b in
              (lying, broken)]
    return [good[:10], flipped, *reseal]


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_check_agrees_with_the_compiled_decode(codec: str) -> None:
    spec = make_spec(capacity=64, obs_shape=(84, 84), chunk_frames=2, codec=codec)
    twin = ChunkCodec(spec)
    frames = (np.arange(2 * 84 * 84, dtype=np.int64) // 97 % 256).astype(np.uint8)
    good = chunk(frames, codec)
    np.testing.assert_array_equal(twin.check(good, "c"), frames.reshape(2, 84, 84))
    np.testing.assert_array_equal(twin.check(good, "c"), twin.decode(good, "c"))
    for bad in damaged(good):
        with pytest.raises(InvalidStoreError) as compiled_err:
            twin.decode(bad, "c")
        with pytest.raises(InvalidStoreError) as twin_err:
            twin.check(bad, "c")
        assert str(twin_err.value) == str(compiled_err.value)
    assert numba_kernels.OK == 0  # the statuses are still the kernel module's names
