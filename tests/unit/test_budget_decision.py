"""The storage budget at runtime (ds_swift.plan.budget, the engine's logging wiring): measured
message sizes, the budgeted plan every rank computes from them, the error for a budget that cannot
be met, and ``ds-swift plan`` on the DGX configs. No process group."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ds_swift import cli
from ds_swift.config import ConfigError, SwiftConfig
from ds_swift.plan.budget import budget_plan, conservative_plan, describe, needs_measuring
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import MeasuredSizes

ROOT = Path(__file__).resolve().parents[2]
PP4_ON_4 = ParallelLayout(pp=4, gpus_per_node=1)  # one stage per machine: three boundaries
BOUNDARY = 131_568  # bytes one send logs per iteration (act or grad), as measured by the tiny GPT


def config(budget: float | None = 500.0, interval: int = 8, **swift: Any) -> SwiftConfig:
    logging = {"storage_budget_gb": budget} if budget is not None else {}
    return SwiftConfig.from_dict(
        {"machines": {"gpus_per_node": 1}, "logging": logging, "checkpoint": {"interval": interval}, **swift}
    )


def reports(layout: ParallelLayout = PP4_ON_4, nbytes: int = BOUNDARY) -> list[dict[str, Any]]:
    """One report per rank of pp ``layout.pp``: each logs its sends to the neighbouring stages."""
    out = []
    for r in range(layout.pp):
        sends = [[q, nbytes] for q in (r - 1, r + 1) if 0 <= q < layout.pp]
        out.append({"rank": r, "iteration": 0, "sends": sends, "seconds": 0.5 + r / 100, "params": 10**6})
    return out


def measured(nbytes: int = BOUNDARY) -> MeasuredSizes:
    return MeasuredSizes.from_reports(reports(nbytes=nbytes), micro_batches=4)


# ---------------------------------------------------------------------------- measured sizes
def test_measured_sizes_merge_every_ranks_report_the_same_way() -> None:
    m = measured()
    assert m.bytes_of(1, 2) == m.bytes_of(2, 1) == BOUNDARY and m.bytes_of(0, 3) == 0
    assert m.iteration_time_s == 0.53 and m.num_params == 4 * 10**6 and m.micro_batches == 4
    assert m.model_state_bytes == 16 * 4 * 10**6
    shuffled = reports()
    random.Random(0).shuffle(shuffled)
    assert MeasuredSizes.from_reports(shuffled, 4) == m  # gather order does not matter
    assert MeasuredSizes.from_json(json.loads(json.dumps(m.to_json()))) == m  # what the job store holds
    with pytest.raises(ValueError, match="different iterations"):
        MeasuredSizes.from_reports([*reports()[:3], {**reports()[3], "iteration": 1}], 4)


# ---------------------------------------------------------------------------- the plans
def test_before_measuring_every_machine_boundary_is_logged() -> None:
    plan = conservative_plan(PP4_ON_4, config())
    assert plan.groups == [[0], [1], [2], [3]] and len(plan.logged_edges) == 6 and not plan.sized
    assert "storage_budget_gb=500 is applied once the first iteration's messages are measured" in plan.notes[-1]
    assert needs_measuring(config(), plan)
    # without a budget too: each stage's log kind and whether logging pays there are measured (issue 34)
    assert needs_measuring(config(budget=None), conservative_plan(PP4_ON_4, config(budget=None)))
    forced = config(strategy="checkpoint")
    assert not needs_measuring(forced, conservative_plan(PP4_ON_4, forced))


def test_the_budget_groups_machines_and_logs_a_subset_of_the_first_iteration() -> None:
    cfg = config(budget=8 * 2 * BOUNDARY * 1.5 / 1e9)  # room for one boundary (act + grad), not two
    plan = budget_plan(PP4_ON_4, cfg, measured())
    assert plan.groups == [[0, 1], [2, 3]] and plan.grouping_method == "exact"
    assert plan.log_bytes_per_iteration == 2 * BOUNDARY and plan.log_bytes_per_iteration * 8 <= 1.5 * 2 * 8 * BOUNDARY
    assert set(plan.stage_strategy.values()) == {"logging"}
    # whatever the budgeted plan logs, iteration 0 (the conservative plan) logged too
    first = conservative_plan(PP4_ON_4, cfg)
    assert {(e.src_rank, e.dst_rank) for e in plan.logged_edges} < {
        (e.src_rank, e.dst_rank) for e in first.logged_edges
    }
    # every rank computes the same plan from the same gathered figures
    assert budget_plan(PP4_ON_4, cfg, measured()) == plan
    # a generous budget (the README's 500 GB) keeps every boundary
    assert budget_plan(PP4_ON_4, config(), measured()).groups == [[0], [1], [2], [3]]


def test_a_budget_that_cannot_be_met_names_the_field_and_the_smallest_budget() -> None:
    with pytest.raises(ConfigError) as err:
        budget_plan(PP4_ON_4, config(budget=1e-6), measured())
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("swift config: logging.storage_budget_gb=1e-06 cannot be met")
    smallest = float(re.search(r"set logging.storage_budget_gb to at least ([\d.e-]+)", msg).group(1))
    assert smallest == pytest.approx(8 * 2 * BOUNDARY / 1e9, rel=1e-2) and smallest >= 8 * 2 * BOUNDARY / 1e9
    plan = budget_plan(PP4_ON_4, config(budget=smallest), measured())  # the smallest budget works
    assert len(plan.groups) == 2 and plan.logged_edges


def test_not_worth_logging_is_said_with_the_measured_iteration_time() -> None:
    plan = budget_plan(PP4_ON_4, config(), measured())
    lines = describe(plan, config())
    assert lines[0].startswith(
        "logging plan for logging.storage_budget_gb=500 (measured in iteration 0, iteration time 0.53 s)"
    )
    assert (
        "4 group(s) of machines [[0], [1], [2], [3]]" in lines[0]
        and f"{6 * BOUNDARY} bytes logged per iteration" in lines[0]
    )
    assert lines[2].startswith("worth logging: yes") and "iteration time 0.53 s" in lines[2]
    # logs bigger than the model state: auto recovers from checkpoints instead, and says so
    big = budget_plan(PP4_ON_4, config(), MeasuredSizes.from_reports(reports(nbytes=10**8), 4))
    assert set(big.stage_strategy.values()) == {"checkpoint"} and not big.logged_edges
    assert describe(big, config())[2].startswith("worth logging: no: logs of")


# ---------------------------------------------------------------------------- the engine's wiring
class FakeStore:
    def __init__(self) -> None:
        self.kv: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value

    def get(self, key: str) -> str | None:
        return self.kv.get(key)


def test_a_replacement_adopts_the_plan_the_others_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    import ds_swift.protect.message_logging as wiring

    monkeypatch.setattr(wiring.dist, "get_rank", lambda: 0)
    cfg = config(budget=8 * 2 * BOUNDARY * 1.5 / 1e9)
    engine = SimpleNamespace(grid=SimpleNamespace(_topo=PipeModelDataParallelTopology(num_pp=4, num_mp=1, num_dp=1)))
    store = FakeStore()
    logs = wiring.EngineLogging(cfg, {}, lambda i, m: None, 0, "/nonexistent", store=store)
    assert logs.static_plan(engine).groups == [[0], [1], [2], [3]]  # nothing measured yet
    logs.after_iteration(engine, lambda: lambda: None)  # no iteration began: nothing is measured
    store.set(wiring.SIZES_KEY, json.dumps(measured().to_json()))
    plan = logs.static_plan(engine)  # (as when the hooks of a rebuilt engine are installed)
    assert plan.groups == [[0, 1], [2, 3]] and plan.measured == measured()
    store.set(wiring.SIZES_KEY, json.dumps(measured(nbytes=1).to_json()))
    assert logs.static_plan(engine) is plan  # decided once


# ---------------------------------------------------------------------------- configs and the CLI
def test_the_budget_config_is_the_readmes_swift_section() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r'```json\n("swift": \{.*?\n\})\n```', readme, re.S)
    assert block, "the README's example swift section moved"
    ours = json.loads((ROOT / "configs" / "gpt_tiny_pp4_budget.json").read_text())["swift"]
    theirs = json.loads("{" + block.group(1) + "}")["swift"]
    # only what a 2-machine CPU test must change: machine size, paths, the checkpoint interval
    for section, key in (
        ("machines", "gpus_per_node"),
        ("logging", "storage"),
        ("checkpoint", "dir"),
        ("checkpoint", "interval"),
    ):
        ours[section].pop(key), theirs[section].pop(key)
    # and the tests' digests at every iteration (the default, 10, would leave some recoveries unverified)
    assert ours.pop("verify") == {"digest_interval": 1}
    assert ours == theirs


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "dgx").glob("*.json")), ids=lambda p: p.name)
def test_plan_on_the_dgx_configs_shows_the_strategy_per_stage(
    path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("ds_swift.plan.cli",))
    assert cli.main(["plan", "--deepspeed-config", str(path), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    stages = json.loads(path.read_text())["pipeline"]["stages"]
    assert [s["stage"] for s in js["stages"]] == list(range(stages))
    assert all(s["strategy"] in ("replication", "logging", "checkpoint") for s in js["stages"])
    budget = SwiftConfig.from_ds_config(path).logging.storage_budget_gb
    if budget is not None:
        assert any(f"storage_budget_gb={budget:g} not applied" in n for n in js["notes"]), js["notes"]
    # with the model shape the README gives, the budget is applied
    assert cli.main(["plan", "--deepspeed-config", str(path), "--hidden", "2048", "--seq-len", "2048", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["grouping"]["method"] == ("exact" if budget is not None else "every-machine")
