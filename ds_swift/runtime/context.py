"""The distributed context: joining the job's process group by generation, and the pipeline's rank layout.

``ds_swift.init_distributed(ds_config)`` replaces ``deepspeed.init_distributed()``. Under
``ds-swift-launch`` it connects to the job store, joins the worker's generation and initialises
torch.distributed on that generation's store prefix; DeepSpeed then attaches to the existing
process group. Every later generation (after a failure) is joined the same way, in-process, by
:func:`join_generation`. Under the stock launcher it is plain ``deepspeed.init_distributed`` (no
replacement machines; ds-swift says so once).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ds_swift import transport
from ds_swift.config import ConfigError, SwiftConfig, left_off, load_ds_config
from ds_swift.config.checks import machines_mismatch
from ds_swift.jobstore.membership import GenerationFailed, JobStore, WorkerEnv
from ds_swift.logs import say
from ds_swift.recovery.registry import load_config

__all__ = [
    "SwiftContext",
    "current_context",
    "eager_device",
    "init_distributed",
    "join_generation",
    "pipeline_topology",
]

#: How long a rank waits in a generation's rendezvous for the others (replacements included:
#: a fresh process must start Python, import torch and DeepSpeed, on a busy machine).
DEFAULT_JOIN_TIMEOUT_S = 300.0

_AXIS = {"tp": "model", "dp": "data", "pp": "pipe"}


@dataclass
class SwiftContext:
    """What a worker process knows about its job between ``init_distributed`` and ``initialize``."""

    cfg: SwiftConfig
    op_timeout_s: float
    env: WorkerEnv | None = None
    store: JobStore | None = None
    generation: int = 0
    t_start: float = 0.0
    """When this worker process started (a replacement's initialization begins there)."""
    t_joined: float = 0.0
    t_arrived: float = 0.0
    """When this worker arrived at its generation's rendezvous (``t_joined``: when everyone had)."""
    backend: str = "gloo"
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    user_timeout: datetime.timedelta | None = None
    """The job's own op timeout (``init_distributed(timeout=...)``: Megatron's
    ``--distributed-timeout-minutes``; None: torch's default). It holds outside ds-swift's calls; the
    op timeout only inside them (ds_swift.patches.op_timeout)."""
    patches: list[Any] = field(default_factory=list)
    stepped: bool = False
    """This process finished a step in the generation in force (set by the engine, cleared at each
    join): an error before it is the job's own whatever it is (ds_swift.detect.job_error)."""
    ledger: Any = None
    """The process groups and ops of this worker's start-up, from joining its generation to
    ``ds_swift.initialize`` (ds_swift.patches.group_swap.StartupLedger), which a survivor replays to
    keep its engine (ds_swift.runtime.swap); None: not recorded (not under ds-swift-launch)."""

    @property
    def launched(self) -> bool:
        """True under ds-swift-launch (a job store exists; replacements can join)."""
        return self.store is not None

    @property
    def run_dir(self) -> str:
        return self.env.run_dir if self.env is not None else self.cfg.run_dir

    def log(self, msg: str, level: int = logging.INFO) -> None:
        """One line on ds-swift's channel (ds_swift.logs), tagged with this worker's rank (``level``:
        WARNING for a protection turned off)."""
        rank = dist.get_rank() if dist.is_initialized() else (self.env.rank if self.env else -1)
        say(msg, rank, level=level, name=__name__)


# One per process: init_distributed runs before the engine exists, initialize() after it.
_CONTEXT: SwiftContext | None = None


def current_context() -> SwiftContext | None:
    return _CONTEXT


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def op_timeout_from(cfg: SwiftConfig, environ: Mapping[str, str] | None = None) -> float:
    """The per-op timeout: ``ds-swift-launch --op-timeout`` (SWIFT_OP_TIMEOUT_S) wins over the config."""
    env = os.environ if environ is None else environ
    value = env.get("SWIFT_OP_TIMEOUT_S")
    return float(value) if value else float(cfg.watchdog.op_timeout_s)


def eager_device(backend: str) -> dict[str, Any]:
    """``device_id`` for ``init_process_group`` on an NCCL world (empty otherwise): this rank's GPU
    (``LOCAL_RANK``), so that torch creates the world's communicator at once (eager, in NCCL's
    non-blocking mode: ds_swift.transport.nccl) instead of at the generation's first collective,
    and DeepSpeed's groups are split from it; an abort then reaches every communicator of the
    generation, those still being created included."""
    if "nccl" not in backend or not torch.cuda.is_available():
        return {}
    return {"device_id": torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))}


