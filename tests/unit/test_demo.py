"""``ds-swift demo`` helpers, and the plan and model of the GPT workload it runs (no processes)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.bench.demo import DemoError, find_repo
from ds_swift.bench.demo_report import (
    LossPoint,
    format_timeline,
    iterations_lost,
    losses_by_iteration,
    plot_losses,
    read_loss_log,
)
from ds_swift.cli import main as cli_main
from ds_swift.models.gpt import Block, GPTConfig
from ds_swift.models.training_plan import PlanError, TrainingPlan, resolve_training_plan
from ds_swift.testing.checkpoints import CheckpointError, compare_checkpoints

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- finding the checkout
def fake_checkout(root: Path) -> Path:
    (root / "examples").mkdir(parents=True)
    (root / "examples" / "pretrain_gpt.py").write_text("")
    (root / "configs").mkdir()
    (root / "configs" / "gpt_tiny_pp2_dp2.json").write_text("{}")
    return root


def test_find_repo_takes_the_first_checkout(tmp_path: Path) -> None:
    empty, repo = tmp_path / "empty", fake_checkout(tmp_path / "repo")
    empty.mkdir()
    found = find_repo([empty, repo])
    assert found.root == repo.resolve() and found.example == repo / "examples" / "pretrain_gpt.py"
    assert found.config("pp2_dp2") == repo / "configs" / "gpt_tiny_pp2_dp2.json"
    with pytest.raises(DemoError, match="pp4"):
        found.config("pp4")  # a name of the table whose file this checkout lacks
    broken = tmp_path / "broken.json"
    broken.write_text('{"swift": {"enabled": true,}}')
    with pytest.raises(DemoError, match=f"--config {broken}: DeepSpeed config '{broken}' is not valid JSON: Expecting"):
        found.config(str(broken))  # was a JSONDecodeError traceback from inside the first job


def test_find_repo_without_checkout_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match=r"pip install -e \.") as err:
        find_repo([tmp_path])
    assert str(tmp_path) in str(err.value) and "DS_SWIFT_ROOT" in str(err.value)


def test_find_repo_default_finds_this_checkout() -> None:
    found = find_repo()
    assert found.root == ROOT
    assert found.config("pp4").name == "gpt_tiny_pp4.json"


def test_demo_rejects_a_kill_after_the_last_iteration(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["demo", "--iterations", "10", "--kill-iteration", "10"]) == 2
    assert "--kill-iteration 10" in capsys.readouterr().out
    # The number that is wrong is the one named (--iterations 0 blamed --kill-iteration; --timeout 0
    # started four ranks and killed them at once).
    assert cli_main(["demo", "--iterations", "0"]) == 2
    assert "error: --iterations 0 must be 2 or more" in capsys.readouterr().out
    assert cli_main(["demo", "--timeout", "0"]) == 2
    assert "error: --timeout 0 must be a positive number of seconds" in capsys.readouterr().out


# ---------------------------------------------------------------------------- loss logs
def test_read_loss_log_skips_a_torn_last_line(tmp_path: Path) -> None:
    log = tmp_path / "loss.jsonl"
    log.write_text('{"iteration": 0, "loss": 5.5}\n{"iteration": 1, "loss": 5.25, "generation": 1}\n{"iterat')
    assert read_loss_log(log) == [LossPoint(0, 5.5, 0), LossPoint(1, 5.25, 1)]
    assert read_loss_log(tmp_path / "absent.jsonl") == []


def test_losses_by_iteration_keeps_the_value_training_went_on_from() -> None:
    points = [LossPoint(0, 3.0), LossPoint(1, 2.0), LossPoint(1, 2.5, 1), LossPoint(2, 1.0, 1)]
    assert losses_by_iteration(points) == {0: 3.0, 1: 2.5, 2: 1.0}


def test_iterations_lost_counts_iterations_trained_twice() -> None:
    replication = [LossPoint(i, 1.0) for i in range(15)]
    assert iterations_lost(replication) == 0
    # checkpoint fallback: done up to 11, reloaded global_step8, iterations 8..11 trained again
    fallback = [LossPoint(i, 1.0) for i in range(12)] + [LossPoint(i, 1.0, 1) for i in range(8, 15)]
    assert iterations_lost(fallback) == 4


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.data())
def test_iterations_lost_is_done_minus_resume_point(done: int, data: st.DataObject) -> None:
    resume = data.draw(st.integers(0, done))
    total = data.draw(st.integers(done, done + 20))
    points = [LossPoint(i, 0.0) for i in range(done)] + [LossPoint(i, 0.0, 1) for i in range(resume, total)]
    assert iterations_lost(points) == done - resume


# ---------------------------------------------------------------------------- timeline
TIMELINE = {
    "failed_generation": 0,
    "strategy": "replication",
    "reason": "every lost rank has a surviving replica",
    "failed_machine": 1,
    "consensus": 6,
    "pre_failure_iteration": 7,
    "checkpoint_step": None,
    "undo_ranks": [],
    "donors": {"2": 0, "3": 1},
    "t_kill": 100.0,
    "phases": {
        "detect": 0.06,
        "teardown": 0.77,
        "rendezvous": 1.72,
        "rebuild": 3.70,
        "consensus_undo": 0.02,
        "state_restore": 0.02,
        "catch_up": 0.0,
    },
    "initialization_s": 6.18,
    "recovery_s": 0.03,
    "total_s": 6.28,
    "ranks": [{"rank": 0, "bytes_moved": 1_430_000}, {"rank": 1, "bytes_moved": 1_410_000}],
}


def test_format_timeline_replication() -> None:
    text = "\n".join(format_timeline(TIMELINE))
    assert "machine 1 failed; recovered by replication" in text
    assert "0->2, 1->3 (2.84 MB)" in text
    assert "back at iteration 7" in text and "survivors kept their state in memory" in text
    for phase in ("detect", "teardown", "rendezvous", "rebuild", "consensus undo", "state restore", "catch up"):
        assert phase in text
    assert "initialization 6.18 s" in text and "recovery 0.03 s" in text and "total 6.28 s (kill -> back)" in text
    assert "undo" not in text.split("consensus undo")[0]  # no update-undo line without undo ranks


def test_the_engines_phase_says_whether_survivors_kept_their_engine() -> None:
    """Issue 50: the phase after the rendezvous is named by what the survivors did (a swap of the
    process groups under their kept engines, or a rebuild), with how many kept theirs."""
    ranks = [
        {"rank": 0, "role": "survivor", "extra": {"engine_kept_s": {"replay": 0.1, "refill": 0.0}}},
        {"rank": 1, "role": "survivor", "extra": {"engine_kept_s": {"replay": 0.1, "refill": 0.0}}},
        {"rank": 2, "role": "replacement", "extra": {}},
        {"rank": 3, "role": "replacement", "extra": {}},
    ]
    kept = "\n".join(format_timeline(dict(TIMELINE, ranks=ranks)))
    assert "  swap " in kept and "2 of 2 survivors kept their engine" in kept and "2 replacements built" in kept
    assert "rebuil" not in kept
    ranks[1] = {"rank": 1, "role": "survivor", "extra": {}}
    mixed = "\n".join(format_timeline(dict(TIMELINE, ranks=ranks)))
    assert "  rebuild " in mixed and "1 of 2 survivors kept their engine" in mixed and "1 rebuilt theirs" in mixed
    ranks[0] = {"rank": 0, "role": "survivor", "extra": {}}
    rebuilt = "\n".join(format_timeline(dict(TIMELINE, ranks=ranks)))
    assert "  rebuild " in rebuilt and "kept" not in rebuilt.split("rebuild ")[1].splitlines()[0]


def test_format_timeline_checkpoint_and_undo() -> None:
    tl = dict(
        TIMELINE,
        strategy="checkpoint",
        checkpoint_step=8,
        consensus=10,
        pre_failure_iteration=11,
        donors={},
        undo_ranks=[1],
        t_kill=None,
        phases={"detect": 0.1},
    )
    text = "\n".join(format_timeline(tl))
    assert "recovered by checkpoint" in text and "every rank reloaded global_step8 and trained iterations 8..10" in text
    assert "update-undo on ranks [1]" in text
    assert "donor" not in text and "(detection -> back)" in text and "rebuild" not in text


def test_format_timeline_logging_replay_and_unknown_phases() -> None:
    replay = {
        "from": 8,
        "to": 10,
        "iterations": 3,
        "ranks": [2, 3],
        "source": "global_step8",
        "replay_s": 0.2,
        "log_bytes_read": 393216,
        "per_rank": {"2": {"messages_from_log": 12}, "3": {"messages_from_log": 0}},
    }
    tl = dict(
        TIMELINE,
        strategy="logging",
        checkpoint_step=8,
        consensus=10,
        pre_failure_iteration=11,
        donors={},
        replay=replay,
        phases={"rebuild": 1.0, "replay": 0.18, "checkpoint_load": 0.05, "new_phase": 0.5},
    )
    lines = format_timeline(tl)
    text = "\n".join(lines)
    assert "the lost ranks loaded global_step8 and replayed" in text
    assert "replay: ranks [2, 3] replayed iterations 8..10 from global_step8: 12 messages, 0.39 MB" in text
    phases = [m.group(1) for m in (re.match(r"^  ([a-z ]+?) +\d+\.\d\d s   ", line + "   ") for line in lines) if m]
    # the recovery's order, not the dict's; phases the demo does not know yet still shown, last
    assert phases == ["rebuild", "checkpoint load", "replay", "new phase"]


# ---------------------------------------------------------------------------- checkpoints
def write_tag(tag: Path, state: dict[str, object]) -> Path:
    tag.mkdir(parents=True)
    torch.save(state, tag / "mp_rank_00_model_states.pt")
    torch.save({"w": torch.arange(4.0)}, tag / "layer_00-model_00-model_states.pt")
    return tag


def state(w: torch.Tensor) -> dict[str, object]:
    return {"module": {"w": w, "b": torch.zeros(2)}, "optimizer": {"state": [{"step": torch.tensor(3)}]}}


def test_compare_checkpoints_equal(tmp_path: Path) -> None:
    w = torch.randn(3, 3)
    diff = compare_checkpoints(write_tag(tmp_path / "a", state(w)), write_tag(tmp_path / "b", state(w.clone())))
    assert diff.bitwise_equal and diff.tensors == 4


def test_compare_checkpoints_finds_one_ulp_and_signed_zero(tmp_path: Path) -> None:
    w = torch.randn(3, 3)
    w2 = w.clone()
    w2[1, 1] = torch.nextafter(w[1, 1], torch.tensor(math.inf))
    diff = compare_checkpoints(write_tag(tmp_path / "a", state(w)), write_tag(tmp_path / "b", state(w2)))
    assert not diff.bitwise_equal
    ((name, gap),) = diff.differing
    assert name == "mp_rank_00_model_states.pt/module/w" and 0 < gap < 1e-6
    neg = {"module": {"w": w, "b": -torch.zeros(2)}, "optimizer": {"state": [{"step": torch.tensor(3)}]}}
    diff = compare_checkpoints(tmp_path / "a", write_tag(tmp_path / "c", neg))
    assert [n for n, _ in diff.differing] == ["mp_rank_00_model_states.pt/module/b"]  # -0.0 == 0.0 as values


def test_compare_checkpoints_reports_missing_tensors_and_empty_tags(tmp_path: Path) -> None:
    w = torch.randn(2)
    a = write_tag(tmp_path / "a", state(w))
    b = write_tag(tmp_path / "b", {**state(w), "extra": torch.ones(1)})
    diff = compare_checkpoints(a, b)
    assert diff.only_in_one == ["mp_rank_00_model_states.pt/extra"] and not diff.bitwise_equal
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint files"):
        compare_checkpoints(a, tmp_path / "empty")


# ---------------------------------------------------------------------------- plot
def test_plot_losses_writes_a_png(tmp_path: Path) -> None:
    base = {i: 5.0 - 0.1 * i for i in range(15)}
    out = plot_losses(base, dict(base), 7, tmp_path / "sub" / "loss.png", note="0 iteration(s) lost")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# ---------------------------------------------------------------------------- the workload's plan
def test_plan_from_config_when_flags_are_absent() -> None:
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "pipeline": {"stages": 2}}
    plan = resolve_training_plan(cfg, 4)
    assert plan == TrainingPlan(tp=1, pp=2, dp=2, micro_batch_size=4, gradient_accumulation_steps=4)
    assert plan.global_batch_size == 32
    out = plan.apply(dict(cfg))
    assert out["train_batch_size"] == 32 and out["pipeline"] == {"stages": 2}


def test_plan_from_flags() -> None:
    plan = resolve_training_plan(
        {}, 8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, micro_batch_size=2, global_batch_size=16
    )
    assert (plan.tp, plan.pp, plan.dp, plan.gradient_accumulation_steps) == (2, 2, 2, 4)
    assert (
        resolve_training_plan(
            {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8}, 2
        ).gradient_accumulation_steps
        == 2
    )


@pytest.mark.parametrize(
    ("cfg", "world", "kw", "flag"),
    [
        (
            {"pipeline": {"stages": 2}},
            4,
            {"pipeline_model_parallel_size": 4, "micro_batch_size": 1},
            "--pipeline-model-parallel-size 4",
        ),
        ({}, 6, {"tensor_model_parallel_size": 4, "micro_batch_size": 1}, "--tensor-model-parallel-size 4"),
        ({"pipeline": {"stages": 4}}, 6, {"micro_batch_size": 1}, "pipeline.stages in --deepspeed_config 4"),
        ({"train_micro_batch_size_per_gpu": 4}, 2, {"micro_batch_size": 2}, "--micro-batch-size 2"),
        ({}, 2, {}, "--micro-batch-size"),
        ({}, 4, {"micro_batch_size": 3, "global_batch_size": 16}, "--global-batch-size 16"),
        (
            {"gradient_accumulation_steps": 2},
            2,
            {"micro_batch_size": 1, "global_batch_size": 8},
            "--global-batch-size 8",
        ),
        ({"train_batch_size": 10, "gradient_accumulation_steps": 2}, 2, {"micro_batch_size": 2}, "train_batch_size=10"),
        ({}, 2, {"micro_batch_size": 0}, "--micro-batch-size 0"),
    ],
)
def test_plan_errors_name_the_flag(cfg: dict, world: int, kw: dict, flag: str) -> None:
    with pytest.raises(PlanError) as err:
        resolve_training_plan(cfg, world, **kw)
    assert flag in str(err.value)


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"hidden_size": 60, "num_attention_heads": 8}, "--hidden-size 60"),
        ({"num_attention_heads": 4, "tensor_parallel": 8, "hidden_size": 64}, "--tensor-model-parallel-size 8"),
        ({"vocab_size": 255, "tensor_parallel": 2}, "--vocab-size 255"),
        ({"num_layers": 0}, "--num-layers 0"),
        ({"dropout": 1.0}, "--dropout 1.0"),
    ],
)
def test_gpt_config_errors_name_the_flag(kw: dict, flag: str) -> None:
    with pytest.raises(ValueError) as err:
        GPTConfig(**kw)
    assert flag in str(err.value)


def test_block_math_is_the_examples_original() -> None:
    """The bitwise recovery tests were recorded with this exact sequence of ops: keep it."""
    torch.manual_seed(0)
    block = Block(32, 4, 0.0)
    x = torch.randn(2, 8, 32)
    b, s, h = x.shape
    q, k, v = block.qkv(block.ln1(x)).split(h, dim=-1)
    q, k, v = (t.view(b, s, 4, h // 4).transpose(1, 2) for t in (q, k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(h // 4)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    att = block.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
    y = x + block.drop(block.proj((att @ v).transpose(1, 2).reshape(b, s, h)))
    y = y + block.drop(block.out(F.gelu(block.fc(block.ln2(y)))))
    assert torch.equal(block(x), y)
