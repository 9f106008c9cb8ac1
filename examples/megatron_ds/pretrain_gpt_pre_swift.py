"""Pretrain GPT, Megatron-DeepSpeed style: the script *before* ds-swift is turned on.

This has the shape of Megatron-DeepSpeed's ``pretrain_gpt.py`` and of the ``megatron.training``
code it calls (argument groups, ``initialize_megatron``, ``model_provider``, ``get_batch_pipe``,
``setup_model_and_optimizer`` with ``deepspeed.initialize``, ``train_step``, ``pretrain``), folded
into one self-contained file that runs on CPU with ds-swift's tiny GPT and the offline stdlib
docstring corpus. ``patches/megatron_deepspeed_pretrain_gpt.diff`` is what ds-swift adds to it
(written against ``pretrain_gpt.py`` at the root of a Megatron-DeepSpeed checkout)::

    mkdir -p /tmp/mds && cp examples/megatron_ds/pretrain_gpt_pre_swift.py /tmp/mds/pretrain_gpt.py
    patch -d /tmp/mds -p1 < patches/megatron_deepspeed_pretrain_gpt.diff

Run it (before or after the patch) with the DeepSpeed launcher, torchrun or ds-swift-launch::

    ds-swift-launch --nnodes 1 --nproc-per-node 2 examples/megatron_ds/pretrain_gpt_pre_swift.py \\
        --deepspeed --deepspeed_config configs/gpt_tiny_pp2_dp2.json --pipeline-model-parallel-size 2 \\
        --micro-batch-size 4 --global-batch-size 16 --train-iters 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state as mpu

from ds_swift.data.corpus import load_corpus
from ds_swift.models.gpt import GPTConfig, gpt_layer_specs, gpt_loss_fn

_GLOBAL_ARGS: argparse.Namespace | None = None  # megatron.get_args()


def get_args() -> argparse.Namespace:
    assert _GLOBAL_ARGS is not None, "arguments are not parsed yet"
    return _GLOBAL_ARGS


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


# ---------------------------------------------------------------------------- megatron/arguments.py
def _add_network_size_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=4)
    group.add_argument("--hidden-size", type=int, default=64)
    group.add_argument("--num-attention-heads", type=int, default=4)
    group.add_argument("--seq-length", type=int, default=32)
    group.add_argument("--vocab-size", type=int, default=256, help="byte-level tokens")
    group.add_argument("--hidden-dropout", type=float, default=0.0)
    return parser


def _add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="training")
    group.add_argument("--micro-batch-size", type=int, default=4)
    group.add_argument("--global-batch-size", type=int, default=None)
    group.add_argument("--train-iters", type=int, default=10)
    group.add_argument("--lr", type=float, default=1e-3)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--log-interval", type=int, default=1)
    group.add_argument("--loss-log", default=None, help="append {iteration, loss} JSON lines (last stage, dp 0)")
    return parser


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", default=None)
    group.add_argument("--load", default=None)
    return parser


def _add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--distributed-backend", default="gloo", choices=["nccl", "gloo"])
    group.add_argument("--local_rank", "--local-rank", type=int, default=None)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = _add_network_size_args(parser)
    parser = _add_training_args(parser)
    parser = _add_checkpointing_args(parser)
    parser = _add_distributed_args(parser)
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    args = parser.parse_args(argv)
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % model_parallel:
        parser.error(
            f"world size {args.world_size} is not divisible by tensor x pipeline parallel size {model_parallel}"
        )
    args.data_parallel_size = args.world_size // model_parallel
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        parser.error("--global-batch-size must be a multiple of --micro-batch-size x data-parallel size")
    args.gradient_accumulation_steps = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    if not args.deepspeed or not args.deepspeed_config:
        parser.error("this script trains with DeepSpeed's pipeline engine: pass --deepspeed --deepspeed_config FILE")
    with open(args.deepspeed_config) as f:
        args.deepspeed_config_dict = json.load(f)
    # Megatron's flags win over the DeepSpeed config, as in Megatron-DeepSpeed.
    ds = args.deepspeed_config_dict
    ds["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    ds["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    ds["train_batch_size"] = args.global_batch_size
    ds.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}}).setdefault("params", {})["lr"] = (
        args.lr
    )
    ds["pipeline"] = {**ds.get("pipeline", {}), "stages": args.pipeline_model_parallel_size}
    return args


# ---------------------------------------------------------------------------- megatron/initialize.py
def initialize_megatron(argv: list[str] | None = None) -> argparse.Namespace:
    global _GLOBAL_ARGS
    args = _GLOBAL_ARGS = parse_args(argv)
    deepspeed.init_distributed(dist_backend=args.distributed_backend)
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    torch.manual_seed(args.seed)
    return args


# ---------------------------------------------------------------------------- pretrain_gpt.py
def model_provider(pre_process: bool = True, post_process: bool = True) -> PipelineModule:
    """Build the model (GPTModelPipe in Megatron-DeepSpeed)."""
    args = get_args()
    print_rank_0("building GPT model ...")
    config = GPTConfig(
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.seq_length,
        args.vocab_size,
        args.hidden_dropout,
        tensor_parallel=args.tensor_model_parallel_size,
    )
    topology = PipeModelDataParallelTopology(
        num_pp=mpu.get_pipeline_model_parallel_world_size(),
        num_mp=mpu.get_tensor_model_parallel_world_size(),
        num_dp=mpu.get_data_parallel_world_size(),
    )
    torch.manual_seed(args.seed)  # the same initial weights in every process
    return PipelineModule(
        layers=gpt_layer_specs(config), topology=topology, loss_fn=gpt_loss_fn(config), partition_method="uniform"
    )


class GPTDataset(torch.utils.data.Dataset):
    """Sample ``idx`` is a window of the corpus at an offset drawn from ``(seed, idx)``."""

    def __init__(self, seq_length: int, seed: int, num_samples: int) -> None:
        self.corpus = load_corpus()
        self.seq_length, self.seed, self.num_samples = seq_length, seed, num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        tokens, labels = self.corpus.batch(self.seed, 0, idx, 1, self.seq_length)
        return {"text": torch.cat([tokens[0], labels[0, -1:]])}


def get_batch_pipe(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-DeepSpeed's get_batch_pipe: (inputs) and (labels) for the pipeline engine."""
    tokens_ = data["text"].long()
    return tokens_[:, :-1].contiguous(), tokens_[:, 1:].contiguous()


