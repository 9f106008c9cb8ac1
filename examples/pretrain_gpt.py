"""Pretrain a small GPT with a Megatron 3D plan on DeepSpeed's pipeline engine, protected by ds-swift.

    ds-swift-launch --nnodes 2 --nproc-per-node 2 --spares 1 \\
        examples/pretrain_gpt.py --deepspeed_config configs/gpt_tiny_pp2_dp2.json --train-iters 15 --save DIR

Megatron's flags set the plan (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--micro-batch-size``, ``--global-batch-size``); a flag left out comes from the DeepSpeed config
(``"pipeline": {"stages": K}``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``).
megatron-core's ``parallel_state`` builds the groups in ``swift.machines.rank_order``; the recovery
planner reads the plan back from it. Data is the standard library's docstrings as bytes
(``--data corpus``) or a synthetic sequence (``--data synthetic``), keyed by (iteration,
micro-batch), so a recovered rank reads exactly the samples it would have read. ``--loss-log FILE``
appends one JSON line per iteration (iteration, loss) from the last stage's rank of replica 0;
iterations count from 0 there, as in ``ds-swift-launch --inject`` and the recovery timeline.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import warnings
from typing import Any

import deepspeed
import torch.distributed as dist

import ds_swift
import ds_swift.megatron
from ds_swift.config import ConfigError, load_ds_config
from ds_swift.data.keyed import ResumableIterator, micro_batches
from ds_swift.models.gpt import DATA_SOURCES, GPTConfig, gpt_batch_fn, gpt_pipeline
from ds_swift.models.training_plan import PlanError, resolve_training_plan
from ds_swift.patches.megatron_import import import_megatron_core
from ds_swift.plan import layout_from_deepspeed_topology, layout_from_parallel_state
from ds_swift.recovery.registry import load_config
from ds_swift.runtime.context import pipeline_topology


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed_config", "--deepspeed-config", required=True)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=None,
        help="default: pipeline.stages of --deepspeed_config, else 1",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="default: train_micro_batch_size_per_gpu of --deepspeed_config",
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="default: micro-batch x gradient_accumulation_steps of --deepspeed_config x dp",
    )
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--lr", type=float, default=None, help="overrides the config's optimizer lr")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save", default=None, help="write a final DeepSpeed checkpoint here")
    p.add_argument("--load", default=None, help="start from the latest DeepSpeed checkpoint here")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=None, help="default: 256 (bytes) for corpus, 128 for synthetic")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--data", choices=DATA_SOURCES, default="corpus")
    p.add_argument("--loss-log", default=None, metavar="FILE", help="append {iteration, loss} JSON lines here")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument(
        "--data-iter",
        action="store_true",
        help="feed train_batch(data_iter=...) from a resumable iterator (as Megatron scripts feed "
        "theirs) instead of letting ds-swift read batch_fn by position",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    ds_swift.megatron.add_arguments(p)  # --swift, --swift-config
    return p.parse_args(argv)


def setup(args: argparse.Namespace) -> tuple[dict[str, Any], Any, GPTConfig]:
    """Config, plan and model shape from the flags; raises PlanError/ConfigError/ValueError naming the flag."""
    config = load_ds_config(args.deepspeed_config)
    if args.swift or args.swift_config:
        config["swift"] = ds_swift.megatron.swift_section(args, config)
    if args.lr is not None:
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = args.lr
    plan = resolve_training_plan(
        config,
        int(os.environ.get("WORLD_SIZE", "1")),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
    )
    plan.apply(config)
    if plan.tp > 1:
        # DeepSpeed would split activations between TP ranks with an all-gather on receipt; each
        # TP rank holding the whole (replicated) activation keeps the p2p messages independent.
        config["pipeline"].setdefault("pipe_partitioned", False)
        config["pipeline"].setdefault("grad_partitioned", False)
    vocab = args.vocab_size if args.vocab_size is not None else (256 if args.data == "corpus" else 128)
    shape = GPTConfig(
        args.num_layers,
        args.hidden_size,
        args.num_attention_heads,
        args.seq_length,
        vocab,
        args.dropout,
        tensor_parallel=plan.tp,
    )
    if args.train_iters < 1:
        raise PlanError(f"--train-iters {args.train_iters} is invalid: a positive integer")
    return config, plan, shape


def import_parallel_state() -> Any:
    """megatron-core's parallel_state (importing megatron.core takes seconds: do it before joining
    the job, where it counts as process start-up, not as a rebuild everyone waits for)."""
    # Megatron warns on import, once per module, that Transformer Engine and Apex are missing: on
    # CPU they always are, and its local fallbacks are what we want.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
    # Without CUDA, without megatron's torch.compile wrappers: a third less CPU per rank to start.
    import_megatron_core()
    from megatron.core import parallel_state

    return parallel_state


def init_model_parallel(parallel_state: Any, tp: int, pp: int, rank_order: str, op_timeout_s: float) -> None:
    """Build megatron-core's groups on the process group in force (after a recovery, a new one)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()  # the last generation's groups: dead
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        order=rank_order,
        # megatron's default is 30 minutes: a rank blocked in a TP collective on a living peer
        # must give up as soon as any other op would.
        distributed_timeout_minutes=op_timeout_s / 60.0,  # type: ignore[arg-type]
        # gloo is the default backend here already: megatron's gloo copies would double the groups.
        create_gloo_process_groups=False,
    )


