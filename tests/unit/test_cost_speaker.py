"""Who says the start-up protection costs (ds_swift.runtime.engine_setup.speaks_for_stage), and
that every rank says, loudly, what a benchmark's switch turned off."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from ds_swift.protect.costs import ENV
from ds_swift.runtime.engine_setup import log_protection_costs, speaks_for_stage


def engine(dp: int, tp: int | None) -> SimpleNamespace:
    grid = SimpleNamespace(get_data_parallel_id=lambda: dp)
    if tp is not None:
        grid.get_slice_parallel_rank = lambda: tp
    return SimpleNamespace(grid=grid)


@pytest.mark.parametrize(("dp", "tp", "says"), [(0, 0, True), (0, None, True), (1, 0, False), (0, 1, False)])
def test_one_rank_per_stage_says_the_costs(dp: int, tp: int | None, says: bool) -> None:
    assert speaks_for_stage(engine(dp, tp)) is says


def test_an_engine_without_a_grid_says_its_own() -> None:
    assert speaks_for_stage(SimpleNamespace()) is True


def test_every_rank_warns_of_protections_a_benchmark_switched_off() -> None:
    said: list[tuple[int, str]] = []
    ctx = SimpleNamespace(log=lambda msg, level=logging.INFO: said.append((level, msg)))
    other: Any = None  # not read on a rank that does not speak for its stage
    log_protection_costs(engine(1, 0), other, ctx, other, other, frozenset({"undo", "logging"}))
    ((level, msg),) = said  # the stage's cost lines are another rank's; this one is every rank's
    assert level == logging.WARNING
    assert msg.startswith(f"protections SWITCHED OFF for a benchmark by {ENV} (unset it for training): logging (")
    assert "; undo (update-undo's step records" in msg and "recovered without them" in msg
    log_protection_costs(engine(1, 0), other, ctx, other, other, frozenset())
    assert len(said) == 1  # nothing switched off: nothing said here
