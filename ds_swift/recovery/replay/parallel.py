"""Parallel recovery (SWIFT section 5.2): survivors replay a share of the lost micro-batches.

The failed stages (a contiguous run of one pipeline replica, ``layout.stages``) are replayed by
two sub-pipelines at once: the replacements (on their own engines) and as many survivors, the
*helpers*, each hosting a copy of one failed stage. Sub-pipeline ``r`` takes micro-batches
``r, r+2, ...`` of every iteration (the paper's Figure 7), reading its inbound activations and
gradients from the log like a sequential replay; the two copies of a stage then combine their
gradients before the optimizer step, which both apply, so they stay identical.

- **exact** mode: every copy records the gradient each backward call adds to each parameter
  (a tensor hook: the value AccumulateGrad adds), the copies swap them, and each sums them in the
  original micro-batch and call order, left to right: the accumulation the sequential run did,
  so the result is bitwise equal to :func:`~ds_swift.recovery.replay.engine.replay`.
- **fast** mode: each copy accumulates its own share, the copies swap the partial sums and add
  them in sub-pipeline order (an all-reduce of two): a different association, so the gradients
  differ in their last bits and Adam carries that on (tests/dist/test_replay_pipeline.py measures
  the parameters after four iterations: at most 192 ulp from the sequential result).

The helpers' copies are real DeepSpeed engines: :func:`build_copy_engine` builds, on every rank
of the job (it creates process groups), the same ``PipelineModule`` with the same partition over a
topology in which helpers and replacements swap their pipeline coordinates; a helper's copy is
then an ordinary stage engine (same instruction handlers, same loss scaling, same optimizer). The
helpers' own engines and their state are not touched: nothing to save and restore afterwards.

The gradients are combined where the optimizer wrapper accumulates them
(:mod:`ds_swift.recovery.replay.parallel_combine`): ``param.grad`` for fp32, fp16 (loss scaling: both copies
carry the same scaler state, and the step's overflow check sees the combined gradient) and ZeRO-1
stage 1; BF16_Optimizer's fp32 buffers for bf16 (ZeRO-0 or ZeRO-1). The copy receives the
replacement's whole state (masters, optimizer moments, loss scaler): the replayed group is one
data-parallel rank, so a ZeRO-1 partition is the whole of its stage's optimizer state.

Supported: pipelines without tied weights across the failed stages, two sub-pipelines, the
wrappers ds_swift.patches.deepspeed_optim_state reads (not ZeRO-2/3 or CPU offload).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ds_swift.data.keyed import BatchFn
from ds_swift.patches.deepspeed_engine import layer_specs, pipe_topology
from ds_swift.patches.deepspeed_grad_accum import accumulator, hp_grads, set_hp_grads
from ds_swift.patches.deepspeed_optim_state import UnsupportedWrapper
from ds_swift.patches.pipeline_copy import copy_pipeline_module, pipeline_globals, swapped_topology
from ds_swift.recovery.consensus import RankReport, RecoveryPlan
from ds_swift.recovery.replay.collectives import CollectiveRecord, CollectiveRecorder, ReplayUnsupported
from ds_swift.recovery.replay.engine import replay
from ds_swift.recovery.replay.log import ProgressFn
from ds_swift.recovery.replay.parallel_combine import GradCapture, combine_exact, combine_exact_hp, combine_fast
from ds_swift.recovery.replay.plan import ReplayStats, unwrap_engine
from ds_swift.recovery.state.transfer import capture_state, load_state, recv_state, send_state

__all__ = [
    "GradCapture",
    "Mode",
    "ParallelReplayLayout",
    "ParallelStats",
    "assign_micro_batches",
    "build_copy_engine",
    "combine_exact",
    "combine_fast",
    "compute_of_this_rank",
    "copy_unsupported_reasons",
    "helper_topology",
    "parallel_helps",
    "parallel_layout",
    "parallel_replay",
    "transfer_state",
]

Mode = Literal["exact", "fast"]


def assign_micro_batches(micro_batches: int, workers: int) -> tuple[tuple[int, ...], ...]:
    """Round-robin shares: worker ``r`` replays micro-batches ``r, r + workers, ...``."""
    if workers < 1 or micro_batches < 1:
        raise ValueError(f"need at least one worker and one micro-batch (got {workers}, {micro_batches})")
    return tuple(tuple(range(r, micro_batches, workers)) for r in range(workers))


@dataclass(frozen=True)
class ParallelReplayLayout:
    """Which ranks replay which copy of which failed stage.

    Args:
        stages: the failed stages of one pipeline replica, contiguous, in pipeline order.
        replacements: ``replacements[j]`` hosts ``stages[j]`` now (sub-pipeline 0).
        helpers: ``helpers[j]`` (a survivor) hosts a copy of ``stages[j]`` (sub-pipeline 1).
        micro_batches: micro-batches per iteration (gradient accumulation steps).
    """

    stages: tuple[int, ...]
    replacements: tuple[int, ...]
    helpers: tuple[int, ...]
    micro_batches: int

    def __post_init__(self) -> None:
        if not (len(self.stages) == len(self.replacements) == len(self.helpers) > 0):
            raise ValueError("stages, replacements and helpers must have one entry per failed stage")
        if list(self.stages) != list(range(self.stages[0], self.stages[0] + len(self.stages))):
            raise ValueError(f"the failed stages {list(self.stages)} must be contiguous and in order")
        if set(self.replacements) & set(self.helpers) or len(set(self.replacements + self.helpers)) != 2 * len(
            self.stages
        ):
            raise ValueError("replacements and helpers must be distinct ranks")
        if self.micro_batches < 2:
            raise ValueError("parallel recovery needs at least two micro-batches per iteration")

    @property
    def shares(self) -> tuple[tuple[int, ...], ...]:
        return assign_micro_batches(self.micro_batches, 2)

    def role(self, rank: int) -> tuple[int, int] | None:
        """(sub-pipeline, index into ``stages``) of ``rank``, or None when it takes no part."""
        for r, ranks in enumerate((self.replacements, self.helpers)):
            if rank in ranks:
                return r, ranks.index(rank)
        return None

    def sub_pipeline(self, r: int) -> frozenset[int]:
        return frozenset((self.replacements, self.helpers)[r])

    def peer(self, rank: int) -> int:
        """The rank holding the other copy of ``rank``'s stage."""
        role = self.role(rank)
        if role is None:
            raise ValueError(f"rank {rank} takes no part in parallel recovery")
        r, j = role
        return (self.helpers, self.replacements)[r][j]


