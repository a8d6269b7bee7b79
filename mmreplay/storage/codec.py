"""One chunk's bytes, exactly as zarr's codec chain of the spec makes them.

``bytes -> blosc(lz4) -> crc32c`` (codec ``"lz4"``, the default), ``bytes -> zstd ->
crc32c`` or ``bytes -> zstd with the store's dictionary -> crc32c`` (``"zstd-dict"``, format
4; see `zstd_dict`): what a chunk file holds (format 1) and what each chunk of a shard file
holds (format 2). Decoding checks the crc32c and the codec header's sizes before trusting a
byte.

This module knows codecs only: no files, slots or shards.
"""

from __future__ import annotations

import math
import struct
import weakref

import google_crc32c
import numcodecs
import numpy as np
import zstandard
from zarr.codecs import BloscCodec, ZstdCodec

from mmreplay.errors import InvalidStoreError
from mmreplay.kernels import compiled
from mmreplay.spec import StoreSpec
from mmreplay.storage.zarr_codec import ZstdDictCodec

_KINDS = {"lz4": 0, "zstd": 1, "zstd-dict": 2}  # the kernel's LZ4, ZSTD, ZSTD_DICT


def compressor(spec: StoreSpec,
               dictionary: bytes | None = None) -> BloscCodec | ZstdCodec | ZstdDictCodec:
    if spec.codec == "zstd-dict":
        return ZstdDictCodec(level=spec.codec_level, dictionary=dictionary)
    if spec.codec == "zstd":
        return ZstdCodec(level=spec.codec_level)
    return BloscCodec(cname="lz4", clevel=spec.codec_level, shuffle="noshuffle", typesize=1,
                      blocksize=0)


def max_chunk_bytes(spec: StoreSpec) -> int:
    """Largest valid chunk file: zstd's compress bound of a raw chunk (above blosc's), plus
    the crc32c."""
    raw = spec.chunk_frames * math.prod(spec.obs_shape) * np.dtype(spec.obs_dtype).itemsize
    return raw + (raw >> 8) + max(0, (128 << 10) - raw) // 2048 + 4 + 512


class ChunkCodec:
    """Encodes and decodes one chunk exactly as zarr's codec chain of the spec does.

    ``bytes -> blosc(lz4) -> crc32c`` (codec ``"lz4"``), ``bytes -> zstd -> crc32c``, or
    zstd with a dictionary (``"zstd-dict"``: set once with `set_dictionary` before the first
    chunk is encoded or decoded).
    """

    def __init__(self, spec: StoreSpec, dictionary: bytes | None = None) -> None:
        self.kind = _KINDS[spec.codec]
        self._lz4 = spec.codec == "lz4"
        self._level = spec.codec_level
        self._inner = (numcodecs.Blosc(cname="lz4", clevel=spec.codec_level,
                                       shuffle=numcodecs.Blosc.NOSHUFFLE, blocksize=0)
                       if self._lz4 else numcodecs.Zstd(level=spec.codec_level))
        self._dtype = np.dtype(spec.obs_dtype).newbyteorder("<")
        self._shape = (spec.chunk_frames, *spec.obs_shape)
        self.nbytes = int(np.prod(self._shape)) * self._dtype.itemsize
        self.dictionary: bytes | None = None
        self._zstd: zstandard.ZstdCompressor | None = None
        self._ddict = 0  # the kernel's prepared dictionary, made on the first decode
        if dictionary is not None:
            self.set_dictionary(dictionary)

    @property
    def needs_dictionary(self) -> bool:
        """A ``"zstd-dict"`` codec with no dictionary yet: it can encode nothing."""
        return self.kind == _KINDS["zstd-dict"] and self.dictionary is None

    def set_dictionary(self, dictionary: bytes) -> None:
        """The store's dictionary (fixed for its life)."""
        assert self.kind == _KINDS["zstd-dict"] and self.dictionary is None
        self.dictionary = dictionary
        self._zstd = zstandard.ZstdCompressor(
            level=self._level, dict_data=zstandard.ZstdCompressionDict(dictionary))

    def encode(self, frames: np.ndarray) -> bytes:
        raw = np.ascontiguousarray(frames, dtype=self._dtype).tobytes()
        if self.kind == _KINDS["zstd-dict"]:
            assert self._zstd is not None, "a zstd-dict chunk before the dictionary"
            payload = self._zstd.compress(raw)
        else:
            payload = bytes(self._inner.encode(raw))
        return payload + struct.pack("<I", google_crc32c.value(payload))

    def decode_many(self, src: np.ndarray, size: np.ndarray, rows: np.ndarray,
                    dest: np.ndarray) -> np.ndarray:
        """The compiled decode of chunks at addresses `src` into ``rows[dest]``: each
        chunk's status (`damage` says what a nonzero one means)."""
        return compiled().decode_chunks(src, size, rows, dest, self.kind, self._ddict_address())

    def _ddict_address(self) -> int:
        if self.kind != _KINDS["zstd-dict"] or self._ddict:
            return self._ddict
        if self.dictionary is None:
            raise InvalidStoreError("a zstd-dict store holds frame chunks but no dictionary")
        k = compiled()
        self._ddict = k.create_ddict(self.dictionary)
        if not self._ddict:
            raise InvalidStoreError("the store's zstd dictionary is not one libzstd accepts "
                                    "(damaged)")
        weakref.finalize(self, k.free_ddict, self._ddict)
        return self._ddict

    def decode(self, data: bytes, where: str) -> np.ndarray:
        """One chunk's frames from its bytes, through the compiled decode (`kernels`): the
        read path's one implementation of decoding; `InvalidStoreError` says what is wrong."""
        out = np.empty(self._shape, self._dtype)
        buf = np.frombuffer(data, np.uint8)  # alive for the call
        status = self.decode_many(
            np.array([buf.ctypes.data], np.int64), np.array([buf.size], np.int64),
            out.reshape(1, -1).view(np.uint8), np.zeros(1, np.int64))
        if status[0]:
            raise InvalidStoreError(self.damage(data, int(status[0]), where))
        return out

    def damage(self, data: bytes, status: int, where: str) -> str:
        """What is wrong with a chunk the decode kernel refused with `status`."""
        k = compiled()
        if status == k.TOO_SHORT:
            return f"frame chunk {where} is truncated ({len(data)} bytes)"
        if status == k.BAD_CRC:
            return f"frame chunk {where} fails its crc32c checksum"
        codec = "blosc" if self._lz4 else "zstd"
        if status == k.BAD_HEADER and self._lz4:
            nbytes, _, cbytes = struct.unpack_from("<III", data, 4)
            return (f"frame chunk {where}: blosc header says {nbytes} bytes from {cbytes}, "
                    f"expected {self.nbytes} from {len(data) - 4}")
        if status == k.BAD_HEADER:
            return f"frame chunk {where}: its zstd frame does not say {self.nbytes} bytes"
        if self.kind == _KINDS["zstd-dict"]:
            return (f"frame chunk {where}: its zstd frame does not decode to {self.nbytes} "
                    f"bytes with the store's dictionary")
        return f"frame chunk {where}: its {codec} stream does not decode"
