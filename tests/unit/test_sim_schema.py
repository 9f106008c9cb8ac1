"""The simulation YAML: defaults, derived values and errors that name the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ds_swift.config import ConfigError
from ds_swift.sim.schema import load_sim_config, parse_sim_config

BASE: dict[str, Any] = {
    "simulation": {"repeats": 3, "seed": 7},
    "failures": {"model": "uniform", "count": 4},
    "defaults": {"restart_s": 60.0, "load_s": 5.0},
    "workloads": [
        {
            "name": "tiny",
            "total_iterations": 1000,
            "failure_free_hours": 1.0,
            "machines": 4,
            "pipeline": {"stages": 8, "micro_batches": 4},
            "defaults": {"checkpoint_interval": 100, "checkpoint_cost_s": 2.0},
            "strategies": {
                "global_checkpoint": {"kind": "checkpoint"},
                "checkfreq": {"kind": "snapshot", "snapshot_interval": 10, "snapshot_cost_s": 0.5},
                "swift": {"kind": "replication", "undo_s": 0.1, "broadcast_s": 0.2},
                "swift_logging": {"kind": "logging", "logging": {"groups": 2, "parallel_recovery": True}},
            },
        }
    ],
}


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    node: Any = doc
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is _DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return doc


_DELETE = object()


def test_parse_base() -> None:
    cfg = parse_sim_config(BASE)
    assert (cfg.repeats, cfg.seed) == (3, 7)
    (wl,) = cfg.workloads
    assert wl.workload.iteration_time_s == pytest.approx(3.6)
    gc = wl.strategy("global_checkpoint")
    assert (gc.restart_s, gc.load_s, gc.checkpoint_interval, gc.checkpoint_cost_s) == (60.0, 5.0, 100, 2.0)
    # load_s from the defaults is skipped for replication, which does not read it.
    assert wl.strategy("swift").load_s == 0.0
    log = wl.strategy("swift_logging").logging
    assert log is not None and log.groups == (2, 2) and log.parallel_recovery


def test_table5_file_loads() -> None:
    cfg = load_sim_config(Path(__file__).resolve().parents[2] / "configs" / "sim" / "swift_table5.yaml")
    assert [w.workload.name for w in cfg.workloads] == ["Wide-ResNet-50", "ViT-128/32", "BERT-128"]


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("workloads.0.strategies.checkfreq.snapshot_interval", -3, r"strategies\.checkfreq: snapshot_interval=-3"),
        ("workloads.0.strategies.checkfreq.snapshot_interval", _DELETE, "snapshot_interval"),
        (
            "workloads.0.strategies.global_checkpoint.snapshot_interval",
            5,
            r"strategies\.global_checkpoint\.snapshot_interval: is not read by kind checkpoint",
        ),
        ("workloads.0.strategies.global_checkpoint.kind", "magic", r"global_checkpoint\.kind: 'magic'"),
        ("workloads.0.strategies.global_checkpoint.load_sec", 1, "unknown key.*load_sec"),
        ("workloads.0.strategies.global_checkpoint.restart_s", "fast", "restart_s='fast'"),
        ("workloads.0.strategies.global_checkpoint.restart_s", True, "restart_s=True"),
        ("workloads.0.strategies.swift_logging.logging.groups", 9, r"logging\.groups: 9 is invalid: 1\.\.4"),
        ("workloads.0.strategies.swift_logging.logging.groups", [1, 1], "add up"),
        ("workloads.0.strategies.swift_logging.logging.replay_fraction", 0.5, "both set"),
        ("workloads.0.strategies.swift_logging.logging.speedup", 2, r"logging: unknown key\(s\) speedup"),
        ("workloads.0.iteration_time_s", 3.0, "exactly one of iteration_time_s and failure_free_hours"),
        ("workloads.0.failure_free_hours", _DELETE, "exactly one of iteration_time_s and failure_free_hours"),
        ("workloads.0.total_iterations", 0, r"workloads\[0\] \(tiny\)\.total_iterations: 0 is invalid"),
        ("workloads.0.pipeline.stage", 3, r"pipeline: unknown key\(s\) stage"),
        ("workloads.0.strategies", {}, "at least one strategy"),
        ("failures.count", 2.5, r"failures: count=2\.5"),
        ("failures.shape", 2.0, "shape"),
        ("failures", _DELETE, "failures: is required"),
        ("simulation.repeats", 0, r"simulation\.repeats: 0 is invalid"),
        ("sweeps", {"mtbf_hours": [17, -1]}, r"sweeps\.mtbf_hours\[1\]"),
        ("defaults.kind", "checkpoint", r"defaults: unknown key\(s\) kind"),
        ("workloads", [], "non-empty list"),
        ("colour", "blue", r"unknown key\(s\) colour"),
    ],
)
def test_errors_name_the_field(path: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_sim_config(_with(path, value), source="x.yaml")


def test_error_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(_with("simulation.seed", -1)))
    with pytest.raises(ConfigError, match=r"^bad\.yaml: simulation\.seed"):
        load_sim_config(f)
    f.write_text("workloads: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_sim_config(f)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_sim_config(tmp_path / "missing.yaml")


def test_duplicate_workload_names() -> None:
    doc = copy.deepcopy(BASE)
    doc["workloads"].append(copy.deepcopy(doc["workloads"][0]))
    with pytest.raises(ConfigError, match=r"workloads\[1\]\.name: 'tiny' is used twice"):
        parse_sim_config(doc)
