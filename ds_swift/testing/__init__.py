"""Failure injection and process helpers shipped with ds-swift (used by tests, demos, benchmarks).

Nothing here imports torch at import time: the launcher validates ``--inject`` before it
starts anything heavy.
"""

from ds_swift.testing.faults import PHASES, FaultSpec, FaultSpecError, Injector, format_specs

__all__ = ["PHASES", "FaultSpec", "FaultSpecError", "Injector", "format_specs"]
