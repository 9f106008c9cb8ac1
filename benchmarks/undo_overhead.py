"""Cost of update-undo: step time and peak memory with vs without the wrapper, undo time.

Two kinds of child process, all started from this one, per optimizer:

- timing: one process builds the model twice (same seed) with a plain and a wrapped
  optimizer (``InvertibleOptimizer``; with ``--engine`` two 1-rank DeepSpeed engines, one with
  ``attach_to_engine``) and runs their iterations *interleaved* (plain, wrapped, wrapped,
  plain, ...), so drift on a shared machine hits both alike. It times the optimizer step
  alone and the whole iteration (zero_grad, forward, backward, step; the engine's
  forward/backward/step), then undoes the wrapped model's last step, with refinement and
  (after re-stepping) without it.
- memory: peak RSS (``ru_maxrss``: per process, cannot be reset, hence one process per
  variant) of plain and of wrapped training, and of the wrapped one's undo afterwards. The
  memory children of one round run in rotated order.

Ratios are medians over ``--rounds`` rounds:
``step_ratio`` / ``iter_ratio`` (wrapped / plain; 1.0 = no overhead), ``undo_over_step``
(undo time / plain optimizer-step time; ``undo_plain_over_step`` without refinement),
``peak_ratio`` (wrapped / plain peak RSS while training), ``undo_peak_delta_mb`` (how far
the undo, a rare event, raised the peak above plain training).

    python benchmarks/undo_overhead.py                      # table
    python benchmarks/undo_overhead.py --json               # one JSON object
    python benchmarks/undo_overhead.py --engine --zero 1    # through DeepSpeed (ZeRO-1, 1 rank)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

OPTIMIZERS = ("adamw", "sgd", "adagrad", "rmsprop", "lamb")
HIDDEN = 1024
BATCH = 8


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=8e6, help="model size (parameters)")
    p.add_argument("--steps", type=int, default=6, help="iterations per model per child (the first is warm-up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--optimizers", default="adamw,sgd,lamb", help=f"comma list of {','.join(OPTIMIZERS)}")
    p.add_argument("--engine", action="store_true", help="measure through a 1-rank DeepSpeed engine")
    p.add_argument("--zero", type=int, default=1, help="ZeRO stage with --engine (0 or 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- child


def _make_optimizer(name: str, params: Any) -> Any:
    import torch

    from ds_swift.undo import Lamb

    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=1e-4)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-3)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-4, momentum=0.9)
    if name == "lamb":
        return Lamb(params, lr=1e-3, weight_decay=0.01)
    raise SystemExit(f"unknown optimizer {name}")


class _Trainer:
    """One model + optimizer (or engine), plain or wrapped, with a timed iteration."""

    def __init__(self, spec: dict[str, Any], wrapped: bool) -> None:
        import torch

        from ds_swift.undo import InvertibleOptimizer, attach_to_engine

        torch.manual_seed(0)
        layers = max(1, round(spec["params"] / (HIDDEN * HIDDEN + HIDDEN)))
        mods: list[torch.nn.Module] = []
        for _ in range(layers):
            mods += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()]
        self.model = torch.nn.Sequential(*mods)
        self.engine: Any = None
        self.handle: Any = None
        inner = _make_optimizer(spec["optimizer"], self.model.parameters())
        if spec["engine"]:
            import deepspeed

            cfg = {
                "train_micro_batch_size_per_gpu": BATCH,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": spec["zero"]},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9,
            }
            self.engine = deepspeed.initialize(model=self.model, optimizer=inner, config=cfg)[0]
            self.handle = attach_to_engine(self.engine) if wrapped else None
            self.opt: Any = self.engine.optimizer
        else:
            self.opt = InvertibleOptimizer(inner) if wrapped else inner
        self.gen = torch.Generator().manual_seed(1)

    def iteration(self) -> tuple[float, float]:
        """(whole iteration, optimizer step) seconds."""
        import torch

        x = torch.randn(BATCH, HIDDEN, generator=self.gen)
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.backward(self.engine(x).pow(2).mean())
            ts = time.perf_counter()
            self.engine.step()
        else:
            self.opt.zero_grad(set_to_none=True)
            self.model(x).pow(2).mean().backward()
            ts = time.perf_counter()
            self.opt.step()
        t1 = time.perf_counter()
        return t1 - t0, t1 - ts

    def undo(self, refine: bool) -> float:
        t0 = time.perf_counter()
        if self.handle is not None:
            self.handle.optimizer.refine = refine
            last = self.handle.last_stepped_iteration
            assert last is not None
            self.handle.undo_to(last - 1)
        else:
            self.opt.refine = refine
            self.opt.undo()
        return time.perf_counter() - t0

    def restep(self) -> None:
        """Step again on the gradient still resident (what redoing the iteration ends with)."""
        if self.engine is not None:
            x = __import__("torch").randn(BATCH, HIDDEN, generator=self.gen)
            self.engine.backward(self.engine(x).pow(2).mean())
            self.engine.step()
        else:
            self.opt.step()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    if spec["engine"]:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    if spec["mode"] == "memory":
        t = _Trainer(spec, wrapped=spec["wrapped"])
        for _ in range(spec["steps"]):
            t.iteration()
        out: dict[str, Any] = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if spec["wrapped"]:
            t.undo(refine=True)
            out["undo_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return out
    # Build order alternates by round: the second model's memory lands elsewhere (page
    # placement, allocator state), which would otherwise bias one variant.
    if spec.get("round", 0) % 2 == 0:
        plain, wrapped = _Trainer(spec, wrapped=False), _Trainer(spec, wrapped=True)
    else:
        wrapped, plain = _Trainer(spec, wrapped=True), _Trainer(spec, wrapped=False)
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "wrapped": []}
    for i in range(spec["steps"]):
        order = [("plain", plain), ("wrapped", wrapped)] if i % 2 == 0 else [("wrapped", wrapped), ("plain", plain)]
        for name, t in order:
            times[name].append(t.iteration())
    med = {
        n: (statistics.median(x[0] for x in v[1:]), statistics.median(x[1] for x in v[1:])) for n, v in times.items()
    }
    undo_refined = wrapped.undo(refine=True)
    wrapped.restep()
    undo_plain = wrapped.undo(refine=False)
    return {
        "iter_s": {n: m[0] for n, m in med.items()},
        "step_s": {n: m[1] for n, m in med.items()},
        "undo_s": undo_refined,
        "undo_plain_s": undo_plain,
    }


# ---------------------------------------------------------------------------- parent


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    from ds_swift.testing.procs import free_port, worker_env
    from ds_swift.testing.ranks import rank_env

    # A DeepSpeed engine needs a (one-rank) process group; the plain optimizer runs need none.
    env = rank_env(0, 1, free_port()) if spec["engine"] else worker_env({"OMP_NUM_THREADS": "1"})
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    base = {"params": args.params, "steps": args.steps, "engine": args.engine, "zero": args.zero}
    timing: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    memory: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        for name in names:
            timing[name].append(_run_child({**base, "optimizer": name, "mode": "timing", "round": rnd}))
            for is_wrapped in [False, True] if rnd % 2 == 0 else [True, False]:
                spec = {**base, "optimizer": name, "mode": "memory", "wrapped": is_wrapped}
                memory.setdefault((name, is_wrapped), []).append(_run_child(spec))
    result: dict[str, Any] = {
        "params": int(args.params),
        "engine": f"deepspeed zero{args.zero} (1 rank)" if args.engine else "torch",
        "rounds": args.rounds,
        "optimizers": {},
    }
    for name in names:
        t, plain, wrapped = timing[name], memory[(name, False)], memory[(name, True)]
        med = statistics.median
        result["optimizers"][name] = {
            "step_ms": 1000 * med(r["step_s"]["plain"] for r in t),
            "iter_ms": 1000 * med(r["iter_s"]["plain"] for r in t),
            "step_ratio": med(r["step_s"]["wrapped"] / r["step_s"]["plain"] for r in t),
            "iter_ratio": med(r["iter_s"]["wrapped"] / r["iter_s"]["plain"] for r in t),
            "undo_over_step": med(r["undo_s"] / r["step_s"]["plain"] for r in t),
            "undo_plain_over_step": med(r["undo_plain_s"] / r["step_s"]["plain"] for r in t),
            "peak_ratio": med(w["peak_rss_bytes"] / p["peak_rss_bytes"] for p, w in zip(plain, wrapped, strict=True)),
            "peak_delta_mb": med(
                (w["peak_rss_bytes"] - p["peak_rss_bytes"]) / 2**20 for p, w in zip(plain, wrapped, strict=True)
            ),
            "undo_peak_delta_mb": med(
                (w["undo_peak_rss_bytes"] - p["peak_rss_bytes"]) / 2**20 for p, w in zip(plain, wrapped, strict=True)
            ),
            "plain_peak_mb": med(p["peak_rss_bytes"] / 2**20 for p in plain),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    result = measure(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"update-undo overhead, {result['params']:,} parameters, {result['engine']}, {result['rounds']} rounds")
    print(
        f"{'optimizer':<10}{'step ms':>9}{'step x':>8}{'iter x':>8}{'undo/step':>11}{'no refine':>11}"
        f"{'peak MB':>9}{'peak x':>8}{'peak +MB':>10}{'undo +MB':>10}"
    )
    for name, r in result["optimizers"].items():
        print(
            f"{name:<10}{r['step_ms']:>9.1f}{r['step_ratio']:>8.3f}{r['iter_ratio']:>8.3f}{r['undo_over_step']:>11.2f}"
            f"{r['undo_plain_over_step']:>11.2f}{r['plain_peak_mb']:>9.0f}{r['peak_ratio']:>8.3f}"
            f"{r['peak_delta_mb']:>10.1f}{r['undo_peak_delta_mb']:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
