"""`ds-swift plan`: what ds-swift will do for a 3D plan, before the job starts.

Reads the plan from flags, or from ``--deepspeed-config FILE`` plus flags (flags win): the
``swift`` section gives gpus_per_node, rank_order, strategy, groups / storage budget, checkpoint
interval and parallel recovery; ``pipeline.stages``, ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps`` and ``bf16``/``fp16`` give the pipeline stages, micro-batch size,
micro-batch count and dtype defaults. A storage budget from the file without a model shape is
not applied here (the engine measures its messages and groups at start-up): the plan shows
every machine boundary and says so. Prints rich tables, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from ds_swift.config import ConfigError, SwiftConfig, load_ds_config
from ds_swift.plan.analysis import Plan, analyze, stage_mode
from ds_swift.plan.buddy_cost import BuddyCost, buddy_cost, copies_kept
from ds_swift.plan.layout import ParallelLayout
from ds_swift.plan.sizes import DTYPE_BYTES, ModelShape
from ds_swift.plan.tables import print_buddy, print_tables
from ds_swift.plan.update_logging import choose_for_plan, print_choices
from ds_swift.recovery.registry import checked, strategy_names

__all__ = ["build_plan", "register", "run"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="show the recovery plan (replication / logging / checkpoint per stage, log bytes) of a 3D layout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--deepspeed-config", metavar="FILE", help="DeepSpeed JSON config (its swift section and batch sizes)"
    )
    g = p.add_argument_group("parallel layout")
    g.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    g.add_argument("--pp", type=int, help="pipeline stages (default 1)")
    g.add_argument("--dp", type=int, help="data-parallel size (default: world-size / (tp*pp), else 1)")
    g.add_argument("--world-size", type=int, help="number of ranks; must equal tp*pp*dp")
    g.add_argument("--order", help="megatron-core rank order, fastest-varying first (default tp-dp-pp)")
    g.add_argument("--gpus-per-node", type=int, help="ranks per machine (default: swift config, 8)")
    g = p.add_argument_group("model shape (message sizes)")
    g.add_argument("--hidden", type=int, help="hidden size")
    g.add_argument("--seq-len", type=int, help="sequence length (tokens per sample)")
    g.add_argument(
        "--micro-batch-size", type=int, help="samples per micro-batch (default: train_micro_batch_size_per_gpu)"
    )
    g.add_argument(
        "--micro-batches", type=int, help="micro-batches per iteration (default: gradient_accumulation_steps)"
    )
    g.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), help="activation dtype (default: bf16/fp16 if enabled, else fp32)"
    )
    g.add_argument(
        "--num-params", type=float, help="model parameters, for the log-size vs model-state check (1.3e9 ok)"
    )
    g = p.add_argument_group("strategy and selective logging")
    g.add_argument(
        "--strategy",
        choices=strategy_names(),
        help="the registered strategy to plan for (default: the config's, else auto); its services say what "
        "each stage may recover by",
    )
    excl = g.add_mutually_exclusive_group()
    excl.add_argument("--groups", type=int, help="force K balanced machine groups")
    excl.add_argument("--storage-budget-gb", type=float, help="log budget between two checkpoints: optimise the groups")
    g.add_argument(
        "--checkpoint-interval", type=int, help="iterations between global checkpoints (default: swift config)"
    )
    g.add_argument(
        "--parallel-recovery", action=argparse.BooleanOptionalAction, default=None, help="survivors share the replay"
    )
    g = p.add_argument_group("timing (section 5.4 verdict, grouping objective)")
    g.add_argument("--iteration-time", type=float, metavar="S", help="failure-free iteration time in seconds")
    g.add_argument("--pcie-gbps", type=float, metavar="G", help="device-to-host bandwidth in GB/s (gigabytes)")
    g.add_argument("--network-gbps", type=float, metavar="G", help="inter-machine bandwidth in GB/s, for the M/B term")
    g.add_argument(
        "--stage-compute-s",
        metavar="LIST",
        help="compute seconds per iteration: one number or one per stage, comma-separated",
    )
    g = p.add_argument_group("recommendation (expected end-to-end time with failures, ds_swift.sim)")
    g.add_argument(
        "--recommend", action="store_true", help="propose strategy, groups and checkpoint interval for a failure rate"
    )
    g.add_argument("--mtbf-hours", type=float, metavar="H", help="mean time between failures of the whole job")
    g.add_argument("--total-iterations", type=int, metavar="N", help="iterations of the whole job (default 100000)")
    g.add_argument("--checkpoint-cost-s", type=float, metavar="C", help="seconds one global checkpoint stalls training")
    g.add_argument("--restart-s", type=float, metavar="R", help="seconds to restart the job's processes (default 60)")
    g.add_argument("--load-s", type=float, metavar="L", help="seconds to load a checkpoint (default 0)")
    g.add_argument("--storage-gbps", type=float, metavar="G", help="global store bandwidth for log upload/download")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def _flag_int(flag: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ConfigError(f"{flag}={value} is invalid: a positive integer")
    return value


def _flag_float(flag: str, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag}={value} is invalid: a positive finite number")
    return value


def _ds_int(cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"DeepSpeed config: {key}={value!r} is invalid: a positive integer")
    return value


def _ds_dtype(cfg: dict[str, Any]) -> str:
    for key in ("bf16", "fp16"):
        section = cfg.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return key
    return "fp32"


def build_plan(args: argparse.Namespace) -> Plan:
    """Resolve flags against the DeepSpeed config and analyse. Raises ConfigError on bad input."""
    ds: dict[str, Any] = load_ds_config(args.deepspeed_config) if args.deepspeed_config else {}
    swift = checked(SwiftConfig.from_dict(ds.get("swift")))
    for flag in ("tp", "pp", "dp", "world_size", "gpus_per_node", "hidden", "seq_len", "micro_batch_size"):
        _flag_int("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("micro_batches", "groups", "checkpoint_interval"):
        _flag_int("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("storage_budget_gb", "iteration_time", "pcie_gbps", "network_gbps", "num_params"):
        _flag_float("--" + flag.replace("_", "-"), getattr(args, flag))
    layout = _layout(args, swift, ds)
    shape = _shape(args, ds)

    groups, budget = args.groups, args.storage_budget_gb
    deferred: float | None = None
    if groups is None and budget is None:
        groups, budget = swift.logging.groups, swift.logging.storage_budget_gb
        if budget is not None and shape is None:
            deferred, budget = budget, None
    stage_compute = _stage_compute(args.stage_compute_s, layout.pp)
    parallel = swift.parallel_recovery if args.parallel_recovery is None else args.parallel_recovery
    plan = analyze(
        layout,
        shape,
        strategy=(args.strategy or swift.strategy),
        mode=stage_mode(dataclasses.replace(swift, strategy=args.strategy) if args.strategy else swift),
        groups=groups,
        storage_budget_gb=budget,
        iteration_time_s=args.iteration_time,
        pcie_gbps=args.pcie_gbps,
        checkpoint_interval=args.checkpoint_interval or swift.checkpoint.interval,
        stage_compute_s=stage_compute[0] if stage_compute and len(stage_compute) == 1 else stage_compute,
        network_gbps=args.network_gbps,
        parallel_recovery=parallel,
        partition_copies=copies_kept(swift, buddy_cost(ds, swift, layout, None).active),  # as the engine decides
    )
    if deferred is None:
        return plan
    note = (
        f"logging.storage_budget_gb={deferred:g} not applied: message sizes unknown (give --hidden and "
        "--seq-len); the engine measures its first iteration's sends and groups the machines at start-up"
    )
    return dataclasses.replace(plan, notes=(*plan.notes, note))


def _layout(args: argparse.Namespace, swift: SwiftConfig, ds: dict[str, Any]) -> ParallelLayout:
    """tp/pp/dp from the flags (dp from --world-size when not given; pp from the DeepSpeed
    config's ``pipeline.stages``), machines from the config."""
    pipeline = ds.get("pipeline")
    stages = _ds_int(pipeline, "stages") if isinstance(pipeline, dict) else None
    tp, pp = args.tp or 1, args.pp or stages or 1
    dp = args.dp
    if dp is None and args.world_size is not None:
        if args.world_size % (tp * pp):
            raise ConfigError(f"--world-size={args.world_size} is not a multiple of tp*pp = {tp}*{pp} = {tp * pp}")
        dp = args.world_size // (tp * pp)
    dp = dp or 1
    if args.world_size is not None and args.world_size != tp * pp * dp:
        raise ConfigError(f"--world-size={args.world_size} does not match tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp}")
    return ParallelLayout(
        tp=tp,
        pp=pp,
        dp=dp,
        gpus_per_node=args.gpus_per_node or swift.machines.gpus_per_node,
        order=args.order or swift.machines.rank_order,
    )


def _shape(args: argparse.Namespace, ds: dict[str, Any]) -> ModelShape | None:
    """The model shape from the flags, with batch sizes and dtype defaulting to the DeepSpeed
    config; None without --hidden/--seq-len (then no other shape flag may be given)."""
    if args.hidden is None and args.seq_len is None:
        for flag in ("micro_batch_size", "micro_batches", "dtype", "num_params"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} needs --hidden and --seq-len (the model shape)")
        return None
    for flag, value in (("--hidden", args.hidden), ("--seq-len", args.seq_len)):
        if value is None:
            raise ConfigError(f"{flag} is needed with --hidden/--seq-len to size the pipeline messages")
    mbs = args.micro_batch_size or _ds_int(ds, "train_micro_batch_size_per_gpu")
    if mbs is None:
        raise ConfigError("--micro-batch-size is needed (or train_micro_batch_size_per_gpu in the DeepSpeed config)")
    m = args.micro_batches or _ds_int(ds, "gradient_accumulation_steps")
    if m is None:
        raise ConfigError("--micro-batches is needed (or gradient_accumulation_steps in the DeepSpeed config)")
    num_params = None
    if args.num_params is not None:
        num_params = int(args.num_params)
        if num_params != args.num_params:
            raise ConfigError(f"--num-params={args.num_params} is invalid: a whole number of parameters")
    return ModelShape(
        hidden=args.hidden,
        seq_len=args.seq_len,
        micro_batch_size=mbs,
        micro_batches=m,
        dtype=args.dtype or _ds_dtype(ds),
        num_params=num_params,
    )


def _stage_compute(text: str | None, pp: int) -> list[float] | None:
    """--stage-compute-s: one number, or one per stage, comma-separated."""
    if text is None:
        return None
    try:
        stage_compute = [float(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--stage-compute-s={text!r} is invalid: numbers separated by commas") from None
    if len(stage_compute) not in (1, pp):
        raise ConfigError(f"--stage-compute-s has {len(stage_compute)} values: give 1 or one per stage (pp={pp})")
    return stage_compute


def build_buddy_cost(args: argparse.Namespace) -> BuddyCost:
    """The buddy copies of optimizer partitions the config asks for, and their cost per rank."""
    ds: dict[str, Any] = load_ds_config(args.deepspeed_config) if args.deepspeed_config else {}
    swift = checked(SwiftConfig.from_dict(ds.get("swift")))
    return buddy_cost(ds, swift, _layout(args, swift, ds), args.num_params)


def run(args: argparse.Namespace) -> int:
    # With --json, stdout carries the JSON alone: nothing here imports DeepSpeed (whose import prints
    # its accelerator line on stdout); the strategies' services are read without it.
    plan = build_plan(args)
    js = plan.to_json()
    buddy = build_buddy_cost(args)
    choices = choose_for_plan(  # activation vs update logging per logging stage (with --num-params)
        plan,
        iteration_time_s=args.iteration_time,
        stage_compute_s=_stage_compute(args.stage_compute_s, plan.layout.pp),
        read_gbps=args.storage_gbps,
        storage_budget_gb=args.storage_budget_gb,
        checkpoint_interval=args.checkpoint_interval,
    )
    rec = _recommend(args, js) if args.recommend else None
    if args.json:
        js |= {"buddy": buddy.to_json(), "stage_logging": [r.to_json() for r in choices]}
        if rec is not None:
            js["recommendation"] = rec
        print(json.dumps(js, indent=2))
    else:
        print_tables(plan)
        print_buddy(buddy)
        if choices:
            print_choices(choices)
        if rec is not None:
            from ds_swift.sim.plan_recommend import print_recommendation

            print_recommendation(rec)
    return 0


def _recommend(args: argparse.Namespace, plan_json: dict[str, Any]) -> dict[str, Any]:
    missing = [
        flag
        for flag, v in (
            ("--mtbf-hours", args.mtbf_hours),
            ("--iteration-time", args.iteration_time),
            ("--checkpoint-cost-s", args.checkpoint_cost_s),
        )
        if v is None
    ]
    if missing:
        raise ConfigError(f"--recommend needs {', '.join(missing)} (the failure rate and the costs it trades off)")
    from ds_swift.sim.plan_recommend import recommend_for_plan

    return recommend_for_plan(
        plan_json,
        _flag_float("--mtbf-hours", args.mtbf_hours) or 0.0,
        _flag_float("--iteration-time", args.iteration_time) or 0.0,
        _flag_int("--total-iterations", args.total_iterations) or 100_000,
        args.checkpoint_cost_s,
        args.restart_s if args.restart_s is not None else 60.0,
        load_s=args.load_s or 0.0,
        micro_batches=plan_json.get("micro_batches"),
        storage_gbps=args.storage_gbps,
    )
