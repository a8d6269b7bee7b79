"""Object storage: a flat namespace of keys and bytes, local or in an S3-compatible bucket.

`Objects` is the interface every remote operation of mmreplay uses (push, pull, mirror,
reading a store from a bucket); it knows keys and bytes only, never manifests or frames::

    list(prefix)                 {key: ObjectInfo(size, etag)}
    get(key) / get_ranges(key, starts, ends)
    put(key, data)               unconditional (whole object, atomic for readers)
    put_if_absent(key, data)     False if the key exists
    put_if_match(key, data, etag)  False if the key changed since `etag`
    delete(key)

Two implementations: `LocalObjects` (a directory; ``file://`` URLs) and `S3Objects`
(``s3://bucket/prefix`` through obstore, the Python binding of the Rust ``object_store``
crate). obstore is imported only when an ``s3://`` URL is opened, so ``import mmreplay``
and local stores never load it. Credentials come from the standard AWS environment
variables and an explicit ``storage_options`` mapping (which wins); they never appear in
a repr, an error message or anything written: messages from the client are scrubbed of
every secret value before they are raised, and a request the server refuses for its
credentials (HTTP 401/403: a wrong key or secret, a signature that does not match) raises
`ObjectAccessDeniedError`, which says so without quoting the server's answer (an S3 error
body may echo the access key and the string that was signed).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mmreplay.errors import InvalidInputError, ObjectStoreError

SCHEMES = ("s3", "file")
SECRET_OPTIONS = ("secret_access_key", "aws_secret_access_key", "session_token",
                  "aws_session_token", "token", "access_key_id", "aws_access_key_id")
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
GET_RETRIES = 3  # whole-request retries on top of the client's own, for reads
_KEY = re.compile(r"[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*")
_DENIED = re.compile(r"\b(401 Unauthorized|403 Forbidden)\b|SignatureDoesNotMatch|"
                     r"InvalidAccessKeyId|AccessDenied")
_S3_CODE = re.compile(r"<Code>([A-Za-z]{1,64})</Code>")


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing says about one object."""

    size: int
    etag: str | None  # None where the backend has none


class ObjectMissingError(ObjectStoreError, FileNotFoundError):
    """The key names no object."""


class ObjectChangedError(ObjectStoreError):
    """The object was replaced since the etag a conditional read named."""


class ObjectAccessDeniedError(ObjectStoreError, PermissionError):
    """The server refused the request's credentials (HTTP 401/403); retrying cannot help."""


def is_url(path: Any) -> bool:
    """Whether `path` is a URL mmreplay opens as object storage (``s3://``, ``file://``)."""
    return isinstance(path, str) and path.split("://", 1)[0] in SCHEMES and "://" in path


def open_objects(url: str, storage_options: Mapping[str, str] | None = None) -> Objects:
    """The object store a URL names: ``s3://bucket/prefix`` or ``file:///abs/dir``."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidInputError(f"file URLs name a local path (file:///dir), got {url!r}")
        return LocalObjects(Path(unquote(parts.path)))
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.fragment:
            raise InvalidInputError(f"expected s3://bucket/prefix, got {_clean_url(url)!r}")
        return S3Objects(parts.netloc, parts.path.strip("/"), dict(storage_options or {}))
    raise InvalidInputError(f"object storage URLs start with s3:// or file://, got "
                            f"{_clean_url(url)!r}")


def _clean_url(url: str) -> str:
    """A URL without any user:password part."""
    parts = urlsplit(url)
    return url.replace(parts.netloc, parts.netloc.rsplit("@", 1)[-1], 1) if "@" in \
        parts.netloc else url


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, of plain characters, with no '.' or '..' part."""
    if not _KEY.fullmatch(key) or any(p in (".", "..") for p in key.split("/")):
        raise InvalidInputError(f"invalid object key {key!r:.80}")
    return key


