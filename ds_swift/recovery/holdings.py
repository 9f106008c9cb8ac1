"""What a rank's protections hold for a recovery, as its report carries it.

Each protection (ds_swift.protect) reports under its own name one JSON object in
:attr:`~ds_swift.recovery.consensus.RankReport.holdings`; a strategy reads it through the typed view
here (``BuddyHeld.of(report)``), never through a field of the shared report. A protection with
holdings of a new kind adds a :class:`Held` subclass (in its strategy's module or here): nothing of
the report, the coordinator or the runtime changes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

__all__ = ["BuddyHeld", "Held", "InflightHeld", "MessageLogHeld", "UpdateLogHeld", "buddy_held", "holdings_of"]

H = TypeVar("H", bound="Held")


class _Reports(Protocol):
    @property
    def holdings(self) -> Mapping[str, Any]: ...


def _tuples(value: Any) -> Any:
    """JSON lists as tuples, all the way down (what the views' fields are)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


@dataclass(frozen=True)
class Held:
    """A typed view of one protection's holdings (its defaults: nothing held)."""

    #: the protection's name: its key in ``RankReport.holdings``
    NAME: ClassVar[str]

    @classmethod
    def of(cls: type[H], report: _Reports) -> H:
        """``report``'s holdings of this kind (nothing held where the protection reported none)."""
        doc = report.holdings.get(cls.NAME)
        if doc is None:
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: _tuples(v) for k, v in doc.items() if k in known})

    def to_doc(self) -> dict[str, Any]:
        """The JSON object the report carries (as JSON reads it back: lists, so a report equals itself
        after the store's round trip)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


@dataclass(frozen=True)
class BuddyHeld(Held):
    """The buddy copier's (ds_swift.protect.buddy): copies of other ranks' optimizer partitions, this
    survivor's own copies, or PipeChurn's erasure-coded chunks."""

    NAME: ClassVar[str] = "buddy"
    copies: tuple[tuple[int, int], ...] = ()
    """(owner rank, iteration) of every complete copy of another rank's optimizer partition held: the
    owner's state after that iteration's step."""
    own: tuple[int, ...] = ()
    """The iterations of this survivor's own complete copies of its partition: it can go back to any
    of them, bitwise, however many steps (without one, update-undo's inverse update gets one step
    back within 2 ulp, and the recovery says so)."""
    chunks: tuple[tuple[int, int, int], ...] = ()
    """(owner rank, iteration, chunk index) of every erasure-coded chunk of another rank's state held
    (strategy pipechurn, ds_swift.recovery.state.erasure)."""
    k: int = 0
    """The chunks that rebuild a state (``pipechurn.data_chunks``; 0: no erasure coding)."""


def holdings_of(*views: Held) -> dict[str, dict[str, Any]]:
    """The report's ``holdings`` map of ``views`` (each under its protection's name)."""
    return {v.NAME: v.to_doc() for v in views}


def buddy_held(holdings: Any, own: tuple[int, ...] = (), k: int = 0) -> BuddyHeld:
    """What a buddy copier's holdings (ds_swift.protect.buddy_holdings.BuddyHoldings; None: none)
    hold: the copies of others' partitions, or with ``k`` (erasure coding) the chunks; ``own``: the
    survivor's own copies."""
    if holdings is None:
        return BuddyHeld(own=own)
    if k:
        return BuddyHeld(own=own, chunks=tuple(holdings.chunks()), k=k)
    return BuddyHeld(copies=tuple(holdings.copies()), own=own)


@dataclass(frozen=True)
class MessageLogHeld(Held):
    """The message log's (ds_swift.protect.message_logging)."""

    NAME: ClassVar[str] = "messages"
    lost: str | None = None
    """Why this rank's message log stopped covering its sends (a write error: full disk, unreachable
    storage), or None: a replay that needs its messages cannot be exact."""


@dataclass(frozen=True)
class InflightHeld(Held):
    """PipeChurn's copy of the iteration in flight (ds_swift.recovery.state.inflight)."""

    NAME: ClassVar[str] = "inflight"
    iteration: int = -1
    """The iteration in flight this rank holds a copy of (-1: none)."""
    passes: int = -1
    """Of ``iteration``, the micro-batches ``0 .. n-1`` whose forward and backward passes the copy
    holds (their sends, the gradients accumulated over them; every micro-batch: all ran); -1: this
    rank keeps no copy (partial recomputation off)."""
    forwards: int = 0
    """Of ``iteration``, the forward passes that ran before the failure (those beyond ``passes`` lost
    their autograd graphs with the engine: redone)."""
    micro_batches: int = 0
    """The micro-batches of ``iteration`` (0: not known), so that a plan can say which survivors had
    not finished theirs even when none had."""


@dataclass(frozen=True)
class UpdateLogHeld(Held):
    """The update log's (ds_swift.protect.update_logger), for a replacement whose rank logged its updates."""

    NAME: ClassVar[str] = "updates"
    newest: int | None = None
    """The newest iteration its rank's update record was stored for (-1: none); None: not looked up
    (a survivor, or the log store could not be listed)."""