def load(engine: Any, load_dir: str) -> None:
    """``--load``: DeepSpeed's load, which names the damaged file when it fails; with no checkpoint
    there, training starts from iteration 0 (the resume-on-every-launch pattern of Megatron's
    scripts), and says so."""
    from ds_swift.checkpoint.damage import named_on_failure

    with named_on_failure(load_dir):
        loaded, _ = engine.load_checkpoint(load_dir)
    if loaded is None and int(os.environ.get("RANK", "0")) == 0:
        print(f"--load {load_dir}: no DeepSpeed checkpoint there (no 'latest' file): training starts from iteration 0")


def resumable_data(engine: Any, batch_fn: Any) -> ResumableIterator:
    """This replica's micro-batches from any iteration on: what a Megatron script's DataLoader over
    MegatronPretrainingSampler(consumed_samples=iteration * global_batch) gives."""
    dp, gas = engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps()

    def factory(iteration: int) -> Any:
        return itertools.chain.from_iterable(micro_batches(batch_fn, i, dp, gas) for i in itertools.count(iteration))

    return ResumableIterator(factory, gas, int(engine.global_steps))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config, plan, shape = setup(args)
    except (PlanError, ConfigError, ValueError) as exc:
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr)
        return 2
    cfg = load_config(config)
    # Start-up work before joining the job: a replacement's start-up is waited for either way, but
    # what it does after joining counts as the rebuild of every rank.
    parallel_state = import_parallel_state()
    batch_fn = gpt_batch_fn(args.data, args.seed, plan.micro_batch_size, shape)
    ds_swift.init_distributed(config)
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or cfg.machines.gpus_per_node)
    op_timeout_s = float(os.environ.get("SWIFT_OP_TIMEOUT_S") or cfg.watchdog.op_timeout_s)

    def model_fn() -> Any:
        # Called at start-up and by ds-swift's rebuild after a failure, on a new process group
        # each time: megatron's groups are made again, in the same order on survivors (in their
        # rebuild) and replacements (here, at start-up).
        init_model_parallel(parallel_state, plan.tp, plan.pp, cfg.machines.rank_order, op_timeout_s)
        layout = layout_from_parallel_state(gpus_per_node)  # the plan as megatron-core built it
        topology = pipeline_topology(layout.order, pp=layout.pp, dp=layout.dp, tp=layout.tp)
        if layout_from_deepspeed_topology(topology, gpus_per_node) != layout:
            raise RuntimeError(f"DeepSpeed's topology disagrees with megatron-core's groups ({layout})")
        model = gpt_pipeline(shape, topology, args.seed)
        if plan.tp == 1:
            # No layer uses megatron's groups: drop them, since a process group still referenced
            # at a failure keeps its sockets open and peers blocked on it wait for the op timeout.
            parallel_state.destroy_model_parallel()
        layouts[:] = [layout]
        return model

    layouts: list[Any] = []
    model = model_fn()
    if dist.get_rank() == 0:
        layout = layouts[0]
        print(
            f"plan: tp={layout.tp} pp={layout.pp} dp={layout.dp} order {layout.order} on "
            f"{layout.num_machines} machine(s) of {gpus_per_node}; micro-batch {plan.micro_batch_size} x "
            f"{plan.gradient_accumulation_steps} accumulation = global batch {plan.global_batch_size}; "
            f"data {args.data}",
            flush=True,
        )
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=[p for p in model.parameters() if p.requires_grad]
    )
    del model  # the engine holds it; a reference here would outlive a failure's teardown
    if args.load:
        load(engine, args.load)
    swift_engine = ds_swift.initialize(engine, config, model_fn=model_fn, batch_fn=batch_fn, seed=args.seed)
    protected = swift_engine is not engine  # false with "swift": {"enabled": false}: plain DeepSpeed
    engine = swift_engine
    data_iter = resumable_data(engine, batch_fn) if protected and args.data_iter else None
    while engine.global_steps < args.train_iters:
        if data_iter is not None:
            loss = engine.train_batch(data_iter=data_iter)  # ds-swift rewinds it after a recovery
        elif protected:
            loss = engine.train_batch()  # ds-swift reads batch_fn by position itself
        else:
            data = micro_batches(
                batch_fn, engine.global_steps, engine.grid.get_data_parallel_id(), engine.gradient_accumulation_steps()
            )
            loss = engine.train_batch(data_iter=data)
        step = int(engine.global_steps)
        if (
            args.loss_log
            and engine.is_last_stage()
            and engine.grid.get_data_parallel_id() == 0
            and engine.grid.get_slice_parallel_rank() == 0
        ):
            # 0-based, as --inject and the recovery timeline count: the iteration that made this loss
            record = {
                "iteration": step - 1,
                "loss": float(loss),
                "time": time.time(),
                "rank": dist.get_rank(),
                "generation": int(getattr(engine, "generation", 0)),
            }
            with open(args.loss_log, "a") as f:  # reopened per line: a killed rank leaves whole lines
                f.write(json.dumps(record) + "\n")
        if engine.global_rank == 0 and (step % args.log_interval == 0 or step == args.train_iters):
            print(f"iteration {step}/{args.train_iters} loss {float(loss):.4f}", flush=True)
    if args.save:
        engine.save_checkpoint(os.path.abspath(args.save))
    if hasattr(engine, "close"):
        engine.close()
    return 0


if __name__ == "__main__":
    # As sys.exit, without the interpreter's teardown of torch, DeepSpeed and megatron-core (2-3 s
    # per rank at the end of every job; the engine is closed and the files written by then).
    ds_swift.exit_process(main())
