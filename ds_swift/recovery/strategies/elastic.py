"""Elastic data parallelism: with no spare machine left the job goes on without a failed machine's
data-parallel replicas (a shrink), and takes them back when the machine returns (a grow). Strategy
``lossy_forward`` with ``elastic.enabled``, ``ds-swift-launch --elastic`` (and ``--restart-delay``
for the return). Nicolae et al. (shared/papers/nicolae-*.txt, section III-B): lossy forward
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

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_swift import transport
from ds_swift.jobstore.membership import JobStore
from ds_swift.patches.deepspeed_engine import pipe_topology
from ds_swift.recovery.base import RecoveryOutcome, loud, say_deviation
from ds_swift.recovery.consensus import RankReport, RecoveryInputs, RecoveryPlan
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.state.transfer import finish_restore, load_state, recv_state, send_state, set_counters
from ds_swift.recovery.strategies.buddy import BuddyTarget, buddy_target
from ds_swift.recovery.timeline import RankTimeline
from ds_swift.recovery.verify import agree, check_resharded, mismatch_reason

__all__ = ["Resize", "ResizeRefused", "recover_resized", "resized_ds_config"]

class ResizeRefused(RuntimeError):
    """The job cannot change its number of replicas (the reason says why and what to do)."""


@dataclass(frozen=True)
class Resize:
    """One change of the job's machines (a shrink or a grow), the same on every rank.

    Args:
        kind: ``shrink`` or ``grow``.
        machine: the machine that left, or came back.
        old_layout: the machines of the generation that ended, in rank order.
        new_layout: the machines of the next one, in rank order.
        per_machine: ranks per machine.
        old_coords: (stage, dp, tp) of every rank of the generation that ended, by rank.
        gas: its gradient accumulation steps.
        micro: the micro-batch size.
        policy: ``elastic.global_batch`` (``keep`` or ``shrink``).
        partitioned: each data-parallel rank of the generation that ended held only its slice of
            the optimizer state (ZeRO-1, BF16_Optimizer with dp > 1).
    """

    kind: str
    machine: int
    old_layout: tuple[int, ...]
    new_layout: tuple[int, ...]
    per_machine: int
    old_coords: tuple[tuple[int, int, int], ...]
    gas: int
    micro: int
    policy: str
    partitioned: bool

    @property
    def old_world(self) -> int:
        return len(self.old_coords)

    @property
    def new_world(self) -> int:
        return len(self.new_layout) * self.per_machine

    @property
    def old_dp(self) -> int:
        return 1 + max(c[1] for c in self.old_coords)

    @property
    def new_dp(self) -> int:
        return self.old_dp * self.new_world // self.old_world

    @property
    def new_gas(self) -> int:
        return self.gas * self.old_dp // self.new_dp if self.policy == "keep" else self.gas

    def machine_of(self, old_rank: int) -> int:
        return self.old_layout[old_rank // self.per_machine]

    def new_rank_of(self, old_rank: int) -> int | None:
        """The rank ``old_rank`` has after the change (None: its machine left)."""
        machine = self.machine_of(old_rank)
        if machine not in self.new_layout:
            return None
        return self.new_layout.index(machine) * self.per_machine + old_rank % self.per_machine

    def old_rank_at(self, stage: int, dp: int, tp: int) -> int:
        return self.old_coords.index((stage, dp, tp))

    @property
    def survivors(self) -> list[int]:
        """The old ranks that are in the new generation too."""
        return [r for r in range(self.old_world) if self.new_rank_of(r) is not None]

    @property
    def lost(self) -> list[int]:
        return [r for r in range(self.old_world) if self.new_rank_of(r) is None]

    @classmethod
    def plan(cls, *, kind: str, machine: int, old_layout: Sequence[int], new_layout: Sequence[int],
             old_coords: Sequence[tuple[int, int, int]], gas: int, micro: int, policy: str, min_dp: int,
             partitioned: bool) -> Resize:  # fmt: skip
        """Check that the change is possible; ResizeRefused (with the fix) where it is not."""
        per_machine = len(old_coords) // len(old_layout)
        resize = cls(kind, machine, tuple(old_layout), tuple(new_layout), per_machine,
                     tuple((int(s), int(d), int(t)) for s, d, t in old_coords), gas, micro, policy, partitioned)  # fmt: skip
        model_parallel = resize.old_world // resize.old_dp
        if per_machine % model_parallel:
            raise ResizeRefused(
                f"a machine holds {per_machine} rank(s), not whole data-parallel replicas of {model_parallel} "
                f"(tp x pp): adding or dropping machine {machine} would break replicas; place whole replicas per "
                "machine (swift machines.rank_order tp-pp-dp with gpus_per_node a multiple of tp x pp), or add spares"
            )
        if resize.new_dp < min_dp:
            raise ResizeRefused(
                f"dropping machine {machine} leaves {resize.new_dp} data-parallel replica(s), fewer than "
                f"elastic.min_data_parallel={min_dp}: add a spare machine (ds-swift-launch --spares) or lower it"
            )
        if policy == "keep" and (gas * resize.old_dp) % resize.new_dp:
            raise ResizeRefused(
                f"elastic.global_batch=keep: {gas * resize.old_dp} micro-batches per iteration do not split over "
                f"{resize.new_dp} replicas; set elastic.global_batch to \"shrink\", or choose a divisible accumulation"
            )
        return resize

    def describe(self) -> str:
        batch = (f"global batch kept: accumulation {self.gas} -> {self.new_gas} micro-batches per replica"
                 if self.policy == "keep" else
                 f"global batch {self.micro * self.gas * self.old_dp} -> {self.micro * self.gas * self.new_dp} samples")  # fmt: skip
        what = (f"elastic shrink: machine {self.machine} left for good (no spare)" if self.kind == "shrink"
                else f"elastic grow: machine {self.machine} is back")  # fmt: skip
        return f"{what}; data parallelism {self.old_dp} -> {self.new_dp} on machines {list(self.new_layout)}; {batch}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Resize:
        d = json.loads(text)
        d["old_layout"], d["new_layout"] = tuple(d["old_layout"]), tuple(d["new_layout"])
        d["old_coords"] = tuple(tuple(c) for c in d["old_coords"])
        return cls(**d)


def resized_ds_config(ds_config: Mapping[str, Any], resize: Resize) -> dict[str, Any]:
    """The DeepSpeed config of the resized job: the micro-batch, the new accumulation and batch."""
    out = dict(ds_config)
    out["train_micro_batch_size_per_gpu"] = resize.micro
    out["gradient_accumulation_steps"] = resize.new_gas
    out["train_batch_size"] = resize.micro * resize.new_gas * resize.new_dp
    return out


def _coords(engine: Any) -> list[tuple[int, int]]:
    """(stage, tp) of every rank of ``engine``'s grid."""
    topo = pipe_topology(engine)
    has_tp = "model" in topo.get_axis_names()
    return [(int(topo.get_coord(r).pipe), int(topo.get_coord(r).model) if has_tp else 0)
            for r in range(topo.world_size())]  # fmt: skip


