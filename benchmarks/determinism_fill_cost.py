"""What torch's NaN fill of fresh allocations costs a ZeRO step (why patches/determinism.py turns it off).

``torch.use_deterministic_algorithms(True)`` also turns on
``torch.utils.deterministic.fill_uninitialized_memory``: every ``torch.empty`` is filled with NaN.
DeepSpeed's ZeRO optimizer allocates its reduce bucket (``reduce_bucket_size``, 5e8 elements by
default) with ``torch.empty`` every step. This times that allocation, side by side in one process,
with the fill on and off, on the CPU and (when there is one) the GPU, and reports the ratio.

    python benchmarks/determinism_fill_cost.py                 # 5e8-element bf16 bucket
    python benchmarks/determinism_fill_cost.py --elements 5e7 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.utils.deterministic


def time_alloc(n: int, dtype: torch.dtype, device: str, fill: bool, repeats: int) -> float:
    """Median seconds of one ``torch.empty(n)`` (and its release) with the fill on or off."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = fill  # type: ignore[attr-defined]
    times = []
    try:
        for _ in range(repeats + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            t = torch.empty(n, dtype=dtype, device=device)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del t
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    return statistics.median(times[1:])  # the first one warms the allocator


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=float, default=5e8, help="allocation size (default: ZeRO's reduce bucket)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    n = int(args.elements)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out: dict[str, object] = {"elements": n, "dtype": "bfloat16", "torch": torch.__version__}
    for device in devices:
        on = time_alloc(n, torch.bfloat16, device, True, args.repeats)
        off = time_alloc(n, torch.bfloat16, device, False, args.repeats)
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        out[device] = {"device": name, "fill_on_s": on, "fill_off_s": off, "ratio_on_off": on / off if off else None}
        if not args.json:
            print(
                f"{name}: torch.empty({n:.0e}, bf16) with the NaN fill {on * 1e3:.2f} ms, without "
                f"{off * 1e3:.3f} ms (x{on / off:.0f})"
            )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
