"""Every DeepSpeed engine internal ds-swift reads or writes outside the other patches, pinned here.

Three seams of one engine *instance* (the class is never touched), written against
``SUPPORTED_DEEPSPEED`` (ds_swift.patches._base; line references are to DeepSpeed 0.19.8):

- **Engine state I/O**: the counters ``DeepSpeedEngine`` advances per step (``global_steps``,
  ``global_samples``, ``skipped_steps``; ``micro_steps`` per micro-batch) and the per-step flags
  ``_take_model_step`` leaves (``_step_applied``, ``_global_grad_norm``). A recovery, an undo, a
  replayed update or a simulated rollback puts an engine at an iteration through
  :func:`set_counters` / :func:`restore_step_state`, never by assigning them one by one.
- **The replay's drive of the pipeline engine** (ds_swift.recovery.replay): one iteration of
  ``PipelineEngine.train_batch`` (``runtime/pipe/engine.py`` 332) without its loss broadcast to the
  whole pipe group (``_aggregate_total_loss``, which would wait on ranks that are not replaying):
  :func:`run_train_schedule`; the loss it leaves (:func:`iteration_loss`); the p2p handshake state of
  an edge (``pipe_recv_buf``, ``first_output_send``: :func:`recv_needs_meta`,
  :func:`keep_first_output_send`, :func:`expect_meta_next`); the tensor-meta message
  ``_send_tensor_meta`` sends (:func:`tensor_meta`).
- **The Megatron save override** (ds_swift.megatron): ``engine.save_checkpoint`` replaced on one
  engine so that saves without a client state carry one (:func:`override_save`, with a handle).
- **Reads of private structure**: the pipeline's process topology (:func:`pipe_topology`) and the
  module's layer specs (:func:`layer_specs`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ds_swift.patches._base import PatchError, PatchHandle, check_deepspeed

__all__ = [
    "COUNTERS",
    "STEP_STATE",
    "backward_output",
    "counters_of",
    "expect_meta_next",
    "iteration_loss",
    "keep_first_output_send",
    "layer_specs",
    "override_save",
    "run_end_of_iteration",
    "pipe_topology",
    "prepare_replay",
    "recv_needs_meta",
    "restore_step_state",
    "run_train_schedule",
    "set_counters",
    "step_state",
    "tensor_meta",
]

#: The engine's progress counters, as a donor sends them and a buddy holds them.
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
#: What one optimizer step changes on the engine (``_take_model_step``): an undo puts these back.
STEP_STATE = ("global_steps", "global_samples", "skipped_steps", "_step_applied", "_global_grad_norm")

_SAVE_MARK = "_ds_swift_save_override"


# ----------------------------------------------------------------------------- engine state I/O
def counters_of(engine: Any) -> dict[str, int]:
    """The engine's :data:`COUNTERS` as plain ints (0 for one the engine does not have)."""
    return {name: int(getattr(engine, name, 0) or 0) for name in COUNTERS}


def set_counters(engine: Any, iteration: int, *, skipped_steps: int | None = None) -> None:
    """Make ``engine`` stand at the start of ``iteration`` (after ``iteration`` steps).

    Args:
        engine: a DeepSpeed engine.
        iteration: the steps taken; the samples and micro-steps follow from the batch geometry.
        skipped_steps: the steps a loss-scale overflow skipped, where the caller knows it (a donor's,
            a survivor's); None leaves the engine's own.
    """
    engine.global_steps = iteration
    engine.global_samples = iteration * engine.train_batch_size()
    engine.micro_steps = iteration * engine.gradient_accumulation_steps()
    if skipped_steps is not None:
        engine.skipped_steps = int(skipped_steps)


def step_state(engine: Any) -> dict[str, Any]:
    """The :data:`STEP_STATE` attributes the engine has now (before a step: what an undo restores)."""
    return {name: getattr(engine, name) for name in STEP_STATE if hasattr(engine, name)}


