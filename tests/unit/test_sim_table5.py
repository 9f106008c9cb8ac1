"""configs/sim/swift_table5.yaml against SWIFT's Table 5 (and the CheckFreq / Elastic Horovod
totals of section 7.3), through the command line's --json.

The totals are ~99 % failure-free time, so a relative check on them passes whatever the
recovery costs are. What is pinned instead is what a recovery cost moves:

- each strategy's saving against the global checkpoint (hours), per cell, with an absolute
  tolerance derived from the Monte Carlo noise and rounding of the paper's own figures;
- for the Wide-ResNet-50 strategies whose losses are small and nearly noise-free, the hours
  lost beyond the failure-free compute time (the saving cannot see these: a restart cost
  shared by every strategy cancels out of it).

``test_a_doubled_recovery_cost_trips_the_new_check_not_the_old_one`` shows that both checks
can fail where the old total-only check (3 %) passes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ds_swift.sim.cli import main
from ds_swift.sim.schema import load_sim_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "sim" / "swift_table5.yaml"

# End-to-end hours with failures: Table 5, and section 7.3's text for CheckFreq / Elastic Horovod.
PAPER: dict[str, dict[str, float]] = {
    "Wide-ResNet-50": {"global_checkpoint": 557.4, "checkfreq": 518.9, "elastic_horovod": 515.9, "swift": 480.7},
    "ViT-128/32": {"global_checkpoint": 86.4, "swift": 86.0},
    "BERT-128": {"global_checkpoint": 524.2, "swift": 476.1},
}
# Failure-free hours: Table 4 (iterations x iteration time, no checkpoint stalls).
FAILURE_FREE: dict[str, float] = {"Wide-ResNet-50": 479.4, "ViT-128/32": 85.6, "BERT-128": 461.1}

# Absolute tolerance on the saving vs the global checkpoint, hours. The paper's figures are
# themselves means of 10 repeats of random failure times, so the global checkpoint's total
# carries the noise of its lost work: each failure loses U(0, interval x iteration time).
SAVING_TOLERANCE_H: dict[tuple[str, str], float] = {
    # 28 failures losing U(0, 5004 x 3.83 s = 5.33 h): a repeat's sd is sqrt(28) x 5.33 / sqrt(12)
    # = 8.1 h, a 10-repeat mean's 2.6 h. The snapshots and replication lose almost nothing, so
    # that is the saving's standard error: 5 h is ~2 of them (seed 0 gives 553.7 h, 200 repeats
    # 555.2 h, the paper 557.4 h). This checks the lost-work model (a snapshot every 60 instead
    # of 30 iterations moves CheckFreq's saving by ~19 h; a replication that replays like a
    # checkpoint, SWIFT's by 73 h), not these strategies' seconds-scale recovery costs:
    # test_hours_lost_beyond_failure_free_time does.
    ("Wide-ResNet-50", "checkfreq"): 5.0,
    ("Wide-ResNet-50", "elastic_horovod"): 5.0,
    ("Wide-ResNet-50", "swift"): 5.0,
    # The saving is 0.4 h, a difference of two totals rounded to 0.1 h: the paper's saving lies
    # in 0.3..0.5 h. Monte Carlo noise is small (5 failures losing U(0, 0.29 h): standard error
    # of the saving ~0.04 h). 0.12 h is 30 % of the saving, and doubling SWIFT's replay
    # fraction (0.13 h left) fails it.
    ("ViT-128/32", "swift"): 0.12,
    # 27 failures losing U(0, 5000 x 3.32 s = 4.61 h): 2.2 h standard error for the global
    # checkpoint; SWIFT replays 0.21 of the same draws, so the saving's is ~1.7 h; 4 h is ~2.3
    # of them (seed 0 gives 50.2 h, 200 repeats 48.6 h, the paper 48.1 h). Doubling SWIFT's
    # replay fraction costs 13.6 h.
    ("BERT-128", "swift"): 4.0,
}

# Hours lost beyond the failure-free compute time (total - Table 4), for the strategies that
# lose at most 30 iterations per failure: their totals have a 95 % CI of +-0.05 h, so only
# the paper's rounding (two figures to 0.1 h) is left: 0.15 h. These cells are fitted
# (restart_s to SWIFT's, snapshot_cost_s to the other two), so this is a regression pin of the
# cost arithmetic: doubling the shared restart (28 x 98.8 s) moves each by 0.77 h.
LOST_BEYOND_FAILURE_FREE_TOLERANCE_H = 0.15
LOW_NOISE_CELLS = [("Wide-ResNet-50", "swift"), ("Wide-ResNet-50", "checkfreq"), ("Wide-ResNet-50", "elastic_horovod")]


def saving(row: dict[str, float], strategy: str) -> float:
    return row["global_checkpoint"] - row[strategy]


def saving_ok(row: dict[str, float], workload: str, strategy: str) -> bool:
    want = saving(PAPER[workload], strategy)
    return abs(saving(row, strategy) - want) <= SAVING_TOLERANCE_H[(workload, strategy)]


def lost_ok(row: dict[str, float], workload: str, strategy: str) -> bool:
    want = PAPER[workload][strategy] - FAILURE_FREE[workload]
    return abs(row[strategy] - FAILURE_FREE[workload] - want) <= LOST_BEYOND_FAILURE_FREE_TOLERANCE_H


def old_total_ok(row: dict[str, float], workload: str, strategy: str) -> bool:
    """The check this file made before: the total within 3 %."""
    return abs(row[strategy] - PAPER[workload][strategy]) <= 0.03 * PAPER[workload][strategy]


def run_json(config: Path, *extra: str) -> dict[str, dict[str, float]]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([str(config), "--json", *extra]) == 0
    return json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def table() -> dict[str, dict[str, float]]:
    # Module-scoped, so capsys (function-scoped) cannot be used: capture by hand.
    return run_json(CONFIG)


def test_failure_counts_are_failure_free_time_over_17_hours() -> None:
    cfg = load_sim_config(CONFIG)
    counts = {w.workload.name: w.failures.expected_count(w.workload.compute_s / 3600) for w in cfg.workloads}
    assert counts == {"Wide-ResNet-50": 28, "ViT-128/32": 5, "BERT-128": 27}
    assert cfg.repeats == 10
    assert all(w.failures.model == "uniform" for w in cfg.workloads)


@pytest.mark.parametrize(("workload", "strategy"), sorted(SAVING_TOLERANCE_H))
def test_saving_vs_global_checkpoint(table: dict[str, dict[str, float]], workload: str, strategy: str) -> None:
    row = table[workload]
    assert saving_ok(row, workload, strategy), (
        f"{workload} {strategy}: saves {saving(row, strategy):.2f} h vs the global checkpoint, the paper "
        f"{saving(PAPER[workload], strategy):.2f} h (+-{SAVING_TOLERANCE_H[(workload, strategy)]} h)"
    )


@pytest.mark.parametrize(("workload", "strategy"), LOW_NOISE_CELLS)
def test_hours_lost_beyond_failure_free_time(table: dict[str, dict[str, float]], workload: str, strategy: str) -> None:
    row = table[workload]
    assert lost_ok(row, workload, strategy), (
        f"{workload} {strategy}: {row[strategy] - FAILURE_FREE[workload]:.2f} h beyond failure-free, the paper "
        f"{PAPER[workload][strategy] - FAILURE_FREE[workload]:.2f} h"
    )


def test_speedups_and_ordering(table: dict[str, dict[str, float]]) -> None:
    for workload, paper in PAPER.items():
        row = table[workload]
        want = paper["global_checkpoint"] / paper["swift"]
        assert abs(row["global_checkpoint"] / row["swift"] - want) <= 0.03 * want, (workload, row)
    row = table["Wide-ResNet-50"]
    # The ordering the paper reports: SWIFT < Elastic Horovod < CheckFreq < global checkpoint.
    assert row["swift"] < row["elastic_horovod"] < row["checkfreq"] < row["global_checkpoint"]


def test_json_has_the_required_strategy_names(table: dict[str, dict[str, float]]) -> None:
    assert set(table) == set(PAPER)
    assert {"global_checkpoint", "checkfreq", "elastic_horovod", "swift"} <= set(table["Wide-ResNet-50"])
    for row in table.values():
        assert all(isinstance(v, float) for v in row.values())


def _strategies(doc: dict[str, Any], workload: str) -> dict[str, Any]:
    return next(w for w in doc["workloads"] if w["name"] == workload)["strategies"]


def _double_replay_fraction(workload: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        _strategies(doc, workload)["swift"]["logging"]["replay_fraction"] *= 2

    return mutate


def _double_restart(doc: dict[str, Any]) -> None:
    doc["defaults"]["restart_s"] *= 2


@pytest.mark.parametrize(
    ("workload", "mutate", "new_check"),
    [
        ("BERT-128", _double_replay_fraction("BERT-128"), saving_ok),
        ("ViT-128/32", _double_replay_fraction("ViT-128/32"), saving_ok),
        # Shared by every strategy, so the saving does not move: the lost-hours pin catches it.
        ("Wide-ResNet-50", _double_restart, lost_ok),
    ],
    ids=["bert-replay-fraction-x2", "vit-replay-fraction-x2", "wide-resnet-restart-x2"],
)
def test_a_doubled_recovery_cost_trips_the_new_check_not_the_old_one(
    tmp_path: Path,
    workload: str,
    mutate: Callable[[dict[str, Any]], None],
    new_check: Callable[[dict[str, float], str, str], bool],
) -> None:
    doc = copy.deepcopy(yaml.safe_load(CONFIG.read_text()))
    mutate(doc)
    path = tmp_path / "perturbed.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    row = run_json(path, "--workload", workload)[workload]
    assert old_total_ok(row, workload, "swift") and old_total_ok(row, workload, "global_checkpoint"), row
    assert not new_check(row, workload, "swift"), row
