"""Nicolae et al.'s immediate mini-batch rollback as a strategy (``"strategy": "immediate_rollback"``).

shared/papers/nicolae-*.txt, section III-B: no consensus on a consistent state and no undo. The
survivors' state, as the failure left it (possibly partly updated), is what the job goes on from:

1. every survivor keeps its state as it is; one that already applied the failed iteration's step
   keeps that update too (no undo), and only its LR schedule and step counters go back, so that the
   replayed iteration runs at its own learning rate;
2. each lost rank takes the state of a survivor as it is: a surviving data-parallel replica's whole
   state, or, where the optimizer state is partitioned (ZeRO-1, BF16_Optimizer), the newest buddy
   copy of its partition, whatever iteration that is;
3. every rank replays the failed mini-batch (the iteration after the survivors' lowest step).

Approximate, and said so: where a rank had stepped the failed iteration, that iteration's update is
applied twice there; where a lost rank's copy is older or newer than its replica peers, the stage's
data-parallel ranks start from a mix. In a DeepSpeed pipeline every rank steps after the whole
backward pass, so a failure in a forward or backward pass leaves nothing partly updated and the
replay is exact in all but name; the deviation appears when a failure hits between the first and
the last rank's step. The outcome's ``deviation`` says which ranks apply an iteration twice.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Any

from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy, announce_deviation
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.simulated_failure import SimulatedFailure, copy_state
from ds_swift.recovery.state.transfer import (
    capture_state,
    finish_restore,
    hand_over,
    load_received,
    load_state,
    set_counters,
)
from ds_swift.recovery.strategies.buddy import copy_holders
from ds_swift.recovery.strategies.replication import donors_for

if TYPE_CHECKING:
    from ds_swift.config import SimulateConfig

__all__ = ["ImmediateRollbackStrategy", "rollback_sources"]


def rollback_sources(inputs: RecoveryInputs) -> tuple[dict[int, tuple[int, int]], str]:
    """Each lost rank's source ``(survivor rank, iteration of the state it sends)``, or ({}, why not).

    Partitioned optimizer state: the newest buddy copy on a machine that did not fail (the least
    loaded holder of it). Otherwise: a surviving data-parallel replica, as it is."""
    by_rank = inputs.by_rank
    if not (inputs.partitioned or inputs.zero_stage > 0):
        donors, missing = donors_for(inputs)
        if missing:
            stages = sorted({by_rank[r].stage for r in missing})
            return {}, f"no surviving data-parallel replica of stage(s) {stages} (ranks {missing}) to take state from"
        return {lost: (d, by_rank[d].last_stepped) for lost, d in donors.items()}, ""
    held = copy_holders(inputs, inputs.replacements)
    missing = sorted(r for r, v in held.items() if not v)
    if missing:
        return {}, f"no buddy copy of the optimizer partition of rank(s) {missing} survived to take state from"
    load: Counter[int] = Counter()
    out: dict[int, tuple[int, int]] = {}
    for owner in sorted(held):
        version = max(held[owner])
        pick = min(held[owner][version], key=lambda h: (load[h], h))
        load[pick] += 1
        out[owner] = (pick, version)
    return out, ""


class ImmediateRollbackStrategy(RecoveryStrategy):
    """No consensus state, no undo: the survivors' state as it is goes to the replacements, and the
    failed mini-batch is replayed on every rank. Approximate."""

    name = "immediate_rollback"
    exact = False
    auto = False  # approximate: only when the config names it
    # The survivors' state as it is (no undo): nothing to check a restore against.
    SERVICES = StrategyServices(buddy_copies=True, sim_kind="replication")

    def simulated_failure(self, cfg: SimulateConfig) -> SimulatedFailure:
        return RollbackSimulation(cfg)

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        if not inputs.survivors:
            return "no rank survived with its state"
        why = inputs.wrapper_blocker()
        if why is not None or not inputs.replacements:
            return why
        return rollback_sources(inputs)[1] or None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 1.0  # one state copy per lost rank, then the failed mini-batch again

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        sources, _ = rollback_sources(inputs)
        ahead = self.ahead(inputs)
        pairs = ", ".join(f"{s}->{r} (iteration {v})" for r, (s, v) in sorted(sources.items()))
        reason = f"replay iteration {inputs.consensus + 1} from the survivors' state as it is" + (
            f"; replacements take it from {pairs}" if pairs else ""
        )
        if ahead:
            reason += f"; ranks {ahead} stepped it already and step it again (no undo: approximate)"
        plan = inputs.plan(self.name, reason, donors={r: s for r, (s, _) in sources.items()})
        return dataclasses.replace(plan, undo=())  # nobody undoes

    @staticmethod
    def ahead(inputs: RecoveryInputs) -> list[int]:
        """The survivors that already applied the iteration to be replayed."""
        return [r.rank for r in inputs.reports if r.survivor and r.last_stepped > inputs.consensus]

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        ahead = self.ahead(inputs)
        rewound = True
        if ctx.kept is not None and ctx.rank in ahead:
            rewound = ctx.kept.rewind_schedule(plan.consensus)
            ctx.log(
                f"immediate rollback: keeping the update of iteration {ctx.kept.last_stepped} (no undo); "
                f"{'LR schedule and counters back to iteration ' + str(plan.consensus) if rewound else 'LR schedule stays one step ahead (no record of it)'}"
            )
        ctx.keep_state(plan)
        sources, _ = rollback_sources(inputs)
        partitioned = inputs.partitioned or inputs.zero_stage > 0
        donor = plan.donor_of(ctx.rank)
        state, outcome.bytes_moved = hand_over(
            plan.recipients_of(ctx.rank),
            lambda lost: self._source_state(ctx, lost, sources[lost][1], partitioned, plan.consensus),
            donor,
            on_sent=lambda lost, sent: ctx.log(
                f"immediate rollback: sent my state as it is to rank {lost} ({sent / 1e6:.2f} MB)"
            ),
        )
        if donor is not None:
            load_received(ctx.engine, state, plan.consensus + 1)
            ctx.log(f"immediate rollback: took rank {donor}'s state of iteration {sources[ctx.rank][1]}")
        finish_restore(ctx.engine)
        lagging = {r: v for r, (_, v) in sources.items() if v != plan.consensus}
        parts = [f"replayed iteration {plan.consensus + 1} without undo"]
        if ahead:
            parts.append(f"ranks {ahead} apply it a second time")
        if lagging:
            parts.append(
                "lost ranks took states of other iterations: "
                + ", ".join(f"rank {r} of iteration {v}" for r, v in sorted(lagging.items()))
            )
        if not rewound:
            parts.append(f"rank {ctx.rank}'s LR schedule runs one step ahead")
        if ahead or lagging or not rewound:
            announce_deviation(ctx, inputs, self.name, outcome, "; ".join(parts))
        return outcome

    @staticmethod
    def _source_state(ctx: RankContext, lost: int, version: int, partitioned: bool, consensus: int) -> Any:
        if not partitioned:
            return capture_state(ctx.engine)
        holdings = ctx.kept.buddy if ctx.kept is not None else None
        if holdings is None:
            raise RuntimeError(f"rank {ctx.rank} was chosen to send rank {lost}'s buddy copy but holds none")
        state = holdings.state_of(lost, version)
        if version != consensus and state.get("optimizer") is not None:
            # fp16: a copy of another iteration holds that iteration's loss scaler, and a rank on
            # another scale than its peers unscales every later gradient by another factor. The
            # job has one scale: this survivor's, at the consensus (rewound where it stepped ahead).
            from ds_swift.patches.deepspeed_optim_state import optimizer_scalars

            state["optimizer"]["scalers"] = optimizer_scalars(ctx.engine.optimizer)["scalers"]
        return state


def _scalars(engine: Any) -> dict[str, Any] | None:
    """A copy of the optimizer wrapper's loss scalers and flags (None: no wrapper ds-swift reads)."""
    from ds_swift.patches.deepspeed_optim_state import UnsupportedWrapper, optimizer_scalars

    try:
        return optimizer_scalars(engine.optimizer) if engine.optimizer is not None else None
    except UnsupportedWrapper:
        return None