def restore_step_state(engine: Any, saved: Mapping[str, Any], *, realign_micro_steps: bool = False) -> None:
    """Put back what :func:`step_state` (or a record of the same names) saved.

    Args:
        realign_micro_steps: also set ``micro_steps`` to ``global_steps`` whole iterations (the
            state after a whole iteration, which is what a replayed update leaves).
    """
    unknown = set(saved) - set(STEP_STATE)
    if unknown:
        raise ValueError(f"not engine step state: {sorted(unknown)} (expected some of {STEP_STATE})")
    for name, value in saved.items():
        setattr(engine, name, value)
    if realign_micro_steps:
        engine.micro_steps = int(engine.global_steps) * engine.gradient_accumulation_steps()


def pipe_topology(engine: Any) -> Any:
    """The ``ProcessTopology`` of a pipeline engine's grid (the axes pipe, data, model)."""
    return engine.grid._topo


def layer_specs(engine: Any) -> list[Any]:
    """The layer specs a pipeline engine's ``PipelineModule`` was built from (all stages')."""
    return list(engine.module._layer_specs)


# ----------------------------------------------------------------------------- the replay's drive
def prepare_replay(engine: Any, start_iteration: int, first_micro_batch: int = 0) -> None:
    """Ready a pipeline engine to run iterations again from ``start_iteration``.

    A fresh p2p handshake on every edge (both ends of an in-group edge reset together), and the
    gradients a step leaves behind (None): also right when retrying after a failed replay.
    ``first_micro_batch``: the forward passes of the micro-batches before it are not run again.
    """
    check_deepspeed()
    engine.reset_activation_shape()
    for p in engine.module.parameters():
        p.grad = None
    if getattr(engine.module, "seed_layers", False):
        # PipelineModule seeds layers from a forward counter kept since construction.
        engine.module.micro_offset = start_iteration * int(engine.micro_batches) + first_micro_batch


def backward_output(engine: Any, buffer_id: int) -> list[Any] | None:
    """After ``BackwardPass(buffer_id)`` on a stage after the first: the gradients its ``SendGrad``
    will send (``_exec_send_grads``), in order; None where DeepSpeed partitions them (tensor
    parallelism with partitioned gradients: what goes on the wire is not these tensors)."""
    if engine.is_grad_partitioned:
        return None
    inputs = engine.pipe_buffers["inputs"][buffer_id]
    if isinstance(inputs, torch.Tensor):
        return [inputs.grad]
    parts = list(inputs)
    if engine.has_attention_mask or engine.has_bool_tensors:
        parts.pop()  # the mask's receive is skipped too
    return [b.grad for b in parts if b.is_floating_point()]


def run_train_schedule(engine: Any, data: Any, micro_batches: int) -> None:
    """``train_batch`` over ``micro_batches`` micro-batches, without the loss broadcast.

    Args:
        engine: a DeepSpeed ``PipelineEngine``.
        data: the iterator of this rank's micro-batches, or None (middle stages read none).
        micro_batches: how many the schedule runs; the loss is still scaled by the engine's
            ``gradient_accumulation_steps()`` (a share of parallel recovery is part of a whole).
    """
    engine.module.train()
    engine.total_loss = None
    engine.total_additional_losses = None
    engine._compute_loss = True
    if data is not None:
        engine.set_dataiterator(data)
    whole = engine.micro_batches
    engine.micro_batches = micro_batches
    try:
        engine._exec_schedule(engine._train_schedule())
    finally:
        engine.micro_batches = whole


def run_end_of_iteration(engine: Any, end_schedule: Any) -> Any:
    """Run ``end_schedule`` (instructions after an iteration's last backward pass: the gradient
    reductions and the step) through the engine's instruction table, then ``train_batch``'s loss
    aggregation; returns what ``train_batch`` returns."""
    check_deepspeed()
    engine.module.train()
    engine._exec_schedule(end_schedule)
    with torch.no_grad():
        engine.agg_train_loss = engine._aggregate_total_loss()
    return engine.agg_train_loss


