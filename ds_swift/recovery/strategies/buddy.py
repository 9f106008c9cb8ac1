"""Buddy copies of ZeRO-1 / BF16_Optimizer partitions: who holds whose, and the recovery strategy.

Under ZeRO-1 (and DeepSpeed's BF16_Optimizer, which partitions the fp32 masters the same way) a
rank's fp32 master partition and the optimizer state of that partition exist only on that rank;
a data-parallel replica holds another slice. So after every step each rank's partition is copied,
asynchronously, into host memory of ``replication_factor`` buddy ranks on other machines (other
failure domains where ``machines.failure_domains`` names them): ds_swift.protect.buddy does the
copying, :func:`assign_buddies` (pure) decides who holds whose copy.

:class:`BuddyStrategy` restores a lost rank's partition from a surviving buddy's copy. A copy is
the owner's state after some iteration's step; each buddy reports which ones it holds complete
(:class:`~ds_swift.recovery.holdings.BuddyHeld` in each report). The restore must land every rank
on one iteration: the newest one, at most the consensus, that every lost rank has a copy of and every
survivor ahead of it can get back to (one step by update-undo; any number to an own copy, where
``buddy.interval`` spaces the copies: every rank then trains the iterations since again); otherwise
the strategy refuses, and the registry falls back to the global checkpoint, saying why.

A survivor ahead of the iteration undoes: bitwise, from its own copy of that iteration, which the
copier staged in its host memory before sending it (ds_swift.protect.buddy, used by
ds_swift.recovery.kept); only without one, by update-undo's inverse update of its last step, which
is exact only to 2 ulp, and the recovery then says so (an approximate recovery).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan
from ds_swift.recovery.holdings import BuddyHeld
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.buddies import BuddyError, Member, assign_buddies  # re-exported
from ds_swift.recovery.state.digest import partition_state
from ds_swift.recovery.state.transfer import finish_restore, hand_over, load_received
from ds_swift.recovery.verify import check_copy, check_received, publish_reference

__all__ = ["BuddyError", "BuddyStrategy", "BuddyTarget", "Member", "assign_buddies", "buddy_target", "copy_holders"]


def copy_holders(inputs: RecoveryInputs, owners: Iterable[int]) -> dict[int, dict[int, list[int]]]:
    """owner -> iteration -> other surviving ranks (on machines that did not fail) holding that copy."""
    failed = inputs.failed_machines
    out: dict[int, dict[int, list[int]]] = {r: {} for r in owners}
    for r in inputs.reports:
        if not r.survivor or r.machine in failed:
            continue
        for owner, version in BuddyHeld.of(r).copies:
            if owner in out and owner != r.rank:
                out[owner].setdefault(version, []).append(r.rank)
    return out


@dataclass(frozen=True)
class BuddyTarget:
    """Where a buddy recovery lands: the iteration, and each lost rank's copy holder (the survivors
    ahead of the iteration undo)."""

    iteration: int
    holders: dict[int, int]


def _pick(holders: dict[int, dict[int, list[int]]], target: int) -> dict[int, int]:
    chosen: dict[int, int] = {}
    load: Counter[int] = Counter()
    for owner in sorted(holders):
        if target in holders[owner]:
            pick = min(holders[owner][target], key=lambda h: (load[h], h))
            chosen[owner] = pick
            load[pick] += 1
    return chosen


def buddy_target(inputs: RecoveryInputs) -> tuple[BuddyTarget | None, str]:
    """Where every rank lands, or (None, why not)."""
    holders = copy_holders(inputs, inputs.replacements)
    missing = sorted(r for r, versions in holders.items() if not versions)
    if missing:
        return None, (
            f"no buddy copy of the optimizer partition of rank(s) {missing} survived "
            f"(their buddies were on failed machine(s) {sorted(inputs.failed_machines)})"
        )
    c = inputs.consensus
    common = set.intersection(*(set(versions) for versions in holders.values()))
    # The newest iteration every lost rank's copy holds that every survivor can get back to: the
    # consensus, one step back (update-undo or an own copy), or further where buddy.interval spaces
    # the copies (every survivor's own copy of it).
    for target in sorted((v for v in common if v <= c), reverse=True):
        if not inputs.rebased(target).cannot_undo:
            return BuddyTarget(target, _pick(holders, target)), ""
    have = "; ".join(f"rank {r}: iteration(s) {sorted(v)}" for r, v in sorted(holders.items()))
    own = "; ".join(
        f"rank {r.rank}: {sorted(mine)}" for r in inputs.reports if r.survivor and (mine := BuddyHeld.of(r).own)
    )
    return None, (
        f"the buddy copies ({have}) do not reach the consensus iteration {c}, and no older one is "
        f"common to every lost rank and reachable by every survivor (one step back by update-undo, "
        f"or to its own copies: {own or 'none held'})"
    )


class BuddyStrategy(RecoveryStrategy):
    """Survivors keep their state (undoing to the agreed iteration); each lost rank receives its
    optimizer partition (fp32 masters, optimizer state, loss scaler, counters, LR scheduler) from a
    surviving buddy, and every rank then rebuilds its low-precision parameters from the masters.
    Exact: the copy holds bitwise the owner's state after that iteration's step."""

    name = "buddy"
    SERVICES = StrategyServices(buddy_copies=True, digests=True, sim_kind="replication")

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        if not inputs.survivors:
            return "no rank survived with its state"
        why = inputs.wrapper_blocker()
        if why is not None:
            return why
        if not inputs.replacements:
            return "no rank lost its state"
        if not inputs.partitioned:
            return "the optimizer state is not partitioned (no buddy copies are kept)"
        return buddy_target(inputs)[1] or None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 0.1  # a partition copy per lost rank plus an all-gather: a little above replication

    def plan(self, inputs: RecoveryInputs) -> RecoveryPlan:
        target, _ = buddy_target(inputs)
        assert target is not None  # can_restore said so
        pairs = ", ".join(f"{h}->{r}" for r, h in sorted(target.holders.items()))
        reason = f"every lost rank's optimizer partition has a buddy copy of iteration {target.iteration} ({pairs})"
        at = inputs.rebased(target.iteration)
        if target.iteration < inputs.consensus - 1:
            reason += (
                f" (copies every buddy.interval iterations: iterations {target.iteration + 1}.."
                f"{inputs.consensus} are trained again)"
            )
        return at.plan(self.name, reason + at.undo_words(), donors=target.holders)

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        ctx.keep_state(plan)
        outcome = RecoveryOutcome(plan, plan.consensus + 1)
        # Back once the iteration the failure cut short is reached again (an older copy: later).
        outcome.back_iteration = max(plan.consensus, inputs.consensus) + 1
        holdings = ctx.kept.buddy if ctx.kept is not None else None

        def copy_of(owner: int) -> Any:
            if holdings is None:
                raise RuntimeError(f"rank {ctx.rank} was chosen to send rank {owner}'s buddy copy but holds none")
            copy = holdings.state_of(owner, plan.consensus)
            if ctx.verify:
                publish_reference(ctx, owner, copy)
            return copy

        def said(owner: int, sent: int) -> None:
            ctx.log(f"sending the buddy copy of rank {owner} (iteration {plan.consensus}, {sent / 1e6:.2f} MB)")

        # The sends are posted first and waited for last: a rank holding several copies serves its
        # receivers in any order.
        holder = plan.donor_of(ctx.rank)
        state, outcome.bytes_moved = hand_over(
            plan.recipients_of(ctx.rank), copy_of, holder, posted=True, on_sent=said, timeline=ctx.timeline
        )
        if holder is not None:
            load_received(ctx.engine, state, plan.consensus + 1)
            ctx.log(f"received my optimizer partition of iteration {plan.consensus} from buddy rank {holder}")
        finish_restore(ctx.engine)  # every rank: the low-precision parameters from the masters
        if holder is not None and ctx.verify:
            transported = check_received(ctx, holder, partition_state(ctx.engine), "my optimizer partition")
            outcome.verdict = check_copy(ctx, transported, plan.consensus, "my state rebuilt from the buddy copy")
        return outcome
