"""`ds-swift simulate`: table, --json, --json-full, --recommend, --plot, errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from ds_swift.sim import cli

CONFIG = {
    "failures": {"model": "exponential", "mtbf_hours": 2.0},
    "simulation": {"repeats": 4},
    "sweeps": {"interval_points": 6, "mtbf_hours": [1, 4]},
    "workloads": [
        {
            "name": "small",
            "total_iterations": 2000,
            "iteration_time_s": 10.0,
            "defaults": {"checkpoint_interval": 200, "checkpoint_cost_s": 5.0, "restart_s": 30.0},
            "strategies": {
                "global_checkpoint": {"kind": "checkpoint"},
                "checkfreq": {"kind": "snapshot", "snapshot_interval": 20, "snapshot_cost_s": 1.0},
                "elastic_horovod": {"kind": "snapshot", "snapshot_interval": 20, "snapshot_cost_s": 0.8},
                "swift": {"kind": "replication", "broadcast_s": 1.0},
            },
        },
        {
            "name": "other",
            "total_iterations": 500,
            "iteration_time_s": 4.0,
            "failures": {"model": "uniform", "count": 3},
            "strategies": {"global_checkpoint": {"kind": "checkpoint", "checkpoint_interval": 50}},
        },
    ],
}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(CONFIG, sort_keys=False))
    return path


def test_register_adds_simulate() -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "x.yaml", "--json"])
    assert args.func is cli.run and args.json and args.config == "x.yaml"


def test_json(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["small", "other"]
    assert list(out["small"]) == ["global_checkpoint", "checkfreq", "elastic_horovod", "swift"]
    assert out["small"]["swift"] < out["small"]["global_checkpoint"]


def test_json_full_with_recommendations(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(config), "--json-full", "--recommend", "--workload", "small", "--repeats", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    gc = out["small"]["global_checkpoint"]
    assert gc["speedup_vs_global_checkpoint"] == 1.0
    assert gc["ci95_hours"][0] <= gc["mean_hours"] <= gc["ci95_hours"][1]
    assert gc["recommendation"]["field"] == "checkpoint_interval" and gc["recommendation"]["optimal"] >= 1
    assert out["small"]["swift"]["recommendation"]["optimal"] is None


def test_table_and_plots(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outdir = tmp_path / "plots"
    assert cli.main([str(config), "--plot", str(outdir), "--repeats", "2"]) == 0
    text = capsys.readouterr().out
    assert "global_checkpoint" in text and "elastic_horovod" in text and "speed-up" in text
    for name in ("interval_sweep.png", "mtbf_sweep.png"):
        data = (outdir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bad_config_is_one_line_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = yaml.safe_load(yaml.safe_dump(CONFIG))
    bad["workloads"][0]["strategies"]["checkfreq"]["snapshot_interval"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert cli.main([str(path), "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "bad.yaml: workloads[0] (small).strategies.checkfreq: snapshot_interval=0" in err
    assert cli.main([str(path.with_name("nope.yaml"))]) == 2


def test_unknown_workload(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(config), "--workload", "nope"]) == 2
    assert "--workload 'nope'" in capsys.readouterr().err


def test_example_weibull_config_runs(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[2] / "configs" / "sim" / "example_gpt_weibull.yaml"
    assert cli.main([str(example), "--json", "--repeats", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["gpt-32-machines"]
    assert set(row) == {"global_checkpoint", "swift", "swift_one_group_per_machine", "elastic_shrink"}
    assert all(h > 200000 * 2.5 / 3600 for h in row.values())


def test_package_facade() -> None:
    import ds_swift.sim as sim
    from ds_swift.sim.plan_recommend import recommend_for_plan

    assert sim.recommend_for_plan is recommend_for_plan
    with pytest.raises(AttributeError):
        _ = sim.no_such_name
