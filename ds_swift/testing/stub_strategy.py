"""A recovery strategy for tests of what a strategy declares (its words, services, bench variants)."""

from __future__ import annotations

from ds_swift.recovery.base import RankContext, RecoveryOutcome, RecoveryStrategy
from ds_swift.recovery.consensus import RecoveryInputs, RecoveryPlan

__all__ = ["StubStrategy"]


class StubStrategy(RecoveryStrategy):
    """Can always restore, at a cost of 1 s, and restores nothing: a test subclasses it with the
    declarations it checks."""

    name = "stub"

    def can_restore(self, inputs: RecoveryInputs) -> str | None:
        return None

    def expected_cost(self, inputs: RecoveryInputs) -> float:
        return 1.0

    def restore(self, plan: RecoveryPlan, inputs: RecoveryInputs, ctx: RankContext) -> RecoveryOutcome:
        raise NotImplementedError(f"{self.name}: a test stub restores nothing")
