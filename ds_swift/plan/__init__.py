"""Planning before the job starts: pure functions on data, no process group.

- :mod:`.layout`: where every rank sits (:class:`ParallelLayout`), read from DeepSpeed or
  megatron-core;
- :mod:`.analysis`: :func:`analyze` gives the :class:`Plan` (strategy per stage, logging
  groups, logged sends, the worth-logging verdict), with the sizes of :mod:`.sizes`;
- :mod:`.machine_groups`: a layout's selective-logging groups (section 5.3), cut by the
  optimisers of :mod:`.grouping` (greedy) and :mod:`.grouping_exact`;
- :mod:`.budget`: the storage budget at runtime (the plan from the sizes an engine measured);
- :mod:`.cli`: ``ds-swift plan`` (its tables: :mod:`.tables`).
"""

from __future__ import annotations

from ds_swift.plan.analysis import Plan, analyze, analyze_config
from ds_swift.plan.layout import ParallelLayout, layout_from_deepspeed_topology, layout_from_parallel_state
from ds_swift.plan.sizes import ModelShape

__all__ = [
    "ModelShape",
    "ParallelLayout",
    "Plan",
    "analyze",
    "analyze_config",
    "layout_from_deepspeed_topology",
    "layout_from_parallel_state",
]
