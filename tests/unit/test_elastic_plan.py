"""The elastic shrink / grow plan (ds_swift.recovery.strategies.elastic) and its config: ranks in the new
layout, the accumulation that keeps the global batch, and the refusals that name their fix."""

from __future__ import annotations

import pytest

from ds_swift.config import ConfigError
from ds_swift.recovery.registry import services_of
from ds_swift.recovery.strategies.resize import Resize, ResizeRefused, resized_ds_config
from ds_swift.testing.configs import swift_config

# pp 2 x dp 2, rank order tp-pp-dp: rank = stage + 2 dp; machines of 2 ranks hold whole replicas
COORDS = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]


def plan(**kw: object) -> Resize:
    args: dict[str, object] = dict(
        kind="shrink",
        machine=0,
        old_layout=[0, 1],
        new_layout=[1],
        old_coords=COORDS,
        gas=4,
        micro=4,
        policy="keep",
        min_dp=1,
        partitioned=True,
    )
    args.update(kw)
    return Resize.plan(**args)  # type: ignore[arg-type]


def test_a_shrink_renumbers_the_machines_left_and_keeps_the_global_batch() -> None:
    r = plan()
    assert (r.old_world, r.new_world, r.old_dp, r.new_dp, r.new_gas) == (4, 2, 2, 1, 8)
    assert [r.new_rank_of(o) for o in range(4)] == [None, None, 0, 1]
    assert r.survivors == [2, 3] and r.lost == [0, 1]
    ds = resized_ds_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "x": 1}, r)
    assert ds == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "train_batch_size": 32, "x": 1}
    shrunk = plan(policy="shrink")
    assert shrunk.new_gas == 4 and resized_ds_config({}, shrunk)["train_batch_size"] == 16
    assert "global batch 32 -> 16 samples" in shrunk.describe()
    assert Resize.from_json(r.to_json()) == r


def test_a_grow_appends_the_machine_and_survivors_keep_their_ranks() -> None:
    r = plan(kind="grow", old_layout=[1], new_layout=[1, 0], old_coords=COORDS[:2], gas=8, partitioned=False)
    assert (r.new_world, r.old_dp, r.new_dp, r.new_gas) == (4, 1, 2, 4)
    assert [r.new_rank_of(o) for o in range(2)] == [0, 1] and r.lost == []
    assert "elastic grow: machine 0 is back" in r.describe()


def test_refusals_name_the_fix() -> None:
    # one rank per machine: a machine holds half a replica
    half = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    with pytest.raises(ResizeRefused, match="not whole data-parallel replicas"):
        plan(old_layout=[0, 1, 2, 3], new_layout=[0, 2, 3], old_coords=half, machine=1)
    with pytest.raises(ResizeRefused, match="elastic.min_data_parallel=2"):
        plan(min_dp=2)
    three = [(0, d, 0) for d in range(3)]  # pp 1 x dp 3 over 3 machines, 3 micro-batches do not split in 2
    with pytest.raises(ResizeRefused, match='set elastic.global_batch to "shrink"'):
        plan(old_layout=[0, 1, 2], new_layout=[0, 1], old_coords=three, gas=1, machine=2)


def test_the_config_section() -> None:
    cfg = swift_config({"strategy": "elastic", "elastic": {"global_batch": "shrink"}})
    assert services_of(cfg).elastic and cfg.elastic.global_batch == "shrink" and cfg.elastic.min_data_parallel == 1
    # The configs written before elastic was a strategy: still served, with a warning naming the new spelling.
    with pytest.warns(FutureWarning, match='write "strategy": "elastic"'):
        old = swift_config({"strategy": "lossy_forward", "elastic": {"enabled": True}})
    assert old.strategy == "elastic" and services_of(old).elastic
    with pytest.raises(ConfigError, match=r"elastic.enabled=true is read only by strategy \['elastic'\]"):
        swift_config({"elastic": {"enabled": True}})
    assert not services_of(swift_config({"strategy": "lossy_forward"})).elastic
    with pytest.raises(ConfigError, match="elastic.global_batch"):
        swift_config({"strategy": "elastic", "elastic": {"global_batch": "half"}})
    with pytest.raises(ConfigError, match="elastic.min_data_parallel"):
        swift_config({"strategy": "elastic", "elastic": {"min_data_parallel": 0}})