@dataclass
class ParallelStats:
    replay: ReplayStats
    mode: str
    share: tuple[int, ...]
    exchange_bytes: int = 0
    exchange_s: float = 0.0
    per_iteration_exchange_s: list[float] = field(default_factory=list)


# ----------------------------------------------------------------------------- the copy engine
def helper_topology(topo: Any, layout: ParallelReplayLayout) -> Any:
    """The engine's topology with helpers and replacements trading coordinates."""
    swap = {**dict(zip(layout.replacements, layout.helpers)), **dict(zip(layout.helpers, layout.replacements))}
    new = swapped_topology(topo, swap)
    for j, stage in enumerate(layout.stages):
        if new.get_coord(layout.helpers[j]).pipe != stage:
            raise ValueError(f"rank {layout.replacements[j]} does not host stage {stage}: the layout does not fit")
    return new


def copy_unsupported_reasons(engine: Any) -> list[str]:
    """Why parallel recovery cannot copy ``engine``'s stage (empty: it can). The same on every rank of a job."""
    from deepspeed.runtime.pipe.module import TiedLayerSpec

    engine = unwrap_engine(engine)
    reasons = []
    try:
        accumulator(engine.optimizer)
    except UnsupportedWrapper as exc:
        reasons.append(f"parallel recovery cannot copy this optimizer's state ({exc})")
    if int(engine.zero_optimization_stage()) > 1:
        reasons.append(
            f"ZeRO stage {engine.zero_optimization_stage()} partitions gradients: parallel recovery "
            "combines whole ones (ZeRO stage 0 or 1)"
        )
    if any(isinstance(s, TiedLayerSpec) for s in layer_specs(engine)):
        reasons.append("tied layers are not supported by parallel recovery")
    if getattr(engine.module, "seed_layers", False):
        reasons.append("seed_layers=True seeds layers from a forward counter: a share of micro-batches breaks it")
    return reasons


