"""Redo one rank's passes of the iteration in flight that a failure lost, skipping those it kept.

PipeChurn's partial recomputation after a failure in the middle of an iteration
(ds_swift.recovery.strategies.pipechurn_passes decides who runs what): every rank runs DeepSpeed's
``TrainSchedule`` of the iteration with its own instruction handlers, and per instruction of
micro-batch ``k`` (each instruction type comes once per micro-batch, in micro-batch order):

- ``ForwardPass`` / ``BackwardPass``: skipped where this rank kept ``k`` (its gradients are already
  accumulated), run otherwise, onto the kept gradients, in the failure-free order: bitwise;
- receives: skipped where not needed, served from the neighbour's kept copy (sent before the redo)
  or live; sends: live where the neighbour needs what this rank computes again, skipped otherwise;
- ``LoadMicroBatch`` always runs (the data iterator stays aligned; a load computes nothing);
- the gradient reductions and the step are left to the live end of the iteration that follows
  (ds_swift.recovery.state.inflight.finish_iteration), with every rank.

The tensor-meta handshake of each edge stays as in the failure-free run: the first live activation
of an edge carries the metadata (the sender skipped every send before it; a served receive leaves
its receiver expecting the metadata next).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ds_swift.data.keyed import micro_batches
from ds_swift.patches import deepspeed_engine
from ds_swift.patches.instructions import hook_instructions, schedule
from ds_swift.recovery.replay.engine import keyed_rng
from ds_swift.recovery.replay.log import Message
from ds_swift.recovery.replay.plan import unwrap_engine
from ds_swift.recovery.replay.serve import meta_message, recv_from_log

if TYPE_CHECKING:  # the strategy imports the replay, not the other way round (no cycle)
    from ds_swift.recovery.strategies.pipechurn_passes import RankPasses

__all__ = ["MidwayStats", "redo_passes"]


@dataclass
class MidwayStats:
    """What one rank's redo ran."""

    passes: int = 0  # micro-batch passes (forward and backward) run
    served: int = 0  # receives served from a neighbour's kept copy
    live: int = 0  # sends and receives on the wire
    skipped: int = 0  # instructions not run again
    wall_s: float = 0.0


