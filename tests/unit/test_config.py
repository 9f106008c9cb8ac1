"""The ``swift`` config section: defaults, every bad value, unknown keys, one-line messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.config import STORAGE_SCHEMES, ConfigError, SwiftConfig, load_ds_config
from ds_swift.testing.configs import swift_config


def error_of(section: Any) -> str:
    with pytest.raises(ConfigError) as err:
        swift_config(section)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_defaults() -> None:
    cfg = swift_config(None)
    assert cfg == swift_config({}) == SwiftConfig()
    assert cfg.enabled is False and cfg.strategy == "auto"
    assert cfg.machines.gpus_per_node == 8 and cfg.machines.rank_order == "tp-dp-pp"
    assert cfg.logging.chunk_iterations == 5 and cfg.logging.bubble_only is True
    assert cfg.logging.groups is None and cfg.logging.storage_budget_gb is None
    assert cfg.checkpoint.interval == 1000 and cfg.parallel_recovery is False
    assert cfg.verify.enabled is True and cfg.verify.digest_interval == 10


def test_the_design_doc_example_parses() -> None:
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "swift": {
            "enabled": True,
            "machines": {"gpus_per_node": 8},
            "strategy": "auto",
            "logging": {
                "storage": "file:///lustre/job42/swift-logs",
                "storage_budget_gb": 500,
                "chunk_iterations": 5,
                "bubble_only": True,
            },
            "parallel_recovery": True,
            "checkpoint": {"dir": "/lustre/job42/ckpt", "interval": 1000},
        },
    }
    cfg = SwiftConfig.from_ds_config(ds)
    assert cfg.enabled and cfg.parallel_recovery and cfg.logging.storage_budget_gb == 500
    assert cfg.checkpoint.dir == "/lustre/job42/ckpt"


def test_from_ds_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"swift": {"enabled": True, "checkpoint": {"interval": 7}}}))
    assert SwiftConfig.from_ds_config(path).checkpoint.interval == 7
    assert SwiftConfig.from_ds_config(str(path)).enabled is True
    assert load_ds_config(path)["swift"]["enabled"] is True


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("{oops", "not valid JSON"), ("[1, 2]", "JSON object at its top level")],
)
def test_bad_files_are_one_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        SwiftConfig.from_ds_config(path)
    assert fragment in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        SwiftConfig.from_ds_config(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="cannot be read"):
        SwiftConfig.from_ds_config(tmp_path)  # a directory


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"enabled": "yes"}, "enabled='yes'"),
        ({"enabled": 1}, "enabled=1"),
        ({"strategy": "fast"}, "strategy='fast'"),
        ({"parallel_recovery": "true"}, "parallel_recovery='true'"),
        ({"parallel_recovery_mode": "slow"}, "parallel_recovery_mode='slow'"),
        ({"parallel_recovery_force": "yes"}, "parallel_recovery_force='yes'"),
        ({"parallel_recovery_force": True}, "parallel_recovery_force=true forces parallel recovery, which is off"),
        ({"run_dir": 3}, "run_dir=3"),
        ({"machines": {"gpus_per_node": 0}}, "machines.gpus_per_node=0"),
        ({"machines": {"gpus_per_node": 8.0}}, "machines.gpus_per_node=8.0"),
        ({"machines": {"gpus_per_node": True}}, "machines.gpus_per_node=True"),
        ({"machines": {"rank_order": "tp-dp"}}, "machines.rank_order='tp-dp'"),
        ({"machines": {"rank_order": "tp-dp-pp-pp"}}, "machines.rank_order="),
        ({"logging": {"storage": "ftp://x/y"}}, "logging.storage='ftp://x/y'"),
        ({"logging": {"storage": 5}}, "logging.storage=5"),
        ({"logging": {"storage_budget_gb": 0}}, "logging.storage_budget_gb=0"),
        ({"logging": {"storage_budget_gb": -3.5}}, "logging.storage_budget_gb=-3.5"),
        ({"logging": {"storage_budget_gb": "10"}}, "logging.storage_budget_gb='10'"),
        ({"logging": {"groups": 0}}, "logging.groups=0"),
        ({"logging": {"groups": 2.5}}, "logging.groups=2.5"),
        ({"logging": {"chunk_iterations": 0}}, "logging.chunk_iterations=0"),
        ({"logging": {"bubble_only": "no"}}, "logging.bubble_only='no'"),
        ({"logging": {"local_dir": 1}}, "logging.local_dir=1"),
        ({"checkpoint": {"interval": -1}}, "checkpoint.interval=-1"),
        ({"checkpoint": {"interval": 0}}, "checkpoint.interval=0"),
        ({"checkpoint": {"interval": True}}, "checkpoint.interval=True"),
        ({"checkpoint": {"interval": 10.0}}, "checkpoint.interval=10.0"),
        ({"checkpoint": {"dir": ""}}, "checkpoint.dir=''"),
        ({"watchdog": {"poll_interval_s": 0}}, "watchdog.poll_interval_s=0"),
        ({"watchdog": {"heartbeat_timeout_s": -1}}, "watchdog.heartbeat_timeout_s=-1"),
        ({"watchdog": {"op_timeout_s": "30"}}, "watchdog.op_timeout_s='30'"),
        ({"watchdog": {"poll_interval_s": 5, "heartbeat_timeout_s": 5}}, "watchdog.poll_interval_s=5"),
        ({"verify": {"enabled": "yes"}}, "verify.enabled='yes'"),
        ({"verify": {"digest_interval": 0}}, "verify.digest_interval=0"),
        ({"verify": {"digest_interval": 2.0}}, "verify.digest_interval=2.0"),
        ({"verify": {"digest_interval": True}}, "verify.digest_interval=True"),
    ],
)
def test_bad_values_name_the_field_and_the_value(section: dict, field: str) -> None:
    msg = error_of(section)
    assert field in msg, msg


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"enabeld": True}, "enabeld"),
        ({"logging": {"chunk_iteration": 5}}, "logging.chunk_iteration"),
        ({"checkpoint": {"intervals": 5}}, "checkpoint.intervals"),
        ({"machines": {"gpus": 8}}, "machines.gpus"),
        ({"watchdog": {"timeout": 1}}, "watchdog.timeout"),
        ({"verify": {"interval": 1}}, "verify.interval"),
    ],
)
def test_unknown_keys_are_errors(section: dict, field: str) -> None:
    msg = error_of(section)
    assert "unknown key" in msg and field in msg, msg
    assert "allowed keys" in msg


def test_several_unknown_keys_are_all_named() -> None:
    msg = error_of({"zzz": 1, "aaa": 2})
    assert "aaa" in msg and "zzz" in msg


@pytest.mark.parametrize("key", ["machines", "logging", "checkpoint", "watchdog", "verify"])
def test_nested_sections_must_be_objects(key: str) -> None:
    assert key in error_of({key: 5})


def test_groups_and_budget_exclude_each_other() -> None:
    msg = error_of({"logging": {"groups": 4, "storage_budget_gb": 10}})
    assert "logging.groups" in msg and "logging.storage_budget_gb" in msg


@pytest.mark.parametrize("scheme", [s for s in STORAGE_SCHEMES if s])
def test_known_storage_schemes(scheme: str) -> None:
    assert swift_config({"logging": {"storage": f"{scheme}://bucket/logs"}}).logging.storage.startswith(scheme)
    assert swift_config({"logging": {"storage": "/plain/path"}}).logging.storage == "/plain/path"


@settings(max_examples=100, deadline=None)
@given(
    gpus=st.integers(1, 64),
    strategy=st.sampled_from(["auto", "replication", "logging", "checkpoint"]),
    interval=st.integers(1, 10**6),
    chunk=st.integers(1, 100),
    budget=st.none() | st.floats(0.001, 1e6),
    order=st.sampled_from(["tp-dp-pp", "tp-pp-dp", "pp-dp-tp"]),
    parallel=st.booleans(),
)
def test_round_trip(
    gpus: int, strategy: str, interval: int, chunk: int, budget: float | None, order: str, parallel: bool
) -> None:
    section = {
        "enabled": True,
        "machines": {"gpus_per_node": gpus, "rank_order": order},
        "strategy": strategy,
        "logging": {"storage_budget_gb": budget, "chunk_iterations": chunk},
        "checkpoint": {"interval": interval},
        "parallel_recovery": parallel,
    }
    cfg = swift_config(section)
    assert swift_config(cfg.to_dict()) == cfg
    assert swift_config(json.loads(json.dumps(cfg.to_dict()))) == cfg


@settings(max_examples=100, deadline=None)
@given(value=st.integers(max_value=0), key=st.sampled_from(["interval"]))
def test_non_positive_intervals_always_fail(value: int, key: str) -> None:
    assert f"checkpoint.{key}={value}" in error_of({"checkpoint": {key: value}})


@pytest.mark.parametrize(
    "section",
    [
        {"logging": {"storage_budget_gb": float("nan")}},
        {"watchdog": {"op_timeout_s": float("nan")}},
        {"watchdog": {"heartbeat_timeout_s": float("inf")}},
    ],
)
def test_non_finite_numbers_are_rejected(section: dict) -> None:
    error_of(section)


@pytest.mark.parametrize("section", [[], "", 0])
def test_swift_section_must_be_an_object(section: Any) -> None:
    error_of(section)


@pytest.mark.parametrize("section", [{"logging": {"storage": ""}}, {"run_dir": ""}])
def test_empty_paths_are_rejected(section: dict) -> None:
    error_of(section)


def test_nested_sections_must_be_dataclasses_when_built_directly() -> None:
    from ds_swift.config import SwiftConfig

    with pytest.raises(ValueError, match="machines"):
        SwiftConfig(machines={"gpus_per_node": 0})  # type: ignore[arg-type]
