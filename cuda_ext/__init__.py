"""Native (C++/CUDA) pieces of ds-swift, each optional, each with a pure-PyTorch fallback.

- :func:`native_writer`: the message-log record appender (crc32c + writev without the GIL) and,
  when built with CUDA, ``D2HStager`` (side-stream copies into a pinned pool, event polling).

Nothing is compiled at import; the first call builds just in time (``torch.utils.cpp_extension``)
and caches the result under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``).
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["native_writer", "native_writer_error"]


def native_writer(verbose: bool = False) -> ModuleType | None:
    """The compiled writer module, or None when it cannot be built (see :func:`native_writer_error`)."""
    from ds_swift.cuda_ext.builder import load

    return load(verbose=verbose)


def native_writer_error() -> str | None:
    from ds_swift.cuda_ext.builder import build_error

    return build_error()
