"""The checksummed store on top of a backend, its errors, and :func:`open_store` for a URL.

See the ds_swift.storage package docstring for why every object carries a crc32c sidecar.

An upload never touches what readers use until it is complete (write-new-then-swap): the bytes
go to a new object ``NAME~TOKEN``, its stored size is checked, and only then the sidecar
``NAME.crc32c`` (size, crc32c, and which object) is replaced, atomically (see
StorageBackend.replace_bytes): that replacement publishes it. A crash before it leaves the
previous version of ``NAME`` published and whole, plus an unpublished object nobody reads (GC
sweeps it, :meth:`Store.delete_where`); after it, the superseded object is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import crc32c as _crc32c

from ds_swift.storage.backends import (
    BLOCK_SIZE,
    STAGED_SEP,
    FsspecBackend,
    HdfsBackend,
    LocalBackend,
    StorageBackend,
    staged_name,
)

__all__ = [
    "CRC_SUFFIX",
    "ChecksumError",
    "MissingObjectError",
    "Store",
    "StorageError",
    "StorageFullError",
    "StorageUnreachableError",
    "StoredObject",
    "Published",
    "file_crc32c",
    "logical_name",
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


@dataclass(frozen=True)
class Published:
    """What a sidecar records: the object holding ``name``'s bytes, their size and crc32c."""

    obj: str
    size: int
    crc32c: int


