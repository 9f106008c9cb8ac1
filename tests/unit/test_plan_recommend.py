"""`ds-swift plan --recommend`: the planner's output fed to the simulator's recommender."""

from __future__ import annotations

import json

import pytest

from ds_swift.cli import main

BERT = "--tp 1 --pp 128 --dp 1 --gpus-per-node 8 --hidden 1024 --seq-len 128 --micro-batch-size 128 --micro-batches 4 --dtype fp32 --groups 16".split()


def test_recommend_adds_alternatives_ranked_by_expected_time(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "plan",
            *BERT,
            "--recommend",
            "--mtbf-hours",
            "17",
            "--iteration-time",
            "3.3",
            "--checkpoint-cost-s",
            "0.93",
            "--total-iterations",
            "500000",
            "--json",
        ]
    )
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    names = [a["name"] for a in rec["alternatives"]]
    assert {"swift", "global_checkpoint"} <= set(names)
    hours = [a["expected_hours"] for a in rec["alternatives"]]
    assert hours == sorted(hours)  # fastest first
    assert rec["recommended"] == names[0]
    # a logging plan must beat restarting everything from the checkpoint at this failure rate
    by = {a["name"]: a for a in rec["alternatives"]}
    assert by["swift"]["expected_hours"] < by["global_checkpoint"]["expected_hours"]


def test_recommend_without_failure_rate_names_the_missing_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *BERT, "--recommend"]) == 2
    err = capsys.readouterr().err
    assert "--mtbf-hours" in err and "--checkpoint-cost-s" in err
