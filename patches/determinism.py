"""Deterministic kernels for the life of a ds-swift engine, without torch's NaN-filled allocations.

Replays and retried iterations must compute what the first run computed, so the engine turns on
``torch.use_deterministic_algorithms`` (warn-only) unless the user already did. That switch also
turns on ``torch.utils.deterministic.fill_uninitialized_memory``: every ``torch.empty`` is then
filled with NaN, a debugging aid, not a determinism guarantee. DeepSpeed's ZeRO optimizer allocates
its reduce bucket (``reduce_bucket_size``, 5e8 elements by default) with ``torch.empty`` every step,
so the fill alone made a tiny GPT's bf16 + ZeRO-1 step 30x slower on CPU (2.3 s against 0.07 s,
``ds-swift bench``) and touched the whole bucket's pages (2.3 GB peak per rank). Where ds-swift
turns determinism on, it keeps the fill off; where the user turned it on, their fill setting
stands. :meth:`ScopedDeterminism.restore` gives back exactly the user's settings.
"""

from __future__ import annotations

import torch
import torch.utils.deterministic

__all__ = ["ScopedDeterminism"]


class ScopedDeterminism:
    """Turn deterministic algorithms on (warn-only, no NaN fill) unless the user did; restore once."""

    def __init__(self, on: bool = True) -> None:
        """``on`` False changes nothing (a benchmark measuring what the setting costs)."""
        self.user = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            bool(torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
        )
        self._restored = False
        self._changed = on and not self.user[0]
        if self._changed:
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]

    def restore(self) -> None:
        """Give the user's settings back (once; later calls do nothing)."""
        if self._restored:
            return
        self._restored = True
        if self._changed:
            torch.use_deterministic_algorithms(False, warn_only=self.user[1])
            torch.utils.deterministic.fill_uninitialized_memory = self.user[2]  # type: ignore[attr-defined]
