"""State digests on the GPU (ds_swift.recovery.state.digest, ds_swift.protect.digest_publisher): the same digest as
on the host (a donor's host copy and a recipient's device state must agree), computed on a side
stream that the next step's stream waits for on the device, never the training thread.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from ds_swift.jobstore.membership import JobStore
from ds_swift.protect.digest_publisher import DigestPublisher
from ds_swift.recovery.state.digest import digest_state, digest_tensors, engine_state
from ds_swift.recovery.verify import published_digests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CHUNK = 1 << 20


def test_device_digests_equal_host_digests() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    named = {
        "big_fp32": torch.randn(9 * CHUNK + 17, device="cuda", generator=g),
        "big_bf16": torch.randn(3 * CHUNK, device="cuda", generator=g).to(torch.bfloat16),
        "small": torch.randn(613, device="cuda", generator=g),
        "strided": torch.randn(64, 64, device="cuda", generator=g).t(),
        "int64": torch.randint(-(2**40), 2**40, (1000,), device="cuda", generator=g),
    }
    on_device = digest_tensors(named)
    on_host = digest_tensors({k: v.cpu() for k, v in named.items()})
    assert on_device == on_host


class Engine:
    """A DeepSpeed-like engine on the GPU whose step rewrites a large weight in place at once."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(2048, 2048, device="cuda")
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-2)
        self.global_steps = 0

    def step(self) -> None:
        self.module(torch.randn(64, 2048, device="cuda")).square().sum().backward()
        self.optimizer.step()
        self.global_steps += 1


def test_the_publisher_digests_the_state_after_each_step_on_a_side_stream() -> None:
    import torch.distributed as dist

    store = JobStore(dist.HashStore(), "t")
    pub = DigestPublisher(0, 1, lambda: store)
    engine = Engine()
    expected = {}
    try:
        for _ in range(4):
            pub.before_step()
            engine.step()
            expected[engine.global_steps - 1] = digest_state({k: _cpu(v) for k, v in engine_state(engine).items()})
            pub.after_step(engine)
            # The next step is queued at once: its stream must wait for the digest's kernels.
        assert pub.wait(timeout_s=60)
    finally:
        pub.stop()
    got = published_digests(store, 0)
    assert sorted(got) == [0, 1, 2, 3]
    for it, ref in expected.items():
        assert ref.first_difference(got[it]) is None, it


def _cpu(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_cpu(v) for v in x)
    return x
