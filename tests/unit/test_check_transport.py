"""scripts/check_transport.py: ds-swift's own traffic calls torch.distributed only in ds_swift/transport/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_transport.py"


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_transport", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_tree_calls_torch_distributed_only_in_the_transport() -> None:
    found = checker().check_tree(ROOT)
    assert found == [], "\n".join(found)


OFFENDER = """
import torch
import torch.distributed as dist
import deepspeed.comm as dscomm
from torch.distributed import all_gather_object as ago, get_rank

def f(send=None):
    dist.isend(t, 1)                                # 8
    torch.distributed.barrier()                     # 9
    send = send or dist.send                        # 10
    ago(out, x)                                     # 11
    dscomm.all_reduce(t)                            # 12
    dist.get_rank(); get_rank()                     # queries: fine
    dist.barrier()  # transport: ok
"""


def test_calls_references_and_imports_are_flagged() -> None:
    found = checker().check_source(OFFENDER, "m.py")
    assert found == [
        "m.py:5: from torch.distributed import all_gather_object",
        "m.py:8: dist.isend",
        "m.py:9: torch.distributed.barrier",
        "m.py:10: dist.send",
        "m.py:11: ago",
        "m.py:12: dscomm.all_reduce",
    ]


def test_the_transport_and_patches_are_where_it_belongs(tmp_path: Path) -> None:
    for rel in ("ds_swift/transport/core.py", "patches/p.py", "ds_swift/other.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("import torch.distributed as dist\ndist.barrier()\n")
    assert checker().check_tree(tmp_path) == ["ds_swift/other.py:2: dist.barrier"]
