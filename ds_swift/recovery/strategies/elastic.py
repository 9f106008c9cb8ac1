"""Elastic data parallelism: with no spare machine left the job goes on without a failed machine's
data-parallel replicas (a shrink), and takes them back when the machine returns (a grow). Strategy
``elastic`` (:class:`ElasticStrategy`: lossy forward's restore where a spare replaces the machine),
``ds-swift-launch --elastic`` (and ``--restart-delay`` for the return). Nicolae et al. (shared/papers/nicolae-*.txt, section III-B): lossy forward
recovery "continues with fewer replicas" when nothing replaces the lost ones.

The job's machines, in rank order, are its *layout* (``launch/layout``): a rank is its machine's
position in it times the ranks per machine, plus its local rank.

- **Shrink.** The launcher drops the failed machine from the layout instead of aborting
  (``launch/fate/<g>/<m>`` = ``shrink``). Each survivor takes its rank in the smaller world and
  rebuilds with the data-parallel size that world gives; the global batch is kept by accumulating
  more micro-batches per replica (``elastic.global_batch`` = ``keep``: replica ``d`` of ``dp'``
  trains global micro-batches ``d * gas' .. d * gas' + gas' - 1``, every sample of the old global
  batch), or shrinks with the replicas (``shrink``). The lost ranks' ZeRO-1 partitions come from
  their buddy copies as in a buddy recovery (:func:`ds_swift.recovery.strategies.buddy.buddy_target`: the
  consensus iteration, who undoes, which holder serves which lost rank).
- **Grow.** The machine comes back (its agent's ``--restart-delay`` ran out) once the job trains
  again: its agent appends it to the layout (survivors keep their ranks), names it in
  ``launch/grow/<g>`` and ends generation ``g`` the way a failure does; survivors undo to the
  consensus, and the machine's new ranks receive their stage's state from survivors.

Either way every rank then holds every old partition of its pipeline stage and tensor-parallel rank
(its own, its peers', the lost ones' buddy copies), joins them and cuts out its new partition
(:func:`ds_swift.patches.deepspeed_optim_state.reshard_optimizer`).

A machine must hold whole data-parallel replicas (its ranks a multiple of tp x pp), so that every
survivor keeps its pipeline stage and tensor-parallel rank; otherwise the shrink is refused, loudly.
Without a copy of every lost partition the job stops with the reason (a checkpoint of the old
data-parallel size cannot be loaded into another one).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_swift import transport
from ds_swift.jobstore.agreement import agree, pack, round_prefix, unpack
from ds_swift.jobstore.membership import JobStore, fate_key, grow_key, read_layout
from ds_swift.patches.deepspeed_engine import pipe_topology
from ds_swift.recovery.base import (
    BenchVariant,
    MembershipChange,
    MembershipView,
    RankContext,
    RecoveryOutcome,
    loud,
    say_deviation,
)
from ds_swift.recovery.consensus import RankReport, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.holdings import BuddyHeld, buddy_held
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.state.transfer import finish_restore, load_state, recv_state, send_state, set_counters
from ds_swift.recovery.strategies.buddy import BuddyTarget, buddy_target
from ds_swift.recovery.strategies.lossy import LossyForwardStrategy
from ds_swift.recovery.strategies.resize import Resize, ResizeRefused, plan_resize, resized_ds_config
from ds_swift.recovery.timeline import RankTimeline
from ds_swift.recovery.verify import agree_verdicts, check_resharded, mismatch_reason

__all__ = ["ElasticChange", "ElasticStrategy", "recover_resized"]


def _agree(
    resize: Resize, reports: list[RankReport], zero_stage: int, partitioned: bool
) -> tuple[RecoveryInputs, BuddyTarget | None, str | None]:
    """The consensus over the survivors, and where the lost partitions come from (a shrink)."""
    reports = reports + [
        RankReport(
            rank=r,
            survivor=False,
            stage=resize.old_coords[r][0],
            dp=resize.old_coords[r][1],
            tp=resize.old_coords[r][2],
            machine=resize.machine,
        )
        for r in resize.lost
    ]
    inputs = RecoveryInputs.agree(reports, forced="lossy_forward", zero_stage=zero_stage, partitioned=partitioned)
    why = inputs.keep_blocker()
    if why is not None or not partitioned or not inputs.replacements:
        return inputs, None, why
    target, why = buddy_target(inputs)
    return inputs, target, why or None


def _verify_resize(
    store: JobStore,
    generation: int,
    engine: Any,
    parts: Mapping[int, Any],
    iteration: int,
    timeline: RankTimeline,
    timeout_s: float,
) -> None:
    """Every rank's resharded state against the old ranks' digests of ``iteration``, agreed; a
    mismatch stops the job (no checkpoint of the old data-parallel size fits the new one)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    verdict = check_resharded(store, engine, parts, iteration)
    timeline.extra["verify"] = {"status": verdict.status, "detail": verdict.detail}
    line = f"resharded state {verdict.status}: {verdict.detail}"
    if verdict.status == "verified":
        print(f"[ds-swift] rank {rank}: {line}", flush=True)
    else:
        loud(rank, line)
    reason = mismatch_reason(agree_verdicts(store, generation, rank, world, verdict, timeout_s))
    if reason is not None:
        loud(
            rank,
            f"ELASTIC RESIZE FAILED VERIFICATION: {reason}; the job stops (restart it from the last global "
            "checkpoint on the original number of machines)",
        )
        raise ResizeRefused(reason)


