"""Getting a sent tensor's bytes into host memory for the writer thread (the "bubble-time copy").

The training thread calls :meth:`Stager.stage` in a pipeline bubble; it must return at once.

- CPU tensors (:class:`HostStager`): nothing to copy off a device. ``copy_mode="ref"`` hands the
  writer a detached reference. That is safe with DeepSpeed 0.19's pipeline engine because every
  tensor it sends is freshly allocated per micro-batch and never written in place afterwards:
  activations are the stage's forward output (dropped after its backward), gradients are the
  ``.grad`` of a per-micro-batch clone of the received input, and the one tensor whose
  ``.data`` DeepSpeed later swaps (the partition meta under tensor parallelism) keeps its old
  storage alive in our detached view. The *receive* buffers are the reused ones, and senders
  never log those. ``tests/dist/test_logging_pipeline.py`` checks every logged record against
  what the receiver got. ``copy_mode="clone"`` (ds_swift.msglog.logger) clones at send time
  anyway: a memcpy on the training thread; benchmarks/logging_overhead.py measures its cost.
- CUDA tensors (:class:`CudaStager`, or the native ``D2HStager``): a side stream waits for the
  current stream, copies into pinned blocks from a pool, and records an event; the writer thread
  polls the event (SWIFT section 6). The device tensors stay referenced until the copy is done.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol

import torch

from ds_swift.msglog.writer import payload_bytes
from ds_swift.msglog.writer_thread import HostStaged, Staged

__all__ = ["CopyMode", "CudaStager", "HostStager", "NativeCudaStager", "PinnedPool", "Stager", "make_stager"]

CopyMode = Literal["ref", "clone"]


class Stager(Protocol):
    def stage(self, tensors: list[torch.Tensor]) -> Staged: ...


class HostStager:
    """CPU tensors: a detached reference (see the module docstring for why that is safe)."""

    def stage(self, tensors: list[torch.Tensor]) -> Staged:
        return HostStaged([t.detach() for t in tensors])


class PinnedPool:
    """Reusable pinned host blocks in power-of-two size classes, bounded in total size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._bytes = 0

    @staticmethod
    def size_class(n: int) -> int:
        c = 4096
        while c < n:
            c <<= 1
        return c

    def take(self, n: int) -> torch.Tensor:
        cap = self.size_class(n)
        free = self._free[cap]
        if free:
            self._bytes -= cap
            return free.pop()
        return torch.empty(cap, dtype=torch.uint8, pin_memory=True)

    def give(self, block: torch.Tensor) -> None:
        cap = block.numel()
        if self._bytes + cap <= self.max_bytes:
            self._free[cap].append(block)
            self._bytes += cap


@dataclass
class _CudaStaged:
    event: Any
    device_refs: list[torch.Tensor]
    blocks: list[torch.Tensor]
    shapes: list[tuple[torch.Size, torch.dtype]]
    pool: PinnedPool

    def ready(self) -> bool:
        return bool(self.event.query())

    def take(self) -> list[torch.Tensor]:
        self.device_refs = []  # the copy is done: the device memory may be reused now
        out = []
        for block, (shape, dtype) in zip(self.blocks, self.shapes):
            nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
            out.append(block[:nbytes].view(dtype).reshape(shape))
        return out

    def release(self, tensors: list[torch.Tensor]) -> None:
        for block in self.blocks:
            self.pool.give(block)
        self.blocks = []


class CudaStager:
    """Side-stream D2H copies into a pinned pool with event polling, in PyTorch."""

    def __init__(self, device: torch.device, max_pool_bytes: int = 256 << 20) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pool = PinnedPool(max_pool_bytes)

    def stage(self, tensors: list[torch.Tensor]) -> Staged:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            srcs = [payload_bytes(t) for t in tensors]
            blocks = [self.pool.take(s.numel()) for s in srcs]
            for block, src in zip(blocks, srcs):
                block[: src.numel()].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _CudaStaged(event, [*tensors, *srcs], blocks, [(t.shape, t.dtype) for t in tensors], self.pool)


@dataclass
class _NativeStaged:
    stager: Any
    ticket: int
    shapes: list[tuple[torch.Size, torch.dtype]]

    def ready(self) -> bool:
        return bool(self.stager.ready(self.ticket))

    _views: Any = None

    def take(self) -> list[torch.Tensor]:
        views = self.stager.take(self.ticket)
        self._views = views
        return [v.view(dtype).reshape(shape) for v, (shape, dtype) in zip(views, self.shapes)]

    def release(self, tensors: list[torch.Tensor]) -> None:
        self.stager.give_back(self._views)
        self._views = []


class NativeCudaStager:
    """The same as :class:`CudaStager`, in cuda_ext (``D2HStager``)."""

    def __init__(self, module: ModuleType, device: torch.device, max_pool_bytes: int = 256 << 20) -> None:
        self._s = module.D2HStager(device.index or 0, max_pool_bytes)

    def stage(self, tensors: list[torch.Tensor]) -> Staged:
        ticket = self._s.stage(list(tensors))
        return _NativeStaged(self._s, ticket, [(t.shape, t.dtype) for t in tensors])


def make_stager(device: torch.device, native: ModuleType | None = None) -> Stager:
    """The stager for tensors on ``device`` (the native one when cuda_ext was built with CUDA)."""
    if device.type == "cuda":
        if native is not None and getattr(native, "with_cuda", False):
            return NativeCudaStager(native, device)
        return CudaStager(device)
    return HostStager()
