"""The step-collective recorder (logging-based recovery) on the GPU: recording a step's all-reduce
makes the training thread wait for nothing (no host copy, no synchronisation in the step).

Skipped without CUDA.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_swift.recovery.replay.collectives import CollectiveRecorder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_recording_a_step_all_reduce_does_not_synchronise(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        rec = CollectiveRecorder()
        rec._begin_step(SimpleNamespace(global_steps=3))
        make = rec._make

        def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
            tensor.mul_(2.0)  # stands in for NCCL: device work, no host involvement

        call = make("all_reduce", all_reduce, inspect.signature(dist.all_reduce))
        t = torch.full((4,), 1.5, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call(t)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got = rec.records[(3, 0)].tensor
        assert got.is_cuda and got.tolist() == [3.0] * 4
        assert CollectiveRecorder.from_bytes(rec.to_bytes()).records[(3, 0)].tensor.device.type == "cpu"
    finally:
        dist.destroy_process_group()