def _transfers(resize: Resize, coords: list[tuple[int, int]], sources: Mapping[int, int],
               first: Mapping[int, int]) -> list[tuple[int, int, int]]:  # fmt: skip
    """(old owner, source rank, destination rank) of every old optimizer state each new rank needs,
    in one order on every rank (the sends are posted first, then received in it): partitioned, every
    old partition of its (stage, tp); else one whole state, its own or ``first[dst]``'s (an old rank)."""
    out = []
    for dst, (stage, tp) in enumerate(coords):
        owners = [resize.old_rank_at(stage, q, tp) for q in range(resize.old_dp)] if resize.partitioned else [first[dst]]
        for owner in owners:
            src = resize.new_rank_of(sources[owner])
            assert src is not None  # sources are survivors
            out.append((owner, src, dst))
    return out


def _agree(resize: Resize, reports: list[RankReport], zero_stage: int,
           partitioned: bool) -> tuple[RecoveryInputs, BuddyTarget | None, str | None]:  # fmt: skip
    """The consensus over the survivors, and where the lost partitions come from (a shrink)."""
    reports = reports + [
        RankReport(rank=r, survivor=False, stage=resize.old_coords[r][0], dp=resize.old_coords[r][1],
                   tp=resize.old_coords[r][2], machine=resize.machine)
        for r in resize.lost
    ]  # fmt: skip
    inputs = RecoveryInputs.agree(reports, forced="lossy_forward", zero_stage=zero_stage, partitioned=partitioned)
    why = inputs.keep_blocker()
    if why is not None or not partitioned or not inputs.replacements:
        return inputs, None, why
    target, why = buddy_target(inputs)
    return inputs, target, why or None


