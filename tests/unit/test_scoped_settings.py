"""ds-swift's process-wide settings are scoped (issue 16): the long op timeout of a checkpoint
save is given back to every group afterwards, and the determinism switch to the user on close."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from ds_swift.patches.deepspeed_rebuild import long_op_timeout
from ds_swift.patches.determinism import ScopedDeterminism
from ds_swift.runtime.engine import SwiftPipelineEngine


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-rank gloo world in this process (an in-memory store), destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=5))
    try:
        yield
    finally:
        dist.destroy_process_group()


def timeouts(group: dist.ProcessGroup) -> list[datetime.timedelta]:
    backend = group._get_backend(torch.device("cpu"))
    return [backend.options._timeout]


def test_a_long_save_timeout_covers_every_group_and_is_given_back(world_of_one: None) -> None:
    world = dist.group.WORLD
    assert world is not None
    sub = dist.new_group([0], timeout=datetime.timedelta(seconds=3))
    handle = long_op_timeout(100.0)
    try:
        assert timeouts(world) == timeouts(sub) == [datetime.timedelta(seconds=100)]
        dist.barrier()  # the groups still work under the long timeout
    finally:
        handle.remove()
    assert timeouts(world) == [datetime.timedelta(seconds=5)]
    assert timeouts(sub) == [datetime.timedelta(seconds=3)]  # each its own, not one for all
    dist.barrier(group=sub)


def test_without_a_process_group_the_long_timeout_is_a_no_op() -> None:
    assert not dist.is_initialized()
    long_op_timeout(100.0).remove()


def closable() -> SwiftPipelineEngine:
    """A SwiftPipelineEngine with what close() touches, the rest left out; its determinism switched
    on as __init__ switches it."""
    engine = SwiftPipelineEngine.__new__(SwiftPipelineEngine)
    parts = {
        "_timeline": mock.Mock(),
        "_monitor": mock.Mock(),
        "_hooks": mock.Mock(),
        "_recv_patch": mock.Mock(),
        "_rebuild": SimpleNamespace(protect=mock.Mock(**{"get.return_value": None})),
        "_ckpt": mock.Mock(),
    }
    vars(engine).update(
        parts, _closed=False, _ctx=SimpleNamespace(env=None, store=None), _determinism=ScopedDeterminism()
    )
    vars(engine)["_write_usage"] = lambda: None
    return engine


def settings() -> tuple[bool, bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        bool(torch.utils.deterministic.fill_uninitialized_memory),
    )


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    before = settings()
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]


@pytest.mark.parametrize("user", [(False, False, True), (False, True, False), (True, False, True), (True, True, False)])
def test_close_gives_the_users_determinism_setting_back(
    user: tuple[bool, bool, bool], restore_determinism: None
) -> None:
    torch.use_deterministic_algorithms(user[0], warn_only=user[1])
    torch.utils.deterministic.fill_uninitialized_memory = user[2]
    engine = closable()
    # On while the engine lives: deterministic kernels; the user's own fill setting if they turned
    # determinism on, else no NaN fill of every fresh allocation.
    assert settings() == ((True, True, False) if not user[0] else user)
    engine.close()
    assert settings() == user
    engine.close()  # twice: nothing more changes
    assert settings() == user


def test_fresh_allocations_are_not_nan_filled_while_ds_swift_keeps_determinism(restore_determinism: None) -> None:
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    scoped = ScopedDeterminism()
    try:
        # torch's NaN fill of torch.empty made each ZeRO step allocate-and-fill a 5e8-element bucket.
        assert not torch.utils.deterministic.fill_uninitialized_memory
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        scoped.restore()
    assert torch.empty(4).numel() == 4 and torch.utils.deterministic.fill_uninitialized_memory
