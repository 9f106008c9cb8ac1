"""Global checkpoint reload: every rank loads the newest global checkpoint complete for all of them.

The fallback of every recovery: always able (with no checkpoint yet, training restarts from the
initial state), always exact, and the most expensive (every rank trains the iterations since the
checkpoint again). It says so loudly, with the reason the cheaper strategies could not be used.

A checkpoint that does not load (a corrupt or missing file of one rank) is not the end: every rank
says whether its load worked, and if any failed, all of them step back to the complete checkpoint
before it, loudly, naming the ranks and the error; the ranks never end on different tags. With no
older checkpoint left the recovery stops with the error (the engine may hold part of a failed load,
so training cannot restart from the initial state).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ds_swift.checkpoint.periodic import tag_for
from ds_swift.jobstore.agreement import agree, round_prefix
from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy, checkpoint_source, loud
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.transfer import set_counters

__all__ = ["AsyncGlobalCheckpointStrategy", "GlobalCheckpointStrategy"]


class GlobalCheckpointStrategy(RecoveryStrategy):
    """Every rank reloads the last global checkpoint (or the initial state, with none yet)."""

    name = "checkpoint"

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        return None

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        # Every way of saving checkpoints (synchronous, asynchronous, CheckFreq's interval) recovers
        # by this one reload, under this one name (the guard and the timelines look for it).
        return inputs.plan(GlobalCheckpointStrategy.name)

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        # Every rank retrains from the checkpoint to the iteration in flight.
        return float(inputs.consensus + 1 - max(0, inputs.checkpoint_step))

    def summary_words(self, summary: Mapping[str, Any] | None, checkpoint_step: int | None) -> str:
        return f"reload of {checkpoint_source(checkpoint_step if checkpoint_step is not None else -1)}"

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        step, ckpt = inputs.checkpoint_step, ctx.ckpt
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        if step >= 0 and ckpt is not None:
            loud(ctx.rank, f"checkpoint fallback ({plan.reason}): loading {tag_for(step)} from {ckpt.ckpt_dir}")
            loaded = _load_agreed(ctx, ckpt, step, [r.rank for r in inputs.reports])
            outcome.checkpoint_step = loaded
            outcome.resume_iteration = int(loaded or 0)
        else:
            loud(
                ctx.rank,
                f"checkpoint fallback ({plan.reason}) but no complete global checkpoint exists yet: "
                "training restarts from the initial state (iteration 0)",
            )
            outcome.resume_iteration = 0
        set_counters(ctx.engine, outcome.resume_iteration)
        return outcome


class AsyncGlobalCheckpointStrategy(GlobalCheckpointStrategy):
    """``"strategy": "global_checkpoint"``: only the global checkpoint, saved asynchronously (training
    waits for a host snapshot; ds_swift.checkpoint.background) also where the state is on CPU."""

    name = "global_checkpoint"
    auto = False  # "auto" keeps its own protections; the reload is its fallback anyway
    SERVICES = StrategyServices(async_checkpoints=True)


def _load_agreed(ctx: RankContext, ckpt: Any, step: int, ranks: list[int]) -> int | None:
    """Load the newest checkpoint of at most ``step`` iterations that loads on every rank. Every rank
    decides from the same gathered reports, so all of them end on one tag (or all raise)."""
    at_most, attempt, tried = step, 0, False
    while True:
        found = ckpt.latest(at_most)
        done = found[0] if found is not None else -1
        error = ""
        if found is not None:
            tried = True
            try:
                ckpt.load(ctx.engine, found)
            except Exception as exc:  # noqa: BLE001 - reported to every rank, which step back together
                error = f"{type(exc).__name__}: {exc}"[:300]
        record = json.dumps({"done": done, "error": error, "tried": tried})
        said = json.loads(
            agree(
                ctx.store,
                round_prefix(ctx.generation, f"ckpt_load/{attempt}"),
                ctx.rank,
                record,
                ranks,
                _load_verdict,
                timeout_s=ctx.gather_timeout_s,
                generation=ctx.generation,
            )
        )
        failed, dones, any_tried = said["failed"], said["dones"], said["any_tried"]
        if not failed and len(dones) == 1:
            if done >= 0:
                return done
            if not any_tried:
                return None  # no checkpoint at all: the rebuilt engine is the initial state
        nxt = min(dones)
        if failed:
            first = min(failed, key=int)
            loud(
                ctx.rank,
                f"CHECKPOINT {tag_for(said['bad'])} DOES NOT LOAD on ranks {said['failed_ranks']} (rank {first}: "
                f"{failed[first]}): every rank steps back to the complete checkpoint before it",
            )
            nxt = min(nxt, said["bad"] - 1)
        if nxt < 0 and any_tried:
            raise RuntimeError(
                "no global checkpoint loads on every rank, and a failed load may have left part of "
                "one in the engine: restart the job from a checkpoint you know is good"
            )
        at_most, attempt = nxt, attempt + 1


def _load_verdict(records: Mapping[int, str]) -> str:
    """A load attempt's verdict, the same on every rank: the iterations the ranks loaded (or would),
    whether any tried one, and the ranks whose load failed (the lowest ones' errors named)."""
    said = {r: json.loads(v) for r, v in records.items()}
    failed = {r: v for r, v in sorted(said.items()) if v["error"]}
    return json.dumps(
        {
            "dones": sorted({v["done"] for v in said.values()}),
            "any_tried": any(v["tried"] for v in said.values()),
            "failed": {r: v["error"] for r, v in list(failed.items())[:8]},
            "failed_ranks": sorted(failed)[:64],
            "bad": min((v["done"] for v in failed.values()), default=-1),
        }
    )
