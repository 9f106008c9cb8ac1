"""`ds-swift plan`, run through ds_swift.cli.main as a user would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ds_swift import cli

BERT = ["--hidden", "1024", "--seq-len", "128", "--micro-batch-size", "128", "--micro-batches", "4", "--dtype", "fp32"]
VIT = ["--hidden", "1024", "--seq-len", "49", "--micro-batch-size", "256", "--micro-batches", "16", "--dtype", "fp32"]
PIPE128 = ["--tp", "1", "--pp", "128", "--dp", "1", "--gpus-per-node", "8"]


@pytest.fixture(autouse=True)
def _only_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other sub-commands are other people's work in progress: keep this test about `plan`.
    monkeypatch.setattr(cli, "SUBCOMMANDS", ("ds_swift.plan.cli",))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)  # exactly one JSON object on stdout


@pytest.mark.parametrize(
    ("model", "groups", "gb", "exact_bytes"),
    [
        (BERT, 16, 8.05, 15 * 2 * 4 * 67_108_864),
        (BERT, 8, 3.76, 7 * 2 * 4 * 67_108_864),
        (VIT, 16, 24.66, 15 * 2 * 16 * 51_380_224),
        (VIT, 8, 11.51, 7 * 2 * 16 * 51_380_224),
    ],
)
def test_table3_acceptance_figures(
    capsys: pytest.CaptureFixture[str], model: list[str], groups: int, gb: float, exact_bytes: int
) -> None:
    js = run_json(capsys, *PIPE128, *model, "--groups", str(groups))
    assert js["log_bytes_per_iteration"] == exact_bytes
    assert isinstance(js["log_bytes_per_iteration"], int)
    assert round(js["log_bytes_per_iteration"] / 1e9, 2) == gb == js["log_gb_per_iteration"]
    assert len(js["groups"]) == groups and [m for g in js["groups"] for m in g] == list(range(16))
    assert {s["strategy"] for s in js["stages"]} == {"logging"} and len(js["stages"]) == 128
    assert set(js["worth_logging"]) == {"value", "reason"} and js["worth_logging"]["value"] is True


def test_figure2_logging_and_replication(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--tp", "2", "--pp", "4", "--dp", "2", "--gpus-per-node", "8"]
    packed = run_json(capsys, *base)
    assert [s["strategy"] for s in packed["stages"]] == ["logging"] * 4
    assert packed["log_bytes_per_iteration"] is None  # no shape given: sizes unknown
    spread = run_json(capsys, *base, "--order", "tp-pp-dp")
    assert [s["strategy"] for s in spread["stages"]] == ["replication"] * 4
    assert spread["worth_logging"]["value"] is False


def test_human_output_has_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *PIPE128, *BERT, "--groups", "8", "--iteration-time", "2", "--pcie-gbps", "16")
    assert code == 0, err
    for text in ("Stages", "Logging groups (balanced)", "Summary", "3.76 GB", "fits in the bubbles", "0-15"):
        assert text in out, text


def test_budget_reports_greedy_and_exact(capsys: pytest.CaptureFixture[str]) -> None:
    boundary = 2 * 4 * 67_108_864
    budget = 7 * boundary * 50 / 1e9
    js = run_json(capsys, *PIPE128, *BERT, "--storage-budget-gb", repr(budget), "--checkpoint-interval", "50")
    assert js["log_bytes_per_iteration"] == 7 * boundary
    g = js["grouping"]
    assert g["method"] == "exact" and g["exact"]["optimal"] is True
    assert g["exact"]["expected_recovery"] <= g["greedy"]["expected_recovery"]
    code, out, _ = run(capsys, *PIPE128, *BERT, "--storage-budget-gb", repr(budget), "--checkpoint-interval", "50")
    assert code == 0 and "greedy grouping" in out and "exact grouping" in out


def test_deepspeed_config_defaults_and_flag_overrides(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ds = {
        "train_micro_batch_size_per_gpu": 128,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "swift": {"machines": {"gpus_per_node": 16}, "logging": {"groups": 4}, "checkpoint": {"interval": 10}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    js = run_json(capsys, "--deepspeed-config", str(path), "--pp", "128", "--hidden", "1024", "--seq-len", "128")
    assert js["layout"]["gpus_per_node"] == 16 and js["layout"]["num_machines"] == 8
    assert js["shape"]["micro_batch_size"] == 128 and js["shape"]["micro_batches"] == 4
    assert js["shape"]["dtype"] == "bf16"
    assert len(js["groups"]) == 4
    assert js["log_bytes_per_iteration"] == 3 * 2 * 4 * 67_108_864 // 2
    # flags win over the file
    js = run_json(
        capsys,
        *("--deepspeed-config", str(path), "--pp", "128", "--hidden", "1024", "--seq-len", "128"),
        *("--gpus-per-node", "8", "--groups", "16", "--dtype", "fp32", "--micro-batches", "2"),
    )
    assert js["layout"]["num_machines"] == 16 and len(js["groups"]) == 16
    assert js["log_bytes_per_iteration"] == 15 * 2 * 2 * 67_108_864
    # a budget on the command line replaces the file's groups
    js = run_json(
        capsys,
        *("--deepspeed-config", str(path), "--pp", "128", "--hidden", "1024", "--seq-len", "128"),
        "--storage-budget-gb",
        "1000",
    )
    assert js["grouping"]["method"] == "exact"


def test_zero1_buddy_copies_stand_in_for_replicas_as_the_engine_decides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """pp 2 x dp 2, each stage on one machine (tp-dp-pp): with ZeRO-1 and buddy copies (the
    defaults) no stage is logged, as the engine decides at start-up; without the copies both are."""
    ds: dict[str, Any] = {
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "swift": {"machines": {"gpus_per_node": 2, "rank_order": "tp-dp-pp"}},
    }
    path = tmp_path / "ds.json"
    argv = ("--deepspeed-config", str(path), "--pp", "2", "--dp", "2", "--hidden", "64", "--seq-len", "32")
    argv += ("--micro-batch-size", "4", "--micro-batches", "4")
    for buddy, logged in ((True, False), (False, True)):
        ds["swift"]["buddy"] = {"enabled": buddy}
        path.write_text(json.dumps(ds))
        js = run_json(capsys, *argv)
        strategies = {s["strategy"] for s in js["stages"]}
        assert strategies == ({"logging"} if logged else {"replication"}), js["stages"]
        assert (js["log_bytes_per_iteration"] > 0) is logged, js["log_bytes_per_iteration"]


def test_world_size_gives_dp(capsys: pytest.CaptureFixture[str]) -> None:
    js = run_json(capsys, "--tp", "2", "--pp", "4", "--world-size", "32")
    assert js["layout"]["dp"] == 4


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--tp", "2", "--pp", "4", "--dp", "2", "--world-size", "8"], "--world-size=8"),
        (["--tp", "2", "--pp", "3", "--world-size", "8"], "--world-size=8"),
        (["--tp", "0", "--pp", "4"], "--tp=0"),
        (["--pp", "3", "--dp", "1", "--gpus-per-node", "2"], "gpus_per_node=2"),
        (["--pp", "4", "--dp", "2", "--order", "tp-pp"], "order="),
        (["--pp", "4", "--order", "tp-qq-pp"], "order="),
        (["--pp", "16", "--groups", "3", "--gpus-per-node", "8"], "groups=3"),
        (["--pp", "16", "--hidden", "1024"], "--seq-len"),
        (["--pp", "16", "--hidden", "8", "--seq-len", "8"], "--micro-batch-size"),
        (["--pp", "16", "--micro-batches", "4"], "--micro-batches"),
        (["--pp", "16", "--iteration-time", "-1"], "--iteration-time=-1"),
        (["--pp", "16", "--checkpoint-interval", "-5"], "--checkpoint-interval=-5"),
        (["--pp", "16", "--stage-compute-s", "1,x"], "--stage-compute-s"),
        (["--pp", "16", "--stage-compute-s", "1,2"], "--stage-compute-s"),
        (["--pp", "16", "--strategy", "replication"], "strategy='replication'"),
        (["--pp", "16", "--storage-budget-gb", "5"], "storage_budget_gb"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], names: str) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("ds-swift plan: error: "), err
    assert names in err, err


@pytest.mark.parametrize(
    ("swift", "names"),
    [
        ({"loging": {}}, "'loging'"),
        ({"checkpoint": {"interval": -1}}, "checkpoint.interval=-1"),
        ({"logging": {"storage": "ftp://host/logs"}}, "logging.storage='ftp://host/logs'"),
        ({"machines": {"gpus_per_node": 0}}, "machines.gpus_per_node=0"),
    ],
)
def test_bad_deepspeed_config_is_one_line_naming_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, swift: dict, names: str
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"swift": swift}))
    code, out, err = run(capsys, "--deepspeed-config", str(path), "--pp", "16")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and names in err, err


def test_missing_and_broken_deepspeed_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "--deepspeed-config", str(tmp_path / "nope.json"))
    assert code == 2 and "cannot be read" in err and err.count("\n") == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "--deepspeed-config", str(bad))
    assert code == 2 and "not valid JSON" in err and err.count("\n") == 1
    ds = tmp_path / "mbs.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 0}))
    code, _, err = run(capsys, "--deepspeed-config", str(ds), "--pp", "8", "--hidden", "8", "--seq-len", "8")
    assert code == 2 and "train_micro_batch_size_per_gpu=0" in err


def test_groups_and_budget_flags_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--pp", "16", "--groups", "2", "--storage-budget-gb", "5"])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_every_registered_strategy_is_planned_under_its_registry_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`ds-swift plan` names the strategy as the registry does (it once labelled buddy, pipechurn and
    scar jobs "checkpoint"), from --strategy and from the config's swift section alike; what each
    stage recovers by comes from the strategy's services."""
    from ds_swift.recovery.registry import strategy_names

    base = ["--tp", "1", "--pp", "2", "--dp", "2", "--gpus-per-node", "1"]
    expected = {
        "replication": {"replication"},
        "logging": {"logging"},
        "checkpoint": {"checkpoint"},
        "buddy": {"checkpoint"},
    }
    for name in strategy_names():
        js = run_json(capsys, *base, "--strategy", name)
        assert js["strategy"] == name, (name, js["strategy"])
        if name in expected:
            assert {s["strategy"] for s in js["stages"]} == expected[name], (name, js["stages"])
        code, out, err = run(capsys, *base, "--strategy", name)
        assert code == 0 and f"; strategy {name}" in out, (name, out, err)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"swift": {"enabled": True, "strategy": "scar"}}))
    assert run_json(capsys, *base, "--deepspeed-config", str(config))["strategy"] == "scar"
