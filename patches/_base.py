"""What every patch of DeepSpeed/Megatron internals shares: version pinning and a handle.

A patch keeps the original, refuses to apply twice, checks the installed version against the
range it was written for, and returns a :class:`PatchHandle` whose ``remove()`` (or ``with``
block) restores exactly what was there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType

from packaging.version import Version

__all__ = ["SUPPORTED_DEEPSPEED", "PatchError", "PatchHandle", "check_deepspeed", "check_version"]

#: The DeepSpeed releases every patch here was written against (``minimum <= v < below``); the one
#: place the range is written (setup.py's requirement is held to it by tests/unit/test_patch_seams.py).
SUPPORTED_DEEPSPEED = ("0.19.0", "0.20.0")


class PatchError(RuntimeError):
    """A patch cannot be applied (unsupported version, applied twice, removed out of order)."""


@functools.cache  # a mismatch raises (never cached); a match is checked per send and per step
def check_version(package: str, installed: str, minimum: str, below: str) -> None:
    """Raise PatchError unless ``minimum <= installed < below``.

    The seams we patch (the pipeline engine's instruction table, p2p globals) move between
    DeepSpeed releases; a silent mismatch would log the wrong tensors or none at all.
    """
    v = Version(installed)
    if not (Version(minimum) <= v < Version(below)):
        raise PatchError(
            f"ds-swift supports {package} >={minimum},<{below}; {installed} is installed. "
            f"Install a supported version (pip install '{package}>={minimum},<{below}') or disable ds-swift "
            f'("swift": {{"enabled": false}}).'
        )


def check_deepspeed(installed: str | None = None) -> None:
    """Raise PatchError unless DeepSpeed (``installed``, default: the imported one) is in
    :data:`SUPPORTED_DEEPSPEED`."""
    if installed is None:
        import deepspeed

        installed = str(deepspeed.__version__)
    check_version("deepspeed", installed, *SUPPORTED_DEEPSPEED)


class PatchHandle:
    """Undo a patch: call :meth:`remove` once, or use the handle as a context manager."""

    def __init__(self, name: str, restore: Callable[[], None]) -> None:
        self.name = name
        self._restore: Callable[[], None] | None = restore

    @property
    def active(self) -> bool:
        return self._restore is not None

    def remove(self) -> None:
        if self._restore is None:
            return
        restore, self._restore = self._restore, None
        restore()

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()
