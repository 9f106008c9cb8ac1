"""A small DeepSpeed pipeline for the message-logging tests and benchmarks (4 stages, MSE loss).

Stage 1 hands stage 2 a *tuple* (two float tensors and an int64 one) in :func:`tuple_boundary_layers`:
multi-tensor messages and the float-only gradient path cross the machine boundary of pp 4 on 2
machines of 2 ranks. Imports torch and DeepSpeed: only workers import this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from torch import nn

__all__ = ["Block", "Merge", "Split", "block_layers", "pipeline_config", "pipeline_engine", "tuple_boundary_layers"]


class Block(nn.Module):
    """Linear + ReLU, with dropout when ``p`` > 0 (replay must reproduce its masks)."""

    def __init__(self, h: int, p: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(h, h)
        self.drop: nn.Module = nn.Dropout(p) if p > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.lin(x)))


class Split(nn.Module):
    """Last layer of stage 1: the boundary carries a 3-tensor tuple."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ids = torch.arange(x.shape[0], dtype=torch.long)
        return x, x * 0.5 + 1.0, ids


class Merge(nn.Module):
    """First layer of stage 2."""

    def forward(self, t: tuple[torch.Tensor, ...]) -> torch.Tensor:
        a, b, ids = t
        return a * b + ids.to(a.dtype).unsqueeze(1) * 1e-3


def tuple_boundary_layers(h: int, dropout: Sequence[float] = (0.0,) * 5) -> list[LayerSpec]:
    """8 layers, 2 per stage of pp 4; ``dropout`` holds the p of the five Blocks in order."""
    p = list(dropout)
    if len(p) != 5:
        raise ValueError(f"dropout: 5 probabilities (one per Block), got {len(p)}")
    layers = [LayerSpec(Block, h, p[0]), LayerSpec(Block, h, p[1]), LayerSpec(Block, h, p[2]), LayerSpec(Split)]
    return layers + [LayerSpec(Merge), LayerSpec(Block, h, p[3]), LayerSpec(Block, h, p[4]), LayerSpec(nn.Linear, h, h)]


def block_layers(h: int, count: int) -> list[LayerSpec]:
    return [LayerSpec(Block, h) for _ in range(count)]


def pipeline_config(micro: int, gas: int, optimizer: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed config of one data-parallel replica, ZeRO 0, quiet."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas,
        "optimizer": optimizer,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }


def pipeline_engine(layers: list[LayerSpec], config: dict[str, Any], seed: int, stages: int = 4) -> Any:
    """A PipelineEngine over ``layers`` (uniform partition), parameters initialised from ``seed``."""
    import deepspeed

    torch.manual_seed(seed)
    model = PipelineModule(layers=layers, num_stages=stages, loss_fn=nn.MSELoss(), partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=dict(config))
    return engine
