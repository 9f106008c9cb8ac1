"""The buddy copier's staging on the GPU (ds_swift.protect.buddy_holdings.stage): a rank's partition copied
into pinned host buffers on a side stream that waits for the step's event, so the copy never holds
up the training stream; the staged copy is the state as the step left it. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ds_swift.protect.buddy_holdings import BuddyHoldings, stage
from ds_swift.recovery.state.transfer import encode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_staged_partition_is_the_state_after_the_step_in_pinned_memory() -> None:
    state = {
        "master": torch.zeros(1 << 22, device="cuda"),
        "exp_avg": torch.zeros(1 << 22, device="cuda"),
        "step": torch.zeros(1, dtype=torch.int64, device="cuda"),
    }
    manifest, tensors = encode(state)
    live = [t.reshape(-1) for t in tensors]
    holdings = BuddyHoldings()
    for version in range(3):
        for t in live:  # "the step": queued on the training stream, not finished when staging starts
            t.add_(1)
        ready = torch.cuda.current_stream().record_event()
        staged, flats = stage(holdings, version, manifest, live, ready)
        assert all(f.is_pinned() for f in flats.values())
        assert all(torch.equal(s, torch.full_like(s, version + 1)) for s in staged)
    assert holdings.own_versions() == (1, 2)
