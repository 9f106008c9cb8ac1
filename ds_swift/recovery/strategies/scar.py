"""SCAR's partial recovery as a strategy (``"strategy": "scar"``): only the lost ranks reload.

SCAR (shared/papers/scar-*.txt, section 4.1) restores from the last checkpoint only the part of
the model that the failure lost, and keeps the rest: the perturbation to the parameters is the
lost part's staleness alone, and training self-corrects from it. Here the lost part is the lost
ranks' state (their pipeline stages' parameters, fp32 masters and optimizer state, or their ZeRO-1
partitions):

1. the survivors keep their state (undoing to the consensus where they are ahead, as for every
   strategy that keeps it);
2. each replacement loads the last global checkpoint (the initial state where none is complete
   yet), then takes the job's counters and LR schedule at the consensus from a survivor, so it
   trains on at the same iteration, on the same data and learning rate, from stale weights;
3. a check round on the store: a replacement that could not load makes every rank fall back to the
   global checkpoint, loudly;
4. every rank rebuilds its low-precision parameters from the fp32 masters.

With SCAR's prioritized checkpoints (``checkpoint.running_fraction``), each rank also keeps a running
checkpoint of its optimizer state (ds_swift.checkpoint.running: the most-changed blocks, a few every
iterations), and a replacement loads the blocks of it newer than the global checkpoint over it, so
the lost part is staler only where it moved least.

Approximate, and said so: no replay, no verification against a digest (the state differs from the
failure-free run's by design). The outcome's ``deviation`` (and the timeline's) says which ranks
went back how many iterations; ``ds-swift bench`` reports the final-loss delta and the parameters'
distance to the failure-free run.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ds_swift.checkpoint.running import running_dir, running_state
from ds_swift.recovery.base import (
    RankContext,
    RecoveryOutcome,
    RecoveryStrategy,
    announce_deviation,
    check_round,
    checkpoint_source,
    loud,
)
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.transfer import finish_restore, set_counters

__all__ = ["ScarStrategy"]


def _schedule(engine: Any) -> dict[str, Any] | None:
    """A survivor's LR scheduler state, where it is plain JSON (DeepSpeed's and torch's are)."""
    sched = getattr(engine, "lr_scheduler", None)
    if sched is None:
        return None
    try:
        state = sched.state_dict()
        json.dumps(state)
    except (TypeError, ValueError):
        return None
    return {"state": state}


def _loss_scale(engine: Any) -> list[dict[str, Any]]:
    """A survivor's loss scalers' numbers (fp16's dynamic scaling; none under bf16): the job's one
    scale, which the checkpoint's is behind of. JSON: no dtype, no tensor."""
    from ds_swift.patches.deepspeed_optim_state import UnsupportedWrapper, kind_of, loss_scalers

    opt = getattr(engine, "optimizer", None)
    try:
        scalers = loss_scalers(opt, kind_of(opt)) if opt is not None else []
    except UnsupportedWrapper:
        return []
    return [{k: v for k, v in vars(s).items() if isinstance(v, bool | int | float)} for s in scalers]


