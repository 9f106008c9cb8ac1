"""Just-in-time build of the native writer (``torch.utils.cpp_extension.load``, ninja).

Mirrors DeepSpeed's ``op_builder``: the build is attempted once per process, lazily; any failure
(no compiler, no ninja, headers missing) is remembered with its reason and the callers fall back
to the pure-Python writer, which writes identical bytes. The CUDA half is compiled only when
torch sees a CUDA device and a toolkit (``CUDA_HOME``); on CPU machines it is not even parsed.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["NAME", "build_error", "is_compatible", "load"]

NAME = "ds_swift_native_writer"
_SRC = Path(__file__).resolve().parent
_log = logging.getLogger(__name__)


class _State:
    lock = threading.Lock()
    module: ModuleType | None = None
    error: str | None = None
    tried = False


def _cuda_available() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


def is_compatible() -> tuple[bool, str]:
    """(can we try to build, why not)."""
    if os.environ.get("DS_SWIFT_NATIVE", "1") == "0":
        return False, "disabled by DS_SWIFT_NATIVE=0"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return False, f"no C++ compiler ({cxx!r} or g++) on PATH"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except Exception as exc:  # RuntimeError when ninja is missing
        return False, f"ninja is not available: {exc}"
    return True, ""


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled module, or None (see :func:`build_error` for why)."""
    with _State.lock:
        if _State.tried:
            return _State.module
        _State.tried = True
        ok, why = is_compatible()
        if not ok:
            _State.error = why
            return None
        try:
            from torch.utils import cpp_extension

            sources = [str(_SRC / "swift_writer.cpp")]
            cflags = ["-O3"]
            with_cuda = _cuda_available()
            if with_cuda:
                sources.append(str(_SRC / "swift_writer_cuda.cpp"))
                cflags.append("-DWITH_CUDA")
            _State.module = cpp_extension.load(
                name=NAME + ("_cuda" if with_cuda else ""),
                sources=sources,
                extra_cflags=cflags,
                with_cuda=with_cuda,
                verbose=verbose,
            )
        except Exception as exc:  # a build failure must never stop training: fall back, loudly
            _State.error = f"{type(exc).__name__}: {exc}"
            _log.warning("ds-swift native writer unavailable, using the Python writer: %s", _State.error)
            _State.module = None
        return _State.module


def build_error() -> str | None:
    """Why :func:`load` returned None (None when it has not been tried or succeeded)."""
    return _State.error
