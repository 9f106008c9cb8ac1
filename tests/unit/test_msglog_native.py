"""The native writer (cuda_ext, JIT-built) writes exactly the bytes of the Python writer."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_swift.msglog.edge import LogEdge
from ds_swift.msglog.format import RecordHeader
from ds_swift.msglog.reader import LogReader
from ds_swift.msglog.writer import LogWriter, MessageMeta, NativeAppender, PythonAppender, payload_bytes, record_header


@pytest.fixture(scope="module")
def native() -> object:
    from ds_swift.cuda_ext import native_writer, native_writer_error

    module = native_writer()
    if module is None:
        pytest.skip(f"native writer cannot be built here: {native_writer_error()}")
    return module


def _write_all(directory: Path, appender: object) -> None:
    w = LogWriter(directory, 3, appender)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    for it in range(7):
        for mb in range(4):
            parts = [torch.randn(33, 17, generator=g), torch.randint(0, 9, (5,), generator=g)]
            if mb == 2:
                parts.append(torch.randn(3, generator=g).to(torch.bfloat16))
            w.write(MessageMeta(it, mb, LogEdge("act", 1, 2, 1, 0), 3, 4), parts)
            w.write(MessageMeta(it, mb, LogEdge("grad", 2, 1, 1, 0), 4, 3), [torch.randn(1000, generator=g)])
    w.write(MessageMeta(7, 0, LogEdge("act", 1, 2, 1, 0), 3, 4), [torch.empty(0), torch.tensor(3.5)])
    w.close()


def test_native_and_python_writers_write_identical_bytes(native: object, tmp_path: Path) -> None:
    _write_all(tmp_path / "py", PythonAppender())
    _write_all(tmp_path / "native", NativeAppender(native))  # type: ignore[arg-type]
    py_files = sorted(p.name for p in (tmp_path / "py").iterdir())
    assert py_files == sorted(p.name for p in (tmp_path / "native").iterdir())
    assert len(py_files) == 2 * 3 * 2
    for name in py_files:
        assert (tmp_path / "py" / name).read_bytes() == (tmp_path / "native" / name).read_bytes(), name
    assert LogReader(tmp_path / "native").verify().ok


@settings(max_examples=30, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1))
def test_native_crc32c_matches_the_crc32c_package(native: object, data: bytes, seed: int) -> None:
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    assert native.crc32c_tensor(t, seed) == crc32c.crc32c(data, seed)  # type: ignore[attr-defined]
    # unaligned starts exercise the byte-wise prologue
    if len(data) > 3:
        assert native.crc32c_tensor(t[3:], 0) == crc32c.crc32c(data[3:])  # type: ignore[attr-defined]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("which", ["python", "native"])
def test_a_full_device_raises_enospc(native: object, which: str) -> None:
    appender = PythonAppender() if which == "python" else NativeAppender(native)  # type: ignore[arg-type]
    t = torch.randn(100)
    header: RecordHeader = record_header(MessageMeta(0, 0, LogEdge("act", 1, 2), 1, 2), t, 0, 1)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as ei:
            appender.append(fd, header, payload_bytes(t))
        assert ei.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
