"""The job's machines in rank order, and the launcher's keys about a failed machine's fate.

An elastic shrink drops a machine from the layout, a grow appends it again
(ds_swift.recovery.strategies.elastic); the agents (launch/agent.py, launch/control.py) write these
keys, the workers' rebuild (ds_swift.runtime.rebuild) reads them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds_swift.jobstore.membership import JobStore

__all__ = ["LAYOUT_KEY", "fate_key", "grow_key", "grown_layout", "read_layout", "resumed_key"]

#: Job-store key of the job's machines in rank order (JSON; absent: 0, 1, ..., every machine). A
#: rank is its machine's position in it times the ranks per machine, plus its local rank
#: (ds_swift.recovery.strategies.elastic: an elastic shrink drops a machine, a grow appends one).
LAYOUT_KEY = "launch/layout"


def read_layout(store: JobStore, num_machines: int) -> list[int]:
    """The job's machines in rank order."""
    raw = store.get(LAYOUT_KEY)
    return [int(m) for m in json.loads(raw)] if raw else list(range(num_machines))


def fate_key(generation: int, machine: int) -> str:
    """Where the launcher says what becomes of ``machine``, failed in ``generation``: ``spare``,
    ``restart``, ``shrink`` (the job goes on without it) or ``abort``."""
    return f"launch/fate/{generation}/{machine}"


def grow_key(generation: int) -> str:
    """Set to a machine id when generation ``generation`` ended because that machine came back."""
    return f"launch/grow/{generation}"


def resumed_key(generation: int) -> str:
    """Set once the recovery into ``generation`` is over and the job trains again (a grow waits for it)."""
    return f"gen{generation}/resumed"


def grown_layout(layout: list[int], machine: int) -> list[int]:
    """``layout`` with ``machine`` back in it, last in rank order (survivors keep their ranks)."""
    return [*(m for m in layout if m != machine), machine]
