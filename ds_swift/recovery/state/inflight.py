"""What a rank keeps of the iteration in flight, for PipeChurn's partial recomputation.

PipeChurn (section 3.5) recomputes after a failure only what the failure lost: the surviving
workers keep the activations and gradients they computed and sent. Here every rank keeps, for the
iteration it is training (and only that one: bounded by one iteration's messages):

- the tensors it sent across the pipeline, exactly as handed to the wire (activations forward,
  gradients backward; ds_swift.patches.pipe_logging captures them, references, not copies: the
  message logger relies on the same, DeepSpeed hands each micro-batch a fresh tensor), and the
  gradient its last backward pass produced while that is not sent yet;
- how many backward passes ran (they run in micro-batch order: ``0 .. n-1``), and how many forward
  passes; on the last stage the loss summed over those backward passes' micro-batches;
- a copy of its accumulated gradients: taken just before ``ReduceTiedGrads`` (the first instruction
  that reduces them in place across ranks: an all-reduce aborted by the failure can leave the buffer
  half reduced) when every pass ran, else when the failed engine is torn down
  (:meth:`InflightKeeper.on_teardown`: nothing on the failure-free path), unless the failure hit
  inside a backward pass (a half-accumulated buffer: nothing is kept).

The consensus carries what a survivor holds (:class:`~ds_swift.recovery.holdings.InflightHeld`); the
strategy (ds_swift.recovery.strategies.pipechurn) sends the neighbours the kept messages
they need, each rank loads its kept gradients back (:meth:`InflightKeeper.load_into`) and runs the
passes it does not hold (ds_swift.recovery.replay.midway), then every rank runs the reductions and
the step live (:func:`finish_iteration`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ds_swift.data.keyed import BatchFn
from ds_swift.logs import say_here
from ds_swift.recovery.holdings import InflightHeld
from ds_swift.recovery.registry import services_of

__all__ = ["FinishIteration", "InflightKeeper", "Message", "finish_iteration", "kept_inflight"]

Message = torch.Tensor | tuple[torch.Tensor, ...]
KINDS = ("act", "grad")


class InflightKeeper:
    """This rank's copy of the iteration in flight (sends, gradients, loss); kept across rebuilds.

    Args:
        batch_fn: ``batch_fn(iteration, micro_batch)``, as in training (a rank redoing passes reads
            its micro-batches again).
        seed: the runtime's RNG seed (forward passes are keyed by iteration, micro-batch and stage).
    """

    def __init__(self, batch_fn: BatchFn, seed: int) -> None:
        self.batch_fn = batch_fn
        self.seed = seed
        #: switches the runtime's per-forward reseeding (the runtime's hooks set it; a redo keys
        #: the RNG itself, by the micro-batches it runs)
        self.reseed: Callable[[bool], None] | None = None
        self.paused = False  # while a redo runs: its passes and sends are not the iteration's own
        self.iteration = -1
        self.restart()
        self._why_not: str | None = None

    # ------------------------------------------------------------------ failure-free path
    def restart(self) -> None:
        """An iteration (or a retry of one) begins: what the last attempt kept goes."""
        self.iteration = -1
        self.sends: dict[str, list[Message]] = {k: [] for k in KINDS}
        self.grads: dict[str, torch.Tensor] | None = None
        self.loss: torch.Tensor | None = None
        self.complete = -1
        """The iteration whose every pass this rank holds (-1: none)."""
        self.passes = 0  # backward passes run (micro-batches 0 .. passes-1)
        self.forwards = 0
        self.micro_batches = 0  # of the iteration (0: no pass ran yet)
        self.pending: Message | None = None  # the last backward's gradient output, not sent yet
        self.unusable: str | None = None  # why the copy cannot be used (set at the teardown)
        self._in_backward = False

    def _at(self, engine: Any) -> None:
        it = int(engine.global_steps)
        if it != self.iteration:
            self.restart()
            self.iteration = it

    def on_send(self, engine: Any, kind: str, tensors: list[torch.Tensor]) -> None:
        if self.paused:
            return
        self._at(engine)
        self.sends[kind].append(tensors[0] if len(tensors) == 1 else tuple(tensors))
        if kind == "grad":
            self.pending = None

    def _copy_grads(self, engine: Any) -> dict[str, torch.Tensor] | None:
        from ds_swift.patches.deepspeed_grad_accum import accumulator, hp_grads
        from ds_swift.patches.deepspeed_optim_state import UnsupportedWrapper

        try:
            where = accumulator(engine.optimizer).where
        except UnsupportedWrapper as exc:
            if self._why_not is None:
                self._why_not = str(exc)
                say_here(f"partial recomputation off: gradients cannot be kept ({exc})", name=__name__)
            return None
        with torch.no_grad():
            names = {id(p): n for n, p in engine.module.named_parameters()}
            if where == "hp":
                return {names[i]: g.clone() for i, g in hp_grads(engine.optimizer).items() if i in names}
            return {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}

    def _copy_loss(self, engine: Any) -> None:
        loss = getattr(engine, "total_loss", None)
        self.loss = loss.detach().clone() if isinstance(loss, torch.Tensor) else None

    def before_reduce(self, engine: Any) -> None:
        """At ``ReduceTiedGrads``: copy the gradients (and the loss); mark the copy complete."""
        self._at(engine)  # a single-stage pipeline sends nothing
        self.grads = self._copy_grads(engine)
        if self.grads is None:
            return
        self._copy_loss(engine)
        gas = int(engine.micro_batches)
        need = {"act": not engine.is_last_stage(), "grad": not engine.is_first_stage()}
        if all(len(self.sends[k]) == (gas if need[k] else 0) for k in KINDS):
            self.complete, self.passes, self.forwards = self.iteration, gas, gas

    def _forward(self, eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        out = call_next(**kw)
        if eng.module.training and not self.paused:
            self._at(eng)
            self.forwards += 1
            self.micro_batches = int(eng.micro_batches)
        return out

    def _backward(self, eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
        from ds_swift.patches.deepspeed_engine import backward_output

        if not eng.module.training or self.paused:
            return call_next(**kw)
        self._at(eng)
        self._in_backward = True
        out = call_next(**kw)
        self._in_backward = False
        self.passes += 1
        if not eng.is_first_stage():
            sent = backward_output(eng, kw["buffer_id"])
            if sent is None:
                self.unusable = "the gradients sent are partitioned (tensor parallelism)"
            else:
                self.pending = sent[0] if len(sent) == 1 else tuple(sent)
        if eng.is_last_stage():
            self._copy_loss(eng)  # the last stage runs forward k then backward k: the sum to k
        return out

    def hooks(self) -> dict[type, Callable[..., Any]]:
        """The instruction hooks that keep the copy (install with ``hook_instructions``)."""
        from ds_swift.patches.instructions import schedule

        def reduce(eng: Any, call_next: Callable[..., Any], **kw: Any) -> Any:
            if eng.module.training and not self.paused:
                self.before_reduce(eng)
            return call_next(**kw)

        return {
            schedule.ReduceTiedGrads: reduce,
            schedule.ForwardPass: self._forward,
            schedule.BackwardPass: self._backward,
        }

    def install(self, engine: Any) -> list[Any]:
        """Hook ``engine`` (sends, then the passes and the gradient copy); returns the handles, innermost last."""
        from ds_swift.patches import pipe_logging
        from ds_swift.patches.instructions import hook_instructions

        sends = pipe_logging.install(
            engine, "ds_swift.inflight.sends", lambda kind, ts: self.on_send(engine, kind, ts), lambda _where: None
        )
        return [sends, hook_instructions(engine, "ds_swift.inflight.grads", self.hooks())]

    def on_teardown(self, engine: Any) -> None:
        """A survivor's failed engine, before it goes: copy the gradients its completed backward
        passes accumulated (the failure hit between passes: a receive or a send raised)."""
        if self.iteration < 0 or self.passes == 0 or self.grads is not None:
            return  # nothing ran, or the copy before ReduceTiedGrads is the clean one
        if self._in_backward:
            self.unusable = "the failure hit inside a backward pass (half-accumulated gradients)"
        if self.unusable is None:
            self.grads = self._copy_grads(engine)
            if self.grads is None:
                self.unusable = "the gradients cannot be kept"
        if self.unusable is not None:
            say_here(
                f"partial recomputation: my {self.passes} passes of iteration {self.iteration} "
                f"cannot be kept ({self.unusable}): I redo them",
                name=__name__,
            )
            self.passes, self.grads = 0, None

    def held(self) -> InflightHeld:
        """What this copy holds, for the consensus."""
        return InflightHeld(self.iteration, self.passes, self.forwards, self.micro_batches)

    # ------------------------------------------------------------------ recovery
    def kept_messages(self, kind: str, iteration: int, micro_batches: range) -> list[list[torch.Tensor]]:
        """The kept sends of ``kind`` of ``iteration`` for ``micro_batches``, each as a list of tensors."""
        if self.iteration != iteration:
            raise RuntimeError(f"no copy of iteration {iteration}'s sends (this rank holds {self.iteration})")
        out = []
        for k in micro_batches:
            sent = self.sends[kind]
            m = sent[k] if k < len(sent) else self.pending if kind == "grad" and k == len(sent) else None
            if m is None or k >= self.passes:
                raise RuntimeError(
                    f"no kept {kind} of micro-batch {k} of iteration {iteration} "
                    f"({len(sent)} sent, {self.passes} passes held)"
                )
            out.append(list(m) if isinstance(m, tuple) else [m])
        return out

    def messages(self, kind: str, iteration: int) -> list[list[torch.Tensor]]:
        """Every kept send of ``kind`` of a ``iteration`` held complete, in micro-batch order."""
        if self.complete != iteration:
            raise RuntimeError(f"no complete copy of iteration {iteration}'s sends (this rank holds {self.complete})")
        return self.kept_messages(kind, iteration, range(len(self.sends[kind])))

    def load_into(self, engine: Any, iteration: int) -> int:
        """Put the kept gradients (and the last stage's loss) of ``iteration`` into the rebuilt
        ``engine``, as its backward passes had left them; returns the gradient bytes loaded."""
        from ds_swift.patches.deepspeed_grad_accum import accumulator, set_hp_grads

        if self.iteration != iteration or self.grads is None or self.passes == 0:
            raise RuntimeError(
                f"no copy of iteration {iteration}'s gradients (this rank holds "
                f"{self.passes} passes of {self.iteration})"
            )
        params = dict(engine.module.named_parameters())
        missing = sorted(set(self.grads) - set(params))
        if missing:
            raise RuntimeError(f"kept gradients of parameters the rebuilt module lacks: {missing[:3]}")
        with torch.no_grad():
            if accumulator(engine.optimizer).where == "hp":
                set_hp_grads(engine.optimizer, {id(params[n]): g for n, g in self.grads.items()})
            else:
                for n, g in self.grads.items():
                    # A copy: the redo's backward passes accumulate into it in place, and a recovery
                    # retried after a failure during the redo loads the kept gradients again.
                    params[n].grad = g.to(params[n].device, copy=True).view_as(params[n])
        if self.loss is not None and engine.is_last_stage():
            engine.total_loss = self.loss.clone()
        return sum(g.numel() * g.element_size() for g in self.grads.values())


def kept_inflight(cfg: Any, batch_fn: BatchFn, seed: int) -> InflightKeeper | None:
    """The keeper the swift config ``cfg`` asks for (its strategy's ``inflight_copy`` service:
    ``pipechurn`` with ``pipechurn.partial_recompute``), or None."""
    if not services_of(cfg).inflight_copy:
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