def recover_resized(
    *,
    store: JobStore,
    generation: int,
    engine: Any,
    kept: KeptState | None,
    resize: Resize | None,
    timeline: RankTimeline,
    gather_timeout_s: float,
    zero_stage: int,
    verify: bool = True,
) -> RecoveryOutcome:
    """Every rank of the resized generation (joined, rebuilt): survivors with what they kept and
    the ``resize`` they planned, a returning machine's new ranks with neither (both from rank 0).
    ``verify``: check the resharded state against the old ranks' digests (``verify.enabled``)."""
    from ds_swift.patches.deepspeed_optim_state import GeometryError

    rank, world = dist.get_rank(), dist.get_world_size()
    resize = _agreed_resize(store, generation, rank, resize, gather_timeout_s)
    if world != resize.new_world:
        raise GeometryError(f"rank {rank} is in a world of {world}, the resize plans {resize.new_world}")
    coords = grid_coords(engine)
    survivor_ranks = {n: r for r in resize.survivors if (n := resize.new_rank_of(r)) is not None}  # new -> old
    old_rank = survivor_ranks.get(rank)
    timeline.rank = rank  # its part of the timeline is gathered by the new rank
    mine = _report_of(rank, old_rank, kept, resize, coords[rank])
    said = agree(
        store,
        round_prefix(generation, "resize_report"),
        rank,
        mine,
        range(world),
        lambda values: pack({r: v for r, v in values.items() if v}),  # the survivors' reports
        timeout_s=gather_timeout_s,
        generation=generation,
    )
    inputs, target, why = _agree(
        resize, [RankReport.from_json(v) for v in unpack(said).values()], zero_stage, resize.partitioned
    )
    if why:
        loud(
            rank,
            f"ELASTIC {resize.kind.upper()} IMPOSSIBLE: {why}; the job stops (restart it from the last "
            "global checkpoint on the original number of machines)",
        )
        raise ResizeRefused(why)
    iteration = target.iteration if target is not None else inputs.consensus
    sources = {r: r for r in inputs.survivors}  # old rank -> old rank whose state (or copy) it is
    if target is not None:
        sources.update(target.holders)
    undo = list(inputs.rebased(iteration).undo)
    timeline.t_consensus = time.time()
    if kept is not None and old_rank in undo:
        kept.undo_logged(iteration, timeline)
    # a new rank's module, LR scheduler and counters: from the first survivor of its (stage, tp)
    donors = {
        dst: min(r for r in range(world) if r in survivor_ranks and coords[r] == coords[dst])
        for dst in range(world)
        if dst not in survivor_ranks
    }
    first = {dst: survivor_ranks[donors.get(dst, dst)] for dst in range(world)}
    moves = ResizeMoves(
        resize, rank, old_rank, kept, iteration, sources, donors, resize_transfers(resize, coords, sources, first)
    )
    moved, owners = moves.run(engine)
    finish_restore(engine)
    if verify:
        _verify_resize(store, generation, engine, owners or {first[rank]: None}, iteration, timeline, gather_timeout_s)
    outcome = _outcome(resize, target, iteration, undo, survivor_ranks, donors, moved, rank, timeline)
    restored = round_prefix(generation, "restored")  # nobody trains before every rank is at the new shape
    agree(store, restored, rank, "", range(world), timeout_s=gather_timeout_s, generation=generation)
    timeline.t_restored = time.time()
    timeline.bytes_moved = moved
    return outcome