def join_generation(
    store: JobStore,
    generation: int,
    rank: int,
    world_size: int,
    op_timeout_s: float,
    join_timeout_s: float,
    backend: str = "gloo",
    swift: bool = True,
    timeout: datetime.timedelta | None = None,
    watch: Callable[[int], object] | None = None,
) -> int:
    """Join ``generation`` (or a later one if it fails first) and initialise torch.distributed on it.

    With ``swift`` (ds-swift recovers this job), NCCL gets the settings that make aborting a failed
    generation safe (the NCCL and torch versions are checked too), the world's communicator is
    created eagerly on this rank's GPU (:func:`eager_device`), and ds-swift's transport opens its
    gloo groups: right after the world, before
    DeepSpeed creates any group, so every rank (survivor or replacement) creates them in the same
    order. Returns the generation joined. DeepSpeed is attached afterwards by the caller.
    ``watch``: called with each generation before it is joined (a survivor's watchdog moves to it,
    so a failure of it ends the join at once: ds_swift.jobstore.agreement.wake).

    The world gets the job's ``timeout`` (None: torch's default) once connected (the join timeout
    bounds its creation), not the op timeout: ds-swift
    applies that only around its own calls (ds_swift.patches.op_timeout); its transport's groups,
    only ever used by ds-swift, keep ``op_timeout_s``.
    """
    if swift and "nccl" in backend:
        # Read by torch when each NCCL group is created; refused (naming the variable) where a user
        # value would end or strand the survivors of a failure, as the NCCL/torch versions are.
        transport.nccl_environment(nonblocking_timeout_s=join_timeout_s)
        transport.check_nccl_versions()
    while True:
        if watch is not None:
            watch(generation)
        try:
            prefix = store.join(generation, rank, world_size, timeout_s=join_timeout_s)
        except GenerationFailed as exc:
            say(
                f"generation {generation} failed while joining ({exc.reason}); joining {generation + 1}",
                rank,
                name=__name__,
            )
            generation += 1
            continue
        # Created with the join timeout, which bounds gloo's connection to every peer; then the
        # job's own (ds_swift.patches.op_timeout.job_timeout_after_connect).
        dist.init_process_group(
            backend,
            store=prefix,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=join_timeout_s),
            **(eager_device(backend) if swift else {}),
        )
        from ds_swift.patches.op_timeout import job_timeout_after_connect

        job_timeout_after_connect(timeout)
        if swift:
            transport.open_generation(op_timeout_s, generation)
        return generation


