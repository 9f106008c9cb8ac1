"""What the runtime and the strategies hand each other, kept by type: one object of each type.

The shared classes of a recovery (:class:`~ds_swift.recovery.base.RankContext`,
:class:`~ds_swift.recovery.base.RecoveryOutcome`) carry one :class:`Handover` each instead of a
field per strategy:

- ``RankContext.lent``: what the runtime keeps for a strategy while nothing fails and lends it at
  a recovery (the message-log replay's :class:`~ds_swift.recovery.replay.runner.ReplayRuntime`,
  TranLogs' :class:`~ds_swift.recovery.state.update_log.UpdateLogStore`, PipeChurn's
  :class:`~ds_swift.recovery.state.inflight.InflightKeeper`);
- ``RecoveryOutcome.handed``: what a strategy hands back for the runtime to act on when training
  resumes (lossy forward's :class:`~ds_swift.recovery.gradmask.GradScale`, PipeChurn's
  :class:`~ds_swift.recovery.state.inflight.FinishIteration`).

A strategy reads its own object by its type (``ctx.lent.get(InflightKeeper)``): a new strategy with
state of its own adds a type in its own module, never a field to the shared classes.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["Handover"]

T = TypeVar("T")


class Handover:
    """Objects kept by their type (``None`` among ``things`` is skipped: nothing kept of that kind)."""

    def __init__(self, *things: object) -> None:
        self._by_type: dict[type, Any] = {}
        for thing in things:
            if thing is not None:
                self.put(thing)

    def put(self, thing: object) -> None:
        """Keep ``thing``, in place of any earlier object of its type."""
        self._by_type[type(thing)] = thing

    def get(self, kind: type[T]) -> T | None:
        """The object of type ``kind`` (or of a subclass), or None where none was handed over."""
        found = self._by_type.get(kind)
        if found is None:
            found = next((t for t in self._by_type.values() if isinstance(t, kind)), None)
        return found  # type: ignore[no-any-return]

    def __contains__(self, kind: type) -> bool:
        return self.get(kind) is not None

    def __repr__(self) -> str:
        return f"Handover({', '.join(sorted(t.__name__ for t in self._by_type))})"