def _verify_resize(store: JobStore, generation: int, engine: Any, parts: Mapping[int, Any], iteration: int,
                   timeline: RankTimeline, timeout_s: float) -> None:
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
    reason = mismatch_reason(agree(store, generation, rank, world, verdict, timeout_s))
    if reason is not None:
        loud(rank, f"ELASTIC RESIZE FAILED VERIFICATION: {reason}; the job stops (restart it from the last global "
                   "checkpoint on the original number of machines)")  # fmt: skip
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
    log: Callable[[str], None],
    zero_stage: int,
    verify: bool = True,
) -> RecoveryOutcome:
    """Every rank of the resized generation (joined, rebuilt): survivors with what they kept and
    the ``resize`` they planned, a returning machine's new ranks with neither (both from rank 0).
    ``verify``: check the resharded state against the old ranks' digests (``verify.enabled``)."""
    from ds_swift.patches.deepspeed_optim_state import GeometryError, load_optimizer, reshard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        assert resize is not None, "rank 0 is a survivor"
        store.publish(generation, "resize", 0, resize.to_json())
    if resize is None:
        resize = Resize.from_json(store.gather(generation, "resize", [0], gather_timeout_s)[0])
    if world != resize.new_world:
        raise GeometryError(f"rank {rank} is in a world of {world}, the resize plans {resize.new_world}")
    coords = _coords(engine)
    survivor_ranks: dict[int, int] = {}  # new rank -> old rank
    for r in resize.survivors:
        new = resize.new_rank_of(r)
        assert new is not None
        survivor_ranks[new] = r
    old_rank = survivor_ranks.get(rank)
    timeline.rank = rank  # its part of the timeline is gathered by the new rank
    if kept is not None:
        assert old_rank is not None
        stage, dp, tp = resize.old_coords[old_rank]
        if coords[rank] != (stage, tp):
            raise GeometryError(f"rank {rank} (was {old_rank}) moved from stage {stage} tp {tp} to "
                                f"stage {coords[rank][0]} tp {coords[rank][1]}: its kept module does not fit")  # fmt: skip
        mine = RankReport(rank=old_rank, survivor=True, stage=stage, dp=dp, tp=tp, machine=resize.machine_of(old_rank),
                          last_stepped=kept.last_stepped, can_undo=kept.can_undo,
                          buddy_copies=kept.buddy.copies() if kept.buddy is not None else ())  # fmt: skip
        store.publish(generation, "resize_report", rank, mine.to_json())
    elif resize.kind != "grow":
        raise GeometryError(f"rank {rank} kept no state, but only a grow brings new ranks")
    gathered = store.gather(generation, "resize_report", sorted(survivor_ranks), gather_timeout_s)
    reports = [RankReport.from_json(v) for v in gathered.values()]
    inputs, target, why = _agree(resize, reports, zero_stage, resize.partitioned)
    if why:
        loud(rank, f"ELASTIC {resize.kind.upper()} IMPOSSIBLE: {why}; the job stops (restart it from the last "
                   "global checkpoint on the original number of machines)")  # fmt: skip
        raise ResizeRefused(why)
    iteration = target.iteration if target is not None else inputs.consensus
    at = inputs.rebased(iteration)
    sources = {r: r for r in inputs.survivors}  # old rank -> old rank whose state (or copy) it is
    if target is not None:
        sources.update(target.holders)
    undo = list(at.undo)
    timeline.t_consensus = time.time()
    if kept is not None and old_rank in undo:
        kept.undo_logged(iteration, timeline, log)

    # a new rank's module, LR scheduler and counters: from the first survivor of its (stage, tp)
    donors = {dst: min(r for r in range(world) if r in survivor_ranks and coords[r] == coords[dst])
              for dst in range(world) if dst not in survivor_ranks}  # fmt: skip
    first = {dst: survivor_ranks[donors.get(dst, dst)] for dst in range(world)}
    transfers = _transfers(resize, coords, sources, first)
    state = kept.state() if kept is not None else None  # after the undo: what this rank now holds

    def payload_of(owner: int) -> dict[str, Any]:
        if owner == old_rank and sources[owner] == owner:
            assert state is not None
            return {"optimizer": state["optimizer"]}
        if kept is None or kept.buddy is None:
            raise RuntimeError(f"rank {rank} was chosen to send rank {owner}'s buddy copy but holds none")
        return {"optimizer": kept.buddy.state_of(owner, iteration)["optimizer"]}

    sending: list[tuple[Any, torch.Tensor]] = []

    def isend(t: torch.Tensor, dst: int, group: Any = None) -> None:
        sending.append((transport.isend(t, dst, group=group), t))

    moved = 0
    for dst, src in sorted(donors.items()):
        if src == rank:
            assert kept is not None and state is not None
            rest = {k: v for k, v in state.items() if k != "optimizer"}
            moved += send_state({**rest, "counters": kept.counters or {}}, dst, send=isend)
    for owner, src, dst in transfers:
        if src == rank and dst != rank:
            moved += send_state(payload_of(owner), dst, send=isend)
    if rank in donors:
        rest = recv_state(donors[rank])
        load_state(engine, rest, iteration + 1)
        counters = rest.get("counters") or {}
    else:
        assert kept is not None and state is not None
        load_state(engine, {**state, "optimizer": None}, iteration + 1)
        counters = kept.counters or {}
    set_counters(engine, iteration + 1, skipped_steps=int(counters.get("skipped_steps", 0)))
    parts: dict[int, dict[str, Any]] = {}
    owners: dict[int, Any] = {}  # old rank -> its part joined here (None: its whole state, unpartitioned)
    for owner, src, dst in transfers:
        if dst == rank:
            parts[resize.old_coords[owner][1]] = payload_of(owner)["optimizer"] if src == rank else recv_state(src)["optimizer"]
            owners[owner] = parts[resize.old_coords[owner][1]]
    for work, _ in sending:
        work.wait()
    if engine.optimizer is not None and parts:
        load_optimizer(engine.optimizer, reshard_optimizer([parts[q] for q in sorted(parts)], engine.optimizer))
    finish_restore(engine)
    if verify:
        _verify_resize(store, generation, engine, owners or {first[rank]: None}, iteration, timeline, gather_timeout_s)

    reason = resize.describe() + f"; iteration {iteration} is the consensus"
    if target is not None:
        pairs = ", ".join(f"{h}->{r}" for r, h in sorted(target.holders.items()))
        reason += f"; the lost partitions from their buddy copies ({pairs}, old ranks)"
    new_undo = tuple(n for n in (resize.new_rank_of(r) for r in undo) if n is not None)
    plan = RecoveryPlan("lossy_forward", reason, iteration, tuple(sorted(survivor_ranks)),
                        tuple(sorted(donors)), donors=donors, undo=new_undo)  # fmt: skip
    outcome = RecoveryOutcome(plan, iteration + 1, bytes_moved=moved)
    if resize.policy == "keep":
        deviation = f"{resize.describe()}: the same samples and update up to the summation order of the gradients"
    else:
        deviation = (f"{resize.describe()}: from iteration {iteration + 1} on, each update averages "
                     f"{resize.new_dp} replicas' samples instead of {resize.old_dp}")  # fmt: skip
    say_deviation(rank, rank == 0, "lossy_forward", outcome, deviation)
    timeline.extra["resize"] = {
        "kind": resize.kind, "machine": resize.machine, "machines": list(resize.new_layout),
        "dp": [resize.old_dp, resize.new_dp], "gradient_accumulation_steps": [resize.gas, resize.new_gas],
        "global_batch": resize.policy,
    }  # fmt: skip
    transport.barrier()
    timeline.t_restored = time.time()
    timeline.bytes_moved = moved
    return outcome
