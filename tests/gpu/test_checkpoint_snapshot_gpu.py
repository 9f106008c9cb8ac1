"""Asynchronous checkpoints' snapshot on the GPU (ds_swift.checkpoint.snapshot.PinnedCopier): copies
into pinned host buffers on a side stream, equal to the device tensors as they were when the save
began, buffers reused by the next save. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from ds_swift.checkpoint.snapshot import PinnedCopier, snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_pinned_snapshots_hold_the_state_as_saved_and_reuse_their_buffers() -> None:
    copier = PinnedCopier()
    state = {
        "w": torch.randn(4096, 1024, device="cuda"),
        "b": [torch.randn(7, device="cuda").t()],
        "n": 3,
        "view": torch.randn(8, 8, device="cuda")[:, 2],
    }
    want = {"w": state["w"].cpu(), "b": state["b"][0].cpu(), "view": state["view"].cpu()}
    snap = snapshot(state, copier)
    state["w"].add_(1.0)  # queued after the copy: the snapshot must not see it
    copier.finish()
    assert snap["n"] == 3 and snap["w"].is_pinned()
    assert torch.equal(snap["w"], want["w"]) and torch.equal(snap["b"][0], want["b"])
    assert torch.equal(snap["view"], want["view"]) and snap["view"].untyped_storage().nbytes() == 8 * 4
    held = copier.pinned_bytes
    ptr = snap["w"].data_ptr()
    copier.give_back(snap)
    again = snapshot(state, copier)
    copier.finish()
    copier.drop_unused()
    assert again["w"].data_ptr() == ptr and copier.pinned_bytes == held
    assert torch.equal(again["w"], want["w"] + 1.0)
