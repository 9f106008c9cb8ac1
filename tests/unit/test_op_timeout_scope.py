"""ds-swift's op timeout holds only inside its own calls (issue 30 item 5): every group gets it for
the call and its own back afterwards; a group created inside gets the job's timeout, except
ds-swift's own transport groups."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from ds_swift.patches.deepspeed_rebuild import _backends
from ds_swift.patches.op_timeout import op_timeout_scope

JOB = datetime.timedelta(minutes=45)  # the job's own (Megatron's --distributed-timeout-minutes)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=JOB)
    try:
        yield
    finally:
        dist.destroy_process_group()


def timeout_of(group: object) -> datetime.timedelta:
    (backend,) = _backends(group)
    return backend.options._timeout  # type: ignore[no-any-return]


def test_the_op_timeout_applies_inside_and_the_jobs_comes_back(world: None) -> None:
    default = dist.distributed_c10d._get_default_group()
    users = dist.new_group([0], timeout=datetime.timedelta(minutes=20))
    generation = [0]
    with op_timeout_scope(3.0, JOB, lambda: generation[0]):
        assert timeout_of(default) == timeout_of(users) == datetime.timedelta(seconds=3)
        rebuilt = dist.new_group([0])  # a group created inside a call (a rebuild's)
        own = dist.new_group([0], timeout=datetime.timedelta(seconds=3), group_desc="ds_swift_copier")
    assert timeout_of(default) == JOB and timeout_of(users) == datetime.timedelta(minutes=20)
    assert timeout_of(rebuilt) == JOB  # not the op timeout outside ds-swift's calls
    assert timeout_of(own) == datetime.timedelta(seconds=3)  # ds-swift's own keep theirs
    assert dist.distributed_c10d.default_pg_timeout != datetime.timedelta(seconds=3)  # nothing process-wide


def test_the_world_gets_the_jobs_timeout_once_connected(tmp_path: Path) -> None:
    """join_generation creates the world with the join timeout (gloo's connection to every peer is
    bounded by it, not by the job's 30 min), then gives it the job's, or torch's default."""
    from ds_swift.patches.op_timeout import job_timeout_after_connect

    join = datetime.timedelta(seconds=300)
    for outside, expected in ((JOB, JOB), (None, dist.distributed_c10d.default_pg_timeout)):
        store = tmp_path / f"store-{expected.seconds}"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=join)
        try:
            assert timeout_of(dist.distributed_c10d._get_default_group()) == join
            job_timeout_after_connect(outside)
            assert timeout_of(dist.distributed_c10d._get_default_group()) == expected
        finally:
            dist.destroy_process_group()
