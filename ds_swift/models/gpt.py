"""A small GPT as DeepSpeed ``LayerSpec`` layers, for the examples, the tests and ``ds-swift demo``.

Pre-LN transformer blocks between a token+position embedding and a LayerNorm + LM head. With
``tensor_parallel == 1`` the layers are plain ``torch.nn`` modules (the math the bitwise recovery
tests were written against: do not change it). With ``tensor_parallel > 1`` the blocks and head
use megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` on megatron-core's tensor
model-parallel group (``parallel_state.initialize_model_parallel`` must have run), initialised on
the CPU from one master weight, so every TP degree starts from the same full matrices.

Data is keyed by position, ``batch_fn(iteration, micro_batch)``: a recovered rank recomputes
exactly the samples it would have read (see :mod:`ds_swift.data.keyed`).
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
    "gpt_batch_fn",
    "gpt_layer_specs",
    "gpt_loss_fn",
    "gpt_pipeline",
    "lm_loss",
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
        self.qkv = ColumnParallelLinear(
            hidden, 3 * hidden, config=config, init_method=_linear_init, bias=True, gather_output=False, stride=3
        )
        self.proj = RowParallelLinear(
            hidden,
            hidden,
            config=config,
            init_method=_linear_init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = ColumnParallelLinear(
            hidden, 4 * hidden, config=config, init_method=_linear_init, bias=True, gather_output=False
        )
        self.out = RowParallelLinear(
            4 * hidden,
            hidden,
            config=config,
            init_method=_linear_init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )
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
        self.lm = ColumnParallelLinear(
            hidden, vocab, config=_megatron_config(tp), init_method=_linear_init, bias=False, gather_output=False
        )

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
        layers += [
            LayerSpec(Block, cfg.hidden_size, cfg.num_attention_heads, cfg.dropout) for _ in range(cfg.num_layers)
        ]
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
        from ds_swift.data.corpus import ByteTokenizer, load_corpus

        if cfg.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(
                f"--vocab-size {cfg.vocab_size} is too small for --data corpus: byte tokens need {ByteTokenizer.vocab_size}"
            )
        corpus = load_corpus()

        def from_corpus(iteration: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
            return corpus.batch(seed, iteration, micro_batch, micro_batch_size, cfg.seq_length)

        return from_corpus
    raise ValueError(f"--data {data!r} is invalid: one of {', '.join(DATA_SOURCES)}")