class RollbackSimulation(SimulatedFailure):
    """The ranks of ``stepped_stages`` had stepped when the simulated failure hit, the others had not;
    then everyone trains the failed mini-batch again. The iteration is trained once, the ranks of the
    other stages put back their state from before it (a copy taken before its first forward pass:
    exact, one state copy of host memory for that iteration), every rank's LR schedule and counters
    go back one iteration, and the iteration is trained again: what the strategy does after a real
    failure with those stages stepped."""

    def __init__(self, cfg: SimulateConfig) -> None:
        super().__init__(cfg)
        self._saved: dict[str, Any] | None = None

    def before(self, engine: Any) -> None:
        if self.done or int(engine.global_steps) != self.iteration:
            return
        stepped = int(engine.stage_id) in self.cfg.stepped_stages
        sched = getattr(engine, "lr_scheduler", None)
        self._saved = {
            "schedule": copy_state(sched.state_dict()) if sched is not None else None,
            "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
            "state": None if stepped else copy_state(capture_state(engine)),
            # fp16: the loss scaler goes back too, as the strategy's rewind puts it back (its
            # record of the step): else the retrained iteration moves it a second time.
            "scalars": _scalars(engine) if stepped else None,
        }

    def roll_back(self, engine: Any) -> bool:
        saved, self._saved = self._saved, None
        if saved is None:
            return False
        self.done = True
        if saved["state"] is not None:
            load_state(engine, saved["state"], self.iteration)
        else:
            if saved["schedule"] is not None:
                engine.lr_scheduler.load_state_dict(saved["schedule"])
            set_counters(engine, self.iteration, skipped_steps=saved["skipped_steps"])
            if saved["scalars"] is not None:
                from ds_swift.patches.deepspeed_optim_state import load_optimizer_scalars

                load_optimizer_scalars(engine.optimizer, saved["scalars"])
        finish_restore(engine)  # the low-precision parameters from the masters (per data-parallel group)
        kept = "kept its update" if saved["state"] is None else "did not apply it"
        self._log(
            f"simulated failure (immediate rollback) at iteration {self.iteration}: my stage {kept}; "
            "training the mini-batch again"
        )
        return True
