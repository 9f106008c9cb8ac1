"""What the message log needs from the topology plan: one question per edge.

ds_swift.topology's plan answers it after selective-logging grouping (section 5.3). This module
only states the protocol, plus :class:`MachineBoundaryPlan`, the plan without grouping (every
machine its own group), for tests, benchmarks, and jobs run without the analyzer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["LoggingPlan", "MachineBoundaryPlan"]


@runtime_checkable
class LoggingPlan(Protocol):
    def is_logged(self, src_rank: int, dst_rank: int) -> bool:
        """Whether a pipeline message from ``src_rank`` to ``dst_rank`` must be logged by its sender."""
        ...


@dataclass(frozen=True)
class MachineBoundaryPlan:
    """Log exactly the messages between different machine groups.

    Args:
        gpus_per_node: ranks ``[k*g, (k+1)*g)`` share machine ``k`` (the launchers' assignment).
        groups: optional machine groups (lists of machine indices); machines in one group do not
            log to each other. ``None``: every machine is its own group.
    """

    gpus_per_node: int
    groups: Sequence[Sequence[int]] | None = None

    def machine_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def group_of(self, rank: int) -> int:
        machine = self.machine_of(rank)
        if self.groups is None:
            return machine
        for i, group in enumerate(self.groups):
            if machine in group:
                return i
        raise ValueError(f"machine {machine} (rank {rank}) is in no logging group of {list(self.groups)}")

    def is_logged(self, src_rank: int, dst_rank: int) -> bool:
        return self.group_of(src_rank) != self.group_of(dst_rank)
