"""A survivor's kept engine made to stand where a freshly built one stands (issue 50).

A survivor that keeps its DeepSpeed engine across a failure (ds_swift.patches.group_swap) holds
what the failed iteration left half done: activations in flight, gradients accumulated over some of
its micro-batches, ZeRO-1's reduction buckets part filled, the pipeline's tensor-meta handshake with
its neighbours already made (a replacement's fresh engine makes it again at its first batch, and
expects the survivor to), ``_force_grad_boundary`` left True by a reduction that raised, DeepSpeed's
batch timer left running. A rebuilt engine had none of that; :func:`fresh_iteration` clears it, with
DeepSpeed's own calls where it has them (``reset_activation_shape``, the wrappers' ``zero_grad``),
leaving the state itself (parameters, masters, optimizer moments, scheduler, counters) as it is.

Measured on DeepSpeed 0.19.8 (attribute names of ``PipelineEngine.__init__``, ``BF16_Optimizer``,
``DeepSpeedZeroOptimizer`` at stage 1); tests/unit/test_group_swap.py holds a reset engine to an
engine between two iterations, after failures at each phase of an iteration.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.pipe import p2p

from ds_swift.patches._base import check_deepspeed
from ds_swift.patches.deepspeed_wrappers import UnsupportedWrapper, WrapperKind, kind_of

__all__ = ["fresh_iteration"]


def fresh_iteration(engine: Any) -> None:
    """Clear what a failed iteration left in ``engine`` (a DeepSpeed ``PipelineEngine`` whose process
    groups are in force): the next ``train_batch`` runs as a fresh engine's first one would."""
    check_deepspeed()
    # The tensor-meta handshake (first_output_send, pipe_recv_buf, grad_layer, meta caches): DeepSpeed's
    # own reset, for activations whose shape changes.
    engine.reset_activation_shape()
    engine.first_gradient_send = True
    engine.num_pipe_buffers = 0
    engine.pipe_buffers = {key: [] for key in engine.pipe_buffers}
    engine.fwd_outputs = []
    engine.outputs = None
    engine.total_loss = None
    engine.total_additional_losses = None
    engine.agg_train_loss = None
    engine.agg_additional_losses = None
    engine.loss = torch.tensor(0.0).to(engine.device)
    engine._force_grad_boundary = False  # _exec_reduce_grads sets it around the reduction, without a finally
    for timer in getattr(engine.timers, "timers", {}).values():
        if getattr(timer, "started_", False):
            timer.started_ = False  # train_batch's timer, started before the failure: start() asserts it is not
    p2p._async = []
    fresh_gradients(engine)


def fresh_gradients(engine: Any) -> None:
    """No gradient anywhere, as after a fresh build: the model's, the wrapper's accumulation buffers
    (BF16_Optimizer's fp32 gradients), ZeRO-1's reduction state."""
    opt = engine.optimizer
    engine.module.zero_grad(set_to_none=True)
    if opt is None:
        return
    try:
        kind = kind_of(opt)
    except UnsupportedWrapper:
        opt.zero_grad(set_to_none=True)
        return
    if kind is WrapperKind.ZERO_STAGE1:
        _fresh_zero1(opt)
    else:
        # BF16_Optimizer: the low-precision .grad dropped, its fp32 accumulation buffers zeroed (the
        # masters keep their views of them, as DeepSpeed's own step does); torch and fp16: .grad dropped.
        opt.zero_grad(set_to_none=True)


def _fresh_zero1(opt: Any) -> None:
    """DeepSpeedZeroOptimizer (stage 1): its gradients, buckets and per-partition reduction records."""
    opt.zero_grad(set_to_none=True)  # the bit16 .grad and .grad_accum
    for master in opt.single_partition_of_fp32_groups:
        master.grad = None  # step() sets it from averaged_gradients and drops it after
    for key in list(opt.averaged_gradients):
        opt.averaged_gradients[key] = None
    for bucket in opt.ipg_buckets.values():
        bucket.clear()  # its params, grads, element count, events
        bucket.index = 0
    opt._release_ipg_buffers()  # the buffers reduce_gradients appends for a pipeline; ready_for_gradients
    opt.params_already_reduced[:] = [False] * len(opt.params_already_reduced)
    for reduced in opt.previous_reduced_grads.values():
        reduced.clear()
    opt.extra_large_param_to_reduce.clear()
    opt.reset_partition_gradient_structures()  # reads the data-parallel group's size: after the swap