def build_copy_engine(
    engine: Any, layout: ParallelReplayLayout, ds_config: Mapping[str, Any] | None = None
) -> Any | None:
    """Build the helpers' copies of the failed stages. Every rank of the job calls it, in the same order.

    It creates process groups (collective over the world), so survivors that do not help and the
    replacements call it too and get None back (their throw-away engine is dropped). DeepSpeed's
    pipeline globals are left pointing at ``engine``'s grid.

    Args:
        engine: this rank's DeepSpeed pipeline engine (its module's layer specs and partition are copied).
        layout: who replays what.
        ds_config: the DeepSpeed config dict the engine was built from (default: ``engine.config``).
    """
    import deepspeed

    engine = unwrap_engine(engine)
    config = ds_config if ds_config is not None else engine.config
    if not isinstance(config, Mapping):
        raise ValueError("build_copy_engine needs the DeepSpeed config as a dict (ds_config=...)")
    reasons = copy_unsupported_reasons(engine)
    if reasons:
        raise ReplayUnsupported("; ".join(reasons))
    with pipeline_globals():
        copy_module = copy_pipeline_module(engine.module, helper_topology(pipe_topology(engine), layout))
        copy, *_ = deepspeed.initialize(
            model=copy_module,
            config=dict(config),
            model_parameters=[p for p in copy_module.parameters() if p.requires_grad],
        )
    if int(engine.global_rank) not in layout.helpers:
        return None
    return copy


def transfer_state(engine: Any, copy: Any | None, layout: ParallelReplayLayout, iteration: int) -> int:
    """Replacements send their (checkpoint-loaded) state to their helper; helpers load it into ``copy``.

    Returns the bytes sent (replacements) or 0. Other ranks return at once.
    """
    rank = int(unwrap_engine(engine).global_rank)
    role = layout.role(rank)
    if role is None:
        return 0
    r, _ = role
    if r == 0:
        return send_state(capture_state(unwrap_engine(engine)), layout.peer(rank))
    if copy is None:
        raise ValueError(f"helper rank {rank} has no copy engine (build_copy_engine returned None?)")
    load_state(copy, recv_state(layout.peer(rank)), iteration)
    return 0


