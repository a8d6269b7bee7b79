"""Reading a possibly hostile directory safely, and writing files atomically.

Every file is opened only if it is a regular file, without following symlinks and
without blocking (a FIFO cannot hang a reader), and read only up to a limit the
caller derives from the spec; JSON is parsed under duplicate-key and finite-number
rules; ``.npy`` headers are checked before any data is read and nothing is ever
unpickled. Every problem is an `InvalidStoreError` with a one-line message.
Writes go through a temp file and a rename. This module knows bytes and files only.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import stat
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.lib.format as npy_format

from mmreplay.errors import InvalidStoreError

TMP_DIR = "tmp"
TMP_SUFFIX = ".mmtmp"
MAX_NPY_HEADER = 1 << 14
Readable = io.RawIOBase | io.BufferedIOBase  # a file opened here, or a BytesIO of its head
_TMP_IDS = itertools.count()  # unique temp names across threads and stores in one process


def write_atomic(path: Path, data: bytes, tmp_dir: Path, *, durable: bool) -> None:
    """Write `data` to `path` through a temp file in `tmp_dir` and a rename.

    Readers never see a torn file; a crash leaves at most a temp file, which
    the next writable open sweeps (all temp files live in one directory).
    """
    tmp = tmp_dir / f"{path.name}.{os.getpid()}.{next(_TMP_IDS)}{TMP_SUFFIX}"
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- files: regular, not followed, bounded ------------------------------------------------
def check_dir(root: Path, name: str, *, required: bool) -> None:
    """``root/name`` must be a real directory (or absent, when not `required`)."""
    info = lstat_or_none(root / name, name)
    if info is None:
        if required:
            raise InvalidStoreError(f"directory {name}/ is missing")
        return
    if not stat.S_ISDIR(info.st_mode):
        raise InvalidStoreError(f"{name} is {file_kind(info.st_mode)}; expected a real directory")


def read_small(path: str | os.PathLike[str], where: str, limit: int) -> bytes:
    """All bytes of a regular file of at most `limit` bytes, in four system calls."""
    fd, size = open_bounded(path, where, limit)
    try:
        return read_at(fd, size, 0, where)
    finally:
        os.close(fd)


def open_bounded(path: str | os.PathLike[str], where: str, limit: int) -> tuple[int, int]:
    """A read-only descriptor of a regular file of at most `limit` bytes, and its size.

    A symlink fails the ``O_NOFOLLOW`` open, a FIFO (opened without blocking) or a
    device fails the ``fstat``, and a file over `limit` is refused before it is read.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise InvalidStoreError(f"{where} is missing") from None
    except (OSError, ValueError) as exc:
        info = lstat_or_none(Path(path), where)  # say what it is: a symlink, a socket, ...
        if info is not None and not stat.S_ISREG(info.st_mode):
            raise InvalidStoreError(
                f"{where} is {file_kind(info.st_mode)}; stores hold regular files") from None
        raise InvalidStoreError(f"{where} cannot be opened: {error_line(exc)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidStoreError(
                f"{where} is {file_kind(info.st_mode)}; stores hold regular files")
        if info.st_size > limit:
            raise InvalidStoreError(f"{where} is {info.st_size} bytes, more than the {limit} "
                                    "allowed")
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_at(fd: int, size: int, offset: int, where: str) -> bytes:
    """Exactly `size` bytes at `offset` of an open file (short reads are retried)."""
    try:
        data = os.pread(fd, size, offset)
        while len(data) < size:  # short reads: rare, but legal
            more = os.pread(fd, size - len(data), offset + len(data))
            if not more:
                raise InvalidStoreError(f"{where} shrank while it was read")
            data += more
        return data
    except OSError as exc:
        raise InvalidStoreError(f"{where} cannot be read: {error_line(exc)}") from None


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def lstat_or_none(path: Path, where: str) -> os.stat_result | None:
    """`os.lstat`, or None when `path` does not exist; other errors as `InvalidStoreError`."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidStoreError(f"{where} cannot be examined: {error_line(exc)}") from None


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages ("a symlink", "a FIFO", ...)."""
    kinds = [(stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")]
    return next((text for test, text in kinds if test(mode)), "not a regular file")


@contextmanager
def open_regular(path: Path, where: str) -> Iterator[tuple[Readable, int]]:
    """Open a regular file for reading: never a symlink, FIFO or device, never blocking."""
    info = lstat_or_none(path, where)
    if info is None:
        raise InvalidStoreError(f"{where} is missing")
    if not stat.S_ISREG(info.st_mode):
        raise InvalidStoreError(
                f"{where} is {file_kind(info.st_mode)}; stores hold regular files")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise InvalidStoreError(f"{where} cannot be opened: {error_line(exc)}") from None
    with io.FileIO(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped after the lstat
            raise InvalidStoreError(
                f"{where} is {file_kind(info.st_mode)}; stores hold regular files")
        yield f, info.st_size


def _read_exact(f: Readable, size: int, where: str) -> bytearray:
    buf = bytearray(size)
    _read_into(f, memoryview(buf), where)
    return buf


def _read_into(f: Readable, view: memoryview, where: str) -> None:
    got = 0
    try:
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise InvalidStoreError(f"{where} shrank while it was read")
            got += n
    except OSError as exc:
        raise InvalidStoreError(f"{where} cannot be read: {error_line(exc)}") from None


def error_line(exc: BaseException) -> str:
    """An exception's message on one short line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def safe_path(root: Path, name: Any) -> Path:
    """`root/name` for a manifest-named file; refuses absolute, `..`, odd names and symlinks."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        raise InvalidStoreError(f"manifest names an invalid file {name!r:.80}")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts) or not name.isprintable():
        raise InvalidStoreError(f"manifest names an invalid file {name!r:.80}")
    for depth in range(1, len(parts)):
        check_dir(root, "/".join(parts[:depth]), required=True)
    path = root.joinpath(*parts)
    info = lstat_or_none(path, name)
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise InvalidStoreError(f"{name} is a symlink; stores never contain symlinks")
    return path


# -- JSON ---------------------------------------------------------------------------------
def parse_json(data: bytes | bytearray, where: str) -> Any:
    """UTF-8 JSON with no duplicate keys, NaN or infinities."""
    try:
        return json.loads(bytes(data).decode("utf-8"), object_pairs_hook=_unique_keys,
                          parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidStoreError(f"{where} is not valid JSON: {error_line(exc)}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys in an object")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def strict_equal(a: Any, b: Any) -> bool:
    """JSON equality that tells bools from ints and ints from floats."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(strict_equal, a, b))
    return bool(a == b)


# -- .npy files ---------------------------------------------------------------------------
def save_npy(root: Path, name: str, array: np.ndarray, tmp_dir: Path, *, durable: bool) -> int:
    """Write `array` as ``root/name`` (.npy, no pickle); returns its crc32."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    data = buf.getvalue()
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, tmp_dir, durable=durable)
    return zlib.crc32(data)


def load_npy(root: Path, name: str, crc: Any, *, dtype: np.dtype,
             shape: tuple[int, ...]) -> np.ndarray:
    """Read a small file the manifest names: header (dtype, shape) first, then at most the
    bytes that header implies, then crc32 and exact size."""
    with open_regular(safe_path(root, name), name) as (f, size):
        head = _read_exact(f, min(size, MAX_NPY_HEADER + 64), name)
        offset = check_npy_header(io.BytesIO(head), size, name, dtype, shape)
        data = bytearray(size)
        data[:len(head)] = head
        _read_into(f, memoryview(data)[len(head):], name)
    if zlib.crc32(data) != crc:
        raise InvalidStoreError(f"{name} fails its crc32 checksum (damaged or replaced)")
    if size != offset + dtype.itemsize * math.prod(shape):
        raise InvalidStoreError(f"{name} is {size} bytes, not the size its header implies")
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape)


def check_npy_header(f: Readable, size: int, name: str, dtype: np.dtype,
                      shape: tuple[int, ...]) -> int:
    """Check a .npy header against the expected dtype and shape; returns the data offset.

    Refuses files larger than that header implies, so nothing big is ever read.
    """
    got_shape, fortran, got_dtype = _read_npy_header(f, name)
    if got_dtype.hasobject or got_dtype != dtype or tuple(got_shape) != shape or fortran:
        order = " (Fortran order)" if fortran else ""
        raise InvalidStoreError(f"{name} holds {got_dtype}{tuple(got_shape)!r:.60}{order}, "
                                f"expected {dtype}{shape}")
    offset = f.tell()
    if size > offset + dtype.itemsize * math.prod(shape):
        raise InvalidStoreError(f"{name} is {size} bytes, more than its header implies")
    return offset


_HEADERS: dict[bytes, tuple[Any, bool, np.dtype]] = {}  # raw header -> parsed (a store's
# step blocks share a handful of headers: an open of 1M steps parses ~500 of them)


def _read_npy_header(f: Readable, name: str) -> tuple[Any, bool, np.dtype]:
    raw = f.read(MAX_NPY_HEADER + 64)
    end = _npy_header_end(raw)
    parsed = _HEADERS.get(raw[:end]) if end else None
    if parsed is not None:
        f.seek(end)  # the readers here start at offset 0 (a file, or BytesIO of its head)
        return parsed
    parsed = _parse_npy_header(io.BytesIO(raw), f, name)
    if end and f.tell() == end and len(_HEADERS) < 256:
        _HEADERS[raw[:end]] = parsed
    return parsed


def _npy_header_end(raw: bytes) -> int:
    """Where a .npy header ends, from its magic and length field (0 if they are not there)."""
    if len(raw) < 12 or raw[:6] != b"\x93NUMPY" or raw[6:8] not in (b"\x01\x00", b"\x02\x00"):
        return 0
    end = (10 + int.from_bytes(raw[8:10], "little")) if raw[6] == 1 else \
        (12 + int.from_bytes(raw[8:12], "little"))
    return end if end <= len(raw) else 0


def _parse_npy_header(head: io.BytesIO, f: Readable, name: str) -> tuple[Any, bool, np.dtype]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # headers that need Python 2 repair are refused
            version = npy_format.read_magic(head)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy format version {version}")
            reader = (npy_format.read_array_header_1_0 if version == (1, 0)
                      else npy_format.read_array_header_2_0)
            got_shape, fortran, got_dtype = reader(head, max_header_size=MAX_NPY_HEADER)
    except Exception as exc:  # noqa: BLE001 -- numpy parses untrusted bytes (ast, tokenize,
        # dtype); whatever it raises means the header is not one a store writes
        raise InvalidStoreError(f"{name} is not a valid .npy file: {error_line(exc)}") from None
    f.seek(head.tell())
    return got_shape, fortran, got_dtype


def is_json(value: Any, kind: type | tuple[type, ...]) -> bool:
    """isinstance for JSON values, where a bool is neither an int nor a float."""
    return isinstance(value, kind) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    """The JSON type name of a parsed value, for messages ("object", "int", ...)."""
    return {dict: "object", list: "array", str: "string", bool: "bool", int: "int",
            float: "float", type(None): "null"}.get(type(value), type(value).__name__)
