"""Topology analyzer: layouts and the DeepSpeed / megatron-core conversions (its plans and their bytes:
tests/unit/test_topology_plans.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.config import ConfigError
from ds_swift.plan.analysis import analyze
from ds_swift.plan.layout import (
    Coord,
    ParallelLayout,
    infer_rank_order,
    layout_from_deepspeed_topology,
    layout_from_parallel_state,
)
from ds_swift.plan.sizes import ModelShape

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "dp", "pp"))]
BERT = ModelShape(hidden=1024, seq_len=128, micro_batch_size=128, micro_batches=4, dtype="fp32")


# ---------------------------------------------------------------------------- layout
def test_default_order_is_megatrons_tp_dp_pp() -> None:
    lay = ParallelLayout(tp=2, pp=4, dp=2, gpus_per_node=8)
    assert lay.world_size == 16 and lay.num_machines == 2
    assert lay.rank(tp=1, dp=1, pp=2) == 1 + 1 * 2 + 2 * 4
    assert lay.coords(11) == Coord(tp=1, pp=2, dp=1)
    assert lay.stage_ranks(1) == [4, 5, 6, 7]
    assert lay.dp_peers(5) == [7]
    assert [lay.machine_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert lay.machine_ranks(1) == list(range(8, 16))


@settings(max_examples=60, deadline=None)
@given(
    tp=st.integers(1, 4),
    pp=st.integers(1, 5),
    dp=st.integers(1, 4),
    order=st.sampled_from(ORDERS),
)
def test_rank_and_coords_are_inverse(tp: int, pp: int, dp: int, order: str) -> None:
    lay = ParallelLayout(tp=tp, pp=pp, dp=dp, gpus_per_node=tp * pp * dp, order=order)
    seen = set()
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert lay.rank(tp=c.tp, pp=c.pp, dp=c.dp) == r
        seen.add(c)
    assert len(seen) == lay.world_size
    # the first token varies fastest
    first = order.split("-")[0]
    size = {"tp": tp, "pp": pp, "dp": dp}[first]
    if size > 1:
        assert getattr(lay.coords(1), first) == 1


def test_layout_matches_megatron_rank_generator() -> None:
    from megatron.core.parallel_state import RankGenerator

    for order in ORDERS:
        for tp, pp, dp in [(2, 4, 2), (1, 3, 2), (4, 2, 1), (2, 2, 3)]:
            lay = ParallelLayout(tp=tp, pp=pp, dp=dp, gpus_per_node=tp * pp * dp, order=order)
            gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
            for axis in ("tp", "pp", "dp"):
                for group in gen.get_ranks(axis):
                    c = lay.coords(group[0])
                    mine = [lay.rank(**{**c._asdict(), axis: i}) for i in range({"tp": tp, "pp": pp, "dp": dp}[axis])]
                    assert mine == group, (order, axis)


def test_megatron_default_order_with_cp_and_ep_tokens() -> None:
    a = ParallelLayout(tp=2, pp=2, dp=2, order="tp-cp-ep-dp-pp")
    b = ParallelLayout(tp=2, pp=2, dp=2, order="tp-dp-pp")
    assert [a.coords(r) for r in range(8)] == [b.coords(r) for r in range(8)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tp": 0}, "tp="),
        ({"pp": -1}, "pp="),
        ({"dp": 1.5}, "dp="),
        ({"gpus_per_node": 0}, "gpus_per_node="),
        ({"tp": True}, "tp="),
        ({"order": "tp-xx-pp"}, "order="),
        ({"order": "tp-tp-pp"}, "order="),
        ({"order": "tp-pp", "dp": 2}, "order="),
        ({"tp": 3, "pp": 2, "gpus_per_node": 4}, "gpus_per_node=4"),
    ],
)
def test_bad_layouts_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelLayout(**kwargs)
    msg = str(err.value)
    assert field in msg and "\n" not in msg


def test_partial_single_machine_is_allowed() -> None:
    lay = ParallelLayout(pp=4, gpus_per_node=8)
    assert lay.num_machines == 1
    plan = analyze(lay, BERT)
    assert set(plan.stage_strategy.values()) == {"checkpoint"} and plan.log_bytes_per_iteration == 0


# ---------------------------------------------------------------------------- DeepSpeed topology
def test_deepspeed_topologies_convert_rank_for_rank() -> None:
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

    topos = [
        PipeModelDataParallelTopology(num_pp=4, num_mp=2, num_dp=2),
        PipeDataParallelTopology(num_pp=4, num_dp=2),
        ProcessTopology(axes=["data", "pipe"], dims=[2, 4]),
        ProcessTopology(axes=["data", "pipe", "model"], dims=[2, 2, 2]),
        ProcessTopology(axes=["pipe"], dims=[3]),
    ]
    for topo in topos:
        lay = layout_from_deepspeed_topology(topo, gpus_per_node=topo.world_size())
        for r in range(topo.world_size()):
            c = topo.get_coord(r)
            assert lay.coords(r) == Coord(tp=getattr(c, "model", 0), pp=c.pipe, dp=getattr(c, "data", 0)), topo.axes


def test_deepspeed_pipe_outer_is_megatron_default_and_data_outer_spreads_replicas() -> None:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, ProcessTopology

    lay = layout_from_deepspeed_topology(PipeModelDataParallelTopology(num_pp=4, num_mp=2, num_dp=2), 8)
    assert lay.axes == ("tp", "dp", "pp")
    assert set(analyze(lay).stage_strategy.values()) == {"logging"}
    spread = layout_from_deepspeed_topology(ProcessTopology(axes=["data", "pipe", "model"], dims=[2, 4, 2]), 8)
    assert set(analyze(spread).stage_strategy.values()) == {"replication"}


def test_deepspeed_unknown_axis_is_refused() -> None:
    from deepspeed.runtime.pipe.topology import ProcessTopology

    with pytest.raises(ConfigError, match="'sequence'"):
        layout_from_deepspeed_topology(ProcessTopology(axes=["pipe", "sequence"], dims=[2, 2]), 8)
    # a size-1 extra axis is harmless
    lay = layout_from_deepspeed_topology(ProcessTopology(axes=["pipe", "sequence", "data"], dims=[2, 1, 2]), 8)
    assert (lay.pp, lay.dp) == (2, 2)


# ---------------------------------------------------------------------------- megatron parallel_state
@pytest.mark.parametrize("order", ORDERS)
def test_infer_rank_order_from_one_ranks_groups(order: str) -> None:
    from megatron.core.parallel_state import RankGenerator

    tp, pp, dp = 2, 3, 2
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    groups = {axis: gen.get_ranks(axis) for axis in ("tp", "pp", "dp")}
    truth = ParallelLayout(tp=tp, pp=pp, dp=dp, gpus_per_node=12, order=order)
    for rank in range(tp * pp * dp):
        mine = {axis: next(g for g in groups[axis] if rank in g) for axis in groups}
        inferred = ParallelLayout(tp=tp, pp=pp, dp=dp, gpus_per_node=12, order=infer_rank_order(rank, tp, pp, dp, mine))
        assert [inferred.coords(r) for r in range(12)] == [truth.coords(r) for r in range(12)]


def test_infer_rank_order_rejects_groups_of_no_order() -> None:
    with pytest.raises(ConfigError, match="match no rank order"):
        infer_rank_order(0, 2, 2, 1, {"tp": [0, 3], "pp": [0, 1], "dp": [0]})


class _FakeParallelState:
    """The parts of megatron-core's parallel_state the planner reads, for a world of 12."""

    def __init__(self, order: str, rank: int) -> None:
        from megatron.core.parallel_state import RankGenerator

        self.sizes = {"tp": 2, "pp": 3, "dp": 2}
        gen = RankGenerator(tp=2, ep=1, dp=2, pp=3, cp=1, order=order)
        self.mine = {a: next(g for g in gen.get_ranks(a) if rank in g) for a in self.sizes}

    def model_parallel_is_initialized(self) -> bool:
        return True

    def get_context_parallel_world_size(self) -> int:
        return 1

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.sizes["tp"]

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.sizes["pp"]

    def get_data_parallel_world_size(self) -> int:
        return self.sizes["dp"]

    def get_tensor_model_parallel_group(self) -> str:
        return "tp"

    def get_pipeline_model_parallel_group(self) -> str:
        return "pp"

    def get_data_parallel_group(self) -> str:
        return "dp"


def test_layout_from_a_twelve_rank_parallel_state(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    rank = 7
    fake = _FakeParallelState("tp-pp-dp", rank)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: 12)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: fake.mine[group])
    lay = layout_from_parallel_state(gpus_per_node=4, parallel_state=fake)
    assert lay == ParallelLayout(tp=2, pp=3, dp=2, gpus_per_node=4, order="tp-pp-dp")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="gpus_per_node"):
        layout_from_parallel_state(parallel_state=fake)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    assert layout_from_parallel_state(parallel_state=fake).gpus_per_node == 6


def test_layout_from_real_parallel_state_world_of_one() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    assert not dist.is_initialized(), "another test left a process group behind"
    ps.destroy_model_parallel()  # megatron-core's globals as a fresh process has them, whatever ran before here
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="not initialised"):
            layout_from_parallel_state(gpus_per_node=8)
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        lay = layout_from_parallel_state(gpus_per_node=8)
        assert (lay.tp, lay.pp, lay.dp, lay.world_size, lay.num_machines) == (1, 1, 1, 1, 1)
        assert analyze(lay).stage_strategy == {0: "checkpoint"}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
