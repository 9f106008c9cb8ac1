"""Garbage collection of log chunks after a global checkpoint (SWIFT section 5.1).

A global checkpoint at iteration ``c`` holds the state after iterations ``0..c-1``; a recovery
loads it and replays from iteration ``c`` on, so chunks whose every iteration is ``< c`` (their
exclusive end ``<= c``) are garbage. A chunk straddling ``c`` is kept whole. Log bytes on disk
are therefore bounded by ``checkpoint.interval + chunk_iterations`` iterations' worth.
"""

from __future__ import annotations

import os
from pathlib import Path

from ds_swift.msglog.chunk_format import ChunkName

__all__ = ["delete_chunks_before", "gc_before"]


def delete_chunks_before(location: str | os.PathLike[str], iteration: int) -> list[str]:
    """Delete chunk and index files (store sidecars and unpublished uploads too) holding only iterations ``< iteration``.

    Args:
        location: a local directory or a store URL (ds_swift.storage).
        iteration: the iteration of a *completed* global checkpoint.

    Returns the names deleted.
    """
    from ds_swift.storage import local_path_of, open_store
    from ds_swift.storage.store import CRC_SUFFIX, logical_name

    local = local_path_of(str(location))
    if local is not None:
        # a writer's directory, or a file:// store (sidecars and uploads' objects beside the chunks)
        directory = Path(local)
        if not directory.is_dir():
            return []
        doomed = [p for p in directory.iterdir() if _before(logical_name(p.name), iteration)]
        for p in sorted(doomed, key=lambda p: not p.name.endswith(CRC_SUFFIX)):  # unpublish first
            p.unlink(missing_ok=True)
        return sorted({logical_name(p.name) for p in doomed})
    # one listing; what an interrupted upload of such a chunk left (an unpublished object) goes too
    return open_store(str(location)).delete_where(lambda name: _before(name, iteration))


def _before(name: str, iteration: int) -> bool:
    cn = ChunkName.parse(name)
    return cn is not None and cn.end_iteration <= iteration


def gc_before(log_dir_or_url: str | os.PathLike[str], iteration: int) -> list[str]:
    """Delete chunks wholly before a completed global checkpoint at ``iteration`` (see module docstring)."""
    return delete_chunks_before(log_dir_or_url, iteration)
