"""Nicolae et al.'s question on the tiny GPT: how far do lossy forward and immediate rollback take
the model from the failure-free run? (issue 14; shared/papers/nicolae-*.txt, section IV)

Runs ``examples/pretrain_gpt.py`` under ``ds-swift-launch`` in the configuration users run
(``configs/gpt_tiny_pp2_dp2_bf16_zero1.json``: bf16, ZeRO-1, clipping, pp 2 x dp 2 on 2 simulated
machines), all jobs started from this one process, with the failure-simulation mode
(``simulate_failure``: nothing is killed; ds_swift.runtime.failure_simulation) at each ``--at`` iteration:

- ``LF-xx%``: lossy forward, replica 1 lost after xx% of the backward pass: the gradients of the
  pipeline layers the backward had not reached count only replica 0's (``upto_layer``); ``LF-0%``
  loses every layer's, what a real failure in DeepSpeed's pipeline loses;
- ``IR-stage1``: immediate rollback with stage 1 (the last, whose backward ends first) stepped:
  its update of the failed mini-batch is applied twice; ``IR-all``: every stage stepped.

For each: the final loss minus the failure-free run's, the mean absolute loss difference over the
iterations after the failure, and the parameters' relative L2 distance to the failure-free run
(ds_swift.testing.checkpoints.relative_distance).

    python benchmarks/failure_simulation.py                 # table
    python benchmarks/failure_simulation.py --json          # one JSON object
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from ds_swift.bench.demo_report import losses_by_iteration, read_loss_log
from ds_swift.testing.checkpoints import checkpoint_tensors, relative_distance
from ds_swift.testing.jobs import JobRun, JobSpec, build_deepspeed_shm_op, run_job

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pretrain_gpt.py"
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2_bf16_zero1.json"


def variants(layers: int) -> dict[str, dict[str, Any]]:
    """name -> ``simulate_failure`` section (without the iteration). ``layers``: pipeline layers."""
    out: dict[str, dict[str, Any]] = {}
    for progress in (0, 25, 50, 75):
        # the backward runs from the last layer down: after p% of it, layers below (1 - p) x layers are left
        left = int(layers * (100 - progress) / 100 + 0.5) - 1
        out[f"LF-{progress}%"] = {"strategy": "lossy_forward", "casualties": [1], "upto_layer": left}
    out["IR-stage1"] = {"strategy": "immediate_rollback", "stepped_stages": [1]}
    out["IR-all"] = {"strategy": "immediate_rollback", "stepped_stages": [0, 1]}
    return out


def job(work: Path, name: str, iterations: int, swift: dict[str, Any]) -> JobRun:
    spec = JobSpec(EXAMPLE, CONFIG, iterations, swift=swift, loss_log=True)
    run = run_job(work / name, spec, 600.0)
    if run.code != 0 or run.timelines():
        raise SystemExit(f"{name}: exit {run.code}\n{run.output[-4000:]}")
    return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.dir or tempfile.mkdtemp(prefix="failure-simulation-"))
    build_deepspeed_shm_op(work / "warm")
    base = job(work, "baseline", args.iterations, {})
    ref = checkpoint_tensors(base.final_tag)
    ref_loss = losses_by_iteration(read_loss_log(base.loss_log))
    layers = len(list(base.final_tag.glob("layer_*-model_states.pt")))
    rows = []
    for at in args.at:
        for name, section in variants(layers).items():
            r = job(
                work,
                f"{name}-at{at}".replace("%", "pct"),
                args.iterations,
                {"simulate_failure": {"iteration": at, **section}},
            )
            loss = losses_by_iteration(read_loss_log(r.loss_log))
            after = [i for i in sorted(ref_loss) if i >= at and i in loss]
            last = max(after)
            rows.append(
                {
                    "variant": name,
                    "at": at,
                    "simulate_failure": section,
                    "final_loss_delta": loss[last] - ref_loss[last],
                    "mean_abs_loss_delta": sum(abs(loss[i] - ref_loss[i]) for i in after) / len(after),
                    "param_distance": relative_distance(ref, checkpoint_tensors(r.final_tag)),
                }
            )
    return {
        "config": str(CONFIG.relative_to(ROOT)),
        "iterations": args.iterations,
        "layers": layers,
        "rows": rows,
        "dir": str(work),
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'variant':<10} {'at':>3} {'final loss delta':>17} {'mean |loss delta|':>18} {'param distance':>15}"]
    for r in result["rows"]:
        lines.append(
            f"{r['variant']:<10} {r['at']:>3} {r['final_loss_delta']:>+17.2e} {r['mean_abs_loss_delta']:>18.2e} "
            f"{r['param_distance']:>15.2e}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--at", type=int, nargs="+", default=[5, 15], help="iterations the simulated failure hits")
    p.add_argument("--dir", help="work directory (default: a new temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
