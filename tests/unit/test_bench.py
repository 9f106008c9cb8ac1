"""``ds-swift bench`` (issue 13): its rows, table and argument checks, from job directories made here
(the jobs themselves run in tests/dist/test_bench_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_swift.bench.profile import checkpoint_stall_s
from ds_swift.bench.run import (
    BenchError,
    bench_profile,
    bench_rows,
    format_table,
    step_seconds,
    strategy_overrides,
    usage,
)
from ds_swift.cli import main
from ds_swift.sim.profile import parse_profile
from ds_swift.testing.checkpoints import compare_tensors, ulp_distance
from ds_swift.testing.jobs import JobRun


def fake_job(
    root: Path,
    name: str,
    losses: list[tuple[int, float, float]],
    weight: torch.Tensor,
    timelines: list[dict] | None = None,
    usages: list[dict] | None = None,
    rss: int = 0,
) -> JobRun:
    job = JobRun(root / name, iterations=4)
    job.final_tag.mkdir(parents=True)
    (job.dir / "peak_rss.json").write_text(json.dumps({"max_rss_bytes": rss}))
    torch.save({"module": {"w": weight}}, job.final_tag / "mp_rank_00_model_states.pt")
    job.loss_log.write_text("".join(json.dumps({"iteration": i, "loss": v, "time": t}) + "\n" for i, v, t in losses))
    job.run_dir.mkdir(parents=True, exist_ok=True)
    for n, tl in enumerate(timelines or []):
        (job.run_dir / f"timeline-gen{n}.json").write_text(json.dumps(tl))
    (job.run_dir / "usage").mkdir()
    for u in usages or []:
        (job.run_dir / "usage" / f"rank{u['rank']}.json").write_text(json.dumps(u))
    return job


W = torch.tensor([1.0, 2.0, 3.0])
STEADY = [(0, 3.0, 100.0), (1, 2.5, 101.0), (2, 2.0, 102.0), (3, 1.5, 103.0)]


def test_a_row_reports_what_the_runs_show(tmp_path: Path) -> None:
    ref = fake_job(tmp_path, "none", STEADY, W, rss=100 << 20)
    slower = [(0, 3.0, 100.0), (1, 2.5, 102.0), (2, 2.0, 104.0), (3, 1.5, 106.0)]
    clean = fake_job(
        tmp_path,
        "clean",
        slower,
        W.clone(),
        rss=150 << 20,
        usages=[
            {"rank": 0, "log_bytes": 4000, "buddy_host_bytes": 10},
            {"rank": 1, "log_bytes": 4000, "buddy_host_bytes": 30},
        ],
    )
    (clean.ckpt_dir / "global_step2").mkdir(parents=True)
    (clean.ckpt_dir / "global_step2" / "x.pt").write_bytes(b"\0" * 800)
    # Trained iteration 2 twice (a checkpoint restart) and ended one float32 ulp off in one element.
    again = [*STEADY[:3], (2, 2.0, 110.0), (3, 1.25, 111.0)]
    off = W.clone()
    off[1] = torch.nextafter(off[1], torch.tensor(9.0))
    tl = {"strategy": "checkpoint", "reason": "forced", "total_s": 4.0, "initialization_s": 1.5, "recovery_s": 2.5}
    failed = fake_job(tmp_path, "failed", again, off, timelines=[tl])
    (row,) = bench_rows(ref, {"checkpoint": (clean, failed)})
    assert row["recovered_by"] == ["checkpoint"]
    assert row["throughput_ratio"] == pytest.approx(0.5)  # steps of 2 s against 1 s
    assert (row["total_s"], row["initialization_s"], row["recovery_s"]) == (4.0, 1.5, 2.5)
    assert row["iterations_lost"] == 1
    assert row["final_loss_delta"] == pytest.approx(-0.25)
    assert not row["bitwise"] and row["max_ulp"] == 1.0
    assert row["failure_free_bitwise"]
    assert row["bytes_per_iteration"] == pytest.approx((8000 + 800) / 4)
    assert row["max_rss_bytes"] == 150 << 20 and row["rss_vs_reference"] == pytest.approx(1.5)
    assert row["buddy_host_bytes"] == 30
    table = format_table([row])
    assert "checkpoint" in table[2] and "1 ulp" in table[2] and "0.500" in table[2]
    # The JSON is a bench profile the simulator reads: checkpoint named as the simulator names it.
    profile = parse_profile(bench_profile(ref, {"checkpoint": (clean, failed)}, [row], interval=2))
    (prow,) = profile.strategies
    assert (prow.name, prow.kind, prow.iterations_lost, prow.exact, prow.max_ulp) == (
        "global_checkpoint",
        "checkpoint",
        1,
        False,
        1,
    )
    assert profile.iteration_time_s == 1.0 and prow.host_memory_per_rank == 50 << 20


def test_a_logging_row_counts_the_replayed_iterations(tmp_path: Path) -> None:
    ref = fake_job(tmp_path, "none", STEADY, W)
    tl = {
        "strategy": "logging",
        "reason": "",
        "total_s": 3.0,
        "initialization_s": 1.0,
        "recovery_s": 2.0,
        "checkpoint_step": 8,
        "pre_failure_iteration": 11,
        "replay": {"replay_s": 1.5},
    }
    clean, failed = fake_job(tmp_path, "c", STEADY, W), fake_job(tmp_path, "f", STEADY, W, timelines=[tl])
    rows = bench_rows(ref, {"logging": (clean, failed)})
    assert rows[0]["iterations_lost"] == 0  # no survivor trained anything twice
    (prow,) = parse_profile(bench_profile(ref, {"logging": (clean, failed)}, rows, interval=8)).strategies
    assert (prow.kind, prow.iterations_lost, prow.exact) == ("logging", 3, True)
    assert prow.restore_s == pytest.approx(0.5)


def test_parallel_and_sequential_replay_rows_count_the_work_recomputed(tmp_path: Path) -> None:
    """The variants run logging-based recovery with and without parallel recovery; each row counts
    the micro-batch passes its replay ran (all replayers / the busiest one), and the table shows them."""
    assert strategy_overrides("logging_parallel", 8) == {
        "strategy": "logging",
        "parallel_recovery": True,
        "parallel_recovery_force": True,
        "checkpoint": {"interval": 8},
    }
    assert strategy_overrides("logging_sequential", 8) == {
        "strategy": "logging",
        "parallel_recovery": False,
        "checkpoint": {"interval": 8},
    }
    ref = fake_job(tmp_path, "none", STEADY, W)
    runs = {}
    for name, passes, busiest, mode in (("logging_sequential", 32, 16, None), ("logging_parallel", 32, 8, "exact")):
        tl = {
            "strategy": "logging",
            "reason": "",
            "total_s": 3.0,
            "initialization_s": 1.0,
            "recovery_s": 2.0,
            "checkpoint_step": 8,
            "pre_failure_iteration": 11,
            "replay": {
                "replay_s": 1.5,
                "parallel": mode,
                "micro_batch_passes": passes,
                "micro_batch_passes_busiest": busiest,
            },
        }
        runs[name] = (fake_job(tmp_path, f"{name}-c", STEADY, W), fake_job(tmp_path, f"{name}-f", STEADY, W, [tl]))
    rows = bench_rows(ref, runs)
    assert [(r["recomputed_passes"], r["recomputed_passes_busiest"], r["parallel_replay"]) for r in rows] == [
        (32, 16, [None]),
        (32, 8, ["exact"]),
    ]
    table = format_table(rows)
    assert "recomputed" in table[0] and table[2].endswith("32/16") and table[3].endswith("32/8")


def test_pipechurn_full_and_partial_rows_count_the_passes_of_the_iteration_in_flight(tmp_path: Path) -> None:
    """PipeChurn without and with partial recomputation: every rank's passes of the iteration in flight
    (16 on 4 ranks of 4 micro-batches) against the lost rank's (4), from the recovery timeline."""
    assert strategy_overrides("pipechurn_full", 8) == {
        "strategy": "pipechurn",
        "pipechurn": {"partial_recompute": False},
        "checkpoint": {"interval": 8},
    }
    assert strategy_overrides("pipechurn_partial", 8)["pipechurn"] == {"partial_recompute": True}
    ref = fake_job(tmp_path, "none", STEADY, W)
    runs = {}
    for name, passes, partial in (("pipechurn_full", 16, False), ("pipechurn_partial", 4, True)):
        tl = {
            "strategy": "pipechurn",
            "reason": "",
            "total_s": 3.0,
            "initialization_s": 1.0,
            "recovery_s": 2.0,
            "checkpoint_step": -1,
            "pre_failure_iteration": 11,
            "replay": {
                "partial": partial,
                "in_flight": 11,
                "micro_batch_passes": passes,
                "micro_batch_passes_busiest": 4,
            },
        }
        runs[name] = (fake_job(tmp_path, f"{name}-c", STEADY, W), fake_job(tmp_path, f"{name}-f", STEADY, W, [tl]))
    table = format_table(bench_rows(ref, runs))
    assert table[2].endswith("16/4") and table[3].endswith("4/4"), table


