"""Which errors of a checkpoint save are the storage's (a full disk, storage gone), not a dead peer's.

A save that the storage refused does not count, and training goes on (ds_swift.checkpoint.periodic);
any other error is judged as every error of an iteration is (a dead peer's: a failure).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["is_write_error"]

#: errnos of a write the storage refused: full disk or quota, storage gone or failing, read-only or
#: forbidden, file too large. Not a dead peer's (ECONNRESET, ETIMEDOUT, ...): those are failures.
_WRITE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ENOSPC",
        "EDQUOT",
        "EIO",
        "EROFS",
        "EACCES",
        "EPERM",
        "EFBIG",
        "ENXIO",
        "ESTALE",
        "ENOENT",
        "ENOTDIR",
        "EISDIR",
        "ENAMETOOLONG",
    )
    if hasattr(errno, name)
)


def is_write_error(exc: BaseException, directory: str | os.PathLike[str] | None = None) -> bool:
    """A checkpoint file that could not be written (full disk, storage gone), not a dead peer: by the
    ``errno`` of the OSError in ``exc``'s chain. torch.save's zip writer raises a RuntimeError without
    one (on a full disk: "iostream error", then "unexpected pos"): then ``directory`` is probed with a
    small write of the same kind, whose OSError says what the storage refuses (nothing: not a write error)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno in _WRITE_ERRNOS
        e = e.__cause__ or e.__context__
    if directory is None or not isinstance(exc, RuntimeError):
        return False
    probe = Path(directory) / f".swift_write_probe.{os.getpid()}"
    try:
        with open(probe, "wb") as f:  # what DeepSpeed's save does: a file under the checkpoint directory
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_error:
        return probe_error.errno in _WRITE_ERRNOS
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return False