def _agreed_resize(store: JobStore, generation: int, rank: int, resize: Resize | None, timeout_s: float) -> Resize:
    """Rank 0's plan of the resize (a survivor's), read by the new ranks of a returning machine."""
    if rank == 0:
        assert resize is not None, "rank 0 is a survivor"
        store.publish(generation, "resize", 0, resize.to_json())
    if resize is None:
        resize = Resize.from_json(store.gather(generation, "resize", [0], timeout_s)[0])
    return resize


def _report_of(
    rank: int,
    old_rank: int | None,
    kept: KeptState | None,
    resize: Resize,
    where: tuple[int, int],
) -> str:
    """A survivor's report under its old rank ("": a new rank of a grow has none to give)."""
    from ds_swift.patches.deepspeed_optim_state import GeometryError

    if kept is None:
        if resize.kind != "grow":
            raise GeometryError(f"rank {rank} kept no state, but only a grow brings new ranks")
        return ""
    assert old_rank is not None
    stage, dp, tp = resize.old_coords[old_rank]
    if where != (stage, tp):
        raise GeometryError(
            f"rank {rank} (was {old_rank}) moved from stage {stage} tp {tp} to "
            f"stage {where[0]} tp {where[1]}: its kept module does not fit"
        )
    mine = RankReport(
        rank=old_rank,
        survivor=True,
        stage=stage,
        dp=dp,
        tp=tp,
        machine=resize.machine_of(old_rank),
        last_stepped=kept.last_stepped,
        can_undo=kept.can_undo,
        # buddy.interval: copies older than one step are reached by its own copies
        holdings={BuddyHeld.NAME: buddy_held(kept.buddy, kept.own_copies).to_doc()},
    )
    return mine.to_json()


def _outcome(
    resize: Resize,
    target: BuddyTarget | None,
    iteration: int,
    undo: list[int],
    survivor_ranks: Mapping[int, int],
    donors: Mapping[int, int],
    moved: int,
    rank: int,
    timeline: RankTimeline,
) -> RecoveryOutcome:
    """The resize as a recovery outcome (its plan in new ranks), its deviation said by rank 0."""
    reason = resize.describe() + f"; iteration {iteration} is the consensus"
    if target is not None:
        pairs = ", ".join(f"{h}->{r}" for r, h in sorted(target.holders.items()))
        reason += f"; the lost partitions from their buddy copies ({pairs}, old ranks)"
    new_undo = tuple(n for n in (resize.new_rank_of(r) for r in undo) if n is not None)
    plan = RecoveryPlan(
        ElasticStrategy.name,
        reason,
        iteration,
        tuple(sorted(survivor_ranks)),
        tuple(sorted(donors)),
        donors=dict(donors),
        undo=new_undo,
    )
    outcome = RecoveryOutcome(plan, iteration + 1, bytes_moved=moved)
    if resize.policy == "keep":
        deviation = f"{resize.describe()}: the same samples and update up to the summation order of the gradients"
    else:
        deviation = (
            f"{resize.describe()}: from iteration {iteration + 1} on, each update averages "
            f"{resize.new_dp} replicas' samples instead of {resize.old_dp}"
        )
    say_deviation(rank, rank == 0, ElasticStrategy.name, outcome, deviation)
    timeline.extra["resize"] = {
        "kind": resize.kind,
        "machine": resize.machine,
        "machines": list(resize.new_layout),
        "dp": [resize.old_dp, resize.new_dp],
        "gradient_accumulation_steps": [resize.gas, resize.new_gas],
        "global_batch": resize.policy,
    }
    return outcome