class Objects:
    """Keys and bytes under one prefix. Subclasses implement the six operations."""

    url: str  # the store's URL, free of credentials

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def get_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        raise NotImplementedError

    def get_suffix(self, key: str, size: int) -> tuple[bytes, ObjectInfo]:
        """The last `size` bytes of an object (all of it if shorter), and its size and etag."""
        raise NotImplementedError

    def get_range_if(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        """Bytes ``start:end`` of the object if its etag is still `etag`; else
        `ObjectChangedError`."""
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> str | None:
        """Write an object whole; returns its new etag (None where there is none)."""
        raise NotImplementedError

    def put_if_absent(self, key: str, data: bytes) -> bool:
        raise NotImplementedError

    def put_if_match(self, key: str, data: bytes, etag: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Delete an object; deleting a missing key is not an error."""
        raise NotImplementedError

    def head(self, key: str) -> ObjectInfo | None:
        """Size and etag of one object, None if the key names none."""
        return self.list(key).get(key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


# -- a directory ---------------------------------------------------------------------------
class LocalObjects(Objects):
    """Objects as files under a directory; a put is a temp file and a rename."""

    TMP = ".mmreplay-tmp"

    def __init__(self, root: Path) -> None:
        self.root = root.absolute()
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        for dirpath, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if d != self.TMP]
            for name in files:
                path = Path(dirpath, name)
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix) and not path.is_symlink():
                    info = path.stat()
                    out[key] = ObjectInfo(info.st_size, f"{info.st_mtime_ns:x}-{info.st_size:x}")
        return out

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissingError(f"{self.url}/{key} does not exist") from None
        except OSError as exc:
            raise ObjectStoreError(f"{self.url}/{key} cannot be read: {exc.strerror}") from None

    def get_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        try:
            with open(self._path(key), "rb") as f:
                return [os.pread(f.fileno(), e - s, s) for s, e in zip(starts, ends, strict=True)]
        except FileNotFoundError:
            raise ObjectMissingError(f"{self.url}/{key} does not exist") from None

    def get_suffix(self, key: str, size: int) -> tuple[bytes, ObjectInfo]:
        with self._exclusive():  # size, etag and bytes of one version
            data = self.get(key)
            return data[-size:] if size else b"", ObjectInfo(len(data), self._etag(key))

    def get_range_if(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        with self._exclusive():
            if etag is not None and self._etag(key) != etag:
                raise ObjectChangedError(f"{self.url}/{key} changed while it was read")
            return self.get_ranges(key, [start], [end])[0]

    def put(self, key: str, data: bytes) -> str | None:
        with self._exclusive():
            return self._put(key, data)

    def _put(self, key: str, data: bytes) -> str | None:
        path = self._write_tmp(key, data)
        os.replace(path, self._path(key))
        return self._etag(key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._write_tmp(key, data)
        try:
            os.link(path, self._path(key))  # atomic: fails if the name exists
            return True
        except FileExistsError:
            return False
        finally:
            path.unlink()

    def put_if_match(self, key: str, data: bytes, etag: str) -> bool:
        with self._exclusive():
            if self._etag(key) != etag:
                return False
            self._put(key, data)
            return True

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _etag(self, key: str) -> str | None:
        try:
            info = self._path(key).stat()
        except FileNotFoundError:
            return None
        return f"{info.st_mtime_ns:x}-{info.st_size:x}"

    def _write_tmp(self, key: str, data: bytes) -> Path:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = self.root / self.TMP
        tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir / f"{path.name}.{os.getpid()}.{time.monotonic_ns()}"
        tmp.write_bytes(data)
        return tmp

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        (self.root / self.TMP).mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / self.TMP / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


# -- an S3-compatible bucket through obstore ------------------------------------------------
class S3Objects(Objects):
    """``s3://bucket/prefix`` through obstore; the client retries with backoff, and reads
    are retried again whole (a connection cut mid-body is not retried by the client)."""

    def __init__(self, bucket: str, prefix: str, options: dict[str, str]) -> None:
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError:
            raise ImportError('s3:// URLs need obstore: pip install "mmreplay[cloud]"') from None
        self._ob = obstore
        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        self._prefix = prefix
        self._secrets = [v for k, v in options.items() if k.lower() in SECRET_OPTIONS and v]
        self._secrets += [os.environ[k] for k in SECRET_ENV if os.environ.get(k)]
        if os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://"):
            options.setdefault("allow_http", "true")
        with self._errors("configure"):
            self._store = S3Store(bucket, prefix=prefix or None, config=options,
                                  client_options={"timeout": "60s", "connect_timeout": "5s"},
                                  retry_config={"max_retries": 4, "retry_timeout":
                                                timedelta_s(30), "backoff": {
                                                    "init_backoff": timedelta_s(0.05),
                                                    "max_backoff": timedelta_s(2), "base": 2}})

    @contextmanager
    def _errors(self, what: str, key: str = "") -> Iterator[None]:
        """Client errors as `ObjectStoreError`s whose message carries no secret."""
        exceptions = self._ob.exceptions
        try:
            yield
        except (FileNotFoundError, exceptions.NotFoundError):
            raise ObjectMissingError(f"{self.url}/{key} does not exist") from None
        except (exceptions.AlreadyExistsError, exceptions.PreconditionError):
            raise  # the conditional puts answer these
        except Exception as exc:  # noqa: BLE001 -- obstore raises its own hierarchy
            if isinstance(exc, ObjectStoreError):
                raise
            text = " ".join(str(exc).split())
            if isinstance(exc, (exceptions.PermissionDeniedError,
                                exceptions.UnauthenticatedError)) or _DENIED.search(text):
                raise ObjectAccessDeniedError(self._denied(what, key, text)) from None
            for secret in self._secrets:
                text = text.replace(secret, "***")
            raise ObjectStoreError(f"{what} {self.url}/{key} failed: {text[:300]}") from None

    def _denied(self, what: str, key: str, text: str) -> str:
        """The message of a refused request: what was expected, what the server said (its
        S3 error code only), where the credentials come from."""
        code = _S3_CODE.search(text)
        said = code.group(1) if code else ("HTTP 401" if "401" in text else "HTTP 403")
        return (f"{what} {self.url}/{key}: access denied by the server ({said}): check the "
                f"credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or storage_options "
                f"access_key_id and secret_access_key) and that they give access to this bucket")

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""  # obstore lists folders
        with self._errors("list", prefix):
            for batch in self._ob.list(self._store, folder or None):
                for meta in batch:
                    if meta["path"].startswith(prefix):
                        out[meta["path"]] = ObjectInfo(int(meta["size"]), _etag(meta["e_tag"]))
        return out

    def head(self, key: str) -> ObjectInfo | None:
        try:
            with self._errors("head", key):
                meta = self._ob.head(self._store, check_key(key))
        except ObjectMissingError:
            return None
        return ObjectInfo(int(meta["size"]), _etag(meta["e_tag"]))

    def get(self, key: str) -> bytes:
        return self._retried("get", key, lambda: bytes(
            self._ob.get(self._store, check_key(key)).bytes()))

    def get_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        return self._retried("get ranges of", key, lambda: [bytes(b) for b in self._ob.get_ranges(
            self._store, check_key(key), starts=list(starts), ends=list(ends))])

    def _retried(self, what: str, key: str, read: Any) -> Any:
        for attempt in range(GET_RETRIES):
            try:
                with self._errors(what, key):
                    return read()
            except (ObjectMissingError, ObjectAccessDeniedError):
                raise
            except ObjectStoreError:
                if attempt + 1 == GET_RETRIES:
                    raise
                time.sleep(0.05 * 2 ** attempt)
        raise AssertionError("unreachable")

    def get_suffix(self, key: str, size: int) -> tuple[bytes, ObjectInfo]:
        def read() -> tuple[bytes, ObjectInfo]:
            result = self._ob.get(self._store, check_key(key), options={"range": {
                "suffix": size}})
            meta = result.meta
            return bytes(result.bytes()), ObjectInfo(int(meta["size"]), _etag(meta["e_tag"]))

        return self._retried("get the end of", key, read)  # type: ignore[no-any-return]

    def get_range_if(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        options: dict[str, Any] = {"range": (start, end)}
        if etag is not None:
            options["if_match"] = f'"{etag}"'
        try:
            return self._retried("get a range of", key, lambda: bytes(self._ob.get(
                self._store, check_key(key), options=options).bytes()))  # type: ignore[arg-type]
        except self._ob.exceptions.PreconditionError:
            raise ObjectChangedError(f"{self.url}/{key} changed while it was read") from None

    def put(self, key: str, data: bytes) -> str | None:
        with self._errors("put", key):
            return _etag(self._ob.put(self._store, check_key(key), data)["e_tag"])

    def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            with self._errors("put", key):
                self._ob.put(self._store, check_key(key), data, mode="create")
            return True
        except (self._ob.exceptions.AlreadyExistsError, self._ob.exceptions.PreconditionError):
            return False

    def put_if_match(self, key: str, data: bytes, etag: str) -> bool:
        try:
            with self._errors("put", key):
                self._ob.put(self._store, check_key(key), data, mode={"e_tag": f'"{etag}"'})
            return True
        except (self._ob.exceptions.PreconditionError, ObjectMissingError):
            return False

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self._ob.delete(self._store, check_key(key))


def _etag(raw: str | None) -> str | None:
    return None if raw is None else raw.strip('"')


def timedelta_s(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def md5_hex(data: bytes) -> str:
    """The etag S3-compatible servers give an object uploaded in one request."""
    return hashlib.md5(data, usedforsecurity=False).hexdigest()
