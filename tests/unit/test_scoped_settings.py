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


def closable(determinism: tuple[bool, bool]) -> SwiftPipelineEngine:
    """A SwiftPipelineEngine with what close() touches, the rest left out."""
    engine = SwiftPipelineEngine.__new__(SwiftPipelineEngine)
    parts = {"_timeline": mock.Mock(), "_monitor": mock.Mock(), "_hooks": mock.Mock(), "_recv_patch": mock.Mock()}
    vars(engine).update(parts, _closed=False, _ctx=SimpleNamespace(env=None, store=None), _determinism=determinism)
    return engine


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("user", [(False, False), (False, True), (True, False), (True, True)])
def test_close_gives_the_users_determinism_setting_back(user: tuple[bool, bool], restore_determinism: None) -> None:
    torch.use_deterministic_algorithms(user[0], warn_only=user[1])
    engine = closable(user)
    if not user[0]:
        torch.use_deterministic_algorithms(True, warn_only=True)  # what __init__ switches on
    engine.close()
    after = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    assert after == user
    engine.close()  # twice: nothing more changes
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == user
