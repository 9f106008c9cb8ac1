"""Logging-based recovery as a strategy (SWIFT 5.1/5.3): when it can be used, and for whom.

The failed machines' whole logging groups are replayed from the last global checkpoint: their
ranks (replacements, and survivors sharing a group with a failed machine, which roll back) load it
and re-execute the iterations up to the consensus from the message log, while the survivors
outside the groups keep their state. The protocol each rank runs is
:func:`~ds_swift.recovery.replay.runner.run_logging_recovery`; when its check round finds the
log unusable, every rank falls back to the global checkpoint.

Under a storage budget the groups are those of the plan the engine made from its first iteration's
measured messages (ds_swift.protect.message_logging), the same on every rank (replacements take it
from the job store); that first iteration was logged at every machine boundary, a superset of what
any grouping needs, so a replay that reaches back to it finds every inbound edge of its group.

The replay's machinery (ds_swift.recovery.replay, which drives DeepSpeed's pipeline engine) is
imported by :meth:`LoggingStrategy.restore` alone: reading the strategies' services (a config
check, ``ds-swift plan``) imports no DeepSpeed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ds_swift.patches.deepspeed_optim_state import refresh_lp_params
from ds_swift.recovery.base import (
    BenchVariant,
    RankContext,
    RecoveryOutcome,
    RecoveryStrategy,
    RestoreFailed,
    checkpoint_source,
    redo_words,
)
from ds_swift.recovery.consensus import LoggingSetup, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.verify import ReplayCheck

if TYPE_CHECKING:
    from ds_swift.config import SwiftConfig

__all__ = ["LoggingStrategy", "replay_group"]


def replay_group(inputs: RecoveryInputs, setup: LoggingSetup) -> tuple[set[int], tuple[int, ...]]:
    """The failed machines' logging groups: their machines, and every rank on them (sorted)."""
    machines = setup.group_machines(inputs.failed_machines)
    return machines, tuple(r.rank for r in inputs.reports if r.machine in machines)


