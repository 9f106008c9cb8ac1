"""CheckFreq (Mohan et al., FAST'21) as a strategy (``"strategy": "checkfreq"``): asynchronous global
checkpoints at an interval chosen from measured costs (ds_swift.checkpoint.checkfreq: at most
``checkfreq.max_overhead`` of training time), recovered like every checkpoint: every rank reloads
the newest complete one (:class:`~ds_swift.recovery.strategies.global_checkpoint.GlobalCheckpointStrategy`).
"""

from __future__ import annotations

from ds_swift.recovery.services import StrategyServices
from ds_swift.recovery.strategies.global_checkpoint import GlobalCheckpointStrategy

__all__ = ["CheckFreqStrategy"]


class CheckFreqStrategy(GlobalCheckpointStrategy):
    """Every rank reloads the last global checkpoint; CheckFreq chose how often one is saved."""

    name = "checkfreq"
    auto = False  # the interval tuner runs only when the config names this strategy
    SERVICES = StrategyServices(async_checkpoints=True, checkpoint_tuner=True, sim_kind="snapshot")
