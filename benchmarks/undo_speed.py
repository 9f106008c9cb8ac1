"""Update-undo speed: undoing torch AdamW's step on N fp32 elements in 16 tensors, against the step.

Per undo path (``InvertibleOptimizer(undo_path=...)``: "fused", one Triton kernel per tensor
(ds_swift.undo.fused; on a GPU only, unless asked for; the default there); "fast", refined densely on
a GPU and by gathering on a CPU; "fast-dense", the fast path refined as on a GPU; and "reference",
the float64 path it is tested against) it prints the step time, the undo time, their ratio, the undo
against a memory-bound estimate (the bytes undo must move: read p, g, m, v and write p, m, v, at the
device-to-device copy bandwidth measured here), the largest error in ulp of each tensor's largest
magnitude per kind (p, exp_avg, exp_avg_sq), the share of elements restored bit for bit, and from
one profiled undo (of ``--profile-elements``) the aten ops, the host-syncing ops (nonzero, item,
bool) and on CUDA the kernel launches. Goals on a GPU (issue 29): undo <= 3x one step, <= 10x the
bound, <= 2 ulp.

    python benchmarks/undo_speed.py --device cuda                       # 256M elements, all paths
    python benchmarks/undo_speed.py --device cuda --paths fused,fast    # what scripts/gpu_check.sh runs
    python benchmarks/undo_speed.py --device cpu --elements 4000000     # both paths, side by side
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ds_swift.undo import InvertibleOptimizer, apply
from ds_swift.undo.numerics import ulp_error

KINDS = ("p", "exp_avg", "exp_avg_sq")
SYNC_OPS = ("aten::nonzero", "aten::_local_scalar_dense", "aten::is_nonzero")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second read plus written by a device-to-device copy (median of 5)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [_timed(device, lambda: dst.copy_(src)) for _ in range(5)]
    return 2 * nbytes / statistics.median(times)


class Setup:
    """16 AdamW tensors stepped twice (so both moments are non-trivial), ready to time."""

    def __init__(self, elements: int, tensors: int, device: torch.device, path: str, seed: int = 0) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        sizes = [elements // tensors + (1 if i < elements % tensors else 0) for i in range(tensors)]
        self.device = device
        self.params = [torch.nn.Parameter(torch.randn(n, device=device, generator=g) * 0.02) for n in sizes]
        self.inner = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.1)
        self.opt = InvertibleOptimizer(self.inner, undo_path=path)  # type: ignore[arg-type]
        for _ in range(2):
            for p in self.params:
                p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
            self.opt.step()
        for p in self.params:
            p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3

    def snapshot(self) -> list[dict[str, torch.Tensor]]:
        return [
            {"p": p.detach().clone(), **{k: self.inner.state[p][k].clone() for k in KINDS[1:]}} for p in self.params
        ]

    def load(self, snap: list[dict[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for p, s in zip(self.params, snap, strict=True):
                p.copy_(s["p"])
                for k in KINDS[1:]:
                    self.inner.state[p][k].copy_(s[k])

    def current(self, i: int, kind: str) -> torch.Tensor:
        p = self.params[i]
        return p.detach() if kind == "p" else self.inner.state[p][kind]


def _path(path: str) -> str:
    """ "fast-dense"/"fast-gather": the fast path with its refinement forced (ds_swift.undo.apply)."""
    mode = path.partition("-")[2]
    apply.FAST_REFINE = mode or None  # type: ignore[assignment]
    return path.partition("-")[0]


def measure(paths: list[str], elements: int, tensors: int, device: torch.device, reps: int) -> dict[str, dict]:
    """The paths interleaved, rep by rep (this machine may be shared: a slow spell hits all alike)."""
    setups = {path: Setup(elements, tensors, device, _path(path)) for path in paths}
    befores = {path: s.snapshot() for path, s in setups.items()}
    out: dict[str, dict[str, Any]] = {
        p: {"steps": [], "undos": [], "ulp": dict.fromkeys(KINDS, 0.0), "exact": dict.fromkeys(KINDS, 0.0)}
        for p in paths
    }
    for _ in range(reps):
        for path, s in setups.items():
            r, before = out[path], befores[path]
            _path(path)
            s.load(before)
            r["steps"].append(_timed(device, s.opt.step))
            post = s.snapshot()
            r["undos"].append(_timed(device, s.opt.undo))
            for i, snap in enumerate(before):
                for kind in KINDS:
                    now = s.current(i, kind)
                    r["ulp"][kind] = max(r["ulp"][kind], ulp_error(now, snap[kind], post[i][kind]))
                    r["exact"][kind] += float((now == snap[kind]).sum()) / (elements * reps)
            del post
    for r in out.values():
        r["step_ms"] = 1e3 * statistics.median(r.pop("steps"))
        r["undo_ms"] = 1e3 * statistics.median(r.pop("undos"))
    return out


def profile(path: str, elements: int, tensors: int, device: torch.device) -> dict[str, int]:
    s = Setup(elements, tensors, device, _path(path))
    s.opt.step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        s.opt.undo()
        _sync(device)
    names = [e.name for e in prof.events()]
    out = {
        "aten_ops": sum(n.startswith("aten::") for n in names),
        "sync_ops": sum(names.count(n) for n in SYNC_OPS),
    }
    if device.type == "cuda":
        # (Triton launches through the driver API's cuLaunchKernelEx)
        launches = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
        out["kernel_launches"] = sum(n in launches for n in names)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--elements", type=int, default=None, help="default 256M on cuda, 4M elsewhere")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument(
        "--paths",
        default=None,
        help="comma-separated undo paths: fused, fast, fast-dense, fast-gather, reference "
        "(default fused,fast,fast-dense,reference on cuda; fast,fast-dense,reference elsewhere)",
    )
    ap.add_argument("--reps", type=int, default=3, help="timed step+undo pairs per path, paths interleaved (median)")
    ap.add_argument(
        "--profile-elements", type=int, default=None, help="elements of the profiled undo (default min(N, 16M))"
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="the fast path's slice size in elements (default: ds_swift.undo.apply's, 2^24 on a GPU)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.chunk:
        apply.FAST_CHUNK_CUDA = apply.FAST_CHUNK_CPU = args.chunk
    elements = args.elements or ((256 << 20) if device.type == "cuda" else 4_000_000)
    prof_elements = args.profile_elements or min(elements, 16 << 20)
    bw = copy_bandwidth(device, min(1 << 30, 8 * elements))
    bound_ms = 1e3 * 7 * 4 * elements / bw
    paths = (args.paths or ("fused," if device.type == "cuda" else "") + "fast,fast-dense,reference").split(",")
    fused_note = ""
    if "fused" in paths:
        from ds_swift.undo.fused import triton_error

        err = triton_error()
        fused_note = (
            f"fused: Triton kernel unavailable ({err}): its row is the fast path" if err else "fused: Triton kernel"
        )
    rows = measure(paths, elements, args.tensors, device, args.reps)
    for path, r in rows.items():
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r["profile"] = profile(path, prof_elements, args.tensors, device)
        r["undo_over_step"] = r["undo_ms"] / r["step_ms"]
        r["undo_over_bound"] = r["undo_ms"] / bound_ms
    result = {
        "device": str(device),
        "elements": elements,
        "tensors": args.tensors,
        "copy_GBps": bw / 1e9,
        "bound_ms": bound_ms,
        "paths": rows,
        "fused": fused_note,
        "command": " ".join(["python", *sys.argv]),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"undo_speed: torch AdamW fp32, {elements:,} elements in {args.tensors} tensors on {name} (torch {torch.__version__})"
    )
    if fused_note:
        print(fused_note)
    print(
        f"copy bandwidth (read+write) {bw / 1e9:.1f} GB/s; undo moves {7 * 4 * elements / 1e6:.0f} MB: bound {bound_ms:.2f} ms"
    )
    head = f"{'path':<10}{'step ms':>9}{'undo ms':>10}{'undo/step':>10}{'/bound':>8}"
    head += (
        "".join(f"{'ulp ' + k:>15}" for k in KINDS) + f"{'exact p/m/v':>17}{'aten ops':>10}{'syncs':>7}{'launches':>10}"
    )
    print(head)
    for path, r in rows.items():
        line = f"{path:<10}{r['step_ms']:>9.2f}{r['undo_ms']:>10.2f}{r['undo_over_step']:>10.1f}{r['undo_over_bound']:>8.1f}"
        line += "".join(f"{r['ulp'][k]:>15.2f}" for k in KINDS)
        exact = "/".join(f"{100 * r['exact'][k]:.1f}" for k in KINDS)
        line += f"{exact:>17}"
        prof = r["profile"]
        line += f"{prof['aten_ops']:>10}{prof['sync_ops']:>7}{prof.get('kernel_launches', '-'):>10}"
        print(line)
    print(
        f"(profile: one undo of {prof_elements:,} elements; syncs: nonzero/item/bool ops, host syncs on a GPU;"
        " exact: % bitwise)"
    )
    print("goals on a GPU: undo/step <= 3, /bound <= 10, ulp <= 2 (issue 29)")
    print("command:", result["command"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
