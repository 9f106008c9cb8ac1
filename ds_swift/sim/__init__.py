"""What-if simulator: end-to-end training time with failures, per fault-tolerance strategy.

Pure functions on plain data (no processes, no torch):

- :mod:`ds_swift.sim.model`: ``Workload``, ``StrategySpec`` and the per-failure cost model;
- :mod:`ds_swift.sim.failures`: ``FailureModel`` (uniform count, exponential, Weibull);
- :mod:`ds_swift.sim.runner`: ``simulate`` (repeats, mean, 95% CI) and the sweeps;
- :mod:`ds_swift.sim.recommend`: optimal intervals; :mod:`ds_swift.sim.plan_recommend`:
  ``recommend_for_plan`` for the planner (what it reads of the plan: :mod:`ds_swift.sim.plan_shape`);
- :mod:`ds_swift.sim.schema`: the YAML input of ``ds-swift simulate`` (``load_sim_config``);
- :mod:`ds_swift.sim.scale_model`: how a recovery's cost grows with the ranks, fitted from
  ``benchmarks/scale.py`` (``load_scale_model``: a workload's ``restart_s`` at its size);
- :mod:`ds_swift.sim.profile`: bench profiles, measured costs for ``--profile`` (``load_profile``;
  their rows: :mod:`ds_swift.sim.profile_rows`);
- :mod:`ds_swift.sim.study`, :mod:`ds_swift.sim.plots`, :mod:`ds_swift.sim.cli`: the command.

Names are loaded on first use so that ``ds-swift --help`` does not import numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "FailureModel",
    "LoggingSpec",
    "ScaleModel",
    "StrategySpec",
    "Workload",
    "apply_profile",
    "load_profile",
    "load_scale_model",
    "load_sim_config",
    "optimal_interval",
    "recommend",
    "recommend_for_plan",
    "simulate",
]

_WHERE = {
    "FailureModel": "ds_swift.sim.failures",
    "LoggingSpec": "ds_swift.sim.model",
    "ScaleModel": "ds_swift.sim.scale_model",
    "StrategySpec": "ds_swift.sim.model",
    "Workload": "ds_swift.sim.model",
    "apply_profile": "ds_swift.sim.profile",
    "load_profile": "ds_swift.sim.profile",
    "load_scale_model": "ds_swift.sim.scale_model",
    "load_sim_config": "ds_swift.sim.schema",
    "optimal_interval": "ds_swift.sim.recommend",
    "recommend": "ds_swift.sim.recommend",
    "recommend_for_plan": "ds_swift.sim.plan_recommend",
    "simulate": "ds_swift.sim.runner",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'ds_swift.sim' has no attribute {name!r}")
