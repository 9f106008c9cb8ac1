"""examples/pretrain_gpt.py whose model raises an ordinary ``RuntimeError`` that reads like a comm
error (a user layer's bug, issue 16): rank ``USER_ERROR_RANK`` raises it in its
``USER_ERROR_FORWARD``-th module forward (every module of the model counted, once per job)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path
from typing import Any

import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "pretrain_gpt.py"
MESSAGE = "user layer: gloo all-reduce of my custom metric timed out (NCCL error 2)"

if __name__ == "__main__":
    if os.environ.get("RANK") == os.environ["USER_ERROR_RANK"]:
        calls = [0]

        def raise_once(module: torch.nn.Module, args: Any, output: Any) -> None:
            calls[0] += 1
            if calls[0] == int(os.environ["USER_ERROR_FORWARD"]):
                raise RuntimeError(MESSAGE)

        torch.nn.modules.module.register_module_forward_hook(raise_once)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
