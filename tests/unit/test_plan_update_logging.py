"""The planner's per-stage choice between activation logging (SWIFT) and update logging (TranLogs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_swift.config import ConfigError
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import ModelShape
from ds_swift.plan.update_logging import choose_stage_logging, stage_params_even

# pp 4, dp 2, one stage per machine (tp-dp-pp order, 2 ranks a machine).
LAYOUT = ParallelLayout(tp=1, pp=4, dp=2, gpus_per_node=2)
BERT_LARGE_LAYER = 12_596_224  # 4h^2 + 4h (attention) + 8h^2 + 5h (MLP) + 4h (norms), h=1024
EIGHT_LAYERS = 8 * BERT_LARGE_LAYER  # ~100.8 M parameters, 403 MB of fp32 updates


def bert128(micro_batches: int) -> ModelShape:
    """SWIFT's BERT-128 setting: fp32 activations, hidden 1024, 128 tokens, 32 samples a micro-batch."""
    return ModelShape(hidden=1024, seq_len=128, micro_batch_size=32, micro_batches=micro_batches)


def test_eight_bert_large_layers_log_their_updates_rather_than_537_mb_of_messages() -> None:
    rows = choose_stage_logging(LAYOUT, bert128(8), [1], [EIGHT_LAYERS] * 4)
    (row,) = rows
    # activation forward from stage 0 and gradient backward from stage 2, for each of 2 replicas
    assert row.activation_bytes == 2 * 2 * 8 * 32 * 128 * 1024 * 4 == 536_870_912
    assert row.update_bytes == 403_079_168
    assert row.choice == "update"


def test_few_micro_batches_make_the_messages_cheaper_than_the_updates() -> None:
    (row,) = choose_stage_logging(LAYOUT, bert128(4), [1], [EIGHT_LAYERS] * 4)
    assert row.activation_bytes == 268_435_456
    assert row.choice == "activation"


def test_the_last_stage_only_receives_activations() -> None:
    first, last = choose_stage_logging(LAYOUT, bert128(8), [0, 3], [EIGHT_LAYERS] * 4)
    assert first.activation_bytes == last.activation_bytes == 268_435_456
    assert first.choice == last.choice == "activation"


def test_a_budget_buys_the_faster_replay_where_it_fits() -> None:
    # Updates are cheaper on stages 1 and 2, but recompute (0.05 s) beats reading 403 MB at
    # 1 GB/s (0.4 s). A budget with room for one stage's extra 134 MB switches exactly one.
    kwargs = dict(stage_compute_s=[0.05] * 4, read_gbps=1.0, checkpoint_interval=10)
    rows = choose_stage_logging(LAYOUT, bert128(8), [1, 2], [EIGHT_LAYERS] * 4, **kwargs)
    assert [r.choice for r in rows] == ["update", "update"]
    cheap = sum(r.update_bytes for r in rows) * 10 / 1e9
    extra = (rows[0].activation_bytes - rows[0].update_bytes) * 10 / 1e9
    one = choose_stage_logging(
        LAYOUT, bert128(8), [1, 2], [EIGHT_LAYERS] * 4, storage_budget_gb=cheap + 1.5 * extra, **kwargs
    )
    assert sorted(r.choice for r in one) == ["activation", "update"]
    assert "replay faster" in next(r.reason for r in one if r.choice == "activation")
    both = choose_stage_logging(
        LAYOUT, bert128(8), [1, 2], [EIGHT_LAYERS] * 4, storage_budget_gb=cheap + 2 * extra, **kwargs
    )
    assert [r.choice for r in both] == ["activation", "activation"]
    over = choose_stage_logging(LAYOUT, bert128(8), [1, 2], [EIGHT_LAYERS] * 4, storage_budget_gb=cheap / 2, **kwargs)
    assert [r.choice for r in over] == ["update", "update"]
    assert all("exceed the budget" in r.reason for r in over)


def test_bad_inputs_name_the_field() -> None:
    with pytest.raises(ConfigError, match="stage_params has 3 values"):
        choose_stage_logging(LAYOUT, bert128(8), [1], [1, 2, 3])
    with pytest.raises(ConfigError, match="stage 4 is outside"):
        choose_stage_logging(LAYOUT, bert128(8), [4], [1] * 4)
    with pytest.raises(ConfigError, match="needs checkpoint_interval"):
        choose_stage_logging(LAYOUT, bert128(8), [1], [1] * 4, storage_budget_gb=1.0)


def test_even_split_keeps_every_parameter() -> None:
    assert stage_params_even(10, 4) == [3, 3, 2, 2]


@pytest.mark.parametrize(("micro_batches", "expected"), [(8, "update"), (4, "activation")])
def test_ds_swift_plan_shows_the_choice(micro_batches: int, expected: str) -> None:
    argv = [
        sys.executable,
        "-m",
        "ds_swift.cli",
        "plan",
        "--tp",
        "1",
        "--pp",
        "4",
        "--dp",
        "2",
        "--gpus-per-node",
        "2",
        "--strategy",
        "logging",
        "--hidden",
        "1024",
        "--seq-len",
        "128",
        "--micro-batch-size",
        "32",
        "--micro-batches",
        str(micro_batches),
        "--num-params",
        str(4 * EIGHT_LAYERS),
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["stage_logging"]
    assert {r["stage"]: r["choice"] for r in rows}[1] == expected


def test_the_command_line_loads_no_deepspeed_before_a_sub_command_runs() -> None:
    """DeepSpeed prints its accelerator line on stdout when imported: `ds-swift plan --json` (and
    any shell reading a sub-command's stdout) must not get it, and `--help` stays fast."""
    code = "import sys, ds_swift.cli as c; c.build_parser(); print(sorted(m for m in ('deepspeed', 'megatron') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_a_config_check_imports_no_deepspeed_and_plan_json_is_json_alone() -> None:
    """Reading the strategies' services (a config check, `ds-swift plan --deepspeed-config`) imports
    no DeepSpeed: its import prints the accelerator line on stdout, which a shell reading the JSON
    would get. The command needs no redirect of stdout for it."""
    code = (
        "import sys; from ds_swift.config import SwiftConfig; from ds_swift.plan.analysis import stage_mode; "
        "from ds_swift.recovery.registry import services_of; "
        "cfg = SwiftConfig.from_dict({'strategy': 'auto'}); services_of(cfg); stage_mode(cfg); "
        "[services_of(SwiftConfig.from_dict({'strategy': n, 'checkpoint': {'dir': '/tmp'}})) "
        "for n in ('logging', 'tranlogs', 'pipechurn', 'buddy')]; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'megatron')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
    config = Path(__file__).resolve().parents[2] / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"
    argv = [
        sys.executable,
        "-m",
        "ds_swift.cli",
        "plan",
        "--tp",
        "1",
        "--pp",
        "2",
        "--dp",
        "2",
        "--deepspeed-config",
        str(config),
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["layout"]["pp"] == 2, done.stdout[:500]
