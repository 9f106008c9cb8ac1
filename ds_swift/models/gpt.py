"""A small GPT as DeepSpeed ``LayerSpec`` layers, for the examples, the tests and ``ds-swift demo``.

Pre-LN transformer blocks between a token+position embedding and a LayerNorm + LM head. With
``tensor_parallel == 1`` the layers are plain ``torch.nn`` modules (the math the bitwise recovery
tests were written against: do not change it). With ``tensor_parallel > 1`` the blocks and head
use megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` on megatron-core's tensor
model-parallel group (``parallel_state.initialize_model_parallel`` must have run), initialised on
the CPU from one master weight, so every TP degree starts from the same full matrices.

Data is keyed by position, ``batch_fn(iteration, micro_batch)``: a recovered rank recomputes
exactly the samples it would have read (see :mod:`ds_swift.data`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "Block",
    "Embedding",
    "GPTConfig",
    "Head",
    "ParallelBlock",
    "ParallelHead",
    "PlanError",
    "TrainingPlan",
    "gpt_batch_fn",
    "gpt_layer_specs",
    "gpt_loss_fn",
    "gpt_pipeline",
    "lm_loss",
    "resolve_training_plan",
    "synthetic_batch",
    "vocab_parallel_lm_loss",
]

DATA_SOURCES = ("corpus", "synthetic")


@dataclass(frozen=True)
class GPTConfig:
    """Model shape; field names follow Megatron's flags (``--num-layers`` -> ``num_layers``)."""

    num_layers: int = 4
    """Transformer blocks (``--num-layers``); the embedding and the head are two more pipeline layers."""
    hidden_size: int = 64
    """Model width (``--hidden-size``)."""
    num_attention_heads: int = 4
    """Attention heads (``--num-attention-heads``); must divide ``hidden_size``."""
    seq_length: int = 32
    """Tokens per sample (``--seq-length``)."""
    vocab_size: int = 128
    """Vocabulary (``--vocab-size``); 256 for the byte-level corpus."""
    dropout: float = 0.0
    """Dropout probability (``--dropout``); the runtime reseeds it per (iteration, micro-batch, stage)."""
    tensor_parallel: int = 1
    """Tensor model-parallel degree (``--tensor-model-parallel-size``)."""
    megatron_layers: bool = False
    """Use megatron-core's tensor-parallel layers even at ``tensor_parallel == 1`` (to compare TP
    degrees on the same math); always on when ``tensor_parallel > 1``."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--num-layers", self.num_layers),
            ("--hidden-size", self.hidden_size),
            ("--num-attention-heads", self.num_attention_heads),
            ("--seq-length", self.seq_length),
            ("--vocab-size", self.vocab_size),
            ("--tensor-model-parallel-size", self.tensor_parallel),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} {value!r} is invalid: a positive integer")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout {self.dropout} is invalid: a probability in [0, 1)")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not a multiple of --num-attention-heads {self.num_attention_heads}"
            )
        tp = self.tensor_parallel
        if self.num_attention_heads % tp:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not a multiple of "
                f"--tensor-model-parallel-size {tp}: each TP rank holds whole heads"
            )
        if self.vocab_size % tp:
            raise ValueError(
                f"--vocab-size {self.vocab_size} is not a multiple of --tensor-model-parallel-size {tp}: "
                "the LM head is split by vocabulary"
            )

    @property
    def parallel_layers(self) -> bool:
        """Whether the blocks and head are megatron-core tensor-parallel layers."""
        return self.megatron_layers or self.tensor_parallel > 1

    @property
    def num_pipeline_layers(self) -> int:
        """Layers the pipeline partitions (embedding + blocks + head)."""
        return self.num_layers + 2


# ---------------------------------------------------------------------------- tp = 1 layers
class Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(pos)[None])


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, drop: nn.Module) -> torch.Tensor:
    """Causal attention over ``[b, heads, s, d]``; returns ``[b, s, heads * d]``."""
    b, n, s, d = q.shape
    att = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    att = drop(att.masked_fill(mask, float("-inf")).softmax(-1))
    return (att @ v).transpose(1, 2).reshape(b, s, n * d)


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
        x = x + self.drop(self.proj(_attention(q, k, v, self.drop)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.lm = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


# ---------------------------------------------------------------------------- tp > 1 layers
def _linear_init(weight: torch.Tensor) -> None:
    # nn.Linear's weight init, applied to megatron's full master matrix before it is split.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _megatron_config(tp: int) -> Any:
    from megatron.core import ModelParallelConfig

    # use_cpu_initialization: the GPU path draws from megatron's CUDA RNG tracker.
    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )


class ParallelBlock(nn.Module):
    """:class:`Block` with megatron-core tensor-parallel linears: each TP rank holds ``heads / tp``
    heads and ``4h / tp`` MLP columns; two all-reduces per block (after ``proj`` and ``out``)."""

    def __init__(self, hidden: int, heads: int, dropout: float, tp: int) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        config = _megatron_config(tp)
        self.local_heads = heads // tp
        self.local_hidden = hidden // tp
        self.ln1 = nn.LayerNorm(hidden)
        # stride=3: rank r gets its heads' rows of q, of k and of v (not a third of [q; k; v]).
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, config=config, init_method=_linear_init, bias=True,
                                        gather_output=False, stride=3)
        self.proj = RowParallelLinear(hidden, hidden, config=config, init_method=_linear_init, bias=True,
                                      input_is_parallel=True, skip_bias_add=False)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = ColumnParallelLinear(hidden, 4 * hidden, config=config, init_method=_linear_init, bias=True,
                                       gather_output=False)
        self.out = RowParallelLinear(4 * hidden, hidden, config=config, init_method=_linear_init, bias=True,
                                     input_is_parallel=True, skip_bias_add=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hl, n = self.local_hidden, self.local_heads
        qkv, _ = self.qkv(self.ln1(x))
        q, k, v = (t.reshape(b, s, n, hl // n).transpose(1, 2) for t in qkv.split(hl, dim=-1))
        attn, _ = self.proj(_attention(q, k, v, self.drop))
        x = x + self.drop(attn)
        hidden, _ = self.fc(self.ln2(x))
        mlp, _ = self.out(F.gelu(hidden))
        return x + self.drop(mlp)


class ParallelHead(nn.Module):
    """:class:`Head` with the LM projection split by vocabulary: each TP rank returns its slice of
    the logits, and :func:`vocab_parallel_lm_loss` reduces over the slices (megatron-core's gather
    of the full logits allocates on ``torch.cuda.current_device()`` and cannot run on CPU)."""

    def __init__(self, hidden: int, vocab: int, tp: int) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear

        self.ln = nn.LayerNorm(hidden)
        self.lm = ColumnParallelLinear(hidden, vocab, config=_megatron_config(tp), init_method=_linear_init,
                                       bias=False, gather_output=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, _ = self.lm(self.ln(x))
        return logits


# ---------------------------------------------------------------------------- assembly
def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def vocab_parallel_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`lm_loss` over vocabulary-split logits (megatron-core's ``vocab_parallel_cross_entropy``)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits.float(), labels).mean()


def gpt_loss_fn(cfg: GPTConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return vocab_parallel_lm_loss if cfg.parallel_layers else lm_loss


def gpt_layer_specs(cfg: GPTConfig) -> list[Any]:
    """The model as DeepSpeed ``LayerSpec`` s: embedding, ``num_layers`` blocks, head."""
    from deepspeed.pipe import LayerSpec

    layers = [LayerSpec(Embedding, cfg.vocab_size, cfg.seq_length, cfg.hidden_size, cfg.dropout)]
    if not cfg.parallel_layers:
        layers += [LayerSpec(Block, cfg.hidden_size, cfg.num_attention_heads, cfg.dropout) for _ in range(cfg.num_layers)]
        layers += [LayerSpec(Head, cfg.hidden_size, cfg.vocab_size)]
    else:
        tp = cfg.tensor_parallel
        layers += [
            LayerSpec(ParallelBlock, cfg.hidden_size, cfg.num_attention_heads, cfg.dropout, tp)
            for _ in range(cfg.num_layers)
        ]
        layers += [LayerSpec(ParallelHead, cfg.hidden_size, cfg.vocab_size, tp)]
    return layers


def gpt_pipeline(cfg: GPTConfig, topology: Any, seed: int, partition_method: str = "uniform") -> Any:
    """A ``PipelineModule`` of the GPT over ``topology``; the same weights in every process, every rebuild."""
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(seed)
    return PipelineModule(
        layers=gpt_layer_specs(cfg), topology=topology, loss_fn=gpt_loss_fn(cfg), partition_method=partition_method
    )


def synthetic_batch(
    seed: int, iteration: int, micro_batch: int, mbs: int, seq: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable synthetic text: mostly t[i+1] = (3 t[i] + 1) mod vocab, with 10% random tokens."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + iteration) * 1_000_003 + micro_batch) % (1 << 62))
    tokens = torch.empty(mbs, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (mbs,), generator=g)
    noise = torch.rand(mbs, seq, generator=g) < 0.1
    rand = torch.randint(vocab, (mbs, seq), generator=g)
    for i in range(seq):
        tokens[:, i + 1] = torch.where(noise[:, i], rand[:, i], (3 * tokens[:, i] + 1) % vocab)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gpt_batch_fn(
    data: str, seed: int, micro_batch_size: int, cfg: GPTConfig
) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """``batch_fn(iteration, micro_batch)`` for ``data`` = ``corpus`` (stdlib docstrings, bytes) or ``synthetic``."""
    if data == "synthetic":

        def synthetic(iteration: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            return synthetic_batch(seed, iteration, micro_batch, micro_batch_size, cfg.seq_length, cfg.vocab_size)

        return synthetic
    if data == "corpus":
        from ds_swift.corpus import ByteTokenizer, load_corpus

        if cfg.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"--vocab-size {cfg.vocab_size} is too small for --data corpus: byte tokens need {ByteTokenizer.vocab_size}"
            )
        corpus = load_corpus()

        def from_corpus(iteration: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            return corpus.batch(seed, iteration, micro_batch, micro_batch_size, cfg.seq_length)

        return from_corpus
    raise ValueError(f"--data {data!r} is invalid: one of {', '.join(DATA_SOURCES)}")


# ---------------------------------------------------------------------------- Megatron flags -> plan
class PlanError(ValueError):
    """Inconsistent parallel / batch flags; the message names the flag (or config key) and the fix."""


@dataclass(frozen=True)
class TrainingPlan:
    """The 3D plan and batch sizes a job runs with, resolved from Megatron flags and the DS config."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.dp

    def apply(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """Write the batch sizes and pipeline stages into ``ds_config`` (DeepSpeed reads them there)."""
        ds_config["train_micro_batch_size_per_gpu"] = self.micro_batch_size
        ds_config["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        ds_config["train_batch_size"] = self.global_batch_size
        pipeline = ds_config.get("pipeline")
        ds_config["pipeline"] = {**(pipeline if isinstance(pipeline, dict) else {}), "stages": self.pp}
        return ds_config


def _positive(flag: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{flag} {value!r} is invalid: a positive integer")
    return value


def resolve_training_plan(
    ds_config: dict[str, Any],
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
) -> TrainingPlan:
    """Resolve tp/pp/dp and the batch sizes the way Megatron-DeepSpeed does, checking every pair.

    A flag left out (None) comes from the DeepSpeed config: pipeline stages from
    ``"pipeline": {"stages": K}`` (default 1), the micro-batch from
    ``train_micro_batch_size_per_gpu``, gradient accumulation from ``gradient_accumulation_steps``
    or ``train_batch_size``. A flag and a config key that disagree are an error, not a silent pick.
    """
    world = _positive("world size", world_size)
    tp = _positive("--tensor-model-parallel-size", tensor_model_parallel_size)
    pipeline = ds_config.get("pipeline") if isinstance(ds_config.get("pipeline"), dict) else {}
    cfg_stages = pipeline.get("stages", "auto") if pipeline else "auto"
    cfg_pp = None if cfg_stages in (None, "auto") else _positive("pipeline.stages in --deepspeed_config", cfg_stages)
    if pipeline_model_parallel_size is None:
        pp = cfg_pp or 1
        pp_name = "pipeline.stages in --deepspeed_config" if cfg_pp else "--pipeline-model-parallel-size (default 1)"
    else:
        pp = _positive("--pipeline-model-parallel-size", pipeline_model_parallel_size)
        pp_name = "--pipeline-model-parallel-size"
        if cfg_pp is not None and cfg_pp != pp:
            raise PlanError(
                f"--pipeline-model-parallel-size {pp} differs from pipeline.stages={cfg_pp} in --deepspeed_config: "
                "give one, or make them equal"
            )
    if world % (tp * pp):
        raise PlanError(
            f"world size {world} is not a multiple of --tensor-model-parallel-size {tp} x {pp_name} {pp}"
        )
    dp = world // (tp * pp)
    cfg_mbs = ds_config.get("train_micro_batch_size_per_gpu")
    if micro_batch_size is None:
        if cfg_mbs is None:
            raise PlanError("no micro-batch size: pass --micro-batch-size or set train_micro_batch_size_per_gpu")
        mbs_name = "train_micro_batch_size_per_gpu in --deepspeed_config"
        mbs = _positive(mbs_name, cfg_mbs)
    else:
        mbs_name = "--micro-batch-size"
        mbs = _positive(mbs_name, micro_batch_size)
        if cfg_mbs is not None and cfg_mbs != mbs:
            raise PlanError(
                f"--micro-batch-size {mbs} differs from train_micro_batch_size_per_gpu={cfg_mbs} in "
                "--deepspeed_config: give one, or make them equal"
            )
    per_step = mbs * dp  # samples one gradient-accumulation step takes over all replicas
    cfg_gas, cfg_tbs = ds_config.get("gradient_accumulation_steps"), ds_config.get("train_batch_size")
    if global_batch_size is not None:
        gbs = _positive("--global-batch-size", global_batch_size)
        if gbs % per_step:
            raise PlanError(
                f"--global-batch-size {gbs} is not a multiple of {mbs_name} {mbs} x data-parallel size {dp} "
                f"(world {world} / (tp {tp} x pp {pp}))"
            )
        gas = gbs // per_step
        if cfg_gas is not None and cfg_gas != gas:
            raise PlanError(
                f"--global-batch-size {gbs} means {gas} gradient accumulation steps (micro-batch {mbs}, dp {dp}), "
                f"but --deepspeed_config sets gradient_accumulation_steps={cfg_gas}: give one"
            )
    elif cfg_gas is not None:
        gas = _positive("gradient_accumulation_steps in --deepspeed_config", cfg_gas)
    elif cfg_tbs is not None:
        tbs = _positive("train_batch_size in --deepspeed_config", cfg_tbs)
        if tbs % per_step:
            raise PlanError(
                f"train_batch_size={tbs} in --deepspeed_config is not a multiple of micro-batch {mbs} x dp {dp}"
            )
        gas = tbs // per_step
    else:
        gas = 1
    plan = TrainingPlan(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, gradient_accumulation_steps=gas)
    if cfg_tbs is not None and cfg_tbs != plan.global_batch_size:
        flag = "--global-batch-size" if global_batch_size is not None else "gradient_accumulation_steps"
        raise PlanError(
            f"train_batch_size={cfg_tbs} in --deepspeed_config differs from {plan.global_batch_size} "
            f"(micro-batch {mbs} x accumulation {gas} x dp {dp}); fix {flag} or train_batch_size"
        )
    return plan
