"""The bench's and the simulator's strategy names come from the registry (issue 31, item 1's
acceptance): a new strategy, and a bench variant it declares, need no edit in ds_swift/bench or
ds_swift/sim."""

from __future__ import annotations

import pytest

from ds_swift.bench.variants import bench_strategies, has_spare, strategy_overrides
from ds_swift.recovery import registry
from ds_swift.recovery.base import BenchVariant
from ds_swift.recovery.registry import strategy_names
from ds_swift.recovery.services import StrategyServices
from ds_swift.sim.profile_rows import default_kind
from ds_swift.testing.stub_strategy import StubStrategy


class _NewStrategy(StubStrategy):
    name = "brand_new"
    SERVICES = StrategyServices(sim_kind="logging")
    BENCH_VARIANTS = {"brand_new_shrunk": BenchVariant({"brand_new": {"fast": True}}, spare=False)}


def test_the_registered_strategies_declare_the_bench_variants() -> None:
    names = bench_strategies()
    assert names[: len(strategy_names())] == strategy_names()
    variants = {
        "logging_parallel",
        "logging_sequential",
        "logging_mix",
        "pipechurn_full",
        "pipechurn_partial",
        "lossy_forward_elastic",
    }
    assert set(names[len(strategy_names()) :]) == variants
    assert strategy_overrides("pipechurn_partial", 8) == {
        "strategy": "pipechurn",
        "pipechurn": {"partial_recompute": True},
        "checkpoint": {"interval": 8},
    }
    assert strategy_overrides("lossy_forward_elastic", 4) == {"strategy": "elastic", "checkpoint": {"interval": 4}}
    assert not has_spare("lossy_forward_elastic") and has_spare("elastic") and has_spare("logging_parallel")
    with pytest.raises(Exception, match="unknown strategy 'nope'; choose from auto, .*pipechurn_partial"):
        strategy_overrides("nope", 8)


def test_the_simulator_s_default_kind_is_the_strategy_s_sim_kind() -> None:
    kinds = {
        n: default_kind(n)
        for n in (
            "global_checkpoint",
            "checkfreq",
            "replication",
            "logging",
            "tranlogs",
            "logging_mix",
            "elastic_horovod",
            "lossy_forward_elastic",
            "auto",
        )
    }
    assert kinds == {
        "global_checkpoint": "checkpoint",
        "checkfreq": "snapshot",
        "replication": "replication",
        "logging": "logging",
        "tranlogs": "logging",
        "logging_mix": "logging",
        "elastic_horovod": "snapshot",
        "lossy_forward_elastic": "elastic",
        "auto": None,
    }


def test_a_new_strategy_needs_no_edit_in_bench_or_sim(monkeypatch: pytest.MonkeyPatch) -> None:
    grown = registry.strategies().copy()
    grown.register(_NewStrategy())
    monkeypatch.setattr(registry, "STRATEGIES", grown)
    assert {"brand_new", "brand_new_shrunk"} <= set(bench_strategies())
    assert strategy_overrides("brand_new_shrunk", 3) == {
        "strategy": "brand_new",
        "brand_new": {"fast": True},
        "checkpoint": {"interval": 3},
    }
    assert strategy_overrides("brand_new", 3) == {"strategy": "brand_new", "checkpoint": {"interval": 3}}
    assert not has_spare("brand_new_shrunk")
    assert default_kind("brand_new") == default_kind("brand_new_shrunk") == "logging"