# ---------------------------------------------------------------- the state moves of a resize
def grid_coords(engine: Any) -> list[tuple[int, int]]:
    """(stage, tp) of every rank of ``engine``'s grid."""
    topo = pipe_topology(engine)
    has_tp = "model" in topo.get_axis_names()
    return [
        (int(topo.get_coord(r).pipe), int(topo.get_coord(r).model) if has_tp else 0) for r in range(topo.world_size())
    ]


def resize_transfers(
    resize: Resize, coords: list[tuple[int, int]], sources: Mapping[int, int], first: Mapping[int, int]
) -> list[tuple[int, int, int]]:
    """(old owner, source rank, destination rank) of every old optimizer state each new rank needs,
    in one order on every rank (the sends are posted first, then received in it): partitioned, every
    old partition of its (stage, tp); else one whole state, its own or ``first[dst]``'s (an old rank)."""
    out = []
    for dst, (stage, tp) in enumerate(coords):
        owners = (
            [resize.old_rank_at(stage, q, tp) for q in range(resize.old_dp)] if resize.partitioned else [first[dst]]
        )
        for owner in owners:
            src = resize.new_rank_of(sources[owner])
            assert src is not None  # sources are survivors
            out.append((owner, src, dst))
    return out


@dataclass
class ResizeMoves:
    """This rank's sends and receives of a resize: a new rank's module, schedule and counters from its
    donor, and every old optimizer partition (or whole state) each rank joins into its new one."""

    resize: Resize
    rank: int
    old_rank: int | None
    kept: KeptState | None
    iteration: int
    sources: Mapping[int, int]
    donors: Mapping[int, int]
    transfers: list[tuple[int, int, int]]

    def __post_init__(self) -> None:
        self.state = self.kept.state() if self.kept is not None else None  # after the undo: what it holds
        self.sending: list[tuple[Any, torch.Tensor]] = []

    def payload_of(self, owner: int) -> dict[str, Any]:
        if owner == self.old_rank and self.sources[owner] == owner:
            assert self.state is not None
            return {"optimizer": self.state["optimizer"]}
        if self.kept is None or self.kept.buddy is None:
            raise RuntimeError(f"rank {self.rank} was chosen to send rank {owner}'s buddy copy but holds none")
        return {"optimizer": self.kept.buddy.state_of(owner, self.iteration)["optimizer"]}

    def _isend(self, t: torch.Tensor, dst: int, group: Any = None) -> None:
        self.sending.append((transport.isend(t, dst, group=group), t))

    def run(self, engine: Any) -> tuple[int, dict[int, Any]]:
        """Post the sends, receive, load; returns the bytes sent and the old partitions joined here
        (old rank -> its part; None: its whole state, unpartitioned)."""
        from ds_swift.patches.deepspeed_optim_state import load_optimizer, reshard_optimizer

        rank, kept, state = self.rank, self.kept, self.state
        moved = 0
        for dst, src in sorted(self.donors.items()):
            if src == rank:
                assert kept is not None and state is not None
                rest = {k: v for k, v in state.items() if k != "optimizer"}
                moved += send_state({**rest, "counters": kept.counters or {}}, dst, send=self._isend)
        for owner, src, dst in self.transfers:
            if src == rank and dst != rank:
                moved += send_state(self.payload_of(owner), dst, send=self._isend)
        if rank in self.donors:
            rest = recv_state(self.donors[rank])
            load_state(engine, rest, self.iteration + 1)
            counters = rest.get("counters") or {}
        else:
            assert kept is not None and state is not None
            load_state(engine, {**state, "optimizer": None}, self.iteration + 1)
            counters = kept.counters or {}
        set_counters(engine, self.iteration + 1, skipped_steps=int(counters.get("skipped_steps", 0)))
        parts: dict[int, dict[str, Any]] = {}
        owners: dict[int, Any] = {}
        for owner, src, dst in self.transfers:
            if dst == rank:
                dp = self.resize.old_coords[owner][1]
                parts[dp] = self.payload_of(owner)["optimizer"] if src == rank else recv_state(src)["optimizer"]
                owners[owner] = parts[dp]
        for work, _ in self.sending:
            work.wait()
        if engine.optimizer is not None and parts:
            load_optimizer(engine.optimizer, reshard_optimizer([parts[q] for q in sorted(parts)], engine.optimizer))
        return moved, owners


