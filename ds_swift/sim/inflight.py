"""The simulator's cost of the iteration in flight after a PipeChurn decode: full retrain vs partial.

Once the lost ranks' states are decoded at the consensus, the iteration that was in flight must be
done again. Today's full retrain runs it again on every rank, pipeline bubbles included: one
iteration. PipeChurn's partial recomputation (section 3.5; ds_swift.recovery.strategies.pipechurn)
runs only the lost ranks' passes, fed from what their surviving neighbours kept: no bubble, since
every input is already there, so a lost stage's ``M`` passes take ``M`` of the ``M + p - 1`` slots of
a 1F1B iteration, plus the transfer of the kept sends; lost ranks on different machines run at once.
A failure in the middle of the iteration (``done`` < 1 of the lost ranks' passes had run) costs the
share of those passes that ran; the survivors keep the passes they finished and run the rest live,
as the failure-free run would have.

The model (per failure, ``M`` micro-batches, ``p`` stages, an iteration of ``T`` seconds)::

    full:    T                                          passes M * ranks, busiest M
    partial: T * M / (M + p - 1) * done + transfer_s    passes M * lost,  busiest M

Pure functions on the workload (ds_swift.sim.model.Workload); ``ds-swift bench`` measures both
(``pipechurn_full``, ``pipechurn_partial``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_swift.sim.specs import Workload

__all__ = ["InflightCost", "inflight_cost", "partial_saving_s", "passes_share"]


@dataclass(frozen=True)
class InflightCost:
    """What getting the iteration in flight done again costs after one failure."""

    seconds: float
    """Wall-clock seconds on the critical path (the busiest rank), the step excluded (both run it)."""
    passes: int
    """Micro-batch passes (one forward and one backward of one stage) run again, all ranks."""
    passes_busiest: int
    """Of those, the busiest rank's."""


def passes_share(workload: Workload) -> float:
    """A lost stage's passes of one iteration, without the pipeline's fill and drain, as a share of
    the iteration: ``M / (M + p - 1)`` of a 1F1B schedule's slots."""
    return workload.micro_batches / (workload.micro_batches + workload.pipeline_stages - 1)


def inflight_cost(
    workload: Workload,
    ranks: int,
    lost_ranks: int = 1,
    partial: bool = True,
    transfer_s: float = 0.0,
    done: float = 1.0,
) -> InflightCost:
    """The cost of the iteration in flight after a decode.

    Args:
        workload: the job (``iteration_time_s``, ``pipeline_stages``, ``micro_batches``).
        ranks: the ranks of the job (the full retrain runs every one's passes again).
        lost_ranks: the ranks whose state was lost (partial: only theirs run again).
        partial: PipeChurn's partial recomputation, else the full retrain.
        transfer_s: partial: the time to move the kept sends to the lost ranks.
        done: partial: the share of the lost ranks' passes that had run when the failure hit (1:
            every pass, the failure hit the reductions or the step).
    """
    if ranks < 1 or not 0 < lost_ranks <= ranks:
        raise ValueError(f"inflight_cost: need 0 < lost_ranks ({lost_ranks}) <= ranks ({ranks})")
    if transfer_s < 0:
        raise ValueError(f"inflight_cost: transfer_s={transfer_s} must be >= 0")
    if not 0.0 <= done <= 1.0:
        raise ValueError(f"inflight_cost: done={done} must be within [0, 1]")
    m, t = workload.micro_batches, workload.iteration_time_s
    if not partial:
        return InflightCost(t, m * ranks, m)
    return InflightCost(t * passes_share(workload) * done + transfer_s, m * lost_ranks, m)


def partial_saving_s(workload: Workload, transfer_s: float = 0.0) -> float:
    """Seconds per failure partial recomputation saves over the full retrain (the pipeline's fill
    and drain, ``T (p - 1) / (M + p - 1)``, less the transfer); at most zero with one stage."""
    full = inflight_cost(workload, 1, 1, partial=False).seconds
    return full - inflight_cost(workload, 1, 1, partial=True, transfer_s=transfer_s).seconds
