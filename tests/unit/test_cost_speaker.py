"""Who says the start-up protection costs (ds_swift.runtime.engine_setup.speaks_for_stage)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ds_swift.runtime.engine_setup import speaks_for_stage


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
