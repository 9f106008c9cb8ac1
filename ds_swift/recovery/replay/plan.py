"""What a replay will do, decided before anything runs: the plan of one rank, and why it cannot replay.

:func:`plan_replay` classifies a rank's two pipeline edges against the replayed group (pure);
:func:`unsupported_reasons` lists what would make the replay wait on ranks outside the group
(data-parallel replicas, tied weights, tensor-parallel peers, the optimizer step's collectives).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.msglog.edge import LogEdge, pipeline_position

__all__ = [
    "ReplayPlan",
    "ReplayStats",
    "plan_of",
    "plan_replay",
    "replay_summary",
    "replay_totals",
    "unsupported_reasons",
    "unwrap_engine",
]


def unwrap_engine(engine: Any) -> Any:
    """The DeepSpeed engine of ``engine`` (itself, or the one a SwiftPipelineEngine has in force)."""
    # SwiftPipelineEngine (not an nn.Module) keeps the DeepSpeed engine in force in ``_engine``.
    if not isinstance(engine, torch.nn.Module) and "_engine" in vars(engine):
        return vars(engine)["_engine"]
    return engine


@dataclass(frozen=True)
class ReplayPlan:
    """What one rank of the replayed group does with each of its two pipeline neighbours."""

    rank: int
    stage: int
    num_stages: int
    dp_rank: int
    tp_rank: int
    micro_batches: int  # per iteration (gradient accumulation steps)
    prev_rank: int | None
    next_rank: int | None
    from_log: tuple[LogEdge, ...]  # receives served from the log
    drop_act: bool  # activations go to a rank outside the group
    drop_grad: bool  # gradients go to a rank outside the group
    share: tuple[int, ...] = ()  # the micro-batches this rank replays, in order (parallel recovery); () = all

    @property
    def mine(self) -> tuple[int, ...]:
        return self.share or tuple(range(self.micro_batches))


def plan_replay(
    rank: int,
    stage: int,
    num_stages: int,
    dp_rank: int,
    tp_rank: int,
    micro_batches: int,
    prev_rank: int | None,
    next_rank: int | None,
    group_ranks: set[int] | frozenset[int],
    share: Sequence[int] | None = None,
) -> ReplayPlan:
    """Classify this rank's pipeline edges against the replayed group (no process group needed)."""
    if rank not in group_ranks:
        raise ValueError(f"rank {rank} is not in the replayed group {sorted(group_ranks)}")
    mine = tuple(int(m) for m in share) if share is not None else ()
    if list(mine) != sorted(set(mine)) or any(not 0 <= m < micro_batches for m in mine):
        raise ValueError(f"share {list(mine)} is not an increasing subset of micro-batches 0..{micro_batches - 1}")
    prev_out = prev_rank is not None and prev_rank not in group_ranks
    next_out = next_rank is not None and next_rank not in group_ranks
    edges: list[LogEdge] = []
    if prev_out:
        edges.append(LogEdge.into("act", stage, dp_rank, tp_rank))
    if next_out:
        edges.append(LogEdge.into("grad", stage, dp_rank, tp_rank))
    return ReplayPlan(
        rank,
        stage,
        num_stages,
        dp_rank,
        tp_rank,
        micro_batches,
        prev_rank,
        next_rank,
        tuple(edges),
        next_out,
        prev_out,
        mine,
    )


def plan_of(engine: Any, group_ranks: set[int] | frozenset[int], share: Sequence[int] | None = None) -> ReplayPlan:
    """:func:`plan_replay` for a DeepSpeed ``PipelineEngine``'s position."""
    pos = pipeline_position(unwrap_engine(engine))
    return plan_replay(
        pos.rank,
        pos.stage,
        pos.num_stages,
        pos.dp_rank,
        pos.tp_rank,
        int(engine.gradient_accumulation_steps()),
        pos.prev_rank,
        pos.next_rank,
        group_ranks,
        share,
    )


def _group_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))