def init_distributed(
    ds_config: Mapping[str, Any] | str | os.PathLike[str] | None = None, timeout: datetime.timedelta | None = None
) -> SwiftContext | None:
    """Use instead of ``deepspeed.init_distributed()``. Returns the context (None when swift is off).

    ``timeout``: the job's own op timeout for its process groups (what it would pass to
    ``init_process_group``; Megatron's ``--distributed-timeout-minutes``); None: torch's default.
    ds-swift's shorter op timeout applies only inside its own calls."""
    global _CONTEXT
    import deepspeed

    config = load_ds_config(ds_config) if ds_config is not None else {}
    cfg = load_config(config)
    if not cfg.enabled and (why := left_off(config.get("swift"))):
        raise ConfigError(why)
    backend = _backend()
    if not cfg.enabled:
        if WorkerEnv.present() and not dist.is_initialized():
            # Under ds-swift-launch MASTER_ADDR:MASTER_PORT is the job store, which rank 0 must not
            # try to host: rendezvous through it as a member of generation 0, without recovery.
            env = WorkerEnv.from_env()
            join_generation(
                JobStore.from_env(env),
                env.generation,
                env.rank,
                env.world_size,
                op_timeout_from(cfg),
                DEFAULT_JOIN_TIMEOUT_S,
                backend,
                swift=False,
                timeout=timeout,
            )
        deepspeed.init_distributed(dist_backend=backend, **({"timeout": timeout} if timeout is not None else {}))
        return None
    if _CONTEXT is not None and dist.is_initialized():
        return _CONTEXT
    op_timeout_s = op_timeout_from(cfg)
    ctx = SwiftContext(
        cfg=cfg, op_timeout_s=op_timeout_s, backend=backend, t_start=_process_start_time(), user_timeout=timeout
    )
    if not WorkerEnv.present():
        if os.environ.get("RANK", "0") == "0":
            say(
                "not started by ds-swift-launch: there is no job store and no replacement machine, "
                "so a failure ends the job as with DeepSpeed alone; start it with ds-swift-launch to recover in-process",
                level=logging.WARNING,
                name=__name__,
            )
        deepspeed.init_distributed(dist_backend=backend, **({"timeout": timeout} if timeout is not None else {}))
        transport.open_generation(op_timeout_s)  # before the engine's groups (see join_generation)
        ctx.t_joined = time.time()
        _CONTEXT = ctx
        return ctx
    env = WorkerEnv.from_env()
    ctx.env = env
    ctx.store = JobStore.from_env(env)
    ctx.t_arrived = time.time()
    ctx.generation = join_generation(
        ctx.store, env.generation, env.rank, env.world_size, op_timeout_s, ctx.join_timeout_s, backend, timeout=timeout
    )
    ctx.t_joined = time.time()
    # An error that ends this worker outside ds-swift's calls (deepspeed.initialize refusing the
    # config, say) is recorded for its node agent, which then ends the job with it.
    from ds_swift.detect.classify import record_uncaught

    record_uncaught(ctx.store, env.rank, ctx)
    # DeepSpeed sees torch.distributed initialised and attaches its comm backend to it.
    deepspeed.init_distributed(dist_backend=backend)
    from ds_swift.patches.group_swap import StartupLedger

    ctx.ledger = StartupLedger.start(restored=env.replacement)  # closed by ds_swift.initialize
    _CONTEXT = ctx
    return ctx


def _process_start_time() -> float:
    """When this process started (psutil; to about a second: the kernel's boot time is whole seconds)."""
    assigned = os.environ.get("SWIFT_ASSIGNED_AT")
    if assigned:
        # A warm spare (ds_swift.runtime.warm) was started long before the failure: its start-up as
        # this rank's worker began when its agent handed it the rank.
        return float(assigned)
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - psutil comes with DeepSpeed; without it, now is close enough
        return time.time()


def pipeline_topology(rank_order: str, pp: int, dp: int, tp: int = 1) -> Any:
    """DeepSpeed ``ProcessTopology`` laying ranks out as megatron-core's ``rank_order`` says.

    ``rank_order`` lists the fastest-varying axis first ("tp-dp-pp": tensor-parallel ranks
    adjacent, then data-parallel replicas, pipeline stages outermost); DeepSpeed's topology lists
    the slowest axis first, hence the reversal.
    """
    from deepspeed.runtime.pipe.topology import ProcessTopology

    names = rank_order.split("-")
    if sorted(names) != ["dp", "pp", "tp"]:
        raise ValueError(f"rank_order {rank_order!r} is not a permutation of tp, dp, pp")
    sizes = {"tp": tp, "dp": dp, "pp": pp}
    axes = [_AXIS[n] for n in reversed(names)]
    dims = [sizes[n] for n in reversed(names)]
    return ProcessTopology(axes=axes, dims=dims)


def check_machines(cfg: SwiftConfig, env: WorkerEnv | None) -> None:
    """Under ds-swift-launch the launcher says how many ranks share a machine; the plan (replicas on
    other machines, buddies, logged boundaries) must count the same, or its recoveries go wrong."""
    if env is None or env.num_machines < 1:
        return
    per_machine = env.world_size // env.num_machines
    if why := machines_mismatch(cfg.machines.gpus_per_node, per_machine, env.num_machines):
        raise ConfigError(why)
