"""One chunk's bytes, exactly as zarr's codec chain of the spec makes them.

``bytes -> blosc(lz4) -> crc32c`` (codec ``"lz4"``, the default; ``"lz4hc"``: blosc's lz4hc,
the same lz4 format, format 5), ``bytes -> zstd ->
crc32c`` or ``bytes -> zstd with the store's dictionary -> crc32c`` (``"zstd-dict"``, format
4; see `zstd_dict`): what a chunk file holds (format 1) and what each chunk of a shard file
holds (format 2). Decoding checks the crc32c and the codec header's sizes before trusting a
byte: through the compiled kernel on the read path (`decode`), through numcodecs and
zstandard in `verify` (`check`, the same checks and messages without loading numba).

This module knows codecs only: no files, slots or shards.
"""

from __future__ import annotations

import math
import struct
import threading
import weakref
from typing import TYPE_CHECKING

import google_crc32c
import numcodecs
import numpy as np
import zstandard

from mmreplay import kernels
from mmreplay.errors import InvalidStoreError
from mmreplay.kernels import compiled
from mmreplay.spec import StoreSpec

# the kernel's LZ4, ZSTD, ZSTD_DICT: "lz4hc" writes the lz4 format, decoded as "lz4"
_KINDS = {"lz4": 0, "lz4hc": 0, "zstd": 1, "zstd-dict": 2}

BLOSC_HEADER = 16  # bytes of a blosc chunk header

if TYPE_CHECKING:
    from zarr.codecs import BloscCodec, ZstdCodec

    from mmreplay.storage.zarr_codec import ZstdDictCodec


def compressor(spec: StoreSpec,
               dictionary: bytes | None = None) -> BloscCodec | ZstdCodec | ZstdDictCodec:
    """zarr's codec object for the spec (zarr imported here: only `create` needs it)."""
    from zarr.codecs import BloscCodec, ZstdCodec

    from mmreplay.storage.zarr_codec import ZstdDictCodec

    if spec.codec == "zstd-dict":
        return ZstdDictCodec(level=spec.codec_level, dictionary=dictionary)
    if spec.codec == "zstd":
        return ZstdCodec(level=spec.codec_level)
    return BloscCodec(cname=spec.codec, clevel=spec.codec_level, shuffle="noshuffle",
                      typesize=1, blocksize=0)


def max_chunk_bytes(spec: StoreSpec) -> int:
    """Largest valid chunk file: zstd's compress bound of a raw chunk (above blosc's), plus
    the crc32c."""
    raw = spec.chunk_frames * math.prod(spec.obs_shape) * np.dtype(spec.obs_dtype).itemsize
    return raw + (raw >> 8) + max(0, (128 << 10) - raw) // 2048 + 4 + 512


