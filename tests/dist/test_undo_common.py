"""Helpers shared by the update-undo dist tests (no tests here).

A worker trains a reference engine (no ds-swift) and an identical one with the undo handle
attached, checks the wrapped trajectory is bit-identical, undoes the last step, and writes
per-rank JSON: the restoration error of every tensor (ulp of the larger of its pre/post-step
largest magnitude), whether the engine counters and LR scheduler came back exactly, and the
step record.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

COUNTERS = ("global_steps", "global_samples", "skipped_steps")
#: Iterations each variant trains; the last one is undone.
ITERATIONS = 4


def snapshot(engine: Any, handle: Any) -> dict[str, Any]:
    """Copies of everything a step changes on this rank."""
    import torch

    inner = handle.kind.inner
    masters = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    states = []
    for g in inner.param_groups:
        for p in g["params"]:
            st = inner.state[p] if p in inner.state else {}
            states.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()})
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    return {
        "module": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "masters": masters,
        "states": states,
        "counters": {c: getattr(engine, c) for c in COUNTERS},
        "sched": copy.deepcopy(sched),
        "lrs": [g["lr"] for g in inner.param_groups],
    }


def compare(before: dict[str, Any], post: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Worst restoration error per category, and exactness of counters/scheduler."""
    import torch

    from ds_swift.undo.numerics import ulp_error

    worst: dict[str, float] = {"module": 0.0, "masters": 0.0}
    for name, b in before["module"].items():
        worst["module"] = max(worst["module"], ulp_error(after["module"][name], b, post["module"][name]))
    for b, p, a in zip(before["masters"], post["masters"], after["masters"], strict=True):
        worst["masters"] = max(worst["masters"], ulp_error(a, b, p))
    scalars_ok = True
    keys_ok = True
    for b, p, a in zip(before["states"], post["states"], after["states"], strict=True):
        keys_ok &= set(a) == set(b)
        for key, vb in b.items():
            va = a[key]
            if isinstance(vb, torch.Tensor) and vb.dim() > 0:
                worst[key] = max(worst.get(key, 0.0), ulp_error(va, vb, p[key]))
            else:
                scalars_ok &= float(va) == float(vb)
    return {
        "ulp": worst,
        "state_keys_ok": keys_ok,
        "state_scalars_ok": scalars_ok,
        "counters_ok": after["counters"] == before["counters"],
        "sched_ok": after["sched"] == before["sched"],
        "lrs_ok": after["lrs"] == before["lrs"],
        "changed_by_step": any(not torch.equal(before["module"][n], post["module"][n]) for n in before["module"]),
    }


def exercise(
    make_engine: Callable[[], Any],
    run_iteration: Callable[[Any, int], None],
    iterations: int = ITERATIONS,
    refresh: bool = True,
    partial_backward: Callable[[Any, int], None] | None = None,
) -> dict[str, Any]:
    """Reference run, wrapped run, undo of the last step; returns the findings."""
    import torch

    from ds_swift.undo import UndoError, attach_to_engine

    ref = make_engine()
    for it in range(iterations):
        run_iteration(ref, it)
    ref_params = {n: p.detach().clone() for n, p in ref.module.named_parameters()}
    del ref

    engine = make_engine()
    handle = attach_to_engine(engine)
    for it in range(iterations - 1):
        run_iteration(engine, it)
    before = snapshot(engine, handle)
    run_iteration(engine, iterations - 1)
    post = snapshot(engine, handle)
    bitwise = all(torch.equal(post["module"][n], t) for n, t in ref_params.items())
    rec = handle.last_record
    assert rec is not None
    summary = rec.summary()
    last = handle.last_stepped_iteration
    too_old = ""
    try:
        handle.undo_to(iterations - 3)
    except UndoError as e:
        too_old = str(e)
    undone = handle.undo_to(iterations - 2, refresh=refresh)
    if not refresh:
        handle.refresh_params(gather=True)
    after = snapshot(engine, handle)
    out = compare(before, post, after)
    out.update(
        bitwise_trajectory=bitwise,
        last_stepped_before=last,
        last_stepped_after=handle.last_stepped_iteration,
        record=summary,
        undone=len(undone),
        too_old_error=too_old,
        noop=handle.undo_to(iterations + 5) == [],
    )
    # The engine trains on after the undo (iteration re-run), and remove() restores it.
    run_iteration(engine, iterations - 1)
    out["redo_recorded"] = handle.last_stepped_iteration == iterations - 1
    if partial_backward is not None:
        # Once the next iteration's backward has begun, g_t is gone: undo must refuse.
        partial_backward(engine, iterations)
        try:
            handle.undo_to(iterations - 2)
            out["released_error"] = ""
        except UndoError as e:
            out["released_error"] = str(e)
    handle.remove()
    out["patched_attrs_left"] = sorted(
        k for k in ("_take_model_step", "backward", "_INSTRUCTION_MAP") if k in vars(engine)
    ) + (["inner.step"] if "step" in vars(handle.kind.inner) else [])
    return out


