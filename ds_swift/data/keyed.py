"""Data and randomness keyed by position, so any rank can recompute any micro-batch bit for bit.

A recovering rank resumes at an iteration it did not run before (a replacement) or runs again
(after an undo or a checkpoint reload). Reading the next item of a stateful iterator would give
it the wrong samples; asking ``batch_fn(iteration, micro_batch)`` gives the right ones. Likewise
dropout: the RNG is reseeded before every forward pass from (seed, iteration, micro-batch,
stage), never carried over from whatever ran before (ds_swift.data.keyed.key_forward_rng, in
training and in the replay alike).

Micro-batch numbering: within iteration ``t``, data-parallel replica ``d`` trains micro-batches
``d * gas .. d * gas + gas - 1`` (``gas`` = gradient accumulation steps), so every sample of the
global batch has one global index and replicas never see the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "BatchFn",
    "DataIteratorError",
    "ResumableIterator",
    "global_micro_batch",
    "key_forward_rng",
    "micro_batches",
    "rng_seed",
    "seed_generators",
]

#: ``batch_fn(iteration, micro_batch) -> (inputs, labels)``
BatchFn = Callable[[int, int], Any]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # A bijective 64-bit mixer: nearby keys (iteration 7 vs 8) give unrelated seeds.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rng_seed(seed: int, iteration: int, micro_batch: int, stage: int) -> int:
    """The torch seed for one forward pass: a function of its position only (fits in int63)."""
    h = _splitmix64(seed & _MASK64)
    for part in (iteration, micro_batch, stage):
        h = _splitmix64(h ^ (part & _MASK64))
    return h & ((1 << 63) - 1)


def global_micro_batch(dp_rank: int, gas: int, local_index: int) -> int:
    """Global index of a replica's ``local_index``-th micro-batch of an iteration."""
    return dp_rank * gas + local_index


def key_forward_rng(engine: Any, seed: int, local_index: int) -> None:
    """Reseed torch for the forward pass of this replica's ``local_index``-th micro-batch of
    iteration ``engine.global_steps``: dropout & co. depend on the position, never on what ran before."""
    mb = global_micro_batch(engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps(), local_index)
    seed_generators(rng_seed(seed, int(engine.global_steps), mb, int(engine.stage_id)))


def seed_generators(seed: int) -> None:
    """What ``torch.manual_seed(seed)`` does to the generators a forward pass can draw from: the
    CPU's and, where CUDA is initialised, every GPU's.

    Not ``torch.manual_seed`` itself: for each accelerator that is not initialised (on a CPU job:
    CUDA, XPU and MTIA) it queues the seed with a formatted traceback of the caller's stack, and
    from inside DeepSpeed's pipeline engine that was the largest single cost ds-swift added to the
    training thread on CPU (a cProfile of the tiny GPT's rank 0 in thread CPU time: 14 of the 41 ms
    per iteration ds-swift added), for generators the job never uses.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def micro_batches(batch_fn: BatchFn, iteration: int, dp_rank: int, gas: int) -> Iterator[Any]:
    """The iterator one ``train_batch`` of replica ``dp_rank`` reads at ``iteration``.

    Lazy: only the first and last pipeline stages pull from it (inputs and labels).
    """
    for m in range(gas):
        yield batch_fn(iteration, global_micro_batch(dp_rank, gas, m))


class ResumableIterator:
    """A ``train_batch(data_iter=...)`` iterator that ds-swift can put back at any iteration.

    A plain iterator cannot be rewound: after a recovery, the iteration that is trained again
    (or the replacement's first one) would read whatever it holds next. ds-swift refuses that
    (:class:`DataIteratorError`). Wrap the iterator's construction instead: ``factory(iteration)``
    returns an iterator over this rank's micro-batches from ``iteration``'s first on, e.g. a
    ``DataLoader`` over Megatron's ``MegatronPretrainingSampler(consumed_samples=...)`` built
    for that iteration. The engine calls :meth:`rewind` whenever the iteration it trains is not
    the one the iterator is at.

    Args:
        factory: ``factory(iteration) -> iterator`` of micro-batches.
        micro_batches: micro-batches per iteration (gradient accumulation steps).
        iteration: the iteration the first ``factory`` call starts at.
    """

    def __init__(self, factory: Callable[[int], Iterator[Any]], micro_batches: int, iteration: int = 0) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches={micro_batches} is invalid: a positive integer")
        self._factory = factory
        self._m = micro_batches
        self._consumed = iteration * micro_batches
        self._it = iter(factory(iteration))

    @property
    def iteration(self) -> float:
        """Where the iterator is, in iterations (fractional: part of one was read)."""
        return self._consumed / self._m

    def rewind(self, iteration: int) -> None:
        """Start over at ``iteration``'s first micro-batch."""
        self._it = iter(self._factory(iteration))
        self._consumed = iteration * self._m

    def __iter__(self) -> ResumableIterator:
        return self

    def __next__(self) -> Any:
        item = next(self._it)
        self._consumed += 1
        return item


class DataIteratorError(RuntimeError):
    """``train_batch(data_iter=...)`` cannot be trained exactly after a recovery."""
