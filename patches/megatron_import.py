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

DeepSpeed's Muon optimizer wraps its kernels in ``torch.compile`` at import too, and every
``deepspeed.initialize`` imports it (``is_zero_supported_optimizer``): :func:`import_megatron_core`
imports it (:func:`import_deepspeed_muon`: on a machine without CUDA) with ``torch.compile`` handing
its kernels back, so that no CPU rank imports ``torch._inductor`` for it (~1.3 CPU-s a rank; Muon is
not the optimizer of a CPU job, and would run eagerly if it were).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ds_swift.interpreter import collector_paused

__all__ = ["eager_jit_fuser", "import_deepspeed_muon", "import_megatron_core"]

#: DeepSpeed's module that wraps Muon's kernels in ``torch.compile`` when it is imported.
DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def _eager(model: Callable[..., Any] | None = None, **_: Any) -> Any:
    """``torch.compile``'s signature, compiling nothing: the function itself (or, called with options
    only, a decorator that returns it)."""
    if model is None:
        return lambda fn: fn
    return model


@contextmanager
def _eager_torch_compile(skip: bool) -> Iterator[bool]:
    """While the block runs, ``torch.compile`` returns what it is given, unless ``skip`` or CUDA is
    present. Yields whether it did."""
    if skip or torch.cuda.is_available():
        yield False
        return
    original = torch.compile
    torch.compile = _eager  # type: ignore[assignment]
    try:
        yield True
    finally:
        torch.compile = original


@contextmanager
def eager_jit_fuser() -> Iterator[bool]:
    """While the block runs, ``torch.compile`` returns what it is given (on a machine without CUDA,
    where megatron-core is not loaded yet). Yields whether it did."""
    with _eager_torch_compile(skip="megatron.core" in sys.modules) as eager:
        yield eager


def import_deepspeed_muon() -> bool:
    """DeepSpeed's Muon module, imported with ``torch.compile`` handing its kernels back (on a machine
    without CUDA, where it is not imported yet): call before ``deepspeed.initialize`` of a ZeRO
    engine, which imports it. Returns whether it did."""
    with _eager_torch_compile(skip=DEEPSPEED_MUON in sys.modules) as eager:
        if eager:
            importlib.import_module(DEEPSPEED_MUON)
    return eager


def import_megatron_core() -> Any:
    """``megatron.core``, imported under :func:`eager_jit_fuser`; DeepSpeed's Muon module too
    (:func:`import_deepspeed_muon`)."""
    with collector_paused():  # start-up time: see ds_swift.interpreter
        with eager_jit_fuser():
            import megatron.core

        import_deepspeed_muon()
    return megatron.core
