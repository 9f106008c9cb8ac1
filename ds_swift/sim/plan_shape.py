"""What the planner's recommendation reads from a topology plan (``ds-swift plan --json``): each
stage's recovery path, the recovery groups, the job's shape and its log download per iteration
(for :mod:`ds_swift.sim.plan_recommend`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_swift.config import ConfigError
from ds_swift.sim.model import Workload

__all__ = ["PATHS", "group_sizes", "log_download_s", "plan_workload", "stage_strategies"]


#: the recovery paths a plan's stage can take
PATHS = ("replication", "logging", "checkpoint")


def stage_strategies(plan: Mapping[str, Any]) -> list[str]:
    stages = plan.get("stages")
    if isinstance(stages, Mapping):
        stages = [stages[k] for k in sorted(stages, key=lambda k: int(k))]
    if not isinstance(stages, list) or not stages:
        raise ConfigError("plan: 'stages' must be a non-empty list of per-stage strategies")
    out = []
    for i, st in enumerate(stages):
        if isinstance(st, Mapping):
            st = st.get("strategy", st.get("recovery", st.get("kind")))
        if st not in ("replication", "logging", "checkpoint"):
            raise ConfigError(f"plan: stages[{i}] strategy {st!r} is not replication, logging or checkpoint")
        out.append(str(st))
    return out


def group_sizes(plan: Mapping[str, Any]) -> list[int]:
    groups = plan.get("groups") or []
    if not isinstance(groups, list):
        raise ConfigError("plan: 'groups' must be a list of lists of machine ids")
    return [len(g) if isinstance(g, list) else int(g) for g in groups if (len(g) if isinstance(g, list) else g)]


def _plan_int(plan: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = plan.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        model = plan.get("model")
        if isinstance(model, Mapping):
            value = model.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def plan_workload(
    plan_json: Mapping[str, Any],
    stage_kinds: list[str],
    sizes: list[int],
    total_iterations: int,
    iteration_time_s: float,
    micro_batches: int | None,
) -> Workload:
    """The job a plan describes: pipeline depth, micro-batches and machines from the plan where given."""
    p = _plan_int(plan_json, "pp", "pipeline_stages") or len(stage_kinds)
    m = micro_batches or _plan_int(plan_json, "micro_batches", "num_micro_batches") or 1
    machines = _plan_int(plan_json, "machines", "num_machines") or max(sum(sizes), 1)
    return Workload("plan", total_iterations, iteration_time_s, machines=machines, pipeline_stages=p, micro_batches=m)


def log_download_s(
    plan_json: Mapping[str, Any], sizes: list[int], storage_gbps: float | None, assumptions: list[str]
) -> float:
    """Seconds to download one replayed iteration's log from the global store (0 when unbounded)."""
    log_bytes = plan_json.get("log_bytes_per_iteration")
    if not (storage_gbps and isinstance(log_bytes, (int, float)) and len(sizes) > 1):
        return 0.0
    # A middle group needs one direction of each of its two boundaries: one boundary's worth.
    download = log_bytes / (len(sizes) - 1) / (storage_gbps * 1e9 / 8.0)
    assumptions.append(f"log download {download:.3f} s per replayed iteration at {storage_gbps} Gb/s")
    return float(download)
