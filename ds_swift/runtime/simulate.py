"""Nicolae et al.'s failure-simulation mode (``simulate_failure`` in the swift section).

shared/papers/nicolae-*.txt, section III-C: to measure what an approximate strategy does to the
model, a failure is simulated without killing anything, and the run goes on to the end, to be
compared with the failure-free run (``benchmarks/failure_simulation.py``):

- ``lossy_forward``: the failed iteration averages only the surviving replicas' gradients; the
  casualties' count as zero from ``upto_layer`` down (ds_swift.recovery.gradmask), every layer by
  default. What the ``lossy_forward`` strategy does after a real failure, bit for bit.
- ``immediate_rollback``: the ranks of ``stepped_stages`` had stepped when the failure hit, the
  others had not; then everyone trains the failed mini-batch again. Here the iteration is trained
  once, the ranks of the other stages put back their state from before it (a copy taken before its
  first forward pass: exact, one state copy of host memory for that iteration), every rank's LR
  schedule and counters go back one iteration, and the iteration is trained again. What the
  ``immediate_rollback`` strategy does after a real failure with those stages stepped.

Paper and DeepSpeed differ in one thing: Horovod reduces and applies gradients layer by layer during
the backward pass, so a failure leaves some layers updated; DeepSpeed's pipeline reduces after the
whole backward and then every rank steps, so what a real failure leaves partly done is a set of
ranks (stages) that stepped. Hence ``stepped_stages`` for the immediate rollback, and
``upto_layer`` (the paper's knob) kept for the lossy forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds_swift.config import ConfigError, SimulateConfig
from ds_swift.recovery.gradmask import GradScale, lossy_factor
from ds_swift.recovery.state.transfer import capture_state, finish_restore, flatten, load_state, set_counters, unflatten

__all__ = ["FailureSimulation"]


def _copy(state: Any) -> Any:
    skeleton, tensors = flatten(state)
    return unflatten(skeleton, [t.detach().clone() for t in tensors])


class FailureSimulation:
    """One rank's part of the simulated failure (generation 0 only: a real recovery ends it)."""

    def __init__(self, cfg: SimulateConfig, log: Callable[[str], None]) -> None:
        assert cfg.iteration is not None
        self.cfg = cfg
        self.iteration = cfg.iteration
        self._log = log
        self._saved: dict[str, Any] | None = None
        self.done = False

    def grad_scale(self, engine: Any) -> GradScale | None:
        """lossy_forward: this rank's gradient scaling of the simulated iteration."""
        if self.cfg.strategy != "lossy_forward":
            return None
        dp = int(engine.grid.get_data_parallel_world_size())
        casualties = self.cfg.casualties or (dp - 1,)
        if max(casualties) >= dp or len(set(casualties)) >= dp:
            raise ConfigError(
                f"swift config: simulate_failure.casualties={list(casualties)} is invalid: data-parallel replica "
                f"indices below {dp}, leaving at least one survivor"
            )
        factor = lossy_factor(int(engine.grid.get_data_parallel_id()), casualties, dp)
        self._log(f"simulated failure (lossy forward) at iteration {self.iteration}: replicas {list(casualties)} "
                  f"lost; my gradients x {factor:g}")  # fmt: skip
        return GradScale(self.iteration, factor, self.cfg.upto_layer)

    def before(self, engine: Any) -> None:
        """immediate_rollback, before the simulated iteration's first pass: what to put back after it."""
        if self.cfg.strategy != "immediate_rollback" or self.done or int(engine.global_steps) != self.iteration:
            return
        stepped = int(engine.stage_id) in self.cfg.stepped_stages
        sched = getattr(engine, "lr_scheduler", None)
        self._saved = {
            "schedule": _copy(sched.state_dict()) if sched is not None else None,
            "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
            "state": None if stepped else _copy(capture_state(engine)),
        }

    def roll_back(self, engine: Any) -> bool:
        """immediate_rollback, after the simulated iteration's first pass: put back what the failure
        would have left and say that the iteration must be trained again (True), once."""
        saved, self._saved = self._saved, None
        if saved is None:
            return False
        self.done = True
        if saved["state"] is not None:
            load_state(engine, saved["state"], self.iteration)
        else:
            if saved["schedule"] is not None:
                engine.lr_scheduler.load_state_dict(saved["schedule"])
            set_counters(engine, self.iteration, skipped_steps=saved["skipped_steps"])
        finish_restore(engine)  # the low-precision parameters from the masters (per data-parallel group)
        kept = "kept its update" if saved["state"] is None else "did not apply it"
        self._log(f"simulated failure (immediate rollback) at iteration {self.iteration}: my stage {kept}; "
                  "training the mini-batch again")  # fmt: skip
        return True