# ----------------------------------------------------------------------------- the replay
class _Combiner:
    """Instruction hooks that tag backward passes with their micro-batch and combine before the step."""

    def __init__(
        self, engine: Any, layout: ParallelReplayLayout, rank: int, share: tuple[int, ...], mode: Mode
    ) -> None:
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.layout, self.rank, self.share, self.mode = layout, rank, share, mode
        self.peer = layout.peer(rank)
        self.backwards = 0
        self.capture = GradCapture(self.params) if mode == "exact" else None
        self.acc = accumulator(engine.optimizer)
        self.exchange_bytes = 0
        self.exchange_s: list[float] = []

    def _backward(self, eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        m = self.share[self.backwards]
        self.backwards += 1
        if self.capture is None:
            return call_next(**kw)
        with self.capture.micro_batch(m):
            return call_next(**kw)

    def _swap(self, mine: Any) -> Any:
        # The lower rank sends first: two blocking gloo transfers in opposite directions never cross.
        if self.rank < self.peer:
            self.exchange_bytes += send_state(mine, self.peer)
            return recv_state(self.peer)
        theirs = recv_state(self.peer)
        self.exchange_bytes += send_state(mine, self.peer)
        return theirs

    def _combined_exact(self) -> list[torch.Tensor | None]:
        mine = self.capture.take() if self.capture is not None else {}
        every = {**mine, **{int(m): c for m, c in self._swap(mine).items()}}
        if sorted(every) != list(range(self.layout.micro_batches)):
            raise RuntimeError(f"exact combination got micro-batches {sorted(every)} of {self.layout.micro_batches}")
        if self.acc.where == "hp":
            return combine_exact_hp(every, len(self.params), self.acc.per == "call", self.acc.dtype)
        return combine_exact(every, len(self.params))

    def _combined_fast(self, opt: Any) -> list[torch.Tensor | None]:
        if self.acc.where == "hp":
            held = hp_grads(opt)
            mine: list[torch.Tensor | None] = [held.get(id(p)) for p in self.params]
        else:
            mine = [p.grad for p in self.params]
        theirs = self._swap(mine)
        r = (self.layout.role(self.rank) or (0, 0))[0]
        return combine_fast([mine, theirs] if r == 0 else [theirs, mine])

    def _reduce(self, eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        t0 = time.perf_counter()
        grads = self._combined_exact() if self.capture is not None else self._combined_fast(eng.optimizer)
        if self.acc.where == "hp":
            # BF16_Optimizer: the step reads its fp32 buffers; param.grad (the last micro-batch's) is
            # zeroed before the next iteration's first backward.
            set_hp_grads(eng.optimizer, {id(p): g.to(p.device) for p, g in zip(self.params, grads) if g is not None})
        else:
            for p, g in zip(self.params, grads):
                p.grad = None if g is None else g.to(p.device)
        self.backwards = 0
        self.exchange_s.append(time.perf_counter() - t0)
        return call_next(**kw)

    def hooks(self) -> dict[type, Callable[..., Any]]:
        from ds_swift.patches.instructions import schedule

        return {schedule.BackwardPass: self._backward, schedule.ReduceGrads: self._reduce}

    def remove(self) -> None:
        if self.capture is not None:
            self.capture.remove()


def parallel_replay(
    engine: Any,
    copy: Any | None,
    layout: ParallelReplayLayout,
    reader: Any,
    start_iteration: int,
    end_iteration: int,
    batch_fn: BatchFn,
    progress: ProgressFn | None = None,
    *,
    mode: Mode = "exact",
    seed: int | None = None,
    collectives: CollectiveRecorder | dict[tuple[int, int], CollectiveRecord] | None = None,
    ahead: int | None = None,
    log_timeout_s: float = 600.0,
    before_iteration: Callable[[int], None] | None = None,
) -> ParallelStats | None:
    """Replay ``start..end`` with the replacements and the helpers splitting each iteration's micro-batches.

    Replacements call it with their engine (loaded from the checkpoint), helpers with their own
    engine and the copy :func:`build_copy_engine` gave them (after :func:`transfer_state`); other
    ranks return None at once. On return the replacements' engines, and the helpers' copies, have
    stepped ``end_iteration``; the helpers' own engines were never touched.

    Args: as :func:`ds_swift.recovery.replay.engine.replay`, plus ``mode`` ("exact": bitwise equal to the
        sequential replay; "fast": partial sums, not bitwise equal).
    """
    if mode not in ("exact", "fast"):
        raise ValueError(f"mode must be 'exact' or 'fast', not {mode!r}")
    rank = int(unwrap_engine(engine).global_rank)
    role = layout.role(rank)
    if role is None:
        return None
    r, _ = role
    target = unwrap_engine(engine) if r == 0 else unwrap_engine(copy) if copy is not None else None
    if target is None:
        raise ValueError(f"helper rank {rank} needs its copy engine")
    share = layout.shares[r]
    combiner = _Combiner(target, layout, rank, share, mode)
    try:
        with pipeline_globals(target.grid if r == 1 else None):
            stats = replay(
                target,
                reader,
                layout.sub_pipeline(r),
                start_iteration,
                end_iteration,
                batch_fn,
                progress,
                seed=seed,
                collectives=collectives,
                ahead=ahead,
                log_timeout_s=log_timeout_s,
                share=share,
                extra_hooks=combiner.hooks(),
                before_iteration=before_iteration,
            )
    finally:
        combiner.remove()
    return ParallelStats(
        stats, mode, share, combiner.exchange_bytes, sum(combiner.exchange_s), list(combiner.exchange_s)
    )


# ---------------------------------------------------------------- whether and how parallel recovery replays a failed group (pure)
# Whether and how parallel recovery replays a failed group (pure, from the plan and the ranks' reports).
#
# :func:`parallel_layout` says which survivors host copies of which failed stages, or why none can;
# :func:`parallel_helps` says whether those copies would make the replay faster on this hardware, or
# why not (the recovery then replays sequentially unless ``parallel_recovery_force``).


def parallel_layout(plan: RecoveryPlan, reports: list[RankReport], micro_batches: int) -> ParallelReplayLayout | str:
    """Who replays what with parallel recovery, or why it cannot be used for this plan.

    The replacements host the failed stages (sub-pipeline 0); as many survivors outside the
    replayed group, lowest ranks first, host a copy each (sub-pipeline 1).
    """
    by_rank = {r.rank: r for r in reports}
    group = list(plan.replay_ranks)
    if micro_batches < 2:
        return "parallel recovery needs at least two micro-batches per iteration"
    if len({(by_rank[r].dp, by_rank[r].tp) for r in group}) != 1:
        return "the replayed group spans several data- or tensor-parallel ranks (two sub-pipelines of one replica only)"
    ordered = sorted(group, key=lambda r: by_rank[r].stage)
    stages = [by_rank[r].stage for r in ordered]
    if stages != list(range(stages[0], stages[0] + len(stages))):
        return f"the replayed stages {stages} are not contiguous"
    helpers = [r for r in plan.survivors if r not in group][: len(group)]
    if len(helpers) < len(group):
        return f"{len(helpers)} survivors outside the replayed group cannot host copies of {len(group)} stages"
    return ParallelReplayLayout(tuple(stages), tuple(ordered), tuple(helpers), micro_batches)


def compute_of_this_rank() -> dict[str, Any]:
    """What :func:`parallel_helps` needs of a rank: its host, the CPU cores it may use, the threads
    it computes with, and whether it computes on an accelerator of its own."""
    import os
    import socket

    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {
        "host": socket.gethostname(),
        "cores": cores,
        "threads": torch.get_num_threads(),
        "accelerator": bool(torch.cuda.is_available()),
    }


def parallel_helps(layout: ParallelReplayLayout, compute: Mapping[int, Mapping[str, Any]]) -> str | None:
    """Why parallel recovery cannot make this replay faster (None: it can), from every replayer's
    :func:`compute_of_this_rank`. A helper speeds the replay up only with compute of its own: a
    rank on an accelerator has it; ranks computing on one host's CPU cores share them, so where a
    host's replayers (replacements and helpers) want more threads than the host has cores, the
    copies only take turns and the state transfer and gradient exchange are pure cost."""
    ranks = list(layout.replacements) + list(layout.helpers)
    if all(compute[r].get("accelerator") for r in ranks):
        return None
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(str(compute[r]["host"]), []).append(r)
    for host, on in sorted(by_host.items()):
        cores = min(int(compute[r]["cores"]) for r in on)
        want = sum(max(1, int(compute[r]["threads"])) for r in on)
        if want > cores:
            return (
                f"replacements {sorted(set(on) & set(layout.replacements))} and helpers "
                f"{sorted(set(on) & set(layout.helpers))} would compute on host {host}'s {cores} CPU core(s) "
                f"with {want} thread(s): the copies would share the cores, not add any"
            )
    return None
