"""TranLogs' recovery as a strategy (``"strategy": "tranlogs"``): checkpoint + re-applied updates.

Every rank logs its update after each optimizer step (ds_swift.protect.update_logger); under
``auto``/``logging`` with ``logging.kinds``, only the ranks of the stages the plan has log their
updates, and a failure whose lost ranks are all of such stages is restored here. After a
failure the survivors keep their state (undoing to the consensus where they are ahead, as for
every strategy that keeps it); each lost rank's replacement loads the last global checkpoint and
re-applies its rank's logged updates from there to the consensus (ds_swift.recovery.state.update_log):
no forward or backward pass is recomputed and no survivor rolls back. Exact: bitwise the state the
lost rank had.

0. the agreed iteration: the consensus, or one before it where a lost rank was lost before its
   record of the consensus was stored (:func:`update_target`): the survivors then undo that step;
1. the replacements load the checkpoint (without the survivors: a collective leaving them raises)
   and re-apply the records, one per iteration, in order;
2. a check round: every rank says whether its part worked; any failure (a record missing because
   the writer had not stored it before the kill, a corrupt record, a full disk that stopped the
   logging) makes every rank fall back to the global checkpoint, naming the rank and the record;
3. every rank rebuilds its low-precision parameters from the fp32 masters (a data-parallel
   all-gather under ZeRO-1/bf16: the lost ranks' partitions meet the survivors');
4. with ``verify.enabled``, each replacement checks its state against the digest its rank
   published at the consensus while alive (ds_swift.recovery.verify).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from ds_swift.recovery.base import (
    RankContext,
    RecoveryOutcome,
    RecoveryStrategy,
    check_round,
    checkpoint_source,
    redo_words,
)
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.holdings import UpdateLogHeld
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.transfer import finish_restore
from ds_swift.recovery.state.update_log import UpdateLogStore, load_record, redo_update, restore_after
from ds_swift.recovery.verify import check_published

__all__ = ["TranLogsStrategy", "update_target"]


def update_target(inputs: RecoveryInputs) -> tuple[int, str]:
    """The iteration every rank lands on, and why where it is not the consensus ``c``.

    A rank's optimizer step waits until its previous record is stored (ds_swift.protect.update_logger),
    so a rank lost in the forward or backward passes after its step of ``c`` may lack only its record
    of ``c``, though every survivor stepped ``c``: then every rank lands on ``c - 1``, the survivors
    going back one step (:meth:`TranLogsStrategy.plan` says how) and the replacements re-applying
    their records to ``c - 1`` (a replacement that could not list the log has its records checked there too).
    Any other gap (a record missing further back, a survivor that cannot undo) stays at ``c``: the
    check round then finds the missing record and every rank falls back to the global checkpoint,
    naming it."""
    c, done = inputs.consensus, inputs.checkpoint_step
    newest = {r: UpdateLogHeld.of(inputs.by_rank[r]).newest for r in inputs.replacements}
    behind = sorted(r for r, n in newest.items() if n is not None and n < c)
    if not behind or done > c or any(newest[r] != c - 1 for r in behind) or inputs.rebased(c - 1).cannot_undo:
        return c, ""
    return c - 1, (
        f"ranks {behind} were lost before their update records of iteration {c} were stored: every rank lands on "
        f"iteration {c - 1}"
    )


class TranLogsStrategy(RecoveryStrategy):
    """Reload the checkpoint on the lost ranks only and re-apply their logged updates; exact."""

    name = "tranlogs"
    auto = False  # every rank logs its updates only when the config names this strategy
    SERVICES = StrategyServices(update_log="every_rank", digests=True, sim_kind="logging")

    def offered(self, inputs: RecoveryInputs) -> bool:
        # Under auto or logging, the stages logging their updates (logging.kinds) are restored so.
        setup = inputs.logging
        return inputs.forced in ("auto", "logging") and setup is not None and bool(setup.update_stages)

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        why = inputs.reload_blocker()
        if why is not None or inputs.forced == self.name or not inputs.replacements:
            return why
        setup = inputs.logging
        stages = sorted({inputs.by_rank[r].stage for r in inputs.replacements})
        logging = sorted(setup.update_stages) if setup is not None else []
        if not set(stages) <= set(logging):
            return (
                f"stage(s) {[s for s in stages if s not in logging]} of the lost ranks do not log their updates "
                f"(stages logging updates: {logging})"
            )
        return None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        # Loading the checkpoint, then an optimizer step (no forward, no backward) per iteration.
        return 1.0 + 0.1 * max(0, inputs.consensus + 1 - max(0, inputs.checkpoint_step))

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        if not inputs.replacements:
            return inputs.plan(self.name, "no rank lost its state")
        start = max(0, inputs.checkpoint_step)
        target, earlier = update_target(inputs)
        at = inputs if target == inputs.consensus else inputs.rebased(target)
        source = checkpoint_source(inputs.checkpoint_step)
        reason = f"ranks {list(inputs.replacements)} load {source} and re-apply their logged updates of iterations {start}..{target}"
        # A survivor goes back one step bitwise from its own copy, where it holds one; else it does as
        # the replacements do from its own records (the inverse update is exact only to within 2 ulp).
        inexact = [r for r in at.undo if not at.undoes_exactly(r)] if earlier else []
        if earlier:
            exact = [r for r in at.undo if r not in inexact]
            reason += f"; {earlier}" + (f"; survivors {exact} go back to it from their own copies" if exact else "")
            if inexact:
                reason += (
                    f"; survivors {inexact}, with no own copy of it, load {source} and re-apply their own records too"
                )
        replay = tuple(sorted({*at.replacements, *inexact}))
        plan = at.plan(self.name, reason, replay_ranks=replay, replay_from=start)
        return dataclasses.replace(plan, undo=tuple(r for r in plan.undo if r not in replay))  # those replay instead

    def summary_words(self, summary: Mapping[str, Any] | None, checkpoint_step: int | None) -> str:
        return redo_words(summary, "re-applied the updates of")

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        ctx.keep_state(plan)
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        if not plan.replay_ranks:
            return outcome
        step = inputs.checkpoint_step
        mine: dict[str, object] = {}
        why = None
        if ctx.rank in plan.replay_ranks:
            try:
                mine = self._reapply(plan, step, ctx)
            except Exception as exc:  # noqa: BLE001 - agreed on below: every rank falls back together
                why = f"rank {ctx.rank}: {type(exc).__name__}: {exc}"
        answers = check_round(ctx, inputs, "tranlogs", why, mine, "update-log recovery impossible")  # 2.
        finish_restore(ctx.engine)  # 3. every rank
        if ctx.verify and ctx.rank in plan.replay_ranks:
            outcome.verdict = check_published(ctx.store, ctx.rank, ctx.engine, plan.consensus, "the re-applied state")
        done = [a for a in answers.values() if "records" in a]
        outcome.checkpoint_step = step if step >= 0 else None
        outcome.summary = {
            "mode": "update log",
            "from": plan.replay_from,
            "to": plan.consensus,
            "source": checkpoint_source(step),
            "ranks": list(plan.replay_ranks),
            "records": sum(int(a["records"]) for a in done),
            "log_bytes_read": sum(int(a["bytes"]) for a in done),
            "replay_s": max((float(a["apply_s"]) for a in done), default=0.0),
        }
        ctx.timeline.extra["replay"] = mine
        return outcome

    @staticmethod
    def _reapply(plan: RecoveryPlan, step: int, ctx: RankContext) -> dict[str, object]:
        """Step 1 on a replacement: the checkpoint, then each logged update to the consensus."""
        from ds_swift.recovery.replay.runner import load_start
        from ds_swift.storage import open_store

        updates = ctx.lent.get(UpdateLogStore)
        if updates is None:
            raise RuntimeError("strategy tranlogs chosen without the runtime's update log")
        load_start(ctx.engine, ctx.ckpt, plan, step)
        ctx.timeline.t_loaded = time.time()
        ctx.timeline.extra["checkpoint_loaded"] = step
        store, inner = open_store(updates.url), ctx.engine.optimizer
        inner = getattr(inner, "optimizer", inner)  # the torch optimizer inside DeepSpeed's wrapper
        t0, nbytes, record = time.perf_counter(), 0, None
        for iteration in plan.replay_iterations:
            record = load_record(store, ctx.rank, iteration)
            nbytes += record.nbytes
            redo_update(inner, record)
        if record is not None:
            restore_after(ctx.engine, record)
        apply_s = time.perf_counter() - t0
        n = len(plan.replay_iterations)
        ctx.log(
            f"re-applied {n} logged updates (iterations {plan.replay_from}..{plan.consensus}, "
            f"{nbytes / 1e6:.2f} MB) in {apply_s:.2f} s"
        )
        return {"records": n, "bytes": nbytes, "apply_s": apply_s}