def get_micro_batch(train_ds: GPTDataset, iteration: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``micro_batch`` (of all replicas: replica ``d`` trains ``d*gas .. d*gas+gas-1``)
    of ``iteration``, with the sample order of Megatron's MegatronPretrainingSampler."""
    args = get_args()
    gas, mbs, dp = args.gradient_accumulation_steps, args.micro_batch_size, args.data_parallel_size
    replica, local = divmod(micro_batch, gas)
    first = iteration * args.global_batch_size + local * mbs * dp + replica * mbs
    samples = [train_ds[i] for i in range(first, first + mbs)]
    return get_batch_pipe(torch.utils.data.default_collate(samples))


def build_data_iterator(train_ds: GPTDataset, iteration: int, data_parallel_rank: int) -> Any:
    """Resume-safe iterator over one iteration's micro-batches of this replica (from consumed samples)."""
    gas = get_args().gradient_accumulation_steps
    return iter([get_micro_batch(train_ds, iteration, data_parallel_rank * gas + m) for m in range(gas)])


# ---------------------------------------------------------------------------- megatron/training.py
def setup_model_and_optimizer(args: argparse.Namespace) -> Any:
    model = model_provider()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        config=args.deepspeed_config_dict,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
    )
    if args.load:
        engine.load_checkpoint(args.load)
    return engine


def train_step(model: Any, data_iterator: Any) -> float:
    return float(model.train_batch(data_iter=data_iterator))


def train(model: Any, train_ds: GPTDataset, args: argparse.Namespace) -> None:
    dp_rank = mpu.get_data_parallel_rank()
    while model.global_steps < args.train_iters:
        iteration = int(model.global_steps)
        start = time.time()
        loss = train_step(model, build_data_iterator(train_ds, iteration, dp_rank))
        if args.loss_log and model.is_last_stage() and dp_rank == 0 and mpu.get_tensor_model_parallel_rank() == 0:
            with open(args.loss_log, "a") as f:
                f.write(json.dumps({"iteration": int(model.global_steps) - 1, "loss": loss}) + "\n")
        if int(model.global_steps) % args.log_interval == 0:
            print_rank_0(
                f" iteration {int(model.global_steps):8d}/{args.train_iters:8d} | lm loss: {loss:.6E} | "
                f"elapsed time per iteration (ms): {1000 * (time.time() - start):.1f}"
            )
    if args.save:
        model.save_checkpoint(os.path.abspath(args.save))


def pretrain(argv: list[str] | None = None) -> int:
    args = initialize_megatron(argv)
    train_ds = GPTDataset(args.seq_length, args.seed, args.train_iters * args.global_batch_size)
    model = setup_model_and_optimizer(args)
    train(model, train_ds, args)
    return 0


if __name__ == "__main__":
    sys.exit(pretrain())
