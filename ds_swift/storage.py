"""The global store for message-log chunks: ``file://`` (shared FS), ``hdfs://`` (WebHDFS), ``s3://``, ``memory://``.

A replacement machine downloads the chunks it needs from here, so every object is stored with a
sidecar ``NAME.crc32c`` (JSON: size and crc32c of the content) and every download is verified
against it: a truncated or bit-flipped chunk must fail loudly, never be replayed. Every error is a
:class:`StorageError` whose message names the store URL (and object) and what went wrong:
unreachable, missing, corrupt, or out of space.

Backends are small: :class:`StorageBackend` has byte-level put/get/list/delete/size. fsspec covers
``file``, ``memory`` and ``s3`` (through s3fs, when installed); ``hdfs``/``webhdfs`` go through the
``hdfs`` package's WebHDFS client (``hdfs://namenode:9870/path`` talks HTTP to port 9870, the
namenode's WebHDFS port; the user comes from ``HADOOP_USER_NAME``).
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import crc32c as _crc32c

__all__ = [
    "ChecksumError",
    "FsspecBackend",
    "HdfsBackend",
    "MissingObjectError",
    "Store",
    "StorageBackend",
    "StorageError",
    "StorageFullError",
    "StorageUnreachableError",
    "file_crc32c",
    "local_path_of",
    "open_store",
]

CRC_SUFFIX = ".crc32c"
_BLOCK = 4 << 20


class StorageError(OSError):
    """A store operation failed; the message names the store URL and the object."""


class StorageUnreachableError(StorageError):
    """The store cannot be contacted (connection refused, DNS, missing client package)."""


class MissingObjectError(StorageError, FileNotFoundError):
    """The object (or its checksum sidecar) does not exist in the store."""


class ChecksumError(StorageError):
    """An object's content does not match its recorded size or crc32c."""


class StorageFullError(StorageError):
    """ENOSPC / quota exceeded while writing."""