def exercise_overflow(
    make_engine: Callable[[], Any], run_iteration: Callable[[Any, int, bool], None]
) -> dict[str, Any]:
    """fp16: iteration 2 overflows (the loss is made inf), DeepSpeed skips the step and the
    loss scaler reacts; undoing it must restore counters and scaler and leave the rest."""
    import torch

    from ds_swift.patches.deepspeed_optim_state import loss_scalers
    from ds_swift.undo import attach_to_engine

    engine = make_engine()
    handle = attach_to_engine(engine)
    run_iteration(engine, 0, False)
    run_iteration(engine, 1, False)
    before = snapshot(engine, handle)
    scaler_before = {k: repr(v) for k, v in vars(loss_scalers(engine.optimizer, handle.kind.kind)[0]).items()}
    run_iteration(engine, 2, True)
    rec = handle.last_record
    assert rec is not None
    scaler_post = {k: repr(v) for k, v in vars(loss_scalers(engine.optimizer, handle.kind.kind)[0]).items()}
    post_counters = {c: getattr(engine, c) for c in COUNTERS}
    handle.undo_to(1)
    after = snapshot(engine, handle)
    scaler_after = {k: repr(v) for k, v in vars(loss_scalers(engine.optimizer, handle.kind.kind)[0]).items()}
    out = {
        "skipped": rec.skipped,
        "iteration": rec.iteration,
        "loss_scale": rec.loss_scale,
        "scaler_changed_by_overflow": scaler_post != scaler_before,
        "skipped_steps_post": post_counters["skipped_steps"],
        "scaler_restored": scaler_after == scaler_before,
        "counters_ok": after["counters"] == before["counters"],
        "params_untouched": all(torch.equal(after["module"][n], t) for n, t in before["module"].items()),
        "masters_untouched": all(torch.equal(a, b) for a, b in zip(after["masters"], before["masters"], strict=True)),
        "last_stepped_after": handle.last_stepped_iteration,
    }
    handle.remove()
    return out


def exercise_detach(make_engine: Callable[[], Any], run_iteration: Callable[[Any, int], None]) -> dict[str, Any]:
    """The recovery runtime's path: detach the handle (engine restored and released, the
    step's gradient kept), then undo through the returned InvertibleOptimizer alone."""
    from ds_swift.undo.numerics import ulp_error

    engine = make_engine()
    handle = _attach(engine)
    run_iteration(engine, 0)
    before = snapshot(engine, handle)
    run_iteration(engine, 1)
    post = snapshot(engine, handle)
    inner = handle.kind.inner
    inv = handle.detach()
    restored = sorted(k for k in ("_take_model_step", "backward") if k in vars(engine)) == []
    rec = inv.undo()
    worst = max(
        ulp_error(p.detach(), b, q)
        for p, b, q in zip(
            (p for g in inner.param_groups for p in g["params"]), before["masters"], post["masters"], strict=True
        )
    )
    return {
        "engine_restored": restored and "step" not in vars(inner) and handle.engine is None,
        "iteration": rec.iteration,
        "ulp": worst,
        "sched_ok": (engine.lr_scheduler.state_dict() if engine.lr_scheduler else None) == before["sched"],
    }


def _attach(engine: Any) -> Any:
    from ds_swift.undo import attach_to_engine

    return attach_to_engine(engine)


def write(out_dir: Path, rank: int, results: dict[str, Any]) -> None:
    (out_dir / f"undo_rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))


def run_workers(script: str, out_dir: Path, world: int) -> dict[int, dict[str, Any]]:
    """Run ``script OUT_DIR`` as ``world`` gloo ranks; returns each rank's findings (see ``write``)."""
    from ds_swift.testing.ranks import run_ranks

    run_ranks(world, [script, str(out_dir)], out_dir / "proc-logs", timeout_s=240)
    return {r: json.loads((out_dir / f"undo_rank{r}.json").read_text()) for r in range(world)}


def check(results: dict[str, Any], variant: str, *, iterations: int = ITERATIONS, bf16: bool = False) -> None:
    """Assertions shared by the dist tests, on one rank's findings for one variant."""
    r = results[variant]
    assert r["bitwise_trajectory"], "wrapped training differs from plain DeepSpeed"
    assert r["changed_by_step"], "the step under test changed nothing"
    assert r["last_stepped_before"] == iterations - 1 and r["last_stepped_after"] == iterations - 2
    assert r["record"]["iteration"] == iterations - 1 and r["record"]["complete"] and not r["record"]["skipped"]
    assert r["undone"] == 1 and r["noop"]
    assert "only" in r["too_old_error"] and "checkpoint" in r["too_old_error"]
    assert r["counters_ok"] and r["sched_ok"] and r["lrs_ok"], r
    assert r["state_keys_ok"] and r["state_scalars_ok"], r
    for kind, ulps in r["ulp"].items():
        assert ulps <= 2.0, f"{variant}: {kind} restored to {ulps} ulp"
    assert r["patched_attrs_left"] == [] and r["redo_recorded"]
    if "released_error" in r:
        assert "released" in r["released_error"], r["released_error"]
