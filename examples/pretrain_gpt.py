"""Pretrain a small GPT on DeepSpeed's pipeline engine, protected by ds-swift.

    ds-swift-launch --nnodes 2 --nproc-per-node 2 --spares 1 \\
        examples/pretrain_gpt.py --deepspeed_config configs/gpt_tiny_pp2_dp2.json --train-iters 15 --save DIR

Pipeline stages come from the DeepSpeed config's ``"pipeline": {"stages": K}``, micro-batch size
and gradient accumulation from its usual keys, the rank layout from ``swift.machines.rank_order``.
Data is synthetic and keyed by (iteration, micro-batch), so a recovered rank reads exactly the
samples it would have read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule

import ds_swift
from ds_swift.data import micro_batches
from ds_swift.distributed import init_distributed, pipeline_topology
from ds_swift.engine import initialize


class Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(pos)[None])


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention, then an MLP."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.lm = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def synthetic_batch(seed: int, iteration: int, micro_batch: int, mbs: int, seq: int, vocab: int) -> tuple:
    """Learnable synthetic text: mostly t[i+1] = (3 t[i] + 1) mod vocab, with 10% random tokens."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + iteration) * 1_000_003 + micro_batch) % (1 << 62))
    tokens = torch.empty(mbs, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (mbs,), generator=g)
    noise = torch.rand(mbs, seq, generator=g) < 0.1
    rand = torch.randint(vocab, (mbs, seq), generator=g)
    for i in range(seq):
        tokens[:, i + 1] = torch.where(noise[:, i], rand[:, i], (3 * tokens[:, i] + 1) % vocab)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed_config", "--deepspeed-config", required=True)
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save", default=None, help="write a final DeepSpeed checkpoint here")
    p.add_argument("--load", default=None, help="start from the latest DeepSpeed checkpoint here")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=None, help="overrides the config's optimizer lr")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.lr is not None:
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    cfg = ds_swift.SwiftConfig.from_ds_config(config)
    init_distributed(config)
    world = torch.distributed.get_world_size()
    pp = int(config.get("pipeline", {}).get("stages", 1))
    if world % pp:
        raise SystemExit(f"world size {world} is not a multiple of pipeline.stages={pp}")
    topology = pipeline_topology(cfg.machines.rank_order, pp=pp, dp=world // pp)
    mbs = int(config["train_micro_batch_size_per_gpu"])

    def model_fn() -> PipelineModule:
        torch.manual_seed(args.seed)  # same initial weights in every process, every rebuild
        layers = [LayerSpec(Embedding, args.vocab_size, args.seq_length, args.hidden_size, args.dropout)]
        layers += [LayerSpec(Block, args.hidden_size, args.num_attention_heads, args.dropout) for _ in range(args.num_layers)]
        layers += [LayerSpec(Head, args.hidden_size, args.vocab_size)]
        return PipelineModule(layers=layers, topology=topology, loss_fn=lm_loss, partition_method="uniform")

    def batch_fn(iteration: int, micro_batch: int) -> tuple:
        return synthetic_batch(args.seed, iteration, micro_batch, mbs, args.seq_length, args.vocab_size)

    model = model_fn()
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=[p for p in model.parameters() if p.requires_grad]
    )
    if args.load:
        engine.load_checkpoint(args.load)
    swift_engine = initialize(engine, config, model_fn=model_fn, batch_fn=batch_fn, seed=args.seed)
    protected = swift_engine is not engine  # false with "swift": {"enabled": false}: plain DeepSpeed
    engine = swift_engine
    loss = None
    while engine.global_steps < args.train_iters:
        if protected:
            loss = engine.train_batch()  # ds-swift reads batch_fn by position itself
        else:
            data = micro_batches(batch_fn, engine.global_steps, engine.grid.get_data_parallel_id(),
                                 engine.gradient_accumulation_steps())
            loss = engine.train_batch(data_iter=data)
        if engine.global_rank == 0 and (engine.global_steps % 5 == 0 or engine.global_steps == args.train_iters):
            print(f"iteration {engine.global_steps}/{args.train_iters} loss {float(loss):.4f}", flush=True)
    if args.save:
        engine.save_checkpoint(os.path.abspath(args.save))
    if hasattr(engine, "close"):
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
