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
  survivor that must undo can;
- otherwise, when the message log covers the lost stages (:class:`LoggingSetup`, from the topology
  plan), the failed machines' whole logging groups are replayed from the last global checkpoint
  (SWIFT section 5.1/5.3): their ranks load it and re-execute the iterations up to the consensus
  from the logs, while the survivors outside the groups keep their state;
- otherwise every rank reloads the last global checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = ["LoggingSetup", "RankReport", "RecoveryPlan", "plan_recovery"]

Strategy = Literal["replication", "logging", "checkpoint"]


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
    replay_ranks: tuple[int, ...] = ()
    """logging: the ranks that load the global checkpoint and replay (the failed logging groups)"""
    replay_from: int = 0
    """logging: the first iteration replayed (the global checkpoint's iterations done; 0: the initial state)"""

    @property
    def replay_iterations(self) -> range:
        """logging: the iterations replayed, ``replay_from .. consensus``."""
        return range(self.replay_from, self.consensus + 1) if self.strategy == "logging" else range(0)

    @property
    def pre_failure_iteration(self) -> int:
        """The iteration in flight when the failure hit, as agreed: training is "back" when it is reached."""
        return self.consensus + 1

    def donor_of(self, rank: int) -> int | None:
        return self.donors.get(rank)

    def recipients_of(self, rank: int) -> list[int]:
        return sorted(r for r, d in self.donors.items() if d == rank)


@dataclass(frozen=True)
class LoggingSetup:
    """What logging-based recovery can use, the same on every rank.

    Args:
        replayable_stages: the pipeline stages the topology plan recovers by logging (their inbound
            cross-group sends are logged).
        machine_groups: the selective-logging groups of machines (section 5.3); a failure rolls the
            whole group of the failed machine back. Machines in no group form their own.
        checkpoint_step: the newest global checkpoint complete for every rank (iterations done;
            -1: none yet, the replay starts from the initial state).
        unavailable: why logging-based recovery from that checkpoint is known not to work (a replay
            of an earlier attempt found a missing or corrupt log record), or None.
    """

    replayable_stages: frozenset[int]
    machine_groups: tuple[tuple[int, ...], ...] = ()
    checkpoint_step: int = -1
    unavailable: str | None = None

    def group_machines(self, machines: Collection[int]) -> set[int]:
        """Every machine sharing a logging group with one of ``machines``."""
        out = set(machines)
        for group in self.machine_groups:
            if out & set(group):
                out |= set(group)
        return out


def plan_recovery(
    reports: list[RankReport],
    zero_stage: int = 0,
    forced: str = "auto",
    optimizer: str | None = None,
    logging: LoggingSetup | None = None,
) -> RecoveryPlan:
    """Decide consensus, donors and strategy.

    Args:
        reports: one report per rank of the new generation.
        zero_stage: the ZeRO stage; above 0 each rank holds the only copy of its optimizer partition.
        forced: the config's ``strategy`` (auto | replication | logging | checkpoint).
        optimizer: the name of an optimizer wrapper whose state survivors cannot keep across the
            rebuild (it holds process groups: DeepSpeed's bf16/fp16 wrappers), or None.
        logging: what logging-based recovery may use (None: no message log, so it is not an option).
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
    if forced == "logging":
        return _logging_plan(by_rank, consensus, undo, failed_machines, logging, 'the config forces strategy "logging"')
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
        why = f"no surviving data-parallel replica of stage(s) {stages} (ranks {missing})"
        if forced == "replication":
            return checkpoint(f'{why} and the config forces strategy "replication"')
        return _logging_plan(by_rank, consensus, undo, failed_machines, logging, why)
    return RecoveryPlan(
        "replication",
        f"every lost rank has a surviving replica ({', '.join(f'{d}->{r}' for r, d in sorted(donors.items()))})",
        donors=donors,
        **base,  # type: ignore[arg-type]
    )


def _logging_plan(
    by_rank: dict[int, RankReport],
    consensus: int,
    undo: tuple[int, ...],
    failed_machines: set[int],
    logging: LoggingSetup | None,
    why: str,
) -> RecoveryPlan:
    """Replay the failed machines' logging groups from the last global checkpoint, or say why not."""
    survivors = tuple(sorted(r for r, rep in by_rank.items() if rep.survivor))
    replacements = tuple(sorted(r for r, rep in by_rank.items() if not rep.survivor))

    def checkpoint(reason: str) -> RecoveryPlan:
        return RecoveryPlan("checkpoint", f"{why}; {reason}", consensus, survivors, replacements, undo=undo)

    if logging is None:
        return checkpoint("logging-based recovery is not set up (the plan logs no pipeline send)")
    machines = logging.group_machines(failed_machines)
    group = tuple(sorted(r for r, rep in by_rank.items() if rep.machine in machines))
    if not [r for r in survivors if r not in group]:
        return checkpoint(f"no rank outside the failed logging group (machines {sorted(machines)}) survived")
    uncovered = sorted({by_rank[r].stage for r in group} - logging.replayable_stages)
    if uncovered:
        return checkpoint(
            f"stage(s) {uncovered} of the failed logging group are not recovered by logging in the plan "
            f"(logged stages: {sorted(logging.replayable_stages)})"
        )
    start = max(0, logging.checkpoint_step)
    source = f"global_step{logging.checkpoint_step}" if logging.checkpoint_step >= 0 else "the initial state"
    if logging.unavailable is not None:
        return checkpoint(f"logging-based recovery from {source} failed before ({logging.unavailable})")
    if consensus < start - 1:
        return checkpoint(f"the survivors' iteration {consensus} is older than {source}")
    rolled_back = sorted(set(group) & set(survivors))
    also = f" (rolling back survivors {rolled_back} of the group)" if rolled_back else ""
    reason = (
        f"{why}: ranks {list(group)} (machines {sorted(machines)}) load {source} and replay iterations "
        f"{start}..{consensus} from the message log{also}"
    )
    return RecoveryPlan(
        "logging", reason, consensus, survivors, replacements,
        undo=tuple(r for r in undo if r not in group), replay_ranks=group, replay_from=start,
    )  # fmt: skip
