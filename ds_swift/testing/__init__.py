"""Failure injection and the test scaffolding shipped with ds-swift (tests, the demo, benchmarks).

- ``faults``: ``--inject`` specs and the injector the runtime consults;
- ``procs``: real processes with a deadline, always killed (``ProcessSet``, ``free_port``);
- ``jobs``: one job under ``ds-swift-launch`` (``run_job``);
- ``ranks``: N gloo ranks of one script (``run_ranks``, ``gloo_rank`` on the worker side);
- ``checkpoints``: bit-for-bit comparison of checkpoint tags and state dicts;
- ``pipeline_model``: the small DeepSpeed pipeline of the message-logging tests and benchmarks.

Nothing here imports torch at import time (``pipeline_model`` aside, which workers import): the
launcher validates ``--inject`` before it starts anything heavy.
"""

from ds_swift.testing.faults import PHASES, FaultSpec, FaultSpecError, Injector, format_specs

__all__ = ["PHASES", "FaultSpec", "FaultSpecError", "Injector", "format_specs"]