class ScarStrategy(RecoveryStrategy):
    """Reload the checkpoint on the lost ranks only, keep the survivors' state; approximate."""

    name = "scar"
    exact = False
    auto = False  # approximate: only when the config names it
    SERVICES = StrategyServices(running_checkpoint=True, sim_kind="replication")

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        return inputs.reload_blocker()

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 1.0  # the lost ranks load the checkpoint; nothing is trained again

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        if not inputs.replacements:
            return inputs.plan(self.name, "no rank lost its state")
        reason = (
            f"ranks {list(inputs.replacements)} load {checkpoint_source(inputs.checkpoint_step)} and train on from iteration "
            f"{inputs.consensus + 1} with the survivors' state (partial recovery: approximate)"
        )
        # replay_ranks: the ranks that load (the checkpoint load is guarded to them); nothing is replayed.
        return inputs.plan(self.name, reason, replay_ranks=inputs.replacements, replay_from=inputs.consensus + 1)

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        from ds_swift.recovery.replay.runner import load_start

        ctx.keep_state(plan)
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        if not plan.replay_ranks:
            return outcome
        step, lost = inputs.checkpoint_step, list(plan.replay_ranks)
        why: str | None = None
        mine: dict[str, object] = {}
        if ctx.rank in lost:
            try:
                load_start(ctx.engine, ctx.ckpt, plan, step)
                self._load_running(ctx, step)
            except Exception as exc:  # noqa: BLE001 - agreed on below: every rank falls back together
                why = f"rank {ctx.rank}: {type(exc).__name__}: {exc}"
        else:
            mine = {
                "skipped_steps": int(getattr(ctx.engine, "skipped_steps", 0)),
                "schedule": _schedule(ctx.engine),
                "loss_scale": _loss_scale(ctx.engine),
            }
        answers = check_round(ctx, inputs, "scar", why, mine, "partial recovery impossible")
        if ctx.rank in lost:
            self._catch_up(ctx, plan, answers)
        finish_restore(ctx.engine)
        behind = plan.consensus + 1 - max(0, step)
        outcome.checkpoint_step = step if step >= 0 else None
        announce_deviation(
            ctx,
            inputs,
            self.name,
            outcome,
            (
                f"ranks {lost} went back {behind} iteration(s) to {checkpoint_source(step)}; the other ranks kept their state "
                f"(partial recovery: the job goes on from a state the failure-free run never had)"
            ),
        )
        return outcome

    @staticmethod
    def _load_running(ctx: RankContext, step: int) -> None:
        """The blocks of this rank's running checkpoint newer than ``step``, over what it loaded."""
        from ds_swift.checkpoint.running import (
            MANIFEST,
            RunningCheckpointError,
            load_running_checkpoint,
            running_checkpoint_job,
        )

        if ctx.ckpt is None:
            return
        where = running_dir(ctx.ckpt.ckpt_dir, ctx.rank, ctx.ckpt.job_id)
        if not (where / MANIFEST).exists():
            return
        owner = running_checkpoint_job(where)
        if owner != ctx.ckpt.job_id:  # a directory copied or moved here: never another run's blocks
            raise RunningCheckpointError(
                f"the running checkpoint in {where} belongs to {owner or 'an unknown job'}, "
                f"not this job ({ctx.ckpt.job_id}): remove it, or recover from the global one"
            )
        live, _ = running_state(ctx.engine.optimizer)
        loaded, ages = load_running_checkpoint(where, live, newer_than=max(step, 0))
        with torch.no_grad():
            for name, t in live.items():
                t.copy_(loaded[name])
        saved = sum(a.saved_blocks for a in ages.values())
        total = sum(a.blocks for a in ages.values())
        newest = max((a.newest for a in ages.values() if a.newest is not None), default=None)
        ctx.log(
            f"running checkpoint: {saved} of {total} blocks newer than {checkpoint_source(step)} loaded over it"
            + (f" (newest of iteration {newest})" if newest is not None else "")
        )

    @staticmethod
    def _catch_up(ctx: RankContext, plan: RecoveryPlan, answers: dict[int, dict[str, Any]]) -> None:
        """A replacement stands at the consensus's counters, LR schedule and loss scale (the lowest
        survivor's): a replacement on the checkpoint's loss scale would unscale every later gradient
        by another factor than its peers."""
        from ds_swift.patches.deepspeed_optim_state import load_optimizer_scalars

        engine = ctx.engine
        survivor = answers[min(r for r, a in answers.items() if "schedule" in a)]
        set_counters(engine, plan.consensus + 1, skipped_steps=int(survivor["skipped_steps"]))
        if survivor.get("loss_scale"):  # the numbers over the replacement's own scalers (dtype stays)
            load_optimizer_scalars(engine.optimizer, {"scalers": survivor["loss_scale"], "flags": {}})
        sched = getattr(engine, "lr_scheduler", None)
        if sched is not None and survivor["schedule"] is not None:
            sched.load_state_dict(survivor["schedule"]["state"])
        elif sched is not None:
            loud(
                ctx.rank,
                "the survivors' LR scheduler state is not plain JSON: this rank's schedule resumes "
                "from the checkpoint's, behind the job's",
            )
        ctx.log(f"partial recovery: at iteration {plan.consensus + 1} with the checkpoint's weights")
