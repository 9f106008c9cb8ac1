"""patches/megatron_import.py: megatron-core imported on CPU without building torch.compile wrappers
(which import torch._inductor: a third of every rank's start-up CPU), and torch.compile given back."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ds_swift.patches.megatron_import import DEEPSPEED_MUON, eager_jit_fuser, import_deepspeed_muon

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"


def _fn(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_torch_compile_hands_functions_back_only_inside_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    original = torch.compile
    with eager_jit_fuser() as eager:
        assert eager
        assert torch.compile(_fn) is _fn
        decorate: Callable[..., object] = torch.compile(mode="max-autotune-no-cudagraphs")
        assert decorate(_fn) is _fn
    assert torch.compile is original


@pytest.mark.parametrize("why", ["cuda", "loaded"])
def test_nothing_changes_with_cuda_or_once_megatron_is_loaded(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: why == "cuda")
    if why == "loaded":
        monkeypatch.setitem(sys.modules, "megatron.core", object())
    else:
        monkeypatch.delitem(sys.modules, "megatron.core", raising=False)
    original = torch.compile
    with eager_jit_fuser() as eager:
        assert not eager and torch.compile is original


def test_megatron_core_imports_without_inductor_on_cpu() -> None:
    code = (
        "import sys, torch\n"
        "from ds_swift.patches.megatron_import import import_megatron_core\n"
        "import_megatron_core()\n"
        "from megatron.core import parallel_state\n"
        "assert parallel_state.model_parallel_is_initialized() is False\n"
        "from ds_swift.patches.megatron_import import import_deepspeed_muon\n"
        "muon = 'deepspeed.runtime.zero.muon.muon_optimizer' in sys.modules and not import_deepspeed_muon()\n"
        "print('inductor', 'torch._inductor.compile_fx' in sys.modules, 'restored', torch.compile.__module__,\n"
        "      'muon', muon)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert "inductor False restored torch muon True" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("why", ["cuda", "loaded"])
def test_muon_is_left_to_deepspeed_with_cuda_or_once_imported(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: why == "cuda")
    if why == "loaded":
        monkeypatch.setitem(sys.modules, DEEPSPEED_MUON, object())
    else:
        monkeypatch.delitem(sys.modules, DEEPSPEED_MUON, raising=False)
    assert not import_deepspeed_muon()
    assert why == "loaded" or DEEPSPEED_MUON not in sys.modules


def test_a_warm_worker_of_the_example_imports_megatron_core_as_the_example_does() -> None:
    """ds_swift.runtime.warm preloads the example's imports: megatron-core through import_megatron_core
    (as the example's own ranks do), not with its torch.compile wrappers (torch._inductor)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ds_swift.runtime.warm import BASE_MODULES, preload, script_imports\n"
        f"source = Path({str(EXAMPLE)!r}).read_text()\n"
        "loaded = preload([*BASE_MODULES, *script_imports(source)])\n"
        "print('megatron', 'megatron.core.parallel_state' in loaded, 'inductor', 'torch._inductor.compile_fx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert "megatron True inductor False" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_warm_worker_loads_deepspeeds_compiled_comm_op_before_its_assignment() -> None:
    """Issue 50 item 4: the shared-memory comm op DeepSpeed's CPU accelerator loads in
    ``deepspeed.init_distributed`` (after the replacement joined its generation) is loaded by the warm
    worker already, and said in its ready line; the later load in the same process is then free."""
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.builder import OpBuilder

    from ds_swift.runtime.warm import held_words, preload_ops

    ops = preload_ops()
    assert ops == ["deepspeed_shm_comm"]
    # DeepSpeed's own cache of loaded ops: its next load returns the module without the JIT's check
    assert build_shm_op() is OpBuilder._loaded_ops["deepspeed_shm_comm"]
    assert held_words(["torch"], ops, 1.25) == "1 modules imported, compiled ops loaded (deepspeed_shm_comm) in 1.2 s"


def test_a_warm_worker_imports_what_a_wrapped_script_imports(tmp_path: Path) -> None:
    """Issue 50 item 4: the fp16 CPU runs start Megatron-DeepSpeed's ``pretrain_gpt.py`` through
    ``-m ds_swift.testing.cpu_fp16_script pretrain_gpt.py ...``; its warm spares imported only the
    wrapper's modules, and each replacement imported Megatron after the failure (57 s of
    initialization in the developers' run). The wrapped script's imports are the worker's too."""
    from ds_swift.runtime.warm import WarmTarget

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("import json\nfrom megatron.training import pretrain\n")
    target = WarmTarget.from_argv(["--module", "ds_swift.testing.cpu_fp16_script", str(script), "--lr", "1e-3"])
    names = target.imports()
    assert "ds_swift.patches.cpu_fp16" in names  # the wrapper's own
    assert "megatron.training" in names and "megatron.training.pretrain" in names and "json" in names


def test_a_warm_worker_does_not_wait_for_a_build_lock_a_killed_build_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's JIT build lock has no owner: a process killed while it loaded the op (a warm spare
    stopped at the end of a job) leaves it, and the next load waits for it for good. A warm worker
    skips its preload there (it loads at its attach as before)."""
    from torch.utils.cpp_extension import _get_build_directory

    from ds_swift.runtime.warm import preload_ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    build.mkdir(parents=True, exist_ok=True)
    (build / "lock").touch()
    assert preload_ops() == []  # at once: a wait here would hang the test (its timeout fails it)
