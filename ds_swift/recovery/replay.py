"""Logging-based recovery: re-execute a failed group's lost iterations from the message log (SWIFT 5.1).

The replacement ranks of a failed logging group load the last global checkpoint (iteration
``start``) and call :func:`replay` to run iterations ``start..end`` of their stages' part of
DeepSpeed's ``TrainSchedule`` again, with the engine's own instruction handlers, so the ops and
their order are those of the failure-free run (bitwise identical on CPU). Per instruction:

- ``RecvActivation`` / ``RecvGrad`` from a rank outside the group: DeepSpeed's handler runs with
  ``p2p.recv`` served from the log record (iteration, micro-batch, edge); the first activation
  receive gets a synthesised tensor-meta message, exactly what ``_send_tensor_meta`` sent;
- ``SendActivation`` / ``SendGrad`` to a rank outside the group: the handler runs with
  ``p2p.send`` dropped (a message logger installed under it still re-logs the send: the failed
  machine's own log died with it);
- sends and receives inside the group stay live (p2p on the world group needs only the pair);
- the per-iteration loss broadcast to the whole pipe group (``_aggregate_total_loss``) is not
  run: :func:`replay` drives ``_exec_schedule`` itself;
- collectives inside the group stay live; one of the optimizer step that reaches outside it (the
  gradient-clipping norm, DeepSpeed's default, reduces over every stage) takes the result a
  survivor recorded (:class:`CollectiveRecorder`); any other is refused up front
  (:func:`unsupported_reasons`) and, as a guard, at the call (it would wait forever on survivors).

Log chunks are read by a background thread ahead of the replay (:mod:`~ds_swift.recovery.replay_log`);
the step's collectives are recorded and substituted by :mod:`~ds_swift.recovery.collectives`. A
missing or corrupt record raises :class:`LogUnavailable` naming the file and record; the engine is
then mid-iteration and must be reloaded from the checkpoint (the runtime's loud fallback).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.data import BatchFn, global_micro_batch, micro_batches, rng_seed
from ds_swift.recovery.collectives import (
    CollectiveRecord,
    CollectiveRecorder,
    ReplayUnsupported,
    _CollectiveGuard,
    _unwrap,
    _wrapped_collectives,
)
from ds_swift.recovery.replay_log import (
    InEdge,
    LogFeeder,
    LogUnavailable,
    Message,
    ProgressFn,
    ReplayProgress,
    chunks_needed,
    rich_progress,
    text_progress,
)

# Re-exported: the replay's public surface predates the split into replay_log and collectives.
__all__ = [
    "CollectiveRecord",
    "CollectiveRecorder",
    "InEdge",
    "LogFeeder",
    "LogUnavailable",
    "ProgressFn",
    "ReplayPlan",
    "ReplayProgress",
    "ReplayStats",
    "ReplayUnsupported",
    "chunks_needed",
    "keyed_rng",
    "plan_replay",
    "replay",
    "rich_progress",
    "text_progress",
    "unsupported_reasons",
]


# ----------------------------------------------------------------------------- plan (pure)
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
    from_log: tuple[InEdge, ...]  # receives served from the log
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
    edges: list[InEdge] = []
    if prev_out:
        edges.append(InEdge("act", stage - 1, stage, dp_rank, tp_rank))
    if next_out:
        edges.append(InEdge("grad", stage + 1, stage, dp_rank, tp_rank))
    return ReplayPlan(
        rank, stage, num_stages, dp_rank, tp_rank, micro_batches, prev_rank, next_rank, tuple(edges), next_out, prev_out,
        mine,
    )  # fmt: skip


def _plan_of(engine: Any, group_ranks: set[int] | frozenset[int], share: Sequence[int] | None = None) -> ReplayPlan:
    from ds_swift.patches.pipe_logging import pipeline_position

    pos = pipeline_position(engine)
    return plan_replay(
        pos.rank, pos.stage, pos.num_stages, pos.dp_rank, pos.tp_rank, int(engine.gradient_accumulation_steps()),
        pos.prev_rank, pos.next_rank, group_ranks, share,
    )  # fmt: skip


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
    engine = _unwrap(engine)
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
                n for n, on in (
                    (f"ZeRO stage {engine.zero_optimization_stage()}", engine.zero_optimization()),
                    ("fp16", engine.fp16_enabled()),
                    ("bf16", engine.bfloat16_enabled()),
                    (f"gradient_clipping={engine.gradient_clipping()}", engine.gradient_clipping() > 0),
                ) if on
            ]  # fmt: skip
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
    losses: dict[int, float] = field(default_factory=dict)  # last stage: mean micro-batch loss per iteration


# ----------------------------------------------------------------------------- RNG keyed by position
def keyed_rng(engine: Any, seed: int, share: Sequence[int] | None = None) -> Any:
    """Reseed torch before every forward pass from (seed, iteration, micro-batch, stage). Returns the handle.

    The same keying as the Swift runtime's forward hook (ds_swift.data.rng_seed), counted per
    iteration from ``engine.global_steps``, so a replayed forward draws the same dropout masks.
    ``share``: the micro-batches the engine runs, in order (parallel recovery); default all.
    """
    from ds_swift.patches.instructions import hook_instructions, schedule

    engine = _unwrap(engine)
    state = {"iteration": -1, "micro": 0}

    def forward(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        it = int(eng.global_steps)
        if it != state["iteration"]:
            state["iteration"], state["micro"] = it, 0
        local = share[state["micro"]] if share else state["micro"]
        mb = global_micro_batch(eng.grid.get_data_parallel_id(), eng.gradient_accumulation_steps(), local)
        state["micro"] += 1
        torch.manual_seed(rng_seed(seed, it, mb, int(eng.stage_id)))
        return call_next(**kw)

    return hook_instructions(engine, "ds_swift.keyed_rng", {schedule.ForwardPass: forward})


# ----------------------------------------------------------------------------- p2p served / dropped
def _meta_message(engine: Any, msg: Message, what: str) -> torch.Tensor:
    """The tensor-meta message ``_send_tensor_meta`` sent before the first activation of an edge."""
    from deepspeed.runtime.pipe.engine import TENSOR_META_SIZE

    parts = msg if isinstance(msg, tuple) else (msg,)
    try:
        ids = [int(engine.DTYPE_TO_ID[t.dtype]) for t in parts]
    except KeyError as exc:
        raise LogUnavailable(f"{what}: the log holds a dtype DeepSpeed cannot send ({exc})") from None
    if isinstance(msg, tuple):
        values = [2, len(parts)]
        for t, i in zip(parts, ids):
            values += [i, t.dim(), *t.shape]
    else:
        values = [0, ids[0], msg.dim(), *msg.shape]
    if len(values) > TENSOR_META_SIZE:
        raise LogUnavailable(f"{what}: the logged message has more dimensions than DeepSpeed's metadata holds")
    meta = torch.zeros(TENSOR_META_SIZE, dtype=torch.int32)
    meta[: len(values)] = torch.tensor(values, dtype=torch.int32)
    return meta


def _recv_served(call_next: Callable[..., Any], kw: dict[str, Any], items: list[torch.Tensor], what: str) -> Any:
    """Run a DeepSpeed receive handler with ``p2p.recv`` filling its buffers from ``items``, in order."""
    from deepspeed.runtime.pipe import p2p

    me = threading.get_ident()
    original = p2p.recv
    pos = 0

    def recv(tensor: torch.Tensor, src_stage: int, async_op: bool = False) -> Any:
        nonlocal pos
        if threading.get_ident() != me:
            return original(tensor, src_stage, async_op=async_op)
        if pos >= len(items):
            raise LogUnavailable(f"{what}: the stage receives more tensors than the log record holds")
        src = items[pos]
        pos += 1
        if tuple(tensor.shape) != tuple(src.shape) or tensor.dtype != src.dtype:
            raise LogUnavailable(
                f"{what}: tensor {pos - 1} of the log record is {src.dtype} {tuple(src.shape)}, "
                f"the receive buffer is {tensor.dtype} {tuple(tensor.shape)}"
            )
        tensor.copy_(src)
        return None

    p2p.recv = recv
    try:
        result = call_next(**kw)
    finally:
        p2p.recv = original
    if pos != len(items):
        raise LogUnavailable(f"{what}: the log record holds {len(items)} tensors, the stage received {pos}")
    return result


def _send_dropped(call_next: Callable[..., Any], kw: dict[str, Any]) -> Any:
    """Run a DeepSpeed send handler with ``p2p.send`` a no-op (its receiver is not replaying)."""
    from deepspeed.runtime.pipe import p2p

    me = threading.get_ident()
    original = p2p.send

    def send(tensor: torch.Tensor, dest_stage: int, async_op: bool = False) -> Any:
        if threading.get_ident() != me:
            return original(tensor, dest_stage, async_op=async_op)
        return None

    p2p.send = send
    try:
        return call_next(**kw)
    finally:
        p2p.send = original


class _Replayer:
    """The instruction hooks of one replay: which receives come from the log, which sends are dropped."""

    def __init__(self, plan: ReplayPlan, stats: ReplayStats, guard: _CollectiveGuard) -> None:
        self.plan = plan
        self.stats = stats
        self.guard = guard
        self.logged_kinds = {e.kind for e in plan.from_log}
        self.edge_of = {e.kind: e for e in plan.from_log}
        self.iteration = -1
        self.messages: dict[tuple[str, int], Message] = {}
        self.counters = {"act": 0, "grad": 0}

    def begin(self, iteration: int, messages: dict[tuple[str, int], Message]) -> None:
        self.iteration = iteration
        self.messages = dict(messages)
        self.counters = {"act": 0, "grad": 0}

    def end(self) -> None:
        for kind in self.logged_kinds:
            if self.counters[kind] != len(self.plan.mine):
                raise RuntimeError(
                    f"replay of iteration {self.iteration}: {self.counters[kind]} {kind} receives from the log, "
                    f"expected {len(self.plan.mine)}"
                )

    def _recv(self, kind: str) -> Callable[..., Any]:
        def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            if kind not in self.logged_kinds:
                self.stats.recvs_live += 1
                return call_next(**kw)
            mb = self.plan.mine[self.counters[kind]]
            self.counters[kind] += 1
            edge = self.edge_of[kind]
            what = f"iteration {self.iteration} micro-batch {mb} ({edge})"
            msg = self.messages.pop((kind, mb), None)
            if msg is None:
                raise LogUnavailable(
                    f"{what}: not read from the log", iteration=self.iteration, micro_batch=mb, edge=edge
                )
            items: list[torch.Tensor] = []
            if kind == "act":
                # A 1-tuple is logged as one record, like a bare tensor: the engine's buffer tells which.
                if isinstance(eng.pipe_recv_buf, tuple) and isinstance(msg, torch.Tensor):
                    msg = (msg,)
                if eng.dynamic_shape or eng.pipe_recv_buf is None:
                    items.append(_meta_message(eng, msg, what))
            items += list(msg) if isinstance(msg, tuple) else [msg]
            self.stats.messages_from_log += 1
            return _recv_served(call_next, kw, items, what)

        return hook

    def _send(self, kind: str) -> Callable[..., Any]:
        drop = self.plan.drop_act if kind == "act" else self.plan.drop_grad

        def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            if not drop:
                self.stats.sends_live += 1
                return call_next(**kw)
            first = eng.first_output_send
            try:
                return _send_dropped(call_next, kw)
            finally:
                # The survivor's rebuilt engine expects the tensor metadata with the first live
                # activation after recovery: keep "metadata not sent yet".
                eng.first_output_send = first
                self.stats.sends_dropped += 1

        return hook

    def _step(self, eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        self.guard.begin_step(int(eng.global_steps))
        try:
            return call_next(**kw)
        finally:
            self.guard.end_step()

    def hooks(self) -> dict[type, Callable[..., Any]]:
        from ds_swift.patches.instructions import schedule

        return {
            schedule.OptimizerStep: self._step,
            schedule.RecvActivation: self._recv("act"),
            schedule.RecvGrad: self._recv("grad"),
            schedule.SendActivation: self._send("act"),
            schedule.SendGrad: self._send("grad"),
        }


# ----------------------------------------------------------------------------- replay
def _reset_for_replay(engine: Any, start: int) -> None:
    # A fresh p2p handshake on every edge (both ends of an in-group edge reset together), and
    # the gradients a step leaves behind (None): also right when retrying after a failed replay.
    engine.reset_activation_shape()
    for p in engine.module.parameters():
        p.grad = None
    if getattr(engine.module, "seed_layers", False):
        # PipelineModule seeds layers from a forward counter kept since construction.
        engine.module.micro_offset = start * int(engine.micro_batches)


def _run_iteration(engine: Any, batch_fn: BatchFn, plan: ReplayPlan, iteration: int) -> None:
    """``train_batch`` without the loss broadcast to the whole pipe group (over this rank's share)."""
    engine.module.train()
    engine.total_loss = None
    engine.total_additional_losses = None
    engine._compute_loss = True
    if engine.is_first_stage() or engine.is_last_stage():
        if plan.share:
            gas = plan.micro_batches
            data: Any = (batch_fn(iteration, global_micro_batch(plan.dp_rank, gas, m)) for m in plan.share)
        else:
            data = micro_batches(batch_fn, iteration, plan.dp_rank, plan.micro_batches)
        engine.set_dataiterator(data)
    # The schedule runs engine.micro_batches; the loss is still scaled by gradient_accumulation_steps().
    engine.micro_batches = len(plan.mine)
    try:
        engine._exec_schedule(engine._train_schedule())
    finally:
        engine.micro_batches = plan.micro_batches


def replay(
    engine: Any,
    reader: Any,
    group_ranks: set[int] | frozenset[int],
    start_iteration: int,
    end_iteration: int,
    batch_fn: BatchFn,
    progress: ProgressFn | None = None,
    *,
    seed: int | None = None,
    before_iteration: Callable[[int], None] | None = None,
    collectives: CollectiveRecorder | dict[tuple[int, int], CollectiveRecord] | None = None,
    ahead: int | None = None,
    log_timeout_s: float = 600.0,
    share: Sequence[int] | None = None,
    extra_hooks: Mapping[type, Callable[..., Any]] | None = None,
) -> ReplayStats:
    """Re-execute iterations ``start_iteration..end_iteration`` (inclusive) on this rank of the failed group.

    Every rank in ``group_ranks`` calls it at the same time; ranks outside it do not take part.
    On return the engine has stepped ``end_iteration`` (``global_steps == end_iteration + 1``) and
    its pipeline edges to ranks outside the group are in the state a freshly built neighbour expects.

    Args:
        engine: the DeepSpeed PipelineEngine (or SwiftPipelineEngine) of this rank, loaded from the
            global checkpoint of ``start_iteration`` (``global_steps == start_iteration``).
        reader: a ``ds_swift.msglog.LogReader`` over the logs of the group's inbound edges.
        group_ranks: the global ranks being replayed (the failed logging group's replacements).
        start_iteration, end_iteration: the iterations to replay, inclusive (``end < start``: nothing).
        batch_fn: ``batch_fn(iteration, micro_batch)``, as in training (ds_swift.data).
        progress: called with a :class:`ReplayProgress` at the start and after each iteration.
        seed: reseed before each forward from (seed, iteration, micro-batch, stage); None when a hook
            already installed on the engine does it (the Swift runtime's).
        before_iteration: called with the iteration number before it is replayed.
        collectives: the optimizer-step collective results a survivor of this pipeline replica
            recorded (:class:`CollectiveRecorder`); needed when the step reduces over the whole
            pipeline (gradient clipping, DeepSpeed's default; ZeRO; fp16/bf16).
        ahead: iterations of log records read in advance (default: one chunk span plus one).
        log_timeout_s: the longest wait for one iteration's records.
        share: replay only these micro-batches of each iteration (parallel recovery; see
            ds_swift.recovery.parallel, which combines the shares' gradients before the step).
        extra_hooks: instruction hooks installed around the replay's own for its duration.

    Raises:
        ReplayUnsupported: before anything ran, when a collective would leave the group.
        LogUnavailable: a record is missing or corrupt; the engine must be reloaded from the checkpoint.
    """
    from ds_swift.patches.instructions import hook_instructions

    engine = _unwrap(engine)
    group = frozenset(int(r) for r in group_ranks)
    plan = _plan_of(engine, group, share)
    records = collectives.records if isinstance(collectives, CollectiveRecorder) else collectives
    reasons = unsupported_reasons(engine, group, step_collectives_recorded=records is not None)
    if plan.share and getattr(engine.module, "seed_layers", False):
        reasons.append("seed_layers=True seeds layers from a forward counter: a share of micro-batches breaks it")
    if reasons:
        raise ReplayUnsupported("; ".join(reasons))
    if int(engine.global_steps) != start_iteration:
        raise ValueError(
            f"replay from iteration {start_iteration}, but the engine is at global_steps={engine.global_steps}: "
            "load the global checkpoint of that iteration first"
        )
    if not torch.is_grad_enabled():
        raise RuntimeError("replay() requires gradients enabled")
    stats = ReplayStats(plan.rank, start_iteration, end_iteration)
    total = max(0, end_iteration - start_iteration + 1)
    if total == 0:
        return stats
    _reset_for_replay(engine, start_iteration)
    feeder = (
        LogFeeder(reader, plan.from_log, start_iteration, end_iteration, plan.mine, ahead, log_timeout_s)
        if plan.from_log
        else None
    )
    guard = _CollectiveGuard(group, records)
    replayer = _Replayer(plan, stats, guard)
    handles: list[Any] = []
    t0 = time.perf_counter()

    def report(next_iteration: int) -> None:
        if progress is not None:
            progress(
                ReplayProgress(
                    plan.rank,
                    stats.iterations,
                    total,
                    next_iteration,
                    feeder.bytes_read if feeder else 0,
                    feeder.chunks_loaded if feeder else 0,
                    feeder.chunks_total if feeder else 0,
                    time.perf_counter() - t0,
                )  # fmt: skip
            )

    try:
        if seed is not None:
            handles.append(keyed_rng(engine, seed, plan.share or None))
        handles.append(hook_instructions(engine, "ds_swift.replay", replayer.hooks()))
        if extra_hooks:
            handles.append(hook_instructions(engine, "ds_swift.replay.extra", extra_hooks))
        with _wrapped_collectives(guard.make):
            report(start_iteration)
            for it in range(start_iteration, end_iteration + 1):
                t_it = time.perf_counter()
                if before_iteration is not None:
                    before_iteration(it)
                replayer.begin(it, feeder.take(it) if feeder is not None else {})
                _run_iteration(engine, batch_fn, plan, it)
                replayer.end()
                if int(engine.global_steps) != it + 1:
                    raise RuntimeError(f"replay of iteration {it} left global_steps at {engine.global_steps}")
                if engine.is_last_stage() and isinstance(engine.total_loss, torch.Tensor):
                    stats.losses[it] = float(engine._scale_loss_by_gas(engine.total_loss).mean())
                stats.iterations += 1
                stats.iteration_s.append(time.perf_counter() - t_it)
                report(it + 1)
    finally:
        while handles:
            handles.pop().remove()
        if feeder is not None:
            feeder.close()
            stats.log_bytes_read = feeder.bytes_read
            stats.chunk_bytes = feeder.chunk_bytes
            stats.chunks_loaded = feeder.chunks_loaded
            stats.log_wait_s = feeder.wait_s
        stats.collectives_substituted = guard.substituted
        if plan.prev_rank is not None and plan.prev_rank not in group:
            # The next activation comes from a survivor's rebuilt engine, metadata first.
            engine.pipe_recv_buf = None
        stats.wall_s = time.perf_counter() - t0
    return stats