class LoggingStrategy(RecoveryStrategy):
    """Replay the failed logging groups from the global checkpoint and the message log; exact."""

    name = "logging"
    SERVICES = StrategyServices(digests=True, stage_recovery=frozenset({"logging"}), sim_kind="logging")

    def services(self, cfg: SwiftConfig) -> StrategyServices:
        # A per-stage mix (logging.kinds) has some stages log their updates instead (TranLogs restores them).
        mixed = cfg.logging.kinds != "messages"
        return dataclasses.replace(self.SERVICES, update_log="per_stage" if mixed else "off")

    def bench_variants(self, pp: int) -> Mapping[str, BenchVariant]:
        """ds-swift bench: the replay spread over survivors (SWIFT 5.2), used even where the plan finds it
        cannot help (``parallel_recovery_force``), and without it: the two measured in one run; and
        TranLogs' per-stage mix: the first half of the stages log their inbound messages, the others
        their updates (``logging.kinds``), against ``logging`` (messages everywhere): the bytes each logs."""
        # Halves, not the planner's pick (logging.kinds auto): on the tiny GPT every stage's messages
        # are smaller than its updates, and machines hold consecutive stages (a group, one kind).
        kinds = ["messages"] * ((pp + 1) // 2) + ["updates"] * (pp // 2)
        return {
            "logging_parallel": BenchVariant({"parallel_recovery": True, "parallel_recovery_force": True}),
            "logging_sequential": BenchVariant({"parallel_recovery": False}),
            "logging_mix": BenchVariant({"logging": {"kinds": kinds}}),
        }

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        why = inputs.keep_blocker()
        if why is not None or not inputs.replacements:
            return why
        # The replayed ranks load their own optimizer partitions (ZeRO-1, BF16_Optimizer) from the
        # checkpoint: no replica needs to hold them. The survivors keep theirs across the rebuild.
        why = inputs.wrapper_blocker()
        setup = inputs.logging
        if why is not None or setup is None:
            return why or "logging-based recovery is not set up (the plan logs no pipeline send)"
        machines, group = replay_group(inputs, setup)
        if not [r for r in inputs.survivors if r not in group]:
            return f"no rank outside the failed logging group (machines {sorted(machines)}) survived"
        uncovered = sorted({inputs.by_rank[r].stage for r in group} - setup.replayable_stages)
        if uncovered and set(uncovered) <= setup.update_stages:
            return f"stage(s) {uncovered} of the failed logging group log their updates, not their inbound messages"
        if uncovered:
            return (
                f"stage(s) {uncovered} of the failed logging group are not recovered by logging in the plan "
                f"(logged stages: {sorted(setup.replayable_stages)})"
            )
        lost = inputs.lost_log_senders(group)
        if lost:
            return (
                f"the message log of rank(s) {[r for r, _ in lost]} stopped covering their sends to the failed group "
                f"({lost[0][1]}): its stages lost log coverage"
            )
        source = checkpoint_source(setup.checkpoint_step)
        if setup.unavailable is not None:
            return f"logging-based recovery from {source} failed before ({setup.unavailable})"
        if inputs.consensus < max(0, setup.checkpoint_step) - 1:
            return f"the survivors' iteration {inputs.consensus} is older than {source}"
        undo = [r for r in inputs.undo if r not in group]
        if undo and inputs.partitioned:
            # An undo restores the fp32 master partition only; the low-precision parameters are
            # all-gathered from the data-parallel peers', some of which replay meanwhile.
            return (
                f"survivors {undo} would undo a step, and their low-precision parameters are rebuilt from "
                "every data-parallel peer's masters, which the replaying ranks cannot join"
            )
        return None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        # Loading the checkpoint, then replaying (on the failed groups only) up to the consensus.
        setup = inputs.logging
        start = max(0, setup.checkpoint_step if setup is not None else inputs.checkpoint_step)
        return 1.0 + max(0, inputs.consensus + 1 - start)

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        setup = inputs.logging
        if setup is None or not inputs.replacements:
            return inputs.plan(self.name, "no rank lost its state")
        machines, group = replay_group(inputs, setup)
        start = max(0, setup.checkpoint_step)
        rolled_back = sorted(set(group) & set(inputs.survivors))
        also = f" (rolling back survivors {rolled_back} of the group)" if rolled_back else ""
        reason = (
            f"ranks {list(group)} (machines {sorted(machines)}) load {checkpoint_source(setup.checkpoint_step)} and replay "
            f"iterations {start}..{inputs.consensus} from the message log{also}"
        )
        plan = inputs.plan(self.name, reason, replay_ranks=group, replay_from=start)
        # Survivors in the group roll back by replaying, not by undoing.
        return dataclasses.replace(plan, undo=tuple(r for r in plan.undo if r not in group))

    def summary_words(self, summary: Mapping[str, Any] | None, checkpoint_step: int | None) -> str:
        return redo_words(summary, "replayed")

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        ctx.keep_state(plan)
        if ctx.rank in plan.undo:
            # The undo put the fp32 masters back; the low-precision parameters (bf16/fp16) follow them
            # (a local copy: can_restore refused partitioned states).
            refresh_lp_params(ctx.engine.optimizer)
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        if not plan.replay_ranks:
            return outcome  # nobody lost: the survivors' kept state is all there is
        from ds_swift.recovery.replay.runner import ReplayRuntime, run_logging_recovery

        rt = ctx.lent.get(ReplayRuntime)
        if rt is None:
            raise RuntimeError("logging-based recovery chosen without the runtime's replay support")
        step = inputs.checkpoint_step
        # A replaying rank checks its state against the digests it published while alive.
        check = (
            ReplayCheck(ctx.store, ctx.rank, plan, ctx.engine) if ctx.verify and ctx.rank in plan.replay_ranks else None
        )
        fallback, outcome.summary = run_logging_recovery(
            store=ctx.store,
            generation=ctx.generation,
            rank=ctx.rank,
            engine=ctx.engine,
            plan=plan,
            reports=list(inputs.reports),
            checkpoint_step=step,
            ckpt=ctx.ckpt,
            rt=rt,
            timeline=ctx.timeline,
            gather_timeout_s=ctx.gather_timeout_s,
            before_iteration=check.before_iteration if check is not None else None,
        )
        if fallback is not None:
            raise RestoreFailed(fallback)
        if check is not None:
            outcome.verdict = check.finish(approximate=(outcome.summary or {}).get("parallel") == "fast")
        outcome.checkpoint_step = step if step >= 0 else None
        return outcome
