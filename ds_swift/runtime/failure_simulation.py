"""Nicolae et al.'s failure-simulation mode (``simulate_failure`` in the swift section): the runtime's
side. What the simulated failure does is the named strategy's
(:meth:`~ds_swift.recovery.base.RecoveryStrategy.simulated_failure`: ``lossy_forward`` scales the
failed iteration's gradients, ``immediate_rollback`` puts back the stages that had not stepped and
trains the iteration again; ds_swift.recovery.simulated_failure says why and how).
"""

from __future__ import annotations

from typing import Any

from ds_swift.config import ConfigError, SimulateConfig
from ds_swift.recovery.gradmask import GradScale
from ds_swift.recovery.registry import STRATEGIES
from ds_swift.recovery.simulated_failure import SimulatedFailure

__all__ = ["FailureSimulation"]


class FailureSimulation:
    """One rank's part of the simulated failure (generation 0 only: a real recovery ends it), run by
    the strategy ``cfg.strategy`` names."""

    def __init__(self, cfg: SimulateConfig) -> None:
        sim = STRATEGIES.get(cfg.strategy).simulated_failure(cfg)
        if sim is None:  # the config checks this too; a registry changed in between must not pass silently
            raise ConfigError(f"swift config: simulate_failure.strategy={cfg.strategy!r} has no failure simulation")
        self._sim: SimulatedFailure = sim
        self.iteration = sim.iteration

    @property
    def done(self) -> bool:
        return self._sim.done

    def grad_scale(self, engine: Any) -> GradScale | None:
        """This rank's gradient scaling of the simulated iteration (None: the strategy scales none)."""
        try:
            return self._sim.grad_scale(engine)
        except ValueError as exc:  # a value the config could not check before the engine existed
            raise ConfigError(str(exc)) from exc

    def before(self, engine: Any) -> None:
        """Before the simulated iteration's first pass."""
        self._sim.before(engine)

    def roll_back(self, engine: Any) -> bool:
        """After the simulated iteration's first pass: whether it must be trained again (once)."""
        return self._sim.roll_back(engine)
