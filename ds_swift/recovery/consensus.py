"""The recovery decision, as a pure function of what every rank published.

After a failure every rank of the new generation publishes a :class:`RankReport` (survivor or
replacement, its pipeline coordinates, its machine, the last iteration whose optimizer step it
applied). Every rank then computes the same :class:`RecoveryPlan` from the same reports, so no
further agreement round is needed:

- the consensus pre-failure iteration is the newest iteration every survivor stepped
  (``min`` of their last stepped iterations); survivors ahead of it undo (SWIFT section 4);
- each replacement rank gets a donor: a survivor with the same pipeline stage and
  tensor-parallel coordinate (a data-parallel replica), on a machine that did not fail;
- replication is possible when every replacement has a donor, the optimizer state is whole on
  each rank (ZeRO stage 0: a ZeRO-1/2 partition of a lost rank exists nowhere else), and every
  survivor that must undo can; otherwise every rank reloads the last global checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = ["RankReport", "RecoveryPlan", "plan_recovery"]

Strategy = Literal["replication", "checkpoint"]


@dataclass(frozen=True)
class RankReport:
    """What one rank tells the others at the start of a recovery."""

    rank: int
    survivor: bool
    stage: int
    dp: int
    tp: int
    machine: int
    last_stepped: int = -1
    """The last iteration whose step this rank applied (-1: none, or a replacement)."""
    can_undo: bool = False
    """The rank can undo its steps back to one iteration before ``last_stepped``."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RankReport:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RecoveryPlan:
    """What every rank does next; identical on every rank."""

    strategy: Strategy
    reason: str
    consensus: int
    """The agreed pre-failure iteration: every rank resumes at ``consensus + 1``."""
    survivors: tuple[int, ...]
    replacements: tuple[int, ...]
    donors: dict[int, int] = field(default_factory=dict)
    """replacement rank -> donor rank"""
    undo: tuple[int, ...] = ()
    """survivors that undo their last step(s) down to ``consensus``"""

    @property
    def pre_failure_iteration(self) -> int:
        """The iteration in flight when the failure hit, as agreed: training is "back" when it is reached."""
        return self.consensus + 1

    def donor_of(self, rank: int) -> int | None:
        return self.donors.get(rank)

    def recipients_of(self, rank: int) -> list[int]:
        return sorted(r for r, d in self.donors.items() if d == rank)


def plan_recovery(
    reports: list[RankReport],
    zero_stage: int = 0,
    forced: str = "auto",
    optimizer: str | None = None,
) -> RecoveryPlan:
    """Decide consensus, donors and strategy.

    Args:
        reports: one report per rank of the new generation.
        zero_stage: the ZeRO stage; above 0 each rank holds the only copy of its optimizer partition.
        forced: the config's ``strategy`` (auto | replication | logging | checkpoint).
        optimizer: the name of an optimizer wrapper whose state survivors cannot keep across the
            rebuild (it holds process groups: DeepSpeed's bf16/fp16 wrappers), or None.
    """
    by_rank = {r.rank: r for r in reports}
    survivors = sorted(r.rank for r in reports if r.survivor)
    replacements = sorted(r.rank for r in reports if not r.survivor)
    if not survivors:
        return RecoveryPlan("checkpoint", "no rank survived with its state", -1, (), tuple(replacements))
    consensus = min(by_rank[r].last_stepped for r in survivors)
    undo = tuple(r for r in survivors if by_rank[r].last_stepped > consensus)
    base = {"consensus": consensus, "survivors": tuple(survivors), "replacements": tuple(replacements), "undo": undo}

    def checkpoint(reason: str) -> RecoveryPlan:
        return RecoveryPlan("checkpoint", reason, **base)  # type: ignore[arg-type]

    cannot_undo = [r for r in undo if not by_rank[r].can_undo or by_rank[r].last_stepped - consensus > 1]
    if cannot_undo:
        return checkpoint(f"ranks {cannot_undo} stepped past the consensus iteration {consensus} and cannot undo")
    if forced == "checkpoint":
        return checkpoint('the config forces strategy "checkpoint"')
    if forced == "logging" and replacements:
        return checkpoint('the config forces strategy "logging" and logging-based recovery is not implemented yet')
    if not replacements:
        return RecoveryPlan("replication", "no rank lost its state", **base)  # type: ignore[arg-type]
    if optimizer is not None:
        return checkpoint(f"{optimizer} holds process groups: survivors cannot keep its state across the rebuild")
    if zero_stage > 0:
        return checkpoint(
            f"ZeRO stage {zero_stage} keeps each rank's optimizer partition only on that rank: "
            f"the partitions of ranks {replacements} are lost with their machine"
        )
    failed_machines = {by_rank[r].machine for r in replacements}
    donors: dict[int, int] = {}
    missing: list[int] = []
    for lost in replacements:
        me = by_rank[lost]
        candidates = [
            s
            for s in survivors
            if by_rank[s].stage == me.stage and by_rank[s].tp == me.tp and by_rank[s].machine not in failed_machines
        ]
        if candidates:
            # Spread the sends: prefer donors not yet serving another replacement.
            load = {s: sum(1 for d in donors.values() if d == s) for s in candidates}
            donors[lost] = min(candidates, key=lambda s: (load[s], s))
        else:
            missing.append(lost)
    if missing:
        stages = sorted({by_rank[r].stage for r in missing})
        return checkpoint(
            f"no surviving data-parallel replica of stage(s) {stages} (ranks {missing}) and logging-based "
            "recovery is not implemented yet"
        )
    return RecoveryPlan(
        "replication",
        f"every lost rank has a surviving replica ({', '.join(f'{d}->{r}' for r, d in sorted(donors.items()))})",
        donors=donors,
        **base,  # type: ignore[arg-type]
    )
