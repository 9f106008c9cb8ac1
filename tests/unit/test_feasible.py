"""A configuration a strategy cannot serve is refused before any worker starts (issue 30 item 2,
issue 34 item 6): one line naming the field or flag and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ds_swift.config import ConfigError, SwiftConfig, left_off
from ds_swift.launch.args import parse_args
from ds_swift.launch.cli import main
from ds_swift.launch.placement import LaunchUsageError
from ds_swift.launch.preflight import arch_list_warning, preflight
from ds_swift.recovery.feasible import JobShape, check_feasible, infeasible

LOSSY = {"enabled": True, "strategy": "lossy_forward"}
ELASTIC = {"enabled": True, "strategy": "elastic"}


def cfg(**section: Any) -> SwiftConfig:
    return SwiftConfig.from_dict(section)


def pp2(machines: int = 2, per: int = 2, elastic: bool = False, partitioned: bool = False) -> JobShape:
    return JobShape(machines, per, elastic, pipeline=2, partitioned_optimizer=partitioned)


def test_elastic_without_the_config_is_refused_naming_the_field() -> None:
    # The hang of issue 30 item 2: the survivors, never told to shrink, would wait for a replacement.
    (why,) = infeasible(cfg(**LOSSY), pp2(elastic=True))
    assert why.startswith("--elastic:") and "strategy 'lossy_forward' does not shrink" in why
    assert '"strategy": "elastic"' in why
    (off,) = infeasible(cfg(), pp2(elastic=True))
    assert "swift.enabled is false" in off
    assert infeasible(cfg(**ELASTIC), pp2(elastic=True)) == []
    assert infeasible(cfg(**LOSSY), pp2(elastic=False)) == []  # a spare (or the job's end) serves it


def test_elastic_needs_whole_replicas_per_machine_and_one_left() -> None:
    (why,) = infeasible(cfg(**ELASTIC), JobShape(4, 1, True, pipeline=2))
    assert "--nproc-per-node 1 is not a multiple of tp x pp = 2" in why and "--nproc-per-node 2" in why
    (why,) = infeasible(cfg(**ELASTIC), pp2(machines=1, elastic=True))
    assert "leaves 0 data-parallel replica(s)" in why and "--nnodes 2" in why
    floor = cfg(**{**ELASTIC, "elastic": {"min_data_parallel": 2}})
    (why,) = infeasible(floor, pp2(machines=2, elastic=True))
    assert "elastic.min_data_parallel=2" in why and "--nnodes 3" in why
    assert infeasible(floor, pp2(machines=3, elastic=True)) == []
    # The pipeline size unknown: not guessed.
    assert infeasible(cfg(**ELASTIC), JobShape(1, 2, True)) == []


def test_pipechurn_needs_k_plus_r_plus_one_machines() -> None:
    churn = cfg(enabled=True, strategy="pipechurn")
    (why,) = infeasible(churn, pp2(machines=2))
    assert 'strategy "pipechurn" needs k + r + 1 = 4 machines' in why and "--nnodes 4" in why
    assert "pipechurn.parity_chunks=1" in why
    assert "replication_factor" not in why  # the buddy assignment's field, which the user never set
    assert infeasible(churn, pp2(machines=4)) == []
    wide = cfg(enabled=True, strategy="pipechurn", pipechurn={"data_chunks": 3, "parity_chunks": 2})
    assert "--nnodes 6" in infeasible(wide, pp2(machines=4))[0]
    with pytest.raises(ConfigError, match="--nnodes 4"):
        check_feasible(churn, pp2(machines=3))


def test_buddy_copies_need_another_machine_only_where_the_state_is_partitioned() -> None:
    one = JobShape(1, 4, pipeline=2, partitioned_optimizer=True)
    (why,) = infeasible(cfg(enabled=True), one)
    assert "buddy.replication_factor=1" in why and "--nnodes 2" in why and '"buddy": {"enabled": false}' in why
    assert infeasible(cfg(enabled=True, buddy={"enabled": False}), one) == []
    assert infeasible(cfg(enabled=True, strategy="checkpoint"), one) == []  # never reads a copy
    assert infeasible(cfg(enabled=True), JobShape(1, 4, pipeline=2, partitioned_optimizer=False)) == []
    assert infeasible(cfg(enabled=True), JobShape(1, 2, pipeline=2, partitioned_optimizer=True)) == []  # dp 1
    three = cfg(enabled=True, buddy={"replication_factor": 3})
    assert "--nnodes 3" in infeasible(three, pp2(machines=2, partitioned=True))[0]
    assert infeasible(three, pp2(machines=3, partitioned=True)) == []


def test_the_shape_comes_from_the_deepspeed_config_and_megatron_flags() -> None:
    ds = {"pipeline": {"stages": 2}, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    shape = JobShape.from_ds_config(ds, 2, 2)
    assert (shape.pipeline, shape.data_parallel, shape.partitioned) == (2, 2, True)
    shape = JobShape.from_ds_config({}, 2, 4, pipeline=2, tensor=2)
    assert (shape.replica, shape.data_parallel, shape.partitioned) == (4, 2, False)


def write_config(tmp: Path, swift: dict[str, Any], stages: int = 2) -> Path:
    """A DeepSpeed config for 2 ranks a machine (``machines.gpus_per_node`` 2 unless ``swift`` says)."""
    path = tmp / "ds.json"
    swift = {"machines": {"gpus_per_node": 2}, **swift}
    path.write_text(json.dumps({"pipeline": {"stages": stages}, "swift": swift}))
    return path


def launch_argv(config: Path, *launcher: str) -> list[str]:
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        *launcher,
        "examples/pretrain_gpt.py",
        "--deepspeed_config",
        str(config),
        "--train-iters",
        "3",
    ]


def test_the_launcher_refuses_the_elastic_hang_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, LOSSY)
    argv = launch_argv(config, "--spares", "0", "--elastic", "--run-dir", str(tmp_path / "run"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-swift-launch: error: --elastic: the swift config's strategy 'lossy_forward'"), err
    assert not (tmp_path / "run").exists()  # no store, no agent, no worker: nothing started
    assert preflight(parse_args(launch_argv(write_config(tmp_path, ELASTIC), "--elastic"))) is None


def test_the_launcher_refuses_pipechurn_on_too_few_machines_and_reads_megatron_flags(tmp_path: Path) -> None:
    churn = write_config(tmp_path, {"enabled": True, "strategy": "pipechurn"})
    why = preflight(parse_args(launch_argv(churn)))
    assert why is not None and "--nnodes 4" in why
    # --swift-config replaces the section (Megatron's flags, read as the script reads them).
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps({"swift": {"enabled": True, "strategy": "checkpoint", "machines": {"gpus_per_node": 2}}})
    )
    assert preflight(parse_args([*launch_argv(churn), "--swift-config", str(other)])) is None
    bad = write_config(tmp_path, {"enabled": True, "strategy": "nope"})
    assert "strategy" in (preflight(parse_args(launch_argv(bad))) or "")
    # No config on the script's command line: nothing to check, unless --elastic depends on it.
    plain = ["--nnodes", "2", "examples/pretrain_gpt.py"]
    assert preflight(parse_args(plain)) is None
    assert "--deepspeed_config" in (preflight(parse_args(["--elastic", *plain])) or "")


@pytest.mark.parametrize(
    ("value", "fixed"),
    [("9.0a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("8.0 9.0a+PTX", "8.0;9.0+PTX"), ("10.0f;12.0a", "10.0;12.0")],
)
def test_an_arch_list_deepspeeds_op_builder_cannot_parse_is_named_with_its_fix(value: str, fixed: str) -> None:
    why = arch_list_warning({"TORCH_CUDA_ARCH_LIST": value}, "0.19.8")
    assert why is not None and f"TORCH_CUDA_ARCH_LIST='{fixed}'" in why and "0.19.8" in why


@pytest.mark.parametrize(
    ("environ", "version"),
    [
        ({"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}, "0.19.8"),  # plain entries parse
        ({}, "0.19.8"),
        ({"TORCH_CUDA_ARCH_LIST": "9.0a"}, None),  # no DeepSpeed installed as a distribution
        ({"TORCH_CUDA_ARCH_LIST": "9.0a"}, "0.20.0"),  # not a version this was seen on
    ],
)
def test_no_arch_list_warning_without_cause(environ: dict[str, str], version: str | None) -> None:
    assert arch_list_warning(environ, version) is None


def test_a_swift_section_without_enabled_is_refused_not_left_off(tmp_path: Path) -> None:
    """A section that configures ds-swift but leaves "enabled" out: ds-swift was off and the job
    trained unprotected without a word. The launcher, ds_swift.init_distributed and
    ds_swift.initialize refuse it; "enabled": false keeps a section that is meant to be off."""
    unset = write_config(tmp_path, {"strategy": "auto", "buddy": {"replication_factor": 1}})
    why = preflight(parse_args(launch_argv(unset)))
    assert why is not None and why.startswith("swift config: the swift section sets buddy, machines, strategy but")
    assert 'add "enabled": true to turn it on' in why and '"enabled": false to train without it' in why
    assert preflight(parse_args(launch_argv(write_config(tmp_path, {"enabled": False, "strategy": "auto"})))) is None
    assert preflight(parse_args([*launch_argv(unset), "--swift"])) is None  # a Megatron script's --swift
    assert left_off({}) is None and left_off(None) is None and left_off({"enabled": True}) is None

    import ds_swift

    engine = object()
    with pytest.raises(ConfigError, match='but not "enabled"'):
        ds_swift.initialize(engine, {"swift": {"strategy": "auto"}})
    with pytest.raises(ConfigError, match='but not "enabled"'):
        ds_swift.init_distributed({"swift": {"checkpoint": {"interval": 10}}})
    assert ds_swift.initialize(engine, {"swift": {"enabled": False, "strategy": "auto"}}) is engine
    assert ds_swift.initialize(engine, {"train_batch_size": 4}) is engine  # no section: off, as always


def test_the_launcher_refuses_what_every_worker_would_refuse_once_started(tmp_path: Path) -> None:
    """machines.gpus_per_node against --nproc-per-node, logging.kinds against the pipeline: each was
    found by every worker after its start (four tracebacks, then "rank 3 exited with code 1")."""
    eight = write_config(tmp_path, {"enabled": True, "machines": {"gpus_per_node": 8}})
    assert preflight(parse_args(launch_argv(eight))) == (
        "swift config: machines.gpus_per_node=8 is invalid: ds-swift-launch placed 2 rank(s) on each of 2 "
        "machine(s) (--nproc-per-node); set it to 2"
    )
    kinds = write_config(tmp_path, {"enabled": True, "logging": {"kinds": ["messages"]}}, stages=4)
    assert preflight(parse_args(launch_argv(kinds))) == (
        'swift config: logging.kinds has 1 entries for 4 pipeline stages: give one per stage (messages or updates), or "auto"'
    )
    fits = write_config(tmp_path, {"enabled": True, "logging": {"kinds": ["messages"] * 4}}, stages=4)
    assert preflight(parse_args(launch_argv(fits))) is None


def test_a_file_where_a_directory_of_the_config_must_be_is_named_before_the_start(tmp_path: Path) -> None:
    """checkpoint.dir under a file failed at the first save (every iteration since the start lost),
    logging.storage under a file switched message logging off at start, --run-dir a file was a
    FileExistsError traceback."""
    blocker = tmp_path / "afile.txt"
    blocker.write_text("not a directory")
    swift = {
        "enabled": True,
        "checkpoint": {"dir": str(blocker / "ckpt")},
        "logging": {"storage": f"file://{blocker}/logs"},
        "run_dir": str(tmp_path / "fine" / "run"),  # missing is fine: the job creates it
    }
    why = preflight(parse_args(launch_argv(write_config(tmp_path, swift))))
    assert why == (
        f"swift config: checkpoint.dir='{blocker}/ckpt' is invalid: {blocker} is a file, so the directory cannot "
        f"be created; give a directory path; swift config: logging.storage='file://{blocker}/logs' is invalid: "
        f"{blocker} is a file, so the directory cannot be created; give a directory path"
    )
    swift["checkpoint"] = {"dir": str(tmp_path / "ckpt")}
    swift["logging"] = {"storage": "hdfs://namenode:9870/logs"}  # not a local path: not checked
    assert preflight(parse_args(launch_argv(write_config(tmp_path, swift)))) is None
    with pytest.raises(LaunchUsageError, match=f"--run-dir {blocker}: {blocker} is a file"):
        parse_args(["--run-dir", str(blocker), *launch_argv(tmp_path / "ds.json")])
