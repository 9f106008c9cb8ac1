"""The recovery timeline: what happened when, on every rank, for one failure.

Every rank records the moments of its own recovery (:class:`RankTimeline`) and publishes them in
the job store once it is back at the pre-failure iteration; rank 0 gathers them with the node
agent's records (``gen<g>/t/detected``) and the injector's (``inject/<i>/t_fire``) and writes
``<run_dir>/timeline-gen<g>.json`` plus one summary line.

The paper's definitions (SWIFT section 7; shared/DESIGN.md), so figures compare:

- initialization time: first detection of the failure -> the replacements joined the job
  (process start, rendezvous, DeepSpeed groups re-formed on every rank);
- recovery time: replacements joined -> every rank back at the pre-failure iteration (state
  transfer; or checkpoint load plus the replay of the lost iterations from the message log on the
  failed machines only; or checkpoint load plus re-training them everywhere);
- total: the kill -> back at the pre-failure iteration.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_swift.checkpoint.durable import write_atomic

if TYPE_CHECKING:
    from ds_swift.jobstore.membership import JobStore

__all__ = [
    "RankTimeline",
    "Timeline",
    "build_timeline",
    "write_timeline",
]


@dataclass
class RankTimeline:
    """One rank's view of one recovery (``time.time()`` stamps; None where a step did not apply)."""

    rank: int
    role: str  # "survivor" | "replacement"
    failed_generation: int
    t_detect: float | None = None
    detect_how: str = ""
    t_start: float | None = None  # replacement: process start (init_distributed entered)
    t_torn_down: float | None = None
    t_joined: float | None = None
    t_rebuilt: float | None = None
    t_consensus: float | None = None
    t_undone: float | None = None
    t_loaded: float | None = None  # logging: the replaying rank loaded the global checkpoint
    t_replayed: float | None = None  # logging: the replaying rank finished its replay
    t_restored: float | None = None
    t_back: float | None = None
    undone_from: int | None = None
    bytes_moved: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RankTimeline:
        return cls(**json.loads(text))


@dataclass
class Timeline:
    """The job-wide timeline of one recovery, as written to ``timeline-gen<g>.json``."""

    failed_generation: int
    strategy: str
    reason: str
    failed_machine: int | None
    consensus: int
    pre_failure_iteration: int
    t_kill: float | None
    t_agent_detected: float | None
    first_detect: float
    joined: float
    back: float
    initialization_s: float
    recovery_s: float
    total_s: float
    phases: dict[str, float]
    ranks: list[RankTimeline]
    undo_ranks: list[int]
    donors: dict[str, int]
    checkpoint_step: int | None = None
    replay: dict[str, Any] | None = None
    """logging: what was replayed (iterations, ranks, log bytes, parallel mode, per-rank stats)."""
    verification: dict[str, str] = field(default_factory=dict)
    """Restored rank -> ``verified``, ``mismatch`` or ``unverified``: its state against its reference
    digest (details in each rank's ``extra["verify"]``; a mismatch fell back to the checkpoint)."""
    deviation: str | None = None
    """Approximate strategies (``scar``): how far the restored state is from the failure-free run's."""
    resize: dict[str, Any] | None = None
    """An elastic shrink or grow: the machine, the machines now, dp and accumulation before/after."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ranks"] = [asdict(r) for r in self.ranks]
        return d


def _max(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _min(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def build_timeline(
    ranks: list[RankTimeline],
    *,
    strategy: str,
    reason: str,
    consensus: int,
    t_kill: float | None,
    t_agent_detected: float | None,
    failed_machine: int | None,
    undo_ranks: list[int],
    donors: dict[int, int],
    checkpoint_step: int | None = None,
    replay: dict[str, Any] | None = None,
    deviation: str | None = None,
) -> Timeline:
    """Combine every rank's stamps into the paper's three durations and per-phase durations."""
    if not ranks:
        raise ValueError("build_timeline: no rank timelines")
    g = ranks[0].failed_generation
    first_detect = _min([t_agent_detected, *(r.t_detect for r in ranks)])
    joined_at = _max([r.t_rebuilt for r in ranks])
    back = _max([r.t_back for r in ranks])
    if first_detect is None or joined_at is None or back is None:
        raise ValueError("build_timeline: detection, rebuild and back stamps are required")
    start = t_kill if t_kill is not None else first_detect
    phases: dict[str, float] = {}
    marks = [
        ("detect", first_detect),
        ("teardown", _max([r.t_torn_down for r in ranks])),
        ("rendezvous", _max([r.t_joined for r in ranks])),
        ("rebuild", joined_at),  # survivors' groups swapped (or engines rebuilt), replacements' engines built
        ("consensus_undo", _max([r.t_undone or r.t_consensus for r in ranks])),
        ("checkpoint_load", _max([r.t_loaded for r in ranks])),
        ("replay", _max([r.t_replayed for r in ranks])),
        ("state_restore", _max([r.t_restored for r in ranks])),
        ("catch_up", back),
    ]
    prev = start
    for name, t in marks:
        if t is None:
            continue
        phases[name] = max(0.0, t - prev)
        prev = max(prev, t)
    return Timeline(
        failed_generation=g,
        strategy=strategy,
        reason=reason,
        failed_machine=failed_machine,
        consensus=consensus,
        pre_failure_iteration=consensus + 1,
        t_kill=t_kill,
        t_agent_detected=t_agent_detected,
        first_detect=first_detect,
        joined=joined_at,
        back=back,
        initialization_s=joined_at - first_detect,
        recovery_s=back - joined_at,
        total_s=back - start,
        phases=phases,
        ranks=sorted(ranks, key=lambda r: r.rank),
        undo_ranks=sorted(undo_ranks),
        donors={str(k): v for k, v in sorted(donors.items())},
        checkpoint_step=checkpoint_step,
        replay=replay,
        verification={str(r.rank): r.extra["verify"]["status"] for r in ranks if "verify" in r.extra},
        deviation=deviation,
        resize=next((r.extra["resize"] for r in ranks if "resize" in r.extra), None),
    )


def write_timeline(run_dir: str | os.PathLike[str], tl: Timeline) -> Path:
    path = Path(run_dir) / f"timeline-gen{tl.failed_generation}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(tl.to_dict(), indent=2, sort_keys=True))
    return path


def kill_time(store: JobStore, failed_generation: int, inject_specs: int) -> float | None:
    """When an injected fault killed a rank just before ``failed_generation`` failed (else None)."""
    detected = store.get(f"gen{failed_generation}/t/detected")
    t_ref = float(detected) if detected else time.time()
    times = []
    for i in range(inject_specs):
        value = store.get(f"inject/{i}/t_fire")
        # An older spec's kill belongs to an older failure.
        if value is not None and 0 <= t_ref - float(value) < 60:
            times.append(float(value))
    return max(times) if times else None
