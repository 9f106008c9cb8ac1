"""What a rank keeps of the iteration in flight, for PipeChurn's partial recomputation.

PipeChurn (section 3.5) recomputes after a failure only what the failure lost: the surviving
workers keep the activations and gradients they computed and sent. Here every rank keeps, for the
iteration it is training (and only that one: bounded by one iteration's messages):

- the tensors it sent across the pipeline, exactly as handed to the wire (activations forward,
  gradients backward; ds_swift.patches.pipe_logging captures them, references, not copies: the
  message logger relies on the same, DeepSpeed hands each micro-batch a fresh tensor);
- a copy of its accumulated gradients, taken just before ``ReduceTiedGrads`` (the first instruction
  that reduces them in place across ranks): an all-reduce aborted by the failure can leave the
  buffer half reduced, so the live step after the recovery must start from a clean copy;
- the last stage's summed loss of the iteration (what ``train_batch`` returns).

The copy is *complete* when the rank reached ``ReduceTiedGrads`` with one send per micro-batch to
each neighbour stage: every pass of the iteration ran on this rank. The consensus carries the
iteration a survivor holds complete (``RankReport.inflight``); the strategy
(ds_swift.recovery.strategies.pipechurn_partial) then feeds a lost rank's replay of its passes
from its neighbours' kept sends, and the survivors load their kept gradients back
(:meth:`InflightKeeper.load_into`) before every rank runs the reductions and the step live
(:func:`finish_iteration`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_swift.data.keyed import BatchFn
from ds_swift.logs import say_here

__all__ = ["FinishIteration", "InflightKeeper", "Message", "finish_iteration", "kept_inflight"]

Message = torch.Tensor | tuple[torch.Tensor, ...]
KINDS = ("act", "grad")


class InflightKeeper:
    """This rank's copy of the iteration in flight (sends, gradients, loss); kept across rebuilds.

    Args:
        batch_fn: ``batch_fn(iteration, micro_batch)``, as in training (a lost first or last stage
            reads its micro-batches again when it replays its passes).
        seed: the runtime's RNG seed (forward passes are keyed by iteration, micro-batch and stage).
    """

    def __init__(self, batch_fn: BatchFn, seed: int) -> None:
        self.batch_fn = batch_fn
        self.seed = seed
        self.iteration = -1
        self.sends: dict[str, list[Message]] = {k: [] for k in KINDS}
        self.grads: dict[str, torch.Tensor] | None = None
        self.loss: torch.Tensor | None = None
        self.complete = -1
        """The iteration whose sends and gradients this rank holds complete (-1: none)."""
        self._why_not: str | None = None

    # ------------------------------------------------------------------ failure-free path
    def restart(self) -> None:
        """An iteration (or a retry of one) begins: what the last attempt kept goes."""
        self.iteration = -1
        self.sends = {k: [] for k in KINDS}
        self.grads, self.loss, self.complete = None, None, -1

    def on_send(self, engine: Any, kind: str, tensors: list[torch.Tensor]) -> None:
        it = int(engine.global_steps)
        if it != self.iteration:
            self.restart()
            self.iteration = it
        self.sends[kind].append(tensors[0] if len(tensors) == 1 else tuple(tensors))

    def before_reduce(self, engine: Any) -> None:
        """At ``ReduceTiedGrads``: copy the gradients (and the loss); mark the copy complete."""
        from ds_swift.patches.deepspeed_grad_accum import accumulator, hp_grads
        from ds_swift.patches.deepspeed_optim_state import UnsupportedWrapper

        it = int(engine.global_steps)
        if it != self.iteration:  # a single-stage pipeline sends nothing
            self.restart()
            self.iteration = it
        try:
            where = accumulator(engine.optimizer).where
        except UnsupportedWrapper as exc:
            if self._why_not is None:
                self._why_not = str(exc)
                say_here(f"partial recomputation off: gradients cannot be kept ({exc})", name=__name__)
            return
        with torch.no_grad():
            names = {id(p): n for n, p in engine.module.named_parameters()}
            if where == "hp":
                self.grads = {names[i]: g.clone() for i, g in hp_grads(engine.optimizer).items() if i in names}
            else:
                self.grads = {
                    n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None
                }
            loss = getattr(engine, "total_loss", None)
            self.loss = loss.detach().clone() if isinstance(loss, torch.Tensor) else None
        gas = int(engine.micro_batches)
        need = {"act": not engine.is_last_stage(), "grad": not engine.is_first_stage()}
        if all(len(self.sends[k]) == (gas if need[k] else 0) for k in KINDS):
            self.complete = it

    def hooks(self) -> dict[type, Callable[..., Any]]:
        """The instruction hooks that keep the copy (install with ``hook_instructions``)."""
        from ds_swift.patches.instructions import schedule

        def reduce(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            if eng.module.training:
                self.before_reduce(eng)
            return call_next(**kw)

        return {schedule.ReduceTiedGrads: reduce}

    def install(self, engine: Any) -> list[Any]:
        """Hook ``engine`` (sends, then the gradient copy); returns the handles, innermost last."""
        from ds_swift.patches import pipe_logging
        from ds_swift.patches.instructions import hook_instructions

        sends = pipe_logging.install(
            engine, "ds_swift.inflight.sends", lambda kind, ts: self.on_send(engine, kind, ts), lambda _where: None
        )
        return [sends, hook_instructions(engine, "ds_swift.inflight.grads", self.hooks())]

    # ------------------------------------------------------------------ recovery
    def messages(self, kind: str, iteration: int) -> list[list[torch.Tensor]]:
        """The kept sends of ``kind`` of ``iteration``, in micro-batch order, each as a list of tensors."""
        if self.complete != iteration:
            raise RuntimeError(f"no complete copy of iteration {iteration}'s sends (this rank holds {self.complete})")
        return [list(m) if isinstance(m, tuple) else [m] for m in self.sends[kind]]

    def load_into(self, engine: Any, iteration: int) -> int:
        """Put the kept gradients (and the last stage's loss) of ``iteration`` into the rebuilt
        ``engine``, as its backward passes had left them; returns the gradient bytes loaded."""
        from ds_swift.patches.deepspeed_grad_accum import accumulator, set_hp_grads

        if self.complete != iteration or self.grads is None:
            raise RuntimeError(f"no complete copy of iteration {iteration}'s gradients (this rank holds {self.complete})")
        params = dict(engine.module.named_parameters())
        missing = sorted(set(self.grads) - set(params))
        if missing:
            raise RuntimeError(f"kept gradients of parameters the rebuilt module lacks: {missing[:3]}")
        with torch.no_grad():
            if accumulator(engine.optimizer).where == "hp":
                set_hp_grads(engine.optimizer, {id(params[n]): g for n, g in self.grads.items()})
            else:
                for n, g in self.grads.items():
                    params[n].grad = g.to(params[n].device).view_as(params[n])
        if self.loss is not None and engine.is_last_stage():
            engine.total_loss = self.loss.clone()
        return sum(g.numel() * g.element_size() for g in self.grads.values())


def kept_inflight(cfg: Any, batch_fn: BatchFn, seed: int) -> InflightKeeper | None:
    """The keeper the swift config ``cfg`` asks for (its strategy's ``inflight_copy`` service:
    ``pipechurn`` with ``pipechurn.partial_recompute``), or None."""
    if not cfg.services.inflight_copy:
        return None
    return InflightKeeper(batch_fn, seed)


class _FinishSchedule:
    """The end of DeepSpeed's ``TrainSchedule``: what runs after an iteration's last backward pass."""

    def num_pipe_buffers(self) -> int:
        return 1

    def __iter__(self) -> Any:
        from ds_swift.patches.instructions import schedule

        yield [schedule.ReduceTiedGrads(), schedule.ReduceGrads(), schedule.OptimizerStep()]


@dataclass(frozen=True)
class FinishIteration:
    """What PipeChurn's partial recomputation hands the runtime (``RecoveryOutcome.handed``): the
    iteration in flight whose passes the recovery already ran (the lost ranks replayed theirs, the
    survivors kept theirs); the runtime runs only its gradient reductions and step
    (:func:`finish_iteration`)."""

    iteration: int


def finish_iteration(engine: Any) -> Any:
    """Every rank, after a partial recomputation: the iteration's gradient reductions and step, live,
    through the engine's instruction table (so every hook of a step runs: undo records, erasure-coded
    chunks, digests), then ``train_batch``'s loss aggregation. Returns what ``train_batch`` returns."""
    from ds_swift.patches.deepspeed_engine import run_end_of_iteration

    return run_end_of_iteration(engine, _FinishSchedule())
