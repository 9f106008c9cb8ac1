"""The agents' side of ``--inject machine=1+2,...``: several machines killed at one instant.

The rank that fires a group spec writes ``inject/<i>/kill`` (the generation it fired in) and kills
itself (:mod:`ds_swift.testing.faults`). Every agent whose machine is in the group kills its
machine's workers when it sees that key (or, for the firing rank's machine, its death), counts
itself in ``inject/<i>/down``, and holds its declaration back until the whole group is down: a
machine of the group still alive when the first failure is declared would start recovering as a
survivor and die in the next generation, which is exactly the timing dependence a group removes.
All of them then declare the generation the spec fired in (one failure, several machines).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ds_swift.jobstore.membership import JobStore
from ds_swift.testing.faults import FaultSpec, group_down_key, group_kill_key

__all__ = ["GROUP_WAIT_S", "GroupKill", "PendingFailure"]

#: the longest an agent holds its machine's failure back for the rest of its group (an agent of the
#: group whose host died never counts itself down; its machine is found by the agents' liveness)
GROUP_WAIT_S = 30.0


@dataclass(frozen=True)
class PendingFailure:
    """A machine killed by a group spec, its failure not declared until the group is down."""

    index: int
    generation: int
    rank: int
    returncode: int
    t_detected: float
    why: str
    deadline: float


class GroupKill:
    """Which fired group specs name a machine, and whether a group is down."""

    def __init__(self, store: JobStore, specs: Sequence[FaultSpec]) -> None:
        self.store = store
        self.groups = [(i, s) for i, s in enumerate(specs) if s.group]

    def fired_for(self, machine: int, spawned_in: int) -> tuple[int, int] | None:
        """(spec index, generation) of a fired group spec that kills ``machine``'s workers started
        in generation ``spawned_in`` (not a replacement started after it fired), else None."""
        for i, spec in self.groups:
            if machine not in spec.machines:
                continue
            raw = self.store.get(group_kill_key(i))
            if raw and int(raw) >= spawned_in:
                return i, int(raw)
        return None

    def describe(self, index: int) -> str:
        spec = self.groups[[i for i, _ in self.groups].index(index)][1]
        return f"injected fault #{index} ({spec}): machines {'+'.join(map(str, spec.machines))} killed at one instant"

    def down(self, pending: PendingFailure) -> None:
        """Count this machine of the group down (once per machine: its agent calls this once)."""
        self.store.add(group_down_key(pending.index), 1)

    def all_down(self, pending: PendingFailure) -> bool:
        spec = self.groups[[i for i, _ in self.groups].index(pending.index)][1]
        return (
            self.store.add(group_down_key(pending.index), 0) >= len(spec.machines)
            or time.monotonic() >= pending.deadline
        )

    def pending(
        self, index: int, generation: int, rank: int, returncode: int, t_detected: float, why: str
    ) -> PendingFailure:
        return PendingFailure(index, generation, rank, returncode, t_detected, why, time.monotonic() + GROUP_WAIT_S)
