"""Data and randomness keyed by position, so any rank can recompute any micro-batch bit for bit.

A recovering rank resumes at an iteration it did not run before (a replacement) or runs again
(after an undo or a checkpoint reload). Reading the next item of a stateful iterator would give
it the wrong samples; asking ``batch_fn(iteration, micro_batch)`` gives the right ones. Likewise
dropout: the RNG is reseeded before every forward pass from (seed, iteration, micro-batch,
stage), never carried over from whatever ran before (ds_swift.runtime.hooks.key_forward_rng, in
training and in the replay alike).

Micro-batch numbering: within iteration ``t``, data-parallel replica ``d`` trains micro-batches
``d * gas .. d * gas + gas - 1`` (``gas`` = gradient accumulation steps), so every sample of the
global batch has one global index and replicas never see the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["BatchFn", "global_micro_batch", "micro_batches", "rng_seed"]

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


def micro_batches(batch_fn: BatchFn, iteration: int, dp_rank: int, gas: int) -> Iterator[Any]:
    """The iterator one ``train_batch`` of replica ``dp_rank`` reads at ``iteration``.

    Lazy: only the first and last pipeline stages pull from it (inputs and labels).
    """
    for m in range(gas):
        yield batch_fn(iteration, global_micro_batch(dp_rank, gas, m))