def logical_name(stored: str) -> str:
    """The object name a stored file belongs to: ``N``, ``N.crc32c``, ``N~T`` and ``N.crc32c~T`` give ``N``."""
    base = stored.split(STAGED_SEP, 1)[0]
    return base[: -len(CRC_SUFFIX)] if base.endswith(CRC_SUFFIX) else base


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
        """Names of the published objects (those with a sidecar)."""
        with self._errors("list"):
            return [n[: -len(CRC_SUFFIX)] for n in self.backend.list() if n.endswith(CRC_SUFFIX)]

    def exists(self, name: str) -> bool:
        """Whether ``name`` is published."""
        with self._errors("stat", name):
            return self.backend.size(name + CRC_SUFFIX) is not None

    def put_file(self, local_path: str | os.PathLike[str], name: str | None = None) -> StoredObject:
        """Upload a local file, then publish it by replacing its sidecar (see the module docstring)."""
        local = str(local_path)
        name = name or os.path.basename(local)
        if STAGED_SEP in name or name.endswith(CRC_SUFFIX):
            raise ValueError(f"log store: object name {name!r} may not contain {STAGED_SEP!r} or end in {CRC_SUFFIX}")
        size, crc = file_crc32c(local)
        try:
            previous = self._published(name)
        except ChecksumError:  # an unreadable sidecar is replaced; its object stays until GC sweeps it
            previous = None
        obj = staged_name(name)
        with self._errors("upload", name):
            try:
                self.backend.put_file(local, obj)
                stored = self.backend.size(obj)
                if stored != size:
                    raise ChecksumError(
                        errno.EIO,
                        f"log store: upload {self.url}/{name}: stored {stored} bytes, the local file has {size}",
                    )
            except Exception:
                # unpublished, so nobody reads it: never let failed tries fill a full disk
                with contextlib.suppress(Exception):
                    self.backend.delete(obj)
                raise
            meta = {"size": size, "crc32c": crc, "object": obj}
            self.backend.replace_bytes(name + CRC_SUFFIX, json.dumps(meta).encode())
        if previous is not None and previous.obj != obj:
            self._discard(previous.obj)  # a reader that had just resolved it re-reads the sidecar
        return StoredObject(name, size)

    def _discard(self, stored: str) -> None:
        try:
            with self._errors("delete", stored):
                self.backend.delete(stored)
        except MissingObjectError:
            pass

    def _published(self, name: str) -> Published | None:
        """The sidecar of ``name``; None if it has none."""
        with self._errors("read checksum of", name):
            try:
                raw = self.backend.read_bytes(name + CRC_SUFFIX)
            except FileNotFoundError:
                return None
            try:
                meta = json.loads(raw)
                # a sidecar from before versioned uploads has no "object": the bytes are at NAME
                return Published(str(meta.get("object", name)), int(meta["size"]), int(meta["crc32c"]))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ChecksumError(
                    errno.EIO, f"log store: sidecar {self.url}/{name}{CRC_SUFFIX} is unreadable: {raw[:80]!r}"
                ) from exc

    def expected(self, name: str) -> tuple[int, int]:
        """(size, crc32c) recorded for ``name`` at upload."""
        meta = self._require(name)
        return meta.size, meta.crc32c

    def _require(self, name: str) -> Published:
        meta = self._published(name)
        if meta is None:
            raise MissingObjectError(
                errno.ENOENT,
                f"log store: {self.url}/{name} is not published: no checksum sidecar {name}{CRC_SUFFIX} "
                "(never uploaded, or an upload that did not finish)",
            )
        return meta

    def get_file(self, name: str, local_path: str | os.PathLike[str], verify: bool = True) -> Path:
        """Download ``name`` to ``local_path`` (atomically) and check it against its sidecar."""
        dest = Path(local_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
        os.close(fd)
        try:
            for attempt in range(2):
                meta = self._require(name) if verify else self._published(name)
                try:
                    with self._errors("download", name):
                        self.backend.get_file(meta.obj if meta else name, tmp)
                    break
                except MissingObjectError:
                    # a new upload published another object and deleted this one: read the sidecar again
                    if attempt or meta is None:
                        raise
            if verify:
                assert meta is not None
                got = file_crc32c(tmp)
                if got != (meta.size, meta.crc32c):
                    raise ChecksumError(
                        errno.EIO,
                        f"log store: {self.url}/{name} is corrupt: size/crc32c {got[0]}/{got[1]:#010x}, "
                        f"recorded {meta.size}/{meta.crc32c:#010x} (object {meta.obj})",
                    )
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return dest

    def current_object(self, name: str) -> str:
        """The stored object that holds ``name``'s published bytes."""
        return self._require(name).obj

    def verify(self, name: str) -> None:
        """Read ``name`` back from the store and check it against its sidecar."""
        with tempfile.TemporaryDirectory(prefix="ds-swift-verify-") as tmp:
            self.get_file(name, os.path.join(tmp, "obj"))

    def delete(self, name: str, missing_ok: bool = True) -> None:
        """Delete an object: its sidecar first (never a published name without its bytes), then its bytes."""
        try:
            meta = self._published(name)
        except ChecksumError:  # an unreadable sidecar goes too; GC (delete_where) sweeps its object
            meta = None
        stored = [name + CRC_SUFFIX, meta.obj if meta else name]
        if meta is None and not missing_ok:
            self._require(name)
        for n in stored:
            self._discard(n)

    def delete_where(self, wanted: Callable[[str], bool]) -> list[str]:
        """Delete every object whose name ``wanted`` selects, with what unfinished uploads left of it.

        One listing. Returns the names deleted (published or not), sorted.
        """
        with self._errors("list"):
            stored = self.backend.list()
        by_name: dict[str, list[str]] = {}
        for n in stored:
            by_name.setdefault(logical_name(n), []).append(n)
        deleted = sorted(n for n in by_name if wanted(n))
        for name in deleted:
            self._delete_all(name, by_name[name])
        return deleted

    def _delete_all(self, name: str, stored: Iterable[str]) -> None:
        sidecar = name + CRC_SUFFIX
        # unpublish first: a crash half-way leaves unpublished files, never a sidecar without bytes
        for n in sorted(stored, key=lambda n: n != sidecar):
            self._discard(n)


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


#: WebHDFS (connect, read) timeouts in seconds: the hdfs client's default is none, and a namenode
#: that stops answering hung the rank on it for good (a replay's listing, a log GC on the training
#: thread, the writer thread whose full queue then blocks the step). Read: between two bytes.
HDFS_TIMEOUT_S = (10.0, 120.0)


def _default_hdfs_client(endpoint: str) -> Any:
    from hdfs import InsecureClient

    return InsecureClient(endpoint, user=os.environ.get("HADOOP_USER_NAME"), timeout=HDFS_TIMEOUT_S)


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
        path = local_path_of(url)
        assert path is not None
        return Store(url, LocalBackend(str(path.absolute())))
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

        # No listing cache: a reader must see the chunks other machines uploaded since it last listed.
        # The endpoint and credentials come from the environment (AWS_ENDPOINT_URL, ...), as botocore reads it.
        fs = fsspec.filesystem("s3", use_listings_cache=False)
        return Store(url, FsspecBackend(fs, parsed.netloc + parsed.path))
    raise StorageError(
        errno.EINVAL, f"log store URL {url}: unsupported scheme {scheme!r} (file, hdfs, webhdfs, s3, memory)"
    )
