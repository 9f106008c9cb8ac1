"""The simulator's cost of the iteration in flight after a PipeChurn decode (ds_swift.sim.inflight)."""

from __future__ import annotations

import pytest

from ds_swift.sim.inflight import inflight_cost, partial_saving_s
from ds_swift.sim.model import Workload


def workload(p: int, m: int) -> Workload:
    return Workload(
        name="w", total_iterations=100, iteration_time_s=1.1, machines=4, pipeline_stages=p, micro_batches=m
    )


def test_partial_recomputation_runs_the_lost_passes_without_the_pipeline_fill() -> None:
    w = workload(p=4, m=8)  # 8 of the 11 slots of a 1F1B iteration are one stage's passes
    full = inflight_cost(w, ranks=8, lost_ranks=2, partial=False)
    part = inflight_cost(w, ranks=8, lost_ranks=2, partial=True, transfer_s=0.05)
    assert (full.seconds, full.passes, full.passes_busiest) == (1.1, 64, 8)
    assert part.seconds == pytest.approx(0.85) and (part.passes, part.passes_busiest) == (16, 8)
    assert partial_saving_s(w, transfer_s=0.05) == pytest.approx(0.25)
    # A failure in the middle of the iteration: a quarter of the lost passes had run, those run again.
    mid = inflight_cost(w, ranks=8, lost_ranks=2, partial=True, done=0.25)
    assert mid.seconds == pytest.approx(0.2) and mid.passes == 16
    with pytest.raises(ValueError, match="done"):
        inflight_cost(w, ranks=8, done=1.5)


def test_one_stage_gains_no_time_only_work_and_bad_inputs_are_refused() -> None:
    w = workload(p=1, m=4)
    assert partial_saving_s(w) == pytest.approx(0.0)
    assert inflight_cost(w, ranks=4, lost_ranks=1).passes == 4
    with pytest.raises(ValueError, match="lost_ranks"):
        inflight_cost(w, ranks=2, lost_ranks=3)
    with pytest.raises(ValueError, match="transfer_s"):
        inflight_cost(w, ranks=2, transfer_s=-1.0)
