"""Bytes on disk that survive a crash: markers, ``latest`` files and manifests.

A rename alone makes a file appear whole to other processes, not to the machine after a power
loss or a kernel crash: the new name may reach the disk before the file's data (an empty or
truncated marker that says "complete"), or the rename itself may be lost (the old marker comes
back over files already rewritten). :func:`write_atomic` orders it: the data to a temporary name,
flushed and fsynced, renamed into place, then the directory fsynced so that the rename is on disk
too. A crash leaves the old file or the new one, and at worst a ``<name>.tmp`` beside it, which
readers ignore (and say so).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

__all__ = [
    "COMPLETE_MARKER",
    "TMP_SUFFIX",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "remove_durable",
    "temp_path",
    "write_atomic",
]

#: the file whose presence makes a global checkpoint's tag complete (ds_swift.checkpoint.periodic writes it last)
COMPLETE_MARKER = "swift_complete"

TMP_SUFFIX = ".tmp"
"""What :func:`write_atomic` appends to a file's name while it writes it."""

# Filesystems that cannot sync a directory (some FUSE mounts) answer these: there the rename is as
# durable as that filesystem makes it, and refusing would stop every checkpoint from counting.
_NO_DIR_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF)


def temp_path(path: str | os.PathLike[str]) -> Path:
    """The temporary name :func:`write_atomic` writes ``path`` under (a leftover one: a write cut short)."""
    p = Path(path)
    return p.with_name(p.name + TMP_SUFFIX)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the names in ``directory`` (renames, new and removed files) durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIR_SYNC:
            raise
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file another writer (``torch.save``, DeepSpeed) closed: its data, not only its name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike[str]) -> None:
    """Every file under ``directory``, then each directory (deepest first): a checkpoint's files
    are on disk before its completion marker says so."""
    dirs: list[str] = []
    for root, _, files in os.walk(directory):
        dirs.append(root)
        for name in files:
            fsync_file(os.path.join(root, name))
    for d in reversed(dirs):
        fsync_dir(d)


def write_atomic(path: str | os.PathLike[str], data: str | bytes | Iterable[Any]) -> None:
    """Write ``data`` (text, bytes, or buffers written back to back) to ``path``: never torn, and
    on disk, name included, when this returns (see the module docstring)."""
    target = Path(path)
    tmp = temp_path(target)
    buffers: Iterable[Any]
    if isinstance(data, str):
        buffers = [data.encode()]
    elif isinstance(data, (bytes, bytearray, memoryview)):
        buffers = [data]
    else:
        buffers = cast(Iterable[Any], data)
    with open(tmp, "wb") as f:
        for buf in buffers:
            f.write(memoryview(buf))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(target.parent)


def remove_durable(path: str | os.PathLike[str]) -> None:
    """Remove ``path`` (if there) for good: a crash must not bring back a marker removed before
    the files it vouched for are rewritten."""
    target = Path(path)
    try:
        target.unlink()
    except FileNotFoundError:
        return
    fsync_dir(target.parent)
