"""The checksummed store on top of a backend, its errors, and :func:`open_store` for a URL.

See the ds_swift.storage package docstring for why every object carries a crc32c sidecar.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import crc32c as _crc32c

from ds_swift.storage.backends import BLOCK_SIZE, FsspecBackend, HdfsBackend, StorageBackend

__all__ = [
    "CRC_SUFFIX",
    "ChecksumError",
    "MissingObjectError",
    "Store",
    "StorageError",
    "StorageFullError",
    "StorageUnreachableError",
    "StoredObject",
    "file_crc32c",
    "local_path_of",
    "open_store",
]

CRC_SUFFIX = ".crc32c"


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
        while block := f.read(BLOCK_SIZE):
            crc = _crc32c.crc32c(block, crc)
            size += len(block)
    return size, crc


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
    raise StorageError(
        errno.EINVAL, f"log store URL {url}: unsupported scheme {scheme!r} (file, hdfs, webhdfs, s3, memory)"
    )
