"""Nicolae et al.'s failure-simulation mode (``simulate_failure``), the part a strategy owns.

shared/papers/nicolae-*.txt, section III-C: to measure what an approximate strategy does to the
model, a failure is simulated without killing anything and the run goes on to the end, to be
compared with the failure-free run (``benchmarks/failure_simulation.py``). A strategy that can be
simulated returns a :class:`SimulatedFailure` from
:meth:`~ds_swift.recovery.base.RecoveryStrategy.simulated_failure` (``lossy_forward``: the failed
iteration's gradients; ``immediate_rollback``: the stages that stepped); the runtime calls its
hooks around the simulated iteration (ds_swift.runtime.failure_simulation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_swift.logs import say_here
from ds_swift.recovery.gradmask import GradScale
from ds_swift.recovery.state.transfer import flatten, unflatten

if TYPE_CHECKING:
    from ds_swift.config import SimulateConfig

__all__ = ["SimulatedFailure", "copy_state"]


def copy_state(state: Any) -> Any:
    """A detached copy of a captured state (what a simulated rollback puts back)."""
    skeleton, tensors = flatten(state)
    return unflatten(skeleton, [t.detach().clone() for t in tensors])


class SimulatedFailure:
    """One rank's part of a simulated failure (generation 0 only: a real recovery ends it). Each
    hook does nothing unless the strategy's simulation needs it.

    Args:
        cfg: the ``simulate_failure`` section (its ``iteration`` is set).
    """

    def __init__(self, cfg: SimulateConfig) -> None:
        assert cfg.iteration is not None
        self.cfg = cfg
        self.iteration = cfg.iteration
        self.done = False

    def _log(self, msg: str) -> None:
        """One line on ds-swift's channel, tagged with this rank."""
        say_here(msg, name=type(self).__module__)

    def grad_scale(self, engine: Any) -> GradScale | None:
        """This rank's gradient scaling of the simulated iteration (None: none)."""
        return None

    def before(self, engine: Any) -> None:
        """Before the simulated iteration's first pass."""

    def roll_back(self, engine: Any) -> bool:
        """After the simulated iteration's first pass: whether it must be trained again."""
        return False
