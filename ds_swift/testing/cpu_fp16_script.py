"""Run a training script with fp16 allowed on DeepSpeed's CPU accelerator (ds_swift.patches.cpu_fp16).

    ds-swift-launch ... -m ds_swift.testing.cpu_fp16_script SCRIPT [ARGS...]

DeepSpeed 0.19.8 refuses an ``"fp16"`` config on a CPU without fp16 kernels, although torch
computes fp16 there (slowly); GPU jobs train in fp16 with DeepSpeed's dynamic loss scaler, so the
CPU runs of scripts/megatron_deepspeed_cpu.sh (``--precision fp16``) start Megatron-DeepSpeed's
``pretrain_gpt.py`` through this module. The script runs as ``__main__`` with its own ``sys.argv``
and its folder first on ``sys.path``, as ``python SCRIPT`` would run it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ds_swift.patches.cpu_fp16 import allow_cpu_fp16


def script_argv(argv: list[str]) -> list[str]:
    """``[SCRIPT, ARGS...]`` from this module's arguments: ``ds-swift-launch -m`` puts its
    ``--local_rank=N`` before ``SCRIPT``; the script gets it first among its own arguments."""
    lead = [a for a in argv[:1] if a.startswith("--local_rank")]
    rest = argv[len(lead) :]
    if not rest:
        raise SystemExit("usage: python -m ds_swift.testing.cpu_fp16_script SCRIPT [ARGS...]")
    return [rest[0], *lead, *rest[1:]]


def main() -> None:
    sys.argv = script_argv(sys.argv[1:])
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)
    with allow_cpu_fp16():
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