def unsupported_reasons(
    engine: Any, group_ranks: set[int] | frozenset[int], step_collectives_recorded: bool = False
) -> list[str]:
    """Why this rank cannot replay within ``group_ranks`` (empty: it can). Call before loading anything.

    Args:
        step_collectives_recorded: a survivor's :class:`CollectiveRecorder` records will be passed to
            :func:`replay`, so the optimizer step's collectives over the whole pipeline are allowed.
    """
    engine = unwrap_engine(engine)
    reasons: list[str] = []
    me = int(engine.global_rank)
    grid = engine.grid
    outside = lambda ranks: sorted(set(ranks) - set(group_ranks))  # noqa: E731

    dp_ranks = list(grid.get_data_parallel_group_ranks())
    if len(dp_ranks) > 1 and outside(dp_ranks):
        reasons.append(
            f"rank {me}: gradients are all-reduced with data-parallel replicas {outside(dp_ranks)} outside the "
            "replayed group (their gradients of the lost iterations are not logged): recover this stage by "
            "replication from a replica"
        )
    tied = getattr(engine.module, "tied_comms", {}) or {}
    for key, comm in tied.items():
        ranks = list(comm.get("ranks", []))
        if me in ranks and outside(ranks):
            reasons.append(
                f"rank {me}: tied weights {key!r} are shared with stages on ranks {outside(ranks)} outside the replayed "
                "group (their tied-gradient all-reduce cannot be replayed from the log)"
            )
    if int(grid.get_slice_parallel_world_size()) > 1:
        tp = _group_ranks(grid.get_slice_parallel_group())
        if outside(tp):
            reasons.append(f"rank {me}: tensor-parallel peers {outside(tp)} are outside the replayed group")
    # The optimizer step of ZeRO, fp16/bf16 and gradient clipping reduces a norm or an overflow
    # flag over the model-parallel group, i.e. every stage of the pipeline: the survivors' shares
    # of the lost iterations are not in the log.
    needs_mp = bool(
        engine.zero_optimization()
        or engine.fp16_enabled()
        or engine.bfloat16_enabled()
        or engine.gradient_clipping() > 0
    )
    if needs_mp and not step_collectives_recorded:
        mp = _group_ranks(grid.get_model_parallel_group())
        if outside(mp):
            what = [
                n
                for n, on in (
                    (f"ZeRO stage {engine.zero_optimization_stage()}", engine.zero_optimization()),
                    ("fp16", engine.fp16_enabled()),
                    ("bf16", engine.bfloat16_enabled()),
                    (f"gradient_clipping={engine.gradient_clipping()}", engine.gradient_clipping() > 0),
                )
                if on
            ]
            reasons.append(
                f"rank {me}: the optimizer step ({', '.join(what)}) reduces a global norm/overflow flag over ranks "
                f"{outside(mp)} outside the replayed group: replay needs a survivor's CollectiveRecorder records"
            )
    if bool(getattr(engine, "dynamic_shape", False)):
        reasons.append(f"rank {me}: dynamic_shape pipelines resend tensor metadata per message (not logged)")
    return reasons


@dataclass
class ReplayStats:
    """What one rank's replay did."""

    rank: int
    start_iteration: int
    end_iteration: int
    iterations: int = 0
    wall_s: float = 0.0
    iteration_s: list[float] = field(default_factory=list)
    messages_from_log: int = 0
    log_bytes_read: int = 0  # payload bytes
    chunk_bytes: int = 0  # chunk files loaded
    chunks_loaded: int = 0
    log_wait_s: float = 0.0  # training-thread time spent waiting for the log
    sends_dropped: int = 0
    sends_live: int = 0
    recvs_live: int = 0
    collectives_substituted: int = 0  # optimizer-step collectives taken from a survivor's records
    micro_batch_passes: int = 0  # the work recomputed: micro-batch forward (and backward) passes run
    losses: dict[int, float] = field(default_factory=dict)  # last stage: mean micro-batch loss per iteration


def replay_summary(stats: Any) -> dict[str, Any]:
    """What one rank's replay did (:class:`ReplayStats`, or parallel recovery's stats), as JSON."""
    rep = getattr(stats, "replay", stats)
    out = {
        "iterations": rep.iterations,
        "from": rep.start_iteration,
        "to": rep.end_iteration,
        "wall_s": rep.wall_s,
        "messages_from_log": rep.messages_from_log,
        "log_bytes_read": rep.log_bytes_read,
        "chunk_bytes": rep.chunk_bytes,
        "chunks_loaded": rep.chunks_loaded,
        "log_wait_s": rep.log_wait_s,
        "sends_dropped": rep.sends_dropped,
        "collectives_substituted": rep.collectives_substituted,
        "micro_batch_passes": rep.micro_batch_passes,
    }
    if rep is not stats:
        out.update(
            mode=stats.mode, share=list(stats.share), exchange_bytes=stats.exchange_bytes, exchange_s=stats.exchange_s
        )
    return out


def replay_totals(per_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The replay's figures over every replayer: the slowest one's wall time, the bytes read, the work
    recomputed (micro-batch forward/backward passes, each one forward and one backward of one stage:
    in all, and on the busiest replayer, the replay's critical path)."""
    passes = [int(s.get("micro_batch_passes", 0)) for s in per_rank.values()]
    return {
        "replay_s": max((s.get("wall_s", 0.0) for s in per_rank.values()), default=0.0),
        "micro_batch_passes": sum(passes),
        "micro_batch_passes_busiest": max(passes, default=0),
        "log_bytes_read": sum(s.get("log_bytes_read", 0) for s in per_rank.values()),
        "per_rank": {str(r): s for r, s in per_rank.items()},
    }