def iteration_loss(engine: Any) -> float | None:
    """The mean loss of the iteration just run (last stage; None elsewhere), as ``train_batch``'s."""
    if not engine.is_last_stage() or not isinstance(engine.total_loss, torch.Tensor):
        return None
    return float(engine._scale_loss_by_gas(engine.total_loss).mean())


def recv_needs_meta(engine: Any, msg: Any) -> tuple[bool, Any]:
    """Whether the next activation receive of ``engine`` reads a tensor-meta message first, and
    ``msg`` shaped as the receive buffer expects (a logged 1-tuple comes back as a bare tensor)."""
    if isinstance(engine.pipe_recv_buf, tuple) and isinstance(msg, torch.Tensor):
        msg = (msg,)
    return bool(engine.dynamic_shape or engine.pipe_recv_buf is None), msg


@contextmanager
def keep_first_output_send(engine: Any) -> Iterator[None]:
    """Leave ``first_output_send`` as it was after the block (a dropped send did not send the
    metadata the survivor's rebuilt engine expects with its first live activation)."""
    first = engine.first_output_send
    try:
        yield
    finally:
        engine.first_output_send = first


def expect_meta_next(engine: Any) -> None:
    """Make the next activation receive read the tensor metadata first (a rebuilt sender sends it)."""
    engine.pipe_recv_buf = None


def tensor_meta(engine: Any, msg: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tensor-meta message ``_send_tensor_meta`` sends before the first activation of an edge.

    Raises:
        ValueError: a dtype DeepSpeed cannot send, or more dimensions than its metadata holds.
    """
    check_deepspeed()
    from deepspeed.runtime.pipe.engine import TENSOR_META_SIZE

    parts = msg if isinstance(msg, tuple) else (msg,)
    try:
        ids = [int(engine.DTYPE_TO_ID[t.dtype]) for t in parts]
    except KeyError as exc:
        raise ValueError(f"the message holds a dtype DeepSpeed cannot send ({exc})") from None
    if isinstance(msg, tuple):
        values = [2, len(parts)]
        for t, i in zip(parts, ids):
            values += [i, t.dim(), *t.shape]
    else:
        values = [0, ids[0], msg.dim(), *msg.shape]
    if len(values) > TENSOR_META_SIZE:
        raise ValueError("the message has more dimensions than DeepSpeed's metadata holds")
    meta = torch.zeros(TENSOR_META_SIZE, dtype=torch.int32)
    meta[: len(values)] = torch.tensor(values, dtype=torch.int32)
    return meta


# ----------------------------------------------------------------------------- the save override
def override_save(engine: Any, make_client_state: Callable[[], dict[str, Any]]) -> PatchHandle:
    """Make ``engine.save_checkpoint`` calls without a client state save ``make_client_state()`` with them.

    The override is an instance attribute shadowing the class's method; ``remove()`` (or leaving
    a ``with`` block) deletes it, leaving the engine as it was. Applying it twice to one engine is
    refused.

    Args:
        engine: a DeepSpeed engine.
        make_client_state: builds the client state at each such save (called inside the save).
    """
    check_deepspeed()
    if _SAVE_MARK in vars(engine):
        raise PatchError("engine.save_checkpoint is already overridden by ds-swift; remove the first override")
    had, previous = "save_checkpoint" in vars(engine), vars(engine).get("save_checkpoint")
    save = engine.save_checkpoint  # the one in force (the class's, bound)

    def save_checkpoint(save_dir: str, tag: str | None = None, client_state: Any = None, **kwargs: Any) -> Any:
        return save(save_dir, tag=tag, client_state=client_state or make_client_state(), **kwargs)

    vars(engine)["save_checkpoint"] = save_checkpoint
    vars(engine)[_SAVE_MARK] = True

    def restore() -> None:
        if vars(engine).get("save_checkpoint") is not save_checkpoint:
            raise PatchError("engine.save_checkpoint was replaced again after ds-swift's override; remove that first")
        del vars(engine)[_SAVE_MARK]
        if had:
            vars(engine)["save_checkpoint"] = previous
        else:
            del vars(engine)["save_checkpoint"]

    return PatchHandle("ds_swift.megatron.save_override", restore)