class ChunkCodec:
    """Encodes and decodes one chunk exactly as zarr's codec chain of the spec does.

    ``bytes -> blosc(lz4) -> crc32c`` (codec ``"lz4"``; ``"lz4hc"`` with blosc's lz4hc),
    ``bytes -> zstd -> crc32c``, or
    zstd with a dictionary (``"zstd-dict"``: set once with `set_dictionary` before the first
    chunk is encoded or decoded).
    """

    def __init__(self, spec: StoreSpec, dictionary: bytes | None = None) -> None:
        self.kind = _KINDS[spec.codec]
        self._lz4 = self.kind == _KINDS["lz4"]
        self._level = spec.codec_level
        self._inner = (numcodecs.Blosc(cname=spec.codec, clevel=spec.codec_level,
                                       shuffle=numcodecs.Blosc.NOSHUFFLE, blocksize=0)
                       if self._lz4 else numcodecs.Zstd(level=spec.codec_level))
        self._dtype = np.dtype(spec.obs_dtype).newbyteorder("<")
        self._shape = (spec.chunk_frames, *spec.obs_shape)
        self.nbytes = int(np.prod(self._shape)) * self._dtype.itemsize
        self.dictionary: bytes | None = None
        self._zstd: zstandard.ZstdCompressor | None = None
        self._ddict = 0  # the kernel's prepared dictionary, made on the first decode
        self._dctx = 0  # a zstd context kept across decodes (one thread at a time)
        self._dctx_lock = threading.Lock()
        if dictionary is not None:
            self.set_dictionary(dictionary)

    @property
    def lz4(self) -> bool:
        """lz4 chunks: a read may decode each only up to its last frame it takes."""
        return self._lz4

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
        chunk's status (`damage` says what a nonzero one means).

        zstd chunks use the codec's own ``ZSTD_DCtx`` (warm from the last call: ~0.5 µs a
        chunk less than a fresh one); a thread that finds it busy gets a fresh one."""
        ddict = self._ddict_address()
        if self._lz4 or not self._dctx_lock.acquire(blocking=False):
            return compiled().decode_chunks(src, size, rows, dest, self.kind, ddict, 0)
        try:
            return compiled().decode_chunks(src, size, rows, dest, self.kind, ddict,
                                            self._dctx_address())
        finally:
            self._dctx_lock.release()

    def decode_prefixes(self, src: np.ndarray, size: np.ndarray, rows: np.ndarray,
                        dest: np.ndarray, frame_rows: np.ndarray) -> np.ndarray:
        """`decode_many` for one read whose frames are ``frame_rows`` (rows of `rows` seen
        as one frame each): an lz4 chunk is decoded only up to the last frame the read
        takes from it (rows are left partly stale: never keep them); zstd chunks whole."""
        if not self._lz4:
            return self.decode_many(src, size, rows, dest)
        return compiled().decode_prefixes(src, size, rows, dest, frame_rows, self._shape[0])

    def _dctx_address(self) -> int:
        """The codec's ``ZSTD_DCtx``, made on first use (0 when libzstd cannot: the
        kernel then makes one per call)."""
        if not self._dctx:
            k = compiled()
            self._dctx = k.create_dctx()
            if self._dctx:
                weakref.finalize(self, k.free_dctx, self._dctx)
        return self._dctx

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

    def check(self, data: bytes, where: str) -> np.ndarray:
        """What `decode` returns, through numcodecs instead of the compiled kernel.

        The twin of the kernel's decode, for `mmreplay verify`: it checks the same things
        in the same order and says the same, loads no numba (a one-off check of each chunk
        gains nothing from compiling, and the command starts in a third of the time), and
        judges the files with a second implementation of the codec chain.
        """
        status, out = self._check_status(data)
        if status:
            raise InvalidStoreError(self.damage(data, status, where))
        return out.reshape(self._shape)

    def _check_status(self, data: bytes) -> tuple[int, np.ndarray]:
        payload = len(data) - 4
        empty = np.empty(0, self._dtype)
        if payload < (1 if not self._lz4 else BLOSC_HEADER):
            return kernels.TOO_SHORT, empty
        if google_crc32c.value(data[:payload]) != struct.unpack_from("<I", data, payload)[0]:
            return kernels.BAD_CRC, empty
        if self._lz4 and struct.unpack_from("<III", data, 4)[::2] != (self.nbytes, payload):
            return kernels.BAD_HEADER, empty
        if not self._lz4 and zstd_content_size(data[:payload]) != self.nbytes:
            return kernels.BAD_HEADER, empty
        try:
            raw = self._check_decode(data[:payload])
        except (RuntimeError, ValueError, TypeError, zstandard.ZstdError):
            return kernels.NO_DECODE, empty
        if len(raw) != self.nbytes:
            return kernels.NO_DECODE, empty
        return kernels.OK, np.frombuffer(raw, self._dtype)

    def _check_decode(self, payload: bytes) -> bytes:
        if self.kind != _KINDS["zstd-dict"]:
            return bytes(self._inner.decode(payload))
        if self.dictionary is None:
            raise InvalidStoreError("a zstd-dict store holds frame chunks but no dictionary")
        dictionary = zstandard.ZstdCompressionDict(self.dictionary)
        return zstandard.ZstdDecompressor(dict_data=dictionary).decompress(
            payload, max_output_size=self.nbytes)

    def damage(self, data: bytes, status: int, where: str) -> str:
        """What is wrong with a chunk the decode refused with `status` (`kernels`)."""
        k = kernels
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


ZSTD_MAGIC = 0xFD2FB528


def zstd_content_size(frame: bytes) -> int | None:
    """The decompressed size a zstd frame's header declares (RFC 8878 3.1.1.1), or None when
    the header is malformed or declares none (as ``ZSTD_getFrameContentSize`` reports)."""
    if len(frame) < 5 or struct.unpack_from("<I", frame)[0] != ZSTD_MAGIC:
        return None
    descriptor = frame[4]
    single_segment = descriptor >> 5 & 1
    size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
    start = 5 + (1 - single_segment) + (0, 1, 2, 4)[descriptor & 3]  # window, dictionary id
    if size_bytes == 0 or len(frame) < start + size_bytes:
        return None
    value = int.from_bytes(frame[start:start + size_bytes], "little")
    return value + 256 if size_bytes == 2 else value
