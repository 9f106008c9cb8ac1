"""``ds-swift simulate`` with a fitted scale model (ds_swift.sim.scale_model): the restart cost of
each workload comes from the model at its number of ranks, not from one constant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_swift.config import ConfigError
from ds_swift.sim.scale_model import Phase, Poly, ScaleModel
from ds_swift.sim.schema import parse_sim_config


def model(tmp_path: Path) -> Path:
    linear = ScaleModel(
        (
            Phase("join", Poly((0.0, 30.0)), Poly((0.0, 1e3)), round_trips=4, fixed_s=1.0),
            Phase("rounds", Poly((0.0, 25.0)), Poly((0.0, 1e4)), round_trips=24),
            Phase("state", fixed_s=0.5),
        ),
        server_requests_per_s=1e5,
        server_bytes_per_s=1e9,
        initialization=("join", "rounds"),
    )
    path = tmp_path / "scale_model.json"
    path.write_text(linear.to_json())
    return path


def config(ranks: int | None, scale_model: str | None, restart_s: float | None = None) -> dict[str, object]:
    workload: dict[str, object] = {
        "name": "gpt",
        "total_iterations": 1000,
        "iteration_time_s": 1.0,
        "strategies": {"swift": {"kind": "replication"}},
    }
    if ranks is not None:
        workload["ranks"] = ranks
    if restart_s is not None:
        workload["strategies"] = {"swift": {"kind": "replication", "restart_s": restart_s}}
    doc: dict[str, object] = {"failures": {"count": 2}, "defaults": {"restart_s": 99.0}, "workloads": [workload]}
    if scale_model is not None:
        doc["scale_model"] = scale_model
    return doc


def test_the_restart_cost_grows_with_the_ranks(tmp_path: Path) -> None:
    path = str(model(tmp_path))
    small = parse_sim_config(config(1024, path)).workloads[0].strategies[0].restart_s
    large = parse_sim_config(config(16384, path)).workloads[0].strategies[0].restart_s
    # join: 1 s + 30 N requests at 1e5/s (+ bytes); rounds: 25 N requests: the state's 0.5 s is not in it
    assert small == pytest.approx(1.0 + 55 * 1024 / 1e5 + 11e3 * 1024 / 1e9)
    assert large == pytest.approx(1.0 + 55 * 16384 / 1e5 + 11e3 * 16384 / 1e9)
    assert parse_sim_config(config(1024, None)).workloads[0].strategies[0].restart_s == 99.0  # no model: the constant


def test_a_strategys_own_restart_cost_wins_and_the_ranks_are_required(tmp_path: Path) -> None:
    path = str(model(tmp_path))
    assert parse_sim_config(config(1024, path, restart_s=7.0)).workloads[0].strategies[0].restart_s == 7.0
    with pytest.raises(ConfigError, match=r"ranks: is required with scale_model"):
        parse_sim_config(config(None, path))
    with pytest.raises(ConfigError, match="scale_model"):
        parse_sim_config(config(1024, str(tmp_path / "missing.json")))


def test_the_model_round_trips_through_json(tmp_path: Path) -> None:
    doc = json.loads(model(tmp_path).read_text())
    again = ScaleModel.from_dict(doc)
    assert again.initialization_s(4096) == pytest.approx(ScaleModel.from_dict(doc).initialization_s(4096))
    assert Poly.fit({16: 100.0, 64: 400.0, 256: 1600.0}).order == 1  # a line stays a line
    assert Poly.fit({16: 256.0, 64: 4096.0, 256: 65536.0}).order == 2