class _Hooks:
    """The per-instruction decisions of one redo (see the module docstring)."""

    def __init__(
        self,
        passes: RankPasses,
        served: Mapping[tuple[str, int], Message],
        kept_loss: torch.Tensor | None,
        iteration: int,
    ) -> None:
        self.passes = passes
        self.served = dict(served)
        self.kept_loss = kept_loss
        self.iteration = iteration
        self.count: dict[type, int] = {}
        self.stats = MidwayStats()

    def _next(self, instr: type) -> int:
        k = self.count.get(instr, 0)
        self.count[instr] = k + 1
        return k

    def _skip(self) -> None:
        self.stats.skipped += 1

    def forward(self, eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        k = self._next(schedule.ForwardPass)
        if not self.passes.runs(k):
            return self._skip()
        if k == self.passes.kept and self.kept_loss is not None and eng.is_last_stage():
            eng.total_loss = self.kept_loss.clone()  # the sum over the kept micro-batches, added onto
        self.stats.passes += 1
        return call_next(**kw)

    def backward(self, eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        if not self.passes.runs(self._next(schedule.BackwardPass)):
            return self._skip()
        return call_next(**kw)

    def recv(self, kind: str, instr: type) -> Callable[..., Any]:
        def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            k = self._next(instr)
            source = self.passes.recv(kind, k)
            if source == "skip":
                return self._skip()
            if source == "live":
                self.stats.live += 1
                return call_next(**kw)
            what = f"iteration {self.iteration} micro-batch {k} ({kind} kept by a neighbour)"
            msg = self.served.pop((kind, k), None)
            if msg is None:
                raise RuntimeError(f"{what}: not sent before the redo")
            items: list[torch.Tensor] = []
            if kind == "act":
                needs_meta, msg = deepspeed_engine.recv_needs_meta(eng, msg)
                if needs_meta:
                    items.append(meta_message(eng, msg, what))
            items += list(msg) if isinstance(msg, tuple) else [msg]
            self.stats.served += 1
            out = recv_from_log(call_next, kw, items, what)
            if kind == "act":
                deepspeed_engine.expect_meta_next(eng)  # the sender's first live send carries it
            return out

        return hook

    def send(self, kind: str, instr: type) -> Callable[..., Any]:
        def hook(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            if self.passes.send(kind, self._next(instr)) == "skip":
                return self._skip()
            self.stats.live += 1
            return call_next(**kw)

        return hook

    def table(self) -> dict[type, Callable[..., Any]]:
        def end(eng: Any, call_next: Callable[..., Any], **kw: Any) -> None:
            return None  # the reductions and the step run live afterwards, with every rank

        return {
            schedule.ForwardPass: self.forward,
            schedule.BackwardPass: self.backward,
            schedule.RecvActivation: self.recv("act", schedule.RecvActivation),
            schedule.RecvGrad: self.recv("grad", schedule.RecvGrad),
            schedule.SendActivation: self.send("act", schedule.SendActivation),
            schedule.SendGrad: self.send("grad", schedule.SendGrad),
            schedule.ReduceTiedGrads: end,
            schedule.ReduceGrads: end,
            schedule.OptimizerStep: end,
        }


def redo_passes(
    engine: Any,
    passes: RankPasses,
    served: Mapping[tuple[str, int], Message],
    iteration: int,
    batch_fn: Any,
    seed: int,
    load_kept: Callable[[Any], object] | None = None,
    kept_loss: torch.Tensor | None = None,
) -> MidwayStats:
    """Run this rank's passes of ``iteration`` it did not keep (not the reductions, not the step).

    Args:
        engine: this rank's rebuilt PipelineEngine, at ``iteration`` (its state after ``iteration - 1``).
        passes: what this rank and its neighbours kept (ds_swift.recovery.strategies.pipechurn_passes).
        served: ``(kind, micro_batch) -> message`` its neighbours sent from their copies.
        batch_fn: ``batch_fn(iteration, micro_batch)``, as in training.
        seed: the runtime's seed (each forward is keyed by iteration, micro-batch and stage).
        load_kept: puts the kept gradients into ``engine`` (after the gradients are reset).
        kept_loss: the last stage's loss summed over the kept micro-batches.
    """
    engine = unwrap_engine(engine)
    if int(engine.global_steps) != iteration:
        raise ValueError(f"redo of iteration {iteration}'s passes, but the engine is at {engine.global_steps}")
    if int(engine.micro_batches) != passes.micro_batches:
        raise ValueError(
            f"redo planned for {passes.micro_batches} micro-batches, the engine runs {engine.micro_batches}"
        )
    t0 = time.perf_counter()
    deepspeed_engine.prepare_replay(engine, iteration, first_micro_batch=passes.kept)
    if load_kept is not None:
        load_kept(engine)
    hooks = _Hooks(passes, served, kept_loss, iteration)
    handles = [keyed_rng(engine, seed, share=list(passes.redo) or None)]
    try:
        handles.append(hook_instructions(engine, "ds_swift.midway", hooks.table()))
        data = None
        if engine.is_first_stage() or engine.is_last_stage():
            dp = int(engine.grid.get_data_parallel_id())
            data = micro_batches(batch_fn, iteration, dp, passes.micro_batches)
        deepspeed_engine.run_train_schedule(engine, data, passes.micro_batches)
    finally:
        while handles:
            handles.pop().remove()
    if hooks.served:
        raise RuntimeError(f"redo of iteration {iteration}: kept messages {sorted(hooks.served)} were never received")
    if passes.kept == passes.micro_batches and kept_loss is not None and engine.is_last_stage():
        engine.total_loss = kept_loss.clone()
    hooks.stats.wall_s = time.perf_counter() - t0
    return hooks.stats
