"""The CPU stand-in for NCCL's semantics (ds_swift.testing.nccl_standin), in one process: two gloo
ranks on threads, the stand-in's calls driven directly."""

from __future__ import annotations

import datetime
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ds_swift.patches.comm_intercept import Call
from ds_swift.testing.nccl_standin import NcclStandIn, StandInAborted


def _gloo_pair() -> list[Any]:
    """Two gloo process groups of one world of 2, each rank's made on a thread (they connect)."""
    store = dist.HashStore()
    groups: list[Any] = [None, None]

    def make(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("pair", store), rank, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups)
    return groups


def _call(name: str, run: Callable[[torch.Tensor, int], Any], tensor: torch.Tensor, peer: int) -> Call:
    def fn(tensor: torch.Tensor, peer: int, group: Any = None) -> Any:
        return run(tensor, peer)

    return Call(name, fn, inspect.signature(fn).bind(tensor, peer))


def _until(what: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.mark.timeout(120)
def test_an_abort_ends_a_blocking_receive_from_a_peer_that_never_sends() -> None:
    """NCCL: a receive from a live peer that left for the next generation waits on the device until
    this rank's own abort kills it. Gloo's blocking receive would wait for its peer alone."""
    pg0, pg1 = _gloo_pair()
    standin = NcclStandIn(op_timeout_s=60.0, rank=0)
    buf = torch.zeros(4)
    call = _call("recv", lambda t, src: pg0.recv([t], src, 0).wait(), buf, 1)
    raised: list[BaseException] = []

    def receive() -> None:
        try:
            standin.around(call)
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            raised.append(exc)

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    _until(lambda: any(th.name == "nccl-standin-recv" for th in threading.enumerate()))  # the gloo call is on
    standin.abort()
    t.join(30)
    assert not t.is_alive(), "the abort did not end the receive"
    assert len(raised) == 1 and isinstance(raised[0], StandInAborted), raised
    # the abandoned gloo receive ends when its peer sends (or its group goes): nothing lands in a
    # buffer the rank still uses after the abort but what that late send carries
    pg1.send([torch.ones(4)], 0, 0).wait()
    _until(lambda: not any(th.name == "nccl-standin-recv" for th in threading.enumerate()))


@pytest.mark.timeout(120)
def test_a_blocking_receive_that_completes_returns_its_result() -> None:
    pg0, pg1 = _gloo_pair()
    standin = NcclStandIn(op_timeout_s=60.0, rank=0)
    buf = torch.zeros(4)
    sender = threading.Thread(target=lambda: pg1.send([torch.arange(4.0)], 0, 0).wait(), daemon=True)
    sender.start()
    assert standin.around(_call("recv", lambda t, src: (pg0.recv([t], src, 0).wait(), src)[1], buf, 1)) == 1
    sender.join(30)
    assert torch.equal(buf, torch.arange(4.0))
    assert standin.stuck is None and not standin.aborted
