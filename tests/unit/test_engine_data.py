"""Position-keyed data and RNG (ds_swift.data.keyed) and the pipeline rank layout (ds_swift.runtime.context)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds_swift.config import SwiftConfig
from ds_swift.data.keyed import global_micro_batch, micro_batches, rng_seed
from ds_swift.runtime.context import op_timeout_from, pipeline_topology

keys = st.tuples(st.integers(0, 2**31), st.integers(0, 10**6), st.integers(0, 4096), st.integers(0, 64))


@given(keys)
def test_rng_seed_is_a_pure_function_in_range(key: tuple[int, int, int, int]) -> None:
    assert rng_seed(*key) == rng_seed(*key)
    assert 0 <= rng_seed(*key) < 2**63


@given(keys, st.integers(0, 3))
def test_rng_seed_changes_with_every_coordinate(key: tuple[int, int, int, int], which: int) -> None:
    other = list(key)
    other[which] += 1
    assert rng_seed(*key) != rng_seed(*other)


def test_micro_batches_are_keyed_by_global_position() -> None:
    seen: list[tuple[int, int]] = []

    def batch_fn(it: int, mb: int) -> tuple[int, int]:
        seen.append((it, mb))
        return it, mb

    batches = micro_batches(batch_fn, iteration=7, dp_rank=1, gas=4)
    assert seen == []  # lazy: only the stages that read data call batch_fn
    assert list(batches) == [(7, 4), (7, 5), (7, 6), (7, 7)]
    assert global_micro_batch(dp_rank=0, gas=4, local_index=3) == 3


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        # tp-pp-dp: a pipeline's stages are adjacent, replicas on other machines.
        ("tp-pp-dp", {(0, 0): 0, (1, 0): 1, (0, 1): 2, (1, 1): 3}),
        # tp-dp-pp (Megatron's default): a stage's replicas are adjacent.
        ("tp-dp-pp", {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}),
    ],
)
def test_pipeline_topology_follows_the_rank_order(order: str, expected: dict[tuple[int, int], int]) -> None:
    topo = pipeline_topology(order, pp=2, dp=2)
    got = {(c.pipe, c.data): topo.get_rank(pipe=c.pipe, data=c.data, model=0) for c in topo.mapping}
    assert got == expected


def test_pipeline_topology_rejects_a_bad_order() -> None:
    with pytest.raises(ValueError, match="permutation"):
        pipeline_topology("tp-pp", pp=2, dp=2)


def test_op_timeout_env_wins_over_config() -> None:
    cfg = SwiftConfig.from_dict({"enabled": True, "watchdog": {"op_timeout_s": 12.0}})
    assert op_timeout_from(cfg, {}) == 12.0
    assert op_timeout_from(cfg, {"SWIFT_OP_TIMEOUT_S": "3.5"}) == 3.5
