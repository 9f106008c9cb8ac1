"""What the runtime lends a recovery strategy: the one seam between recovery/ and runtime/.

The runtime's engine wrapper implements :class:`RecoveryHost`; recovery code asks it for the few
runtime switches a replay needs instead of holding callbacks into the engine's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ["NullHost", "RecoveryHost", "replaying"]


class RecoveryHost(Protocol):
    """The runtime switches a recovery may flip (the engine wrapper implements them)."""

    def set_reseed(self, on: bool) -> None:
        """Switch the runtime's per-forward reseeding on/off (a replay keys the RNG itself, by the
        micro-batches it actually runs)."""
        ...

    def set_armed(self, on: bool) -> None:
        """Switch the after-receive failure check on/off (on while replaying, so that a peer's
        poison message wakes a live receive with an error instead of garbage)."""
        ...

    def poison_neighbours(self) -> None:
        """Wake this rank's pipeline neighbours blocked in a receive from it."""
        ...

    def suspend_logging(self) -> Callable[[], None]:
        """Stop this rank's message logger; returns what restarts it (parallel recovery runs a
        share of the micro-batches, which would be logged under the wrong numbers)."""
        ...


class NullHost:
    """A host with nothing to switch (standalone replays, unit tests)."""

    def set_reseed(self, on: bool) -> None:
        return None

    def set_armed(self, on: bool) -> None:
        return None

    def poison_neighbours(self) -> None:
        return None

    def suspend_logging(self) -> Callable[[], None]:
        return lambda: None


@contextmanager
def replaying(host: RecoveryHost) -> Iterator[None]:
    """The runtime's state while a replay runs: no reseeding by the runtime, receives checked."""
    host.set_reseed(False)
    host.set_armed(True)
    try:
        yield
    finally:
        host.set_armed(False)
        host.set_reseed(True)
