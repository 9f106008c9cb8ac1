"""The global store for message-log chunks: ``file://`` (shared FS), ``hdfs://`` (WebHDFS), ``s3://``, ``memory://``.

A replacement machine downloads the chunks it needs from here, so every object is stored with a
sidecar ``NAME.crc32c`` (JSON: size and crc32c of the content) and every download is verified
against it: a truncated or bit-flipped chunk must fail loudly, never be replayed. Every error is a
:class:`StorageError` whose message names the store URL (and object) and what went wrong:
unreachable, missing, corrupt, or out of space.

An upload is written under a new name and published by atomically replacing its sidecar, which
names it (write-new-then-swap, see store.py): a reader always finds a complete object + sidecar
pair, the previous one while an upload is in flight or after it crashed.

Backends are small: :class:`StorageBackend` has byte-level put/get/list/delete/size and an atomic
small-object replace. ``file`` is a directory written with fsync (:class:`LocalBackend`); fsspec
covers ``memory`` and ``s3`` (through s3fs, when installed); ``hdfs``/``webhdfs`` go through the
``hdfs`` package's WebHDFS client (``hdfs://namenode:9870/path`` talks HTTP to port 9870, the
namenode's WebHDFS port; the user comes from ``HADOOP_USER_NAME``).
"""

from __future__ import annotations

from ds_swift.storage.backends import FsspecBackend, HdfsBackend, LocalBackend, StorageBackend
from ds_swift.storage.store import (
    ChecksumError,
    MissingObjectError,
    StorageError,
    StorageFullError,
    StorageUnreachableError,
    Store,
    file_crc32c,
    local_path_of,
    open_store,
)

__all__ = [
    "ChecksumError",
    "FsspecBackend",
    "HdfsBackend",
    "LocalBackend",
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
