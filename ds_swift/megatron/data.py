"""Megatron-DeepSpeed's training samples, read by position instead of from its data iterator.

Megatron-DeepSpeed hands ``train_batch(data_iter=...)`` an iterator over a ``DataLoader`` whose
``MegatronPretrainingSampler`` starts at ``args.consumed_train_samples``. After a failure that
iterator is in the wrong place on every rank: survivors have read part of the failed iteration,
a replacement has read nothing. The sampler is plain arithmetic on the consumed-samples count,
so ds-swift asks for the same samples by position instead (``batch_fn(iteration, micro_batch)``,
see ds_swift.data.keyed), and gets exactly the micro-batches the iterator would have given:

* iteration ``t`` starts at ``consumed = start_consumed + (t - start_iteration) * global_batch``;
* its ``k``-th micro-batch on every replica is the block ``consumed + k * mbs * dp`` ..
  ``+ mbs * dp``, of which data-parallel rank ``d`` takes ``[d * mbs, (d + 1) * mbs)``
  (``MegatronPretrainingSampler.__iter__``);
* ds-swift numbers replica ``d``'s ``k``-th micro-batch ``d * gas + k`` (ds_swift.data.keyed).

Only ``--dataloader-type single`` (Megatron's default for GPT) is supported: the ``cyclic``
sampler shuffles per epoch with its own generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ds_swift.config import ConfigError

__all__ = ["MegatronSamples", "SamplerPosition", "sample_indices"]


@dataclass(frozen=True)
class SamplerPosition:
    """What ``MegatronPretrainingSampler`` needs to place any micro-batch (constant batch size).

    Args:
        micro_batch_size: ``--micro-batch-size``.
        data_parallel_size: replicas (``mpu.get_data_parallel_world_size()``).
        gas: micro-batches per iteration per replica (gradient accumulation steps).
        start_iteration: the iteration whose first sample is ``start_consumed``.
        start_consumed: ``args.consumed_train_samples`` at ``start_iteration``.
    """

    micro_batch_size: int
    data_parallel_size: int
    gas: int
    start_iteration: int = 0
    start_consumed: int = 0

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.data_parallel_size * self.gas


def sample_indices(pos: SamplerPosition, iteration: int, micro_batch: int) -> list[int]:
    """Dataset indices of ds-swift's global ``micro_batch`` of ``iteration``, in Megatron's order."""
    mbs, dp, gas = pos.micro_batch_size, pos.data_parallel_size, pos.gas
    if not 0 <= micro_batch < dp * gas:
        raise ValueError(f"micro_batch {micro_batch} out of range: {dp} replicas x {gas} micro-batches")
    replica, k = divmod(micro_batch, gas)
    consumed = pos.start_consumed + (iteration - pos.start_iteration) * pos.global_batch_size
    start = consumed + k * mbs * dp + replica * mbs
    return list(range(start, start + mbs))


class MegatronSamples:
    """Keeps the training dataset Megatron builds and serves its micro-batches by position.

    ``keep(provider)`` wraps ``pretrain``'s dataset provider (the dataset is built later than the
    engine, and again by a survivor's rebuild); ``batch_fn`` is what ``ds_swift.initialize`` takes.
    """

    def __init__(self) -> None:
        self.dataset: Sequence[Any] | None = None
        self.position: SamplerPosition | None = None

    def keep(self, provider: Callable[[Any], tuple[Any, Any, Any]]) -> Callable[[Any], tuple[Any, Any, Any]]:
        """``provider`` that also remembers the training dataset it returns."""

        def provide(num_samples: Any) -> tuple[Any, Any, Any]:
            train, valid, test = provider(num_samples)
            self.dataset = train
            return train, valid, test

        return provide

    def configure(self, args: Any, data_parallel_size: int, gas: int, iteration: int) -> None:
        """Fix the sampler arithmetic from Megatron's arguments, at ``iteration`` (the engine's)."""
        if getattr(args, "dataloader_type", "single") != "single":
            raise ConfigError(
                f"--dataloader-type {args.dataloader_type!r}: ds-swift reads Megatron's samples by "
                "position only for --dataloader-type single"
            )
        if getattr(args, "rampup_batch_size", None):
            raise ConfigError("--rampup-batch-size: ds-swift needs a constant global batch size")
        mbs = int(args.micro_batch_size)
        if mbs * data_parallel_size * gas != int(args.global_batch_size):
            raise ConfigError(
                f"--global-batch-size {args.global_batch_size} != micro-batch {mbs} x {data_parallel_size} "
                f"replicas x {gas} gradient accumulation steps"
            )
        consumed = int(getattr(args, "consumed_train_samples", 0) or 0)
        start_iteration = int(getattr(args, "iteration", 0) or 0)
        if consumed == 0 and start_iteration > 0:
            consumed = start_iteration * mbs * data_parallel_size * gas  # Megatron's own fallback
        pos = SamplerPosition(mbs, data_parallel_size, gas, start_iteration, consumed)
        # A replacement resumes at the engine's iteration: its counters follow from the position.
        args.iteration = iteration
        args.consumed_train_samples = consumed + (iteration - start_iteration) * pos.global_batch_size
        if getattr(args, "seq_length", None):
            # Megatron logs (and may decay the LR by) tokens: a replacement started them at 0.
            args.consumed_train_tokens = args.consumed_train_samples * int(args.seq_length)
        self.position = pos

    def consumed(self, iteration: int) -> int:
        """``args.consumed_train_samples`` once ``iteration`` iterations are done."""
        pos = self.position
        if pos is None:
            raise RuntimeError("MegatronSamples.configure() must run first")
        return pos.start_consumed + (iteration - pos.start_iteration) * pos.global_batch_size

    def batch_fn(self, iteration: int, micro_batch: int) -> Any:
        """``{'text': LongTensor[mbs, seq + 1]}`` as Megatron's ``DataLoader`` collates it.

        None where Megatron builds no dataset (tensor-parallel ranks > 0): its ``get_batch_pipe``
        broadcasts the batch from tensor-parallel rank 0 there.
        """
        if self.dataset is None:
            return None
        if self.position is None:
            raise RuntimeError("MegatronSamples.configure() must run before batches are read")
        from torch.utils.data import default_collate

        return default_collate([self.dataset[i] for i in sample_indices(self.position, iteration, micro_batch)])
