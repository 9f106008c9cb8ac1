"""CUDA staging of logged tensors: side-stream D2H copies into a pinned pool, event polling.

Skipped without CUDA. Both the PyTorch stager and the native one (cuda_ext built with CUDA) must
hand the writer exactly the bytes of the device tensors, and the log they produce must be
byte-identical to logging the same tensors from host memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(64, 1024, device="cuda", generator=g),
        torch.randn(3, 5, device="cuda", generator=g).to(torch.bfloat16),
        torch.randint(0, 100, (17,), device="cuda", generator=g),
        torch.randn(8, 8, device="cuda", generator=g).t(),  # non-contiguous
    ]


def _stagers() -> list[object]:
    from ds_swift.cuda_ext import native_writer
    from ds_swift.msglog.staging import CudaStager, NativeCudaStager

    out: list[object] = [CudaStager(torch.device("cuda", 0))]
    native = native_writer()
    if native is not None and getattr(native, "with_cuda", False):
        out.append(NativeCudaStager(native, torch.device("cuda", 0)))
    return out


@pytest.mark.parametrize("which", [0, 1])
def test_staged_copies_equal_the_device_tensors(which: int) -> None:
    stagers = _stagers()
    if which >= len(stagers):
        pytest.skip("the native writer was not built with CUDA")
    stager = stagers[which]
    for round_ in range(3):  # later rounds reuse pooled pinned blocks
        tensors = _tensors(round_)
        staged = stager.stage(tensors)  # type: ignore[attr-defined]
        expected = [t.cpu() for t in tensors]
        while not staged.ready():
            pass
        host = staged.take()
        assert [h.device.type for h in host] == ["cpu"] * len(host)
        for h, e in zip(host, expected):
            assert h.dtype == e.dtype and h.shape == e.shape and torch.equal(h, e)
        staged.release(host)


def test_logging_from_the_gpu_writes_the_same_bytes_as_from_host(tmp_path: Path) -> None:
    from ds_swift.msglog.edge import LogEdge
    from ds_swift.msglog.staging import CudaStager
    from ds_swift.msglog.writer import LogWriter, MessageMeta, PythonAppender
    from ds_swift.msglog.writer_thread import HostStaged, WriteItem, WriterThread

    tensors = _tensors(7)
    meta = MessageMeta(0, 0, LogEdge("act", 1, 2), 1, 2)
    gpu = WriterThread(LogWriter(tmp_path / "gpu", 5, PythonAppender()))
    gpu.submit(WriteItem(meta, CudaStager(torch.device("cuda", 0)).stage(tensors), 1))
    gpu.close()
    host = WriterThread(LogWriter(tmp_path / "host", 5, PythonAppender()))
    host.submit(WriteItem(meta, HostStaged([t.cpu() for t in tensors]), 1))
    host.close()
    for p in (tmp_path / "host").iterdir():
        assert p.read_bytes() == (tmp_path / "gpu" / p.name).read_bytes()
