"""The zarr v3 codec ``mmreplay.zstd_dict``: zstd with a dictionary carried in ``zarr.json``.

It is what lets plain zarr read a ``"zstd-dict"`` store's frames. The package registers it
under the entry point group ``zarr.codecs`` (``pyproject.toml``), so with mmreplay installed
``zarr.open_array(store / "frames")`` finds it without importing mmreplay; importing
`mmreplay.storage` registers it too. Its configuration::

    {"name": "mmreplay.zstd_dict",
     "configuration": {"level": 3, "dictionary": "<the dictionary's bytes in base64>"}}

``dictionary`` is absent until the store has trained its dictionary (no chunk exists then).
The chunk stream is a plain zstd frame made with that dictionary, so any zstd that is given
the dictionary (``zstd -d -D zstd.dict``) decodes it; see ``docs/compression.md``.

mmreplay's own read path never comes here: it decodes in the compiled kernel
(`mmreplay.kernels`); this codec is the zarr-facing twin.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import zstandard
from zarr.abc.codec import BytesBytesCodec
from zarr.core.common import JSON, parse_named_configuration
from zarr.registry import register_codec

from mmreplay.storage.zstd_dict import NAME, configuration

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer



@dataclass(frozen=True)
class ZstdDictCodec(BytesBytesCodec):
    """zstd at `level` with `dictionary` (raw bytes; None before one is trained)."""

    is_fixed_size = False

    level: int = 3
    dictionary: bytes | None = None

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        _, config = parse_named_configuration(data, NAME)
        level, text = config.get("level"), config.get("dictionary")
        if type(level) is not int or set(config) - {"level", "dictionary"}:
            raise ValueError(f"{NAME} takes an int level and a dictionary, got {config!r:.80}")
        if text is None:
            return cls(level=level)
        if not isinstance(text, str):
            raise ValueError(f"{NAME}: dictionary must be a base64 string")
        try:
            return cls(level=level, dictionary=base64.b64decode(text, validate=True))
        except binascii.Error as exc:
            raise ValueError(f"{NAME}: dictionary is not base64 ({exc})") from None

    def to_dict(self) -> dict[str, JSON]:
        return {"name": NAME, "configuration": configuration(self.level, self.dictionary)}

    @cached_property
    def _dict(self) -> zstandard.ZstdCompressionDict:
        if self.dictionary is None:
            raise ValueError(f"{NAME}: this array has no dictionary yet, so no chunks")
        return zstandard.ZstdCompressionDict(self.dictionary)

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        out = zstandard.ZstdDecompressor(dict_data=self._dict).decompress(
            chunk_bytes.as_numpy_array().tobytes())
        return chunk_spec.prototype.buffer.from_bytes(out)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return self._decode_sync(chunk_bytes, chunk_spec)

    def _encode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        out = zstandard.ZstdCompressor(level=self.level, dict_data=self._dict).compress(
            chunk_bytes.as_numpy_array().tobytes())
        return chunk_spec.prototype.buffer.from_bytes(out)

    async def _encode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        return self._encode_sync(chunk_bytes, chunk_spec)

    def compute_encoded_size(self, _input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError




register_codec(NAME, ZstdDictCodec)