def file_crc32c(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(size, crc32c) of a local file, streamed."""
    crc = 0
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = _crc32c.crc32c(block, crc)
            size += len(block)
    return size, crc


# --------------------------------------------------------------------------- backends
class StorageBackend(ABC):
    """Byte-level access to one store root. Names are '/'-separated, relative to the root.

    Implementations raise FileNotFoundError for missing objects and let other errors through;
    :class:`Store` turns them into StorageErrors that name the URL.
    """

    @abstractmethod
    def put_file(self, local_path: str, name: str) -> None:
        """Upload a local file to ``name`` (overwriting)."""

    @abstractmethod
    def get_file(self, name: str, local_path: str) -> None:
        """Download ``name`` to a local file."""

    @abstractmethod
    def write_bytes(self, name: str, data: bytes) -> None: ...

    @abstractmethod
    def read_bytes(self, name: str) -> bytes: ...

    @abstractmethod
    def list(self) -> list[str]:
        """Names of all objects directly under the root."""

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size in bytes, None when the object does not exist."""

    def probe(self) -> None:
        """Contact the store (creating the root if needed); raise when it is unreachable."""
        self.list()


class FsspecBackend(StorageBackend):
    """Any fsspec filesystem: local files, memory, s3 (s3fs)."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"

    def _p(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def probe(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        self.list()

    def put_file(self, local_path: str, name: str) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        with open(local_path, "rb") as src, self.fs.open(self._p(name), "wb") as dst:
            shutil.copyfileobj(src, dst, _BLOCK)

    def get_file(self, name: str, local_path: str) -> None:
        with self.fs.open(self._p(name), "rb") as src, open(local_path, "wb") as dst:
            shutil.copyfileobj(src, dst, _BLOCK)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        with self.fs.open(self._p(name), "wb") as f:
            f.write(data)

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open(self._p(name), "rb") as f:
            return bytes(f.read())

    def list(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root, detail=False))

    def delete(self, name: str) -> None:
        self.fs.rm(self._p(name))

    def size(self, name: str) -> int | None:
        path = self._p(name)
        if not self.fs.exists(path):
            return None
        return int(self.fs.size(path))


class HdfsBackend(StorageBackend):
    """WebHDFS through the ``hdfs`` package's ``Client`` (or anything with the same methods)."""

    def __init__(self, client: Any, root: str) -> None:
        self.client = client
        self.root = root.rstrip("/") or "/"

    def _p(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def probe(self) -> None:
        self.client.makedirs(self.root)
        self.list()

    def put_file(self, local_path: str, name: str) -> None:
        with open(local_path, "rb") as src:
            self.client.write(self._p(name), data=src, overwrite=True)

    def get_file(self, name: str, local_path: str) -> None:
        if self.client.status(self._p(name), strict=False) is None:
            raise FileNotFoundError(name)
        with self.client.read(self._p(name)) as src, open(local_path, "wb") as dst:
            shutil.copyfileobj(src, dst, _BLOCK)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.client.write(self._p(name), data=data, overwrite=True)

    def read_bytes(self, name: str) -> bytes:
        if self.client.status(self._p(name), strict=False) is None:
            raise FileNotFoundError(name)
        with self.client.read(self._p(name)) as src:
            return bytes(src.read())

    def list(self) -> list[str]:
        if self.client.status(self.root, strict=False) is None:
            return []
        return sorted(self.client.list(self.root))

    def delete(self, name: str) -> None:
        if not self.client.delete(self._p(name)):
            raise FileNotFoundError(name)

    def size(self, name: str) -> int | None:
        status = self.client.status(self._p(name), strict=False)
        return None if status is None else int(status["length"])


# --------------------------------------------------------------------------- the store
@dataclass(frozen=True)
class StoredObject:
    name: str
    size: int


class Store:
    """Checksummed objects in one store root (see the module docstring)."""

    def __init__(self, url: str, backend: StorageBackend) -> None:
        self.url = url
        self.backend = backend

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @contextmanager
    def _errors(self, action: str, name: str | None = None) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            raise self._translate(exc, action, name) from exc

    def _translate(self, exc: Exception, action: str, name: str | None) -> StorageError:
        where = f"{self.url.rstrip('/')}/{name}" if name else self.url
        # requests' connection errors are OSErrors without an errno: test them first
        if _is_connection_error(exc) or (
            isinstance(exc, OSError)
            and exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT)
        ):
            return StorageUnreachableError(
                errno.ECONNREFUSED, f"log store {self.url} is unreachable: {type(exc).__name__}: {exc}"
            )
        if isinstance(exc, FileNotFoundError):
            return MissingObjectError(errno.ENOENT, f"log store: {action} {where}: no such object")
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StorageFullError(exc.errno, f"log store: {action} {where}: out of space ({exc})")
        if isinstance(exc, OSError):
            return StorageError(exc.errno, f"log store: {action} {where} failed: {exc}")
        return StorageError(errno.EIO, f"log store: {action} {where} failed: {type(exc).__name__}: {exc}")

    def probe(self) -> None:
        """Raise StorageUnreachableError (naming the URL) unless the store answers."""
        with self._errors("probe"):
            self.backend.probe()

    def names(self) -> list[str]:
        """Object names (checksum sidecars excluded)."""
        with self._errors("list"):
            return [n for n in self.backend.list() if not n.endswith(CRC_SUFFIX)]

    def exists(self, name: str) -> bool:
        with self._errors("stat", name):
            return self.backend.size(name) is not None

    def put_file(self, local_path: str | os.PathLike[str], name: str | None = None) -> StoredObject:
        """Upload a local file with its checksum sidecar; verify the stored size."""
        local = str(local_path)
        name = name or os.path.basename(local)
        size, crc = file_crc32c(local)
        with self._errors("upload", name):
            self.backend.put_file(local, name)
            stored = self.backend.size(name)
            if stored != size:
                raise ChecksumError(
                    errno.EIO, f"log store: upload {self.url}/{name}: stored {stored} bytes, the local file has {size}"
                )
            # The sidecar goes last: an object without one is an interrupted upload, not a valid chunk.
            self.backend.write_bytes(name + CRC_SUFFIX, json.dumps({"size": size, "crc32c": crc}).encode())
        return StoredObject(name, size)

    def expected(self, name: str) -> tuple[int, int]:
        """(size, crc32c) recorded for ``name`` at upload."""
        with self._errors("read checksum of", name):
            try:
                meta = json.loads(self.backend.read_bytes(name + CRC_SUFFIX))
            except FileNotFoundError as exc:
                raise MissingObjectError(
                    errno.ENOENT,
                    f"log store: {self.url}/{name} has no checksum sidecar {name}{CRC_SUFFIX} (interrupted upload?)",
                ) from exc
            return int(meta["size"]), int(meta["crc32c"])

    def get_file(self, name: str, local_path: str | os.PathLike[str], verify: bool = True) -> Path:
        """Download ``name`` to ``local_path`` (atomically) and check it against its sidecar."""
        dest = Path(local_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        expected = self.expected(name) if verify else None
        fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
        os.close(fd)
        try:
            with self._errors("download", name):
                self.backend.get_file(name, tmp)
            if expected is not None:
                got = file_crc32c(tmp)
                if got != expected:
                    raise ChecksumError(
                        errno.EIO,
                        f"log store: {self.url}/{name} is corrupt: size/crc32c {got[0]}/{got[1]:#010x}, "
                        f"recorded {expected[0]}/{expected[1]:#010x}",
                    )
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return dest

    def verify(self, name: str) -> None:
        """Read ``name`` back from the store and check it against its sidecar."""
        with tempfile.TemporaryDirectory(prefix="ds-swift-verify-") as tmp:
            self.get_file(name, os.path.join(tmp, "obj"))

    def delete(self, name: str, missing_ok: bool = True) -> None:
        """Delete an object and its sidecar (sidecar first: never a sidecar-less orphan that looks valid)."""
        for n in (name + CRC_SUFFIX, name):
            try:
                with self._errors("delete", n):
                    self.backend.delete(n)
            except MissingObjectError:
                if not missing_ok and n == name:
                    raise


def _is_connection_error(exc: BaseException) -> bool:
    try:
        import requests

        if isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout):
            return True
    except ImportError:  # pragma: no cover - requests comes with hdfs
        pass
    return isinstance(exc, ConnectionError)


def local_path_of(url: str) -> Path | None:
    """The local directory of a plain path or ``file://`` URL; None for other schemes."""
    parsed = urlparse(url)
    if parsed.scheme == "":
        return Path(url)
    if parsed.scheme != "file":
        return None
    # file:///abs -> /abs; file://./rel (the config default) -> ./rel
    return Path(parsed.netloc + parsed.path) if parsed.netloc else Path(parsed.path)


HdfsClientFactory = Callable[[str], Any]


def _default_hdfs_client(endpoint: str) -> Any:
    from hdfs import InsecureClient

    return InsecureClient(endpoint, user=os.environ.get("HADOOP_USER_NAME"))


def open_store(url: str | os.PathLike[str], *, hdfs_client_factory: HdfsClientFactory | None = None) -> Store:
    """The :class:`Store` for a URL. Nothing is contacted until the first operation (see ``probe``).

    Args:
        url: ``file:///dir``, a plain directory path, ``memory://name``, ``hdfs://host:port/dir``,
            ``webhdfs://host:port/dir`` or ``s3://bucket/prefix``.
        hdfs_client_factory: builds the WebHDFS client from ``http://host:port`` (tests pass a fake).
    """
    url = str(url)
    parsed = urlparse(url)
    scheme = parsed.scheme
    if scheme in ("", "file"):
        import fsspec

        path = local_path_of(url)
        assert path is not None
        return Store(url, FsspecBackend(fsspec.filesystem("file"), str(path.absolute())))
    if scheme == "memory":
        import fsspec

        return Store(url, FsspecBackend(fsspec.filesystem("memory"), "/" + (parsed.netloc + parsed.path).strip("/")))
    if scheme in ("hdfs", "webhdfs"):
        if not parsed.hostname:
            raise StorageError(errno.EINVAL, f"log store URL {url} names no namenode (hdfs://host:port/path)")
        endpoint = f"http://{parsed.hostname}:{parsed.port or 9870}"
        factory = hdfs_client_factory or _default_hdfs_client
        return Store(url, HdfsBackend(factory(endpoint), parsed.path or "/"))
    if scheme == "s3":
        try:
            import s3fs  # noqa: F401
        except ImportError as exc:
            raise StorageUnreachableError(
                errno.ENOPROTOOPT, f"log store {url} needs s3fs: pip install 'ds-swift[s3]'"
            ) from exc
        import fsspec

        return Store(url, FsspecBackend(fsspec.filesystem("s3"), parsed.netloc + parsed.path))
    raise StorageError(errno.EINVAL, f"log store URL {url}: unsupported scheme {scheme!r} (file, hdfs, webhdfs, s3, memory)")

