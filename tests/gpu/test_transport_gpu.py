"""ds-swift's transport on one GPU: a one-rank NCCL world, its gloo groups, the abort of a failed
generation and the next generation in the same process.

Skipped without CUDA. One GPU cannot host a multi-rank NCCL group, so what runs here is the
one-rank half of the design (docs/gpu.md): host tensors on the transport's gloo groups while the
world is NCCL, device tensors on the world, the NCCL settings, and an abort from another thread
(the watchdog's) followed by the teardown and a fresh world, which must then work.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ds_swift import transport
from ds_swift.transport.shutdown import backends_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _world(generation: int) -> transport.Transport:
    transport.nccl_environment()  # as ds_swift.runtime.context.join_generation does
    dist.init_process_group(
        "nccl",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", 0),
    )
    return transport.open_generation(60.0, generation)


@pytest.fixture
def strict() -> Iterator[None]:
    transport.set_strict(True)
    try:
        yield
    finally:
        transport.set_strict(None)
        transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_host_tensors_go_on_gloo_and_device_tensors_on_nccl(strict: None) -> None:
    t = _world(0)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] in ("0", "2")
    assert t.world_backends == backends_of() and "nccl" in t.world_backends
    assert t.all_gather_json({"ok": True}) == [{"ok": True}]  # host: the gloo group
    out = [torch.zeros(3, device="cuda")]
    t.all_gather(out, torch.arange(3.0, device="cuda"))  # device: the NCCL world
    assert out[0].tolist() == [0.0, 1.0, 2.0]
    assert t.counts[("all_gather", "host", "cpu")] == 2 and t.counts[("all_gather", "device", "cuda")] == 1
    with pytest.raises(transport.StrictTransportError):
        t.all_gather([torch.zeros(1)], torch.ones(1), group=dist.group.WORLD)  # would raise in NCCL anyway


def test_an_aborted_generation_is_torn_down_and_the_next_one_works(strict: None) -> None:
    _world(0)
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)  # the communicator exists before it is aborted
    torch.cuda.synchronize()
    aborted: list[int] = []
    watchdog = threading.Thread(target=lambda: aborted.append(transport.on_generation_failed(0)))
    watchdog.start()
    watchdog.join(60)
    assert aborted and aborted[0] >= 1  # from another thread, as the watchdog does
    transport.teardown_world()  # gloo groups destroyed, the world aborted (again: idempotent)
    assert not dist.is_initialized()
    t = _world(1)
    y = torch.full((4,), 2.0, device="cuda")
    dist.all_reduce(y)
    assert y.tolist() == [2.0] * 4 and t.all_gather_ints([1]) == [[1]]
