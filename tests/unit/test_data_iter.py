"""train_batch(data_iter=...) after a recovery (issue 12, item 7): a ResumableIterator is put back at
the iteration trained; a plain iterator is refused, never read for the wrong samples."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from ds_swift.data.keyed import DataIteratorError, ResumableIterator
from ds_swift.runtime.engine import SwiftPipelineEngine

GAS = 3


def factory(iteration: int) -> Any:
    return ((i, m) for i in itertools.count(iteration) for m in range(GAS))


def test_a_resumable_iterator_counts_and_rewinds() -> None:
    it = ResumableIterator(factory, GAS, iteration=2)
    assert [next(it) for _ in range(4)] == [(2, 0), (2, 1), (2, 2), (3, 0)]
    assert it.iteration == pytest.approx(3 + 1 / 3)
    it.rewind(3)
    assert it.iteration == 3 and next(it) == (3, 0)
    with pytest.raises(ValueError, match="micro_batches=0"):
        ResumableIterator(factory, 0)


def fake(global_steps: int, first: bool = True, replacement: bool = False, seen: bool = True) -> Any:
    engine = SimpleNamespace(global_steps=global_steps, is_first_stage=lambda: first, is_last_stage=lambda: False)
    ctx = SimpleNamespace(env=SimpleNamespace(replacement=replacement))
    return SimpleNamespace(_engine=engine, _ctx=ctx, _user_iter_warned=seen)


def test_the_engine_puts_a_resumable_iterator_at_the_iteration_it_trains() -> None:
    it = ResumableIterator(factory, GAS, iteration=5)
    next(it)  # a failure cut iteration 5 short after its first micro-batch
    assert SwiftPipelineEngine._position(fake(5), it, attempts=1) is it
    assert [next(it) for _ in range(GAS)] == [(5, 0), (5, 1), (5, 2)]
    SwiftPipelineEngine._position(fake(4), it, attempts=1)  # a recovery went back one iteration
    assert next(it) == (4, 0)


def test_a_plain_iterator_is_refused_after_a_recovery() -> None:
    plain = iter([1, 2, 3])
    assert SwiftPipelineEngine._position(fake(5), plain, attempts=0) is plain  # no recovery: fine
    with pytest.raises(DataIteratorError, match="ResumableIterator"):
        SwiftPipelineEngine._position(fake(5), plain, attempts=1)
    with pytest.raises(DataIteratorError, match="batch_fn"):  # a replacement's first iteration
        SwiftPipelineEngine._position(fake(7, replacement=True, seen=False), plain, attempts=0)
    # middle stages read no data: nothing to refuse
    assert SwiftPipelineEngine._position(fake(5, first=False), plain, attempts=1) is plain