def test_an_elastic_row_measures_the_shrunk_speed(tmp_path: Path) -> None:
    """No spare: the job shrank at iteration 4 (consensus 3) and went on at half speed; the profile
    row is kind elastic with that speed, which the simulator's elastic model reads."""
    ref = fake_job(tmp_path, "none", STEADY, W)
    losses = (
        [(i, 1.0, 100.0 + i) for i in range(4)]
        + [(4, 1.0, 110.0)]
        + [(i, 1.0, 110.0 + 2 * (i - 4)) for i in range(5, 9)]
    )
    tl = {
        "strategy": "lossy_forward",
        "reason": "",
        "total_s": 3.0,
        "initialization_s": 1.0,
        "recovery_s": 0.5,
        "consensus": 3,
        "resize": {"kind": "shrink", "dp": [2, 1]},
    }
    clean, failed = fake_job(tmp_path, "c", STEADY, W), fake_job(tmp_path, "f", losses, W, timelines=[tl])
    rows = bench_rows(ref, {"lossy_forward_elastic": (clean, failed)})
    assert rows[0]["shrunk_throughput"] == pytest.approx(0.5)
    (prow,) = parse_profile(bench_profile(ref, {"lossy_forward_elastic": (clean, failed)}, rows, interval=8)).strategies
    assert (prow.kind, prow.shrunk_throughput) == ("elastic", pytest.approx(0.5))
    # A spare took the failed machine's place: no shrink, no elastic row.
    spare = fake_job(tmp_path, "s", STEADY, W, timelines=[{**tl, "resize": None}])
    assert bench_rows(ref, {"lossy_forward": (clean, spare)})[0]["shrunk_throughput"] is None


