"""How exact update-undo's inverse update is: the share of elements it does not restore bit for bit.

A torch AdamW (decoupled weight decay, what DeepSpeed's ``"torch_adam": true`` builds on CPU) steps a
partition of ``--elements`` fp32 parameters ``--steps`` times with gradients of a realistic scale
(1e-3, a few percent of the weights zero-initialised like biases); then
``ds_swift.undo.InvertibleOptimizer`` undoes the last step. Per tensor (masters, ``exp_avg``,
``exp_avg_sq``) it reports the share of elements that differ from the state before that step, and
the share that still differ after stepping the undone state forward again with the same gradient
(an undone element that is *a* pre-image of the post-step value, though not *the* one, maps back).

Why buddy copies keep an own copy (ds_swift.protect.buddy): survivors that must go back one step take
it back instead of undoing, so their state is the failure-free run's bit for bit.

    python benchmarks/undo_exactness.py
    python benchmarks/undo_exactness.py --elements 1000000 --steps 20 --json
"""

from __future__ import annotations

import argparse
import json

import torch

from ds_swift.undo import InvertibleOptimizer


def measure(elements: int, steps: int, lr: float, weight_decay: float, seed: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(elements) * 0.02)
    with torch.no_grad():
        p[: elements // 60] = 0  # zero-initialised entries, as biases are
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=weight_decay)
    undo = InvertibleOptimizer(opt)
    before: dict[str, torch.Tensor] = {}
    for t in range(steps):
        p.grad = torch.randn(elements) * 1e-3 * (1 + torch.rand(elements))
        if t == steps - 1:
            st = opt.state[p]
            before = {
                "masters": p.detach().clone(),
                "exp_avg": st["exp_avg"].clone(),
                "exp_avg_sq": st["exp_avg_sq"].clone(),
            }
        undo.step()
    after_step = {"masters": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items() if k != "step"}}
    undo.undo()
    st = opt.state[p]
    undone = {"masters": p.detach().clone(), "exp_avg": st["exp_avg"].clone(), "exp_avg_sq": st["exp_avg_sq"].clone()}
    # The undone state stepped forward again with the same gradient.
    q = torch.nn.Parameter(undone["masters"].clone())
    again = torch.optim.AdamW([q], lr=lr, weight_decay=weight_decay)
    again.state[q] = {
        "step": torch.tensor(float(steps - 1)),
        "exp_avg": undone["exp_avg"].clone(),
        "exp_avg_sq": undone["exp_avg_sq"].clone(),
    }
    assert p.grad is not None
    q.grad = p.grad.clone()
    again.step()
    redone = {"masters": q.detach(), "exp_avg": again.state[q]["exp_avg"], "exp_avg_sq": again.state[q]["exp_avg_sq"]}
    return {
        name: {
            "off_after_undo": float((undone[name] != before[name]).double().mean()),
            "off_after_redo": float((redone[name] != after_step[name]).double().mean()),
        }
        for name in before
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=120_000, help="parameters in the partition (default 120000)")
    p.add_argument("--steps", type=int, default=6, help="steps taken; the last is undone (default 6)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    out = measure(args.elements, args.steps, args.lr, args.weight_decay, args.seed)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"AdamW, {args.elements} elements, step {args.steps} undone by the inverse update:")
    print(f"{'tensor':12s} {'off after undo':>15s} {'off after redo':>15s}")
    for name, r in out.items():
        print(f"{name:12s} {r['off_after_undo']:15.2%} {r['off_after_redo']:15.4%}")
    print("(an own copy taken back, as buddy copies do: 0 elements off, by construction)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
