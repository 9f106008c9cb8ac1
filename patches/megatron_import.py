"""Importing megatron-core on a machine without CUDA, without building ``torch.compile`` wrappers.

megatron-core wraps its fused kernels in ``torch.compile`` when its modules are imported
(``megatron/core/jit.py``: ``jit_fuser``; ``fusions/fused_bias_geglu.py`` and others decorate with
it). Building one such wrapper imports ``torch._inductor`` and ``torch._dynamo``: 40 % of the CPU
that ``from megatron.core import parallel_state`` costs after torch and DeepSpeed are loaded
(measured on the CPU machine: 6.8 CPU-s for the whole import, 4.3 with this patch, per process).
A CPU job starts every rank, and every replacement, through that import, on a machine where the
compiled kernels could not run anyway (inductor would generate and compile C++ at the first call).

:func:`eager_jit_fuser` lets ``torch.compile`` hand the function back unchanged while megatron-core
is imported, so its fused kernels run eagerly (the same arithmetic, unfused), then restores it.
Where CUDA is present, or megatron-core is loaded already, it changes nothing: a GPU run keeps
megatron's fused kernels.

On the same condition :func:`import_megatron_core` also leaves out what megatron-core imports only
to find out whether it is there (``try: ... except ImportError``), and a CPU job never uses:
DTensor (``torch.distributed._tensor``, for FSDP2; it pulls in sympy and torch's symbolic shapes:
16 % of a 4-rank CPU job's start-up CPU, measured with py-spy) and triton. And it imports DeepSpeed's
Muon optimizer, whose kernels ``torch.compile`` wraps at import (in every ``deepspeed.initialize``:
``is_zero_supported_optimizer`` imports it), eagerly too: Muon is not the optimizer of a CPU job.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["OPTIONAL_ON_CPU", "eager_jit_fuser", "import_megatron_core"]

#: Imported by megatron-core inside ``try`` only (``HAVE_DTENSOR``, ``HAVE_TRITON`` in
#: ``megatron/core/utils.py``): left out on a machine without CUDA, where neither is used.
OPTIONAL_ON_CPU = ("torch.distributed._tensor", "triton")
#: DeepSpeed's module that wraps Muon's kernels in ``torch.compile`` when it is imported.
_DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def _eager(model: Callable[..., Any] | None = None, **_: Any) -> Any:
    """``torch.compile``'s signature, compiling nothing: the function itself (or, called with options
    only, a decorator that returns it)."""
    if model is None:
        return lambda fn: fn
    return model


@contextmanager
def eager_jit_fuser() -> Iterator[bool]:
    """While the block runs, ``torch.compile`` returns what it is given (on a machine without CUDA,
    where megatron-core is not loaded yet). Yields whether it did."""
    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        yield False
        return
    original = torch.compile
    torch.compile = _eager  # type: ignore[assignment]
    try:
        yield True
    finally:
        torch.compile = original


@contextmanager
def _left_out(modules: tuple[str, ...]) -> Iterator[None]:
    """While the block runs, importing any of ``modules`` (not imported yet) raises ImportError
    (a ``None`` in ``sys.modules``); afterwards they import as usual."""
    blocked = [m for m in modules if m not in sys.modules]
    for m in blocked:
        sys.modules[m] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for m in blocked:
            if m in sys.modules and sys.modules[m] is None:
                del sys.modules[m]


def import_megatron_core() -> Any:
    """``megatron.core``, imported under :func:`eager_jit_fuser`; on CPU without the modules of
    :data:`OPTIONAL_ON_CPU`, and DeepSpeed's Muon optimizer imported eagerly too."""
    with eager_jit_fuser() as eager:
        if not eager:
            import megatron.core
        else:
            with _left_out(OPTIONAL_ON_CPU):
                import megatron.core
            importlib.import_module(_DEEPSPEED_MUON)
    return megatron.core
