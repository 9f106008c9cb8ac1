"""The teardown's cut of the process groups that graphs in flight keep in their autograd contexts
(patches/deepspeed_rebuild.release_autograd_groups): a context's group is cut, and scanning the
collector's objects warns about nothing (``isinstance`` on torch.distributed's deprecated
``reduce_op`` shim raised a FutureWarning at every rebuild)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_swift.patches.deepspeed_rebuild import release_autograd_groups


def test_a_group_saved_by_a_graph_in_flight_is_cut_without_a_warning(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])

        class KeepsGroup(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
                ctx.group = group  # as megatron-core's tensor-parallel linear saves ctx.tp_group
                return x * 2

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                return g * 2

        y = KeepsGroup.apply(torch.ones(2, requires_grad=True))
        assert y.grad_fn.group is group
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            assert release_autograd_groups() >= 1
        assert y.grad_fn.group is None
    finally:
        dist.destroy_process_group()
