"""One chunk's bytes, exactly as zarr's codec chain of the spec makes them.

``bytes -> blosc(lz4) -> crc32c`` (codec ``"lz4"``, the default) or ``bytes -> zstd ->
crc32c``: what a chunk file holds (format 1) and what each chunk of a shard file holds
(format 2). Decoding checks the crc32c and blosc's header sizes before trusting a byte.

This module knows codecs only: no files, slots or shards.
"""

from __future__ import annotations

import ctypes
import math
import struct
from typing import Any

import google_crc32c
import numcodecs
import numpy as np
from numcodecs import blosc
from zarr.codecs import BloscCodec, ZstdCodec

from .errors import InvalidStoreError
from .spec import StoreSpec

BLOSC_HEADER = 16


def compressor(spec: StoreSpec) -> BloscCodec | ZstdCodec:
    if spec.codec == "zstd":
        return ZstdCodec(level=spec.codec_level)
    return BloscCodec(cname="lz4", clevel=spec.codec_level, shuffle="noshuffle", typesize=1,
                      blocksize=0)


def max_chunk_bytes(spec: StoreSpec) -> int:
    """Largest valid chunk file: zstd's compress bound of a raw chunk (above blosc's), plus
    the crc32c."""
    raw = spec.chunk_frames * math.prod(spec.obs_shape) * np.dtype(spec.obs_dtype).itemsize
    return raw + (raw >> 8) + max(0, (128 << 10) - raw) // 2048 + 4 + 512


def _blosc_decompress_ctx() -> Any:
    """numcodecs' own c-blosc ``blosc_decompress_ctx``, called directly: numcodecs'
    ``decompress`` spends ~2 µs per call on buffer checks (about a third of decoding an
    8-frame chunk). None where its extension does not export the symbol."""
    try:
        fn = ctypes.CDLL(blosc.__file__).blosc_decompress_ctx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_DECOMPRESS = _blosc_decompress_ctx()


class ChunkCodec:
    """Encodes and decodes one chunk exactly as zarr's codec chain of the spec does.

    ``bytes -> blosc(lz4) -> crc32c`` (codec ``"lz4"``) or ``bytes -> zstd -> crc32c``.
    """

    def __init__(self, spec: StoreSpec) -> None:
        self._lz4 = spec.codec == "lz4"
        self._inner = (numcodecs.Blosc(cname="lz4", clevel=spec.codec_level,
                                       shuffle=numcodecs.Blosc.NOSHUFFLE, blocksize=0)
                       if self._lz4 else numcodecs.Zstd(level=spec.codec_level))
        self._dtype = np.dtype(spec.obs_dtype).newbyteorder("<")
        self._shape = (spec.chunk_frames, *spec.obs_shape)
        self.nbytes = int(np.prod(self._shape)) * self._dtype.itemsize

    def encode(self, frames: np.ndarray) -> bytes:
        payload = bytes(self._inner.encode(
            np.ascontiguousarray(frames, dtype=self._dtype).tobytes()))
        return payload + struct.pack("<I", google_crc32c.value(payload))

    def decode(self, data: bytes, where: str) -> np.ndarray:
        out = np.empty(self._shape, self._dtype)
        self.decode_into(data, out.reshape(-1).view(np.uint8), where)
        return out

    def decode_into(self, data: bytes, out: np.ndarray, where: str) -> None:
        """Decode a chunk file's bytes into `out`, a C-contiguous uint8 array of nbytes."""
        if len(data) < 5:
            raise InvalidStoreError(f"frame chunk {where} is truncated ({len(data)} bytes)")
        payload = data[:-4]
        if google_crc32c.value(payload) != struct.unpack("<I", data[-4:])[0]:
            raise InvalidStoreError(f"frame chunk {where} fails its crc32c checksum")
        try:
            if self._lz4:
                self._blosc_into(payload, out, where)
                return
            raw = self._inner.decode(payload)
        except InvalidStoreError:
            raise
        except Exception as exc:  # numcodecs raises RuntimeError/ValueError on bad frames
            raise InvalidStoreError(f"frame chunk {where} does not decode: {exc}") from None
        if len(raw) != self.nbytes:
            raise InvalidStoreError(
                f"frame chunk {where} decodes to {len(raw)} bytes, expected {self.nbytes}")
        out[:] = np.frombuffer(raw, np.uint8)

    def _blosc_into(self, payload: bytes, out: np.ndarray, where: str) -> None:
        """Blosc into `out`, after checking the header's sizes (blosc trusts them)."""
        if len(payload) < BLOSC_HEADER:
            raise InvalidStoreError(f"frame chunk {where} is truncated ({len(payload)} bytes)")
        nbytes, _, cbytes = struct.unpack_from("<III", payload, 4)
        if nbytes != self.nbytes or cbytes != len(payload):
            raise InvalidStoreError(
                f"frame chunk {where}: blosc header says {nbytes} bytes from {cbytes}, expected "
                f"{self.nbytes} from {len(payload)}")
        assert out.flags.c_contiguous and out.nbytes == self.nbytes
        if _DECOMPRESS is None:
            blosc.decompress(payload, out)
        elif _DECOMPRESS(payload, out.ctypes.data, self.nbytes, 1) != self.nbytes:
            raise InvalidStoreError(f"frame chunk {where}: its blosc stream does not decode")