def test_the_checkpoint_stall_is_the_excess_of_the_save_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_swift.bench.profile as bench

    times = [0.0, 1.0, 2.0, 3.0, 6.0, 7.0, 8.0, 9.0]  # iteration 3 ends a checkpoint interval of 4: +2 s
    monkeypatch.setattr(bench, "loss_series", lambda _job: [(t, i, 1.0) for i, t in enumerate(times)])
    # One save inside the run (after iteration 3); the one after iteration 7 is past its last line.
    assert checkpoint_stall_s(JobRun(Path("/nonexistent"), iterations=8), interval=4, warmup=0) == pytest.approx(2.0)


def test_step_time_counts_each_iteration_once(tmp_path: Path) -> None:
    # A retrained iteration's second line is not a step: the gap it leaves is the recovery's.
    job = fake_job(tmp_path, "j", [(0, 1, 0.0), (1, 1, 1.0), (2, 1, 2.0), (3, 1, 3.0), (2, 1, 50.0), (3, 1, 51.0)], W)
    assert step_seconds(job, warmup=0) == 1.0


def test_usage_without_records_is_zero(tmp_path: Path) -> None:
    job = fake_job(tmp_path, "j", STEADY, W)
    assert usage(job)["ranks_reporting"] == 0 and usage(job)["log_bytes"] == 0


def test_ulps_count_representable_values_across_zero() -> None:
    tiny = torch.tensor([1e-45])  # the smallest float32 subnormal
    assert ulp_distance(tiny, -tiny) == 2.0
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])) == 0.0
    assert ulp_distance(torch.tensor([1.0]).bfloat16(), torch.tensor([1.0078125]).bfloat16()) == 1.0
    assert compare_tensors({"a": torch.ones(2)}, {"a": torch.ones(2, dtype=torch.float64)}).max_ulp == float("inf")


def test_strategies_are_checked_by_name() -> None:
    assert strategy_overrides("none", 8) == {"enabled": False}
    assert strategy_overrides("lossy_forward_elastic", 8) == {"strategy": "elastic", "checkpoint": {"interval": 8}}
    assert strategy_overrides("logging", 8) == {"strategy": "logging", "checkpoint": {"interval": 8}}
    with pytest.raises(BenchError, match="unknown strategy 'tranlog'"):
        strategy_overrides("tranlog", 8)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--strategies", "auto,nope"], "unknown strategy 'nope'"),
        (["--strategies", "none"], "name at least one"),
        (["--kill-iteration", "20", "--iterations", "16"], "--kill-iteration 20"),
        (["--machine", "2"], "--machine 2"),
    ],
)
def test_bad_arguments_name_the_flag(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv]) == 2
    assert says in capsys.readouterr().err