class ElasticChange(MembershipChange):
    """A shrink or a grow (``resize``; None: a returning machine's new rank, told by rank 0), and
    this rank's place in it."""

    strategy = "elastic"

    def __init__(
        self, resize: Resize | None, rank: int, world: int, ds_config: Mapping[str, Any], machines: list[int]
    ) -> None:
        self.resize, self.rank, self.world, self.ds_config, self.machines = resize, rank, world, ds_config, machines

    def describe(self) -> str:
        return self.resize.describe() if self.resize is not None else "a returning machine's rank joins"

    def restore(self, ctx: RankContext, zero_stage: int) -> RecoveryOutcome:
        return recover_resized(
            store=ctx.store,
            generation=ctx.generation,
            engine=ctx.engine,
            kept=ctx.kept,
            resize=self.resize,
            timeline=ctx.timeline,
            gather_timeout_s=ctx.gather_timeout_s,
            zero_stage=zero_stage,
            verify=ctx.verify,
        )


class ElasticStrategy(LossyForwardStrategy):
    """``"strategy": "elastic"``: a failed machine that a spare replaces is restored as by
    ``lossy_forward``; with no spare left (``ds-swift-launch --elastic``) the job goes on with fewer
    data-parallel replicas, and takes them back when the machine returns (:meth:`membership_change`,
    :func:`recover_resized`). Approximate."""

    name = "elastic"
    SERVICES = StrategyServices(buddy_copies=True, digests=True, elastic=True, sim_kind="elastic")
    # ds-swift bench: with no spare, the job goes on without the failed machine (a shrink)
    BENCH_VARIANTS = {"lossy_forward_elastic": BenchVariant(spare=False)}

    def membership_change(self, view: MembershipView) -> ElasticChange | None:
        """A shrink where the launcher goes on without the failed machine (``launch/fate/<g>/<m>`` =
        ``shrink``: no spare left, ``--elastic``); a grow where a machine came back
        (``launch/grow/<g>``, its agent set it before ending the generation); None: a spare replaces it."""
        store, env, g = view.store, view.env, view.generation
        if view.joining:  # a new rank of a machine that came back: its state comes from the survivors, resharded
            if store.get(grow_key(g)) is None:
                return None
            return ElasticChange(None, env.rank, env.world_size, view.ds_config, read_layout(store, env.num_machines))
        back = store.get(grow_key(g))
        if back is not None:  # not a failure: a machine came back
            return self._resize(view, "grow", int(back))
        machine = view.failed_machine()
        if machine is None or machine == env.machine:
            return None  # this rank's own machine failed: it leaves the job
        fate = store.wait_value(fate_key(g, machine), view.join_timeout_s)
        if fate == "shrink":
            return self._resize(view, "shrink", machine)
        if fate is None:
            view.log(
                f"the launcher did not say within {view.join_timeout_s:g} s what becomes of "
                f"machine {machine}: waiting for its replacement"
            )
        return None

    @staticmethod
    def _resize(view: MembershipView, kind: str, machine: int) -> ElasticChange:
        """The launcher goes on without ``machine`` (a shrink) or takes it back (a grow): this rank's
        place in the new world and the DeepSpeed config with its batch."""
        env, kept = view.env, view.kept
        assert kept is not None and kept.grid is not None and view.machines is not None
        layout = read_layout(view.store, env.num_machines)
        resize = plan_resize(kind, machine, view.machines, layout, kept.grid, view.cfg.elastic, env.rank)
        rank = resize.new_rank_of(env.rank)
        assert rank is not None  # this rank's machine is in the new layout
        view.log(resize.describe() + f"; rank {env.rank} -> {rank}")
        return ElasticChange(resize, rank, resize.new_world, resized_ds_config(view.ds_config, resize), layout)
