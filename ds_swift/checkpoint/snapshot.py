"""The host snapshot of an asynchronous checkpoint (ds_swift.checkpoint.background): the tensors of a
state dict copied to host memory, the only part of a save the training thread waits for.

On a GPU the copies go into pinned host buffers (:class:`PinnedCopier`, kept from one save to the
next: pinning is slow, the copy at PCIe speed is not), queued on a side stream after the training
stream's work so far; the training thread waits for them once, at the end of the save. Host
tensors are cloned.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PinnedCopier", "snapshot", "tensors_of"]


def snapshot(obj: Any, copy_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """A deep copy of ``obj`` whose tensors are host copies that training cannot change any more
    (``copy_tensor`` makes each one; default: a plain copy)."""
    if isinstance(obj, torch.Tensor):
        if copy_tensor is not None:
            return copy_tensor(obj.detach())
        t = obj.detach()
        return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict and other dict types
        for k, v in obj.items():
            out[k] = snapshot(v, copy_tensor)
        return out
    if isinstance(obj, list):
        return [snapshot(v, copy_tensor) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v, copy_tensor) for v in obj)
    return copy.deepcopy(obj)


class PinnedCopier:
    """Device tensors into pinned host buffers, copied on a side stream.

    The buffers of one save are reused by the next (same dtype and size; at most one snapshot is in
    host memory at a time): pinning host memory costs far more than the copy. Host tensors are
    cloned. :meth:`finish` waits for the copies of this save. :meth:`copy_into` is the same side-stream
    copy into buffers the caller holds (the buddy copier's flat buffers, ds_swift.protect.buddy).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._streams: dict[torch.device, Any] = {}
        self._pending: list[Any] = []
        self.pinned_bytes = 0
        """Pinned host memory held for snapshots (allocated on the first save)."""

    def side_stream(self, device: torch.device) -> Any:
        """This copier's CUDA stream on ``device`` (made once: streams are cheap but not free)."""
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            return self._streams[device]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda" or t.numel() == 0:
            return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
        stream = self.side_stream(t.device)
        with self._lock:
            free = self._free.get((t.dtype, t.numel()))
            buf = free.pop() if free else None
        if buf is None:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
            self.pinned_bytes += buf.numel() * buf.element_size()
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            stream.wait_event(ready)  # after what training queued so far
            out = buf.view(t.shape)
            out.copy_(t, non_blocking=True)
            # DeepSpeed may free a tensor it built for this save before the copy ran.
            t.record_stream(stream)
        self._pending.append(out)
        return out

    def copy_into(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], ready: Any = None) -> None:
        """Copy each of ``srcs`` into the host tensor beside it in ``dsts`` (pinned, for the copy to
        run asynchronously) and wait for the copies: only the calling thread waits.

        Device tensors are copied on the side stream after ``ready`` (an event the training stream
        recorded where the tensors are final, e.g. after the optimizer step; None: recorded now on
        the calling thread's current stream): on the training stream the copy would hold up the
        next iteration's kernels for its whole PCIe time. Host tensors are copied in place."""
        device = next((t.device for t in srcs if t.is_cuda), None)
        with torch.no_grad():
            if device is None:
                for dst, src in zip(dsts, srcs, strict=True):
                    dst.copy_(src)
                return
            stream = self.side_stream(device)
            if ready is None:
                ready = torch.cuda.current_stream(device).record_event()
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                for dst, src in zip(dsts, srcs, strict=True):
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()

    def finish(self) -> None:
        """Wait for this save's copies (the training thread's only wait)."""
        if self._pending:
            for stream in list(self._streams.values()):
                stream.synchronize()
        self._pending.clear()

    def give_back(self, snap: Any) -> None:
        """A persisted snapshot's pinned buffers, for the next save."""
        for t in tensors_of(snap):
            if t.is_pinned():
                with self._lock:
                    self._free.setdefault((t.dtype, t.numel()), []).append(t.view(-1))

    def drop_unused(self) -> None:
        """Free the buffers the last save did not need (the state's tensors changed)."""
        with self._lock:
            for bufs in self._free.values():
                self.pinned_bytes -= sum(b.numel() * b.element_size() for b in bufs)
            self._free.clear()


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_of(v)]
    return []
