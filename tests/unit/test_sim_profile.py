"""Bench profiles (ds_swift/sim/profile.py): loading errors, the row -> cost-model conversion,
the ranking the example profile gives, and ``ds-swift simulate FILE --profile BENCH.json``."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from ds_swift.config import ConfigError
from ds_swift.sim import cli
from ds_swift.sim.model import Workload, failure_costs_s, failure_free_s
from ds_swift.sim.profile import BenchProfile, apply_profile, load_profile, parse_profile, strategy_from_row
from ds_swift.sim.schema import parse_sim_config

PROFILE = Path(__file__).resolve().parents[2] / "configs" / "sim" / "example_bench_profile.json"
RAW: dict[str, Any] = json.loads(PROFILE.read_text())

# A job that fails often (20 failures in ~11 h), so recovery and failure-free costs both count.
SIM: dict[str, Any] = {
    "simulation": {"repeats": 10, "seed": 0},
    "failures": {"model": "uniform", "count": 20},
    "workloads": [
        {
            "name": "job",
            "total_iterations": 20000,
            "iteration_time_s": 2.0,
            "strategies": {
                "global_checkpoint": {
                    "kind": "checkpoint",
                    "checkpoint_interval": 500,
                    "checkpoint_cost_s": 30.0,
                    "restart_s": 60.0,
                    "load_s": 10.0,
                },
                "hand_set": {"kind": "replication", "restart_s": 60.0},
            },
        }
    ],
}


@pytest.fixture
def profile() -> BenchProfile:
    return load_profile(PROFILE)


def _row(profile: BenchProfile, name: str) -> Any:
    row = profile.row(name)
    assert row is not None
    return row


_DELETE = object()


def _mutated(path: str, value: Any, row: int | None = None) -> dict[str, Any]:
    doc = copy.deepcopy(RAW)
    target = doc if row is None else doc["strategies"][row]
    if value is _DELETE:
        del target[path]
    else:
        target[path] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "must hold a JSON object with a 'strategies' list"),
        (_mutated("iteration_time_s", _DELETE), "iteration_time_s is required"),
        (_mutated("version", 2), "version=2 is invalid: this ds-swift reads version 1"),
        (_mutated("iteration_time_s", 0), "iteration_time_s=0 is invalid: a positive number"),
        (_mutated("checkpoint_interval", 0), "checkpoint_interval=0 is invalid: a positive integer or null"),
        (_mutated("checkpoint_cost_s", float("nan")), "checkpoint_cost_s=nan is invalid"),
        (_mutated("strategies", []), "strategies must be a non-empty list"),
        (_mutated("recovery_sec", 1.0, row=0), "strategies[0] (global_checkpoint): unknown key(s) recovery_sec;"),
        (_mutated("init_s", _DELETE, row=1), "strategies[1] (checkfreq): init_s is required"),
        (_mutated("name", "auto", row=2), "strategies[2] (auto): kind=None is invalid: needed for strategy 'auto'"),
        (_mutated("kind", "rollback", row=2), "kind='rollback' is invalid: one of checkpoint, snapshot"),
        (_mutated("throughput_ratio", 1.2, row=0), "throughput_ratio=1.2 is invalid: the strategy's throughput over"),
        (_mutated("throughput_ratio", True, row=0), "throughput_ratio=True is invalid"),
        (_mutated("iterations_lost", 3, row=2), "iterations_lost=3 is invalid: 0 for kind replication"),
        (_mutated("iterations_lost", 0, row=3), "iterations_lost=0 is invalid: > 0 for kind logging"),
        (_mutated("snapshot_interval", _DELETE, row=1), "snapshot_interval=None is invalid: required for kind snap"),
        (_mutated("snapshot_interval", 5, row=0), "snapshot_interval/snapshot_cost_s are only read by kind snapshot"),
        (_mutated("restore_s", 9.0, row=3), "restore_s=9.0 is invalid: at most recovery_s=8.0"),
        (_mutated("max_ulp", 3, row=0), "max_ulp=3 is invalid: 0 or null when exact is true"),
        (_mutated("exact", "yes", row=0), "exact='yes' is invalid: true or false"),
        (_mutated("name", "tranlogs", row=3), "strategies[4].name='tranlogs' is used twice"),
    ],
)
def test_load_errors_are_one_line_naming_the_field(doc: Any, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_profile(doc, source="bench.json")
    text = str(exc.value)
    assert text.startswith("bench.json: ") and "\n" not in text
    assert message in text, text


def test_load_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_profile(bad)


def test_nulls_and_inheritance(profile: BenchProfile) -> None:
    gc, checkfreq = _row(profile, "global_checkpoint"), _row(profile, "checkfreq")
    assert (gc.kind, gc.checkpoint_interval, gc.checkpoint_cost_s) == ("checkpoint", 50, 2.0)
    assert (checkfreq.kind, checkfreq.checkpoint_interval) == ("snapshot", None)  # null: took none
    assert _row(profile, "tranlogs").kind == "logging"
    doc = _mutated("max_ulp", None, row=0)
    assert parse_profile(doc).strategies[0].max_ulp is None


def test_conversion_of_each_kind(profile: BenchProfile) -> None:
    gc = strategy_from_row(_row(profile, "global_checkpoint"), profile)
    overhead = 1 / 0.925 - 1 - 2.0 / (50 * 0.5)  # the bench's checkpoint stalls are taken out
    assert gc.iteration_overhead == pytest.approx(overhead)
    assert (gc.restart_s, gc.checkpoint_interval, gc.checkpoint_cost_s) == (20.0, 50, 2.0)
    assert gc.load_s == pytest.approx(15.5 - 25 * 0.5 * (1 + overhead))
    checkfreq = strategy_from_row(_row(profile, "checkfreq"), profile)
    assert (checkfreq.checkpoint_interval, checkfreq.snapshot_interval, checkfreq.snapshot_cost_s) == (None, 5, 0.2)
    assert checkfreq.iteration_overhead == pytest.approx(1 / 0.9245 - 1 - 0.2 / (5 * 0.5))
    replication = strategy_from_row(_row(profile, "replication"), profile)
    assert (replication.kind, replication.broadcast_s, replication.fixed_s) == ("replication", 1.5, 21.5)
    logging = strategy_from_row(_row(profile, "logging"), profile)
    assert logging.logging is not None and not logging.logging.parallel_recovery
    assert logging.load_s == 2.0
    assert logging.logging.replay_fraction == pytest.approx(6.0 / (25 * 0.5 * (1 + logging.iteration_overhead)))


def test_an_elastic_row_takes_the_measured_speed_and_the_yamls_repair_policy(profile: BenchProfile) -> None:
    doc = copy.deepcopy(RAW)
    doc["strategies"].append(
        {
            **doc["strategies"][0],
            "name": "lossy_forward_elastic",
            "kind": "elastic",
            "shrunk_throughput": 0.6,
            "recovery_s": 0.7,
            "exact": False,
            "max_ulp": None,
        }
    )
    elastic_profile = parse_profile(doc)
    row = _row(elastic_profile, "lossy_forward_elastic")
    spec = strategy_from_row(row, elastic_profile)
    assert (spec.kind, spec.shrunk_throughput, spec.broadcast_s, spec.repair_s) == ("elastic", 0.6, 0.7, None)
    from ds_swift.sim.model import StrategySpec

    base = StrategySpec("lossy_forward_elastic", "elastic", repair_s=3600.0, grow_s=40.0)
    spec = strategy_from_row(row, elastic_profile, base=base)
    assert (spec.repair_s, spec.grow_s, spec.shrunk_throughput) == (3600.0, 40.0, 0.6)
    bad = copy.deepcopy(doc)
    del bad["strategies"][-1]["shrunk_throughput"]
    with pytest.raises(ConfigError, match="shrunk_throughput=None is invalid: a fraction in"):
        parse_profile(bad)
    bad["strategies"][-1].update(kind="replication", shrunk_throughput=0.5, iterations_lost=0)
    with pytest.raises(ConfigError, match="shrunk_throughput is only read by kind elastic"):
        parse_profile(bad)


@pytest.mark.parametrize("name", ["global_checkpoint", "checkfreq", "replication", "logging", "tranlogs"])
def test_simulating_the_bench_job_gives_back_what_was_measured(profile: BenchProfile, name: str) -> None:
    """On the bench's own job, the model reproduces the measured kill -> back time and the
    failure-free throughput ratio: the conversion loses nothing."""
    row = _row(profile, name)
    spec = strategy_from_row(row, profile)
    job = Workload(name="bench", total_iterations=1000, iteration_time_s=profile.iteration_time_s)
    restore = 0 if row.checkpoint_interval is None else row.checkpoint_interval
    if row.snapshot_interval is not None:
        restore = 10 * row.snapshot_interval
    position = (restore + row.iterations_lost) / job.total_iterations  # no in-flight part
    cost = failure_costs_s(job, spec, np.array([position]), np.array([0.0]))[0]
    assert cost == pytest.approx(row.init_s + row.recovery_s)
    ratio = job.total_iterations * job.iteration_time_s / failure_free_s(job, spec)
    assert ratio == pytest.approx(row.throughput_ratio)


def test_apply_keeps_yaml_intervals_and_adds_profile_strategies(profile: BenchProfile) -> None:
    cfg = apply_profile(parse_sim_config(SIM), profile)
    (wl,) = cfg.workloads
    names = [s.name for s in wl.strategies]
    assert names == ["global_checkpoint", "hand_set", "checkfreq", "replication", "logging", "tranlogs"]
    gc = wl.strategy("global_checkpoint")
    assert (gc.checkpoint_interval, gc.checkpoint_cost_s, gc.restart_s) == (500, 2.0, 20.0)  # costs measured
    assert wl.strategy("hand_set").restart_s == 60.0  # not in the profile: as the YAML says
    # Added strategies follow the job's checkpoint policy, not the bench's 50 iterations.
    assert wl.strategy("replication").checkpoint_interval == 500
    assert wl.strategy("checkfreq").checkpoint_interval is None
    assert wl.strategy("checkfreq").snapshot_interval == 5


def test_kind_mismatch_with_the_yaml_is_an_error(profile: BenchProfile) -> None:
    sim = copy.deepcopy(SIM)
    sim["workloads"][0]["strategies"]["replication"] = {"kind": "logging", "logging": {"replay_fraction": 0.5}}
    with pytest.raises(ConfigError, match="'replication' is kind replication in the profile but logging in the YAML"):
        apply_profile(parse_sim_config(sim), profile)


@pytest.fixture
def sim_file(tmp_path: Path) -> Path:
    path = tmp_path / "sim.yaml"
    path.write_text(yaml.safe_dump(SIM, sort_keys=False))
    return path


def test_cli_profile_gives_the_expected_ranking(sim_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(sim_file), "--profile", str(PROFILE), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["job"]
    measured = {k: v for k, v in row.items() if k != "hand_set"}
    # Replication: 1 % slower, nothing replayed. CheckFreq: a 0.2 s snapshot every 5 iterations.
    # TranLogs replays at 0.15 of an iteration against SWIFT logging's 0.47, but is 1.3 % slower
    # while nothing fails; the global checkpoint loses 250 iterations per failure.
    assert sorted(measured, key=measured.__getitem__) == [
        "replication",
        "checkfreq",
        "tranlogs",
        "logging",
        "global_checkpoint",
    ]
    assert cli.main([str(sim_file), "--json"]) == 0  # without the profile: the YAML's costs
    assert json.loads(capsys.readouterr().out)["job"]["global_checkpoint"] != row["global_checkpoint"]


def test_cli_table_names_the_profile(sim_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([str(sim_file), "--profile", str(PROFILE), "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert f"costs measured in {PROFILE}" in out and "tranlogs" in out


def test_cli_bad_profile_is_one_line(sim_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps(_mutated("init_s", -1, row=4)))
    assert cli.main([str(sim_file), "--profile", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "bench.json: strategies[4] (tranlogs): init_s=-1 is invalid: a number >= 0 (seconds)" in err
