"""Integration for existing Megatron-DeepSpeed training scripts.

Two edits turn ds-swift on in a Megatron-DeepSpeed style ``pretrain_gpt.py`` (the unified diff in
``patches/megatron_deepspeed_pretrain_gpt.diff`` makes exactly these)::

    parser = ds_swift.megatron.add_arguments(parser)          # --swift, --swift-config
    ...
    engine, *_ = deepspeed.initialize(...)
    engine = ds_swift.megatron.initialize(engine, args, model_fn=model_provider, batch_fn=get_batch)

``--swift`` turns ds-swift on with the ``swift`` section of ``--deepspeed_config`` (or defaults);
``--swift-config FILE`` takes the section from another JSON file (a whole DeepSpeed config, or
just ``{"swift": {...}}``), so a job can try ds-swift without editing its DeepSpeed config.
Without a ``checkpoint.dir`` there, ds-swift's periodic checkpoints go to Megatron's ``--save``
every ``--save-interval`` iterations: one directory, DeepSpeed's ``global_step<N>`` tags.

The real deepspeedai/Megatron-DeepSpeed (``patches/megatron_deepspeed/``, applied by
``ds-swift megatron-patch``) goes through :class:`MegatronDeepSpeed`, which also keeps its
training samples by position (ds_swift.megatron.data).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import types
from collections.abc import Callable
from typing import Any

from ds_swift.config import ConfigError, SwiftConfig, load_ds_config
from ds_swift.patches._base import PatchHandle
from ds_swift.recovery.registry import checked

__all__ = [
    "MegatronDeepSpeed",
    "add_arguments",
    "init_distributed",
    "initialize",
    "scheduler_loads_by_setting",
    "scheduler_tokens_from_steps",
    "swift_section",
]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ds-swift's flags to a Megatron argument parser; returns the parser."""
    group = parser.add_argument_group("ds-swift", "failure recovery (update-undo, replication, logging)")
    group.add_argument("--swift", action="store_true", help="enable ds-swift failure recovery")
    group.add_argument(
        "--swift-config",
        default=None,
        metavar="FILE",
        help="JSON file holding the swift section (a DeepSpeed config or {'swift': {...}}); "
        "default: the swift section of --deepspeed_config",
    )
    return parser


def swift_section(args: argparse.Namespace, ds_config: dict[str, Any] | None) -> dict[str, Any]:
    """The swift section in force for these arguments, validated (raises ConfigError)."""
    section = _section((ds_config or {}).get("swift"), "the DeepSpeed config's")
    path = getattr(args, "swift_config", None)
    if path:
        try:
            other = load_ds_config(path)
        except ConfigError as exc:
            raise ConfigError(f"--swift-config: {exc}") from None
        if "swift" not in other:
            raise ConfigError(f"--swift-config {path!r} has no 'swift' key: write {{\"swift\": {{...}}}}")
        section = _section(other["swift"], f"--swift-config {path!r}:")
    if getattr(args, "swift", False):
        section["enabled"] = True
    save = getattr(args, "save", None)
    given = section.get("checkpoint", {})  # anything but an object is named by the check below
    if save and isinstance(given, dict) and "dir" not in given:
        # Megatron's --save directory holds ds-swift's checkpoints too (same DeepSpeed tags).
        checkpoint = dict(given, dir=save)
        if getattr(args, "save_interval", None):
            checkpoint.setdefault("interval", int(args.save_interval))
        section["checkpoint"] = checkpoint
    checked(SwiftConfig.from_dict(section))  # fail before training starts, naming the field
    return section


def _section(value: Any, where: str) -> dict[str, Any]:
    """A swift section as a dict (absent or null: empty); anything but a JSON object is refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"swift config: {where} swift must be a JSON object, got {value!r}")
    return dict(value)


def initialize(
    engine: Any,
    args: argparse.Namespace,
    ds_config: dict[str, Any] | None = None,
    model_fn: Callable[[], Any] | None = None,
    batch_fn: Callable[[int, int], Any] | None = None,
    engine_fn: Callable[[], Any] | None = None,
) -> Any:
    """``ds_swift.initialize`` driven by Megatron arguments (``--deepspeed_config``, ``--swift``...)."""
    import ds_swift

    if ds_config is None:
        path = getattr(args, "deepspeed_config", None)
        ds_config = load_ds_config(path) if path else {}
    config = dict(ds_config)
    config["swift"] = swift_section(args, ds_config)
    return ds_swift.initialize(engine, config, model_fn=model_fn, batch_fn=batch_fn, engine_fn=engine_fn)


def init_distributed(args: argparse.Namespace) -> Any:
    """``ds_swift.init_distributed`` for Megatron's ``_initialize_distributed`` (before
    ``pretrain`` reads ``--deepspeed_config`` into ``args.deepspeed_config_dict``)."""
    import ds_swift

    path = getattr(args, "deepspeed_config_dict", None) or getattr(args, "deepspeed_config", None)
    ds_config = load_ds_config(path) if path else {}
    minutes = getattr(args, "distributed_timeout_minutes", None)  # the job's own, kept outside ds-swift's calls
    timeout = datetime.timedelta(minutes=float(minutes)) if minutes else None
    return ds_swift.init_distributed(dict(ds_config, swift=swift_section(args, ds_config)), timeout=timeout)


class MegatronDeepSpeed:
    """ds-swift inside Megatron-DeepSpeed's ``pretrain`` (what ``patches/megatron_deepspeed/`` calls).

    Args:
        dataset_provider: ``pretrain``'s ``train_valid_test_dataset_provider``; use
            :attr:`dataset_provider` in its place, so the training dataset is kept.
        args: Megatron's arguments. A replacement worker drops ``--load``: its state comes from
            the recovery, and the survivors' rebuild loads nothing either (the collectives of
            the two sides must match).
    """

    def __init__(self, dataset_provider: Callable[[Any], Any], args: argparse.Namespace) -> None:
        from ds_swift.jobstore.membership import WorkerEnv
        from ds_swift.megatron.data import MegatronSamples

        if WorkerEnv.present() and WorkerEnv.from_env().replacement:
            args.load = None
        elif getattr(args, "load", None):
            from ds_swift.runtime.context import current_context

            ctx = current_context()
            if ctx is not None and ctx.ledger is not None:
                # Its collectives are in this start-up's ledger, and a replacement's start-up skips it.
                ctx.ledger.refuse("the start-up loaded Megatron's --load checkpoint, which a replacement's does not")
        self.samples = MegatronSamples()
        self.dataset_provider = self.samples.keep(dataset_provider)
        self.rebuild: Callable[[], Any] | None = None
        """Builds the engine again after a failure (set by the patched ``pretrain``)."""
        self.save_override: PatchHandle | None = None
        """Removes the save override of the engine in force (:meth:`save_megatron_state`)."""

    def wrap(self, engine: Any, args: argparse.Namespace) -> Any:
        """The wrapped engine; ``args.iteration`` and ``args.consumed_train_samples`` follow it.

        Call it after every collective of Megatron's start-up: a replacement recovers inside it,
        and the survivors' :attr:`rebuild` must have run the same collectives by then.
        """
        rebuild = self.rebuild
        if rebuild is None:
            raise RuntimeError("MegatronDeepSpeed.rebuild is not set: the patch sets it in pretrain()")
        dp = int(engine.grid.get_data_parallel_world_size())
        self.samples.configure(args, dp, int(engine.gradient_accumulation_steps()), int(args.iteration))
        self.prepare(engine, args)
        wrapped = initialize(
            engine,
            args,
            args.deepspeed_config_dict,
            batch_fn=self.samples.batch_fn,
            engine_fn=lambda: self.prepare(rebuild(), args),
        )
        # A replacement resumed at the recovered iteration: Megatron's counters follow it.
        self.samples.configure(args, dp, int(engine.gradient_accumulation_steps()), int(wrapped.global_steps))
        return wrapped

    def prepare(self, engine: Any, args: argparse.Namespace) -> Any:
        """What a Megatron-DeepSpeed engine needs under ds-swift (at start-up and after every
        rebuild): Megatron's RNG tracker keyed by position, its scheduler's counts kept by its own
        state, and its state in ds-swift's saves."""
        engine.module.register_forward_pre_hook(key_megatron_rng_tracker)
        scheduler = getattr(engine, "lr_scheduler", None)
        scheduler_loads_by_setting(scheduler)
        scheduler_tokens_from_steps(scheduler, int(getattr(args, "seq_length", 0) or 0))
        return self.save_megatron_state(engine, args)

    def follow(self, args: argparse.Namespace, iteration: int) -> None:
        """Megatron's loop after each step (the patched ``train()``): its iteration, consumed samples
        and tokens are the engine's position's, ``iteration`` iterations done. Counted on by the loop
        (``+= new_samples``), they went on from before a recovery that went back (a checkpoint
        reload), into Megatron's logs and the ``args`` its saves keep (what ``--load`` resumes the
        data from)."""
        args.iteration = iteration
        args.consumed_train_samples = self.samples.consumed(iteration)
        args.consumed_train_tokens = args.consumed_train_samples * int(args.seq_length)

    def save_megatron_state(self, engine: Any, args: argparse.Namespace) -> Any:
        """Make ds-swift's periodic saves (``save_checkpoint`` without a client state) carry what
        Megatron's own save adds, so that ``--load`` resumes from them too; returns ``engine``.

        Without it DeepSpeed pickles ``GPTModelPipe.universal_checkpoint_info`` (a bound method:
        Megatron's save overrides that key) and the save fails; and Megatron's ``--load`` needs
        ``iteration`` and ``args`` in the state. RNG states are left out: gathering them is a
        collective, and ds-swift keys the RNG by position anyway. The override's handle is
        :attr:`save_override` (an engine the rebuild drops takes its override with it).
        """
        import copy

        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
        from megatron.checkpointing import _universal_checkpoint_info  # the pinned commit's own

        from ds_swift.patches.deepspeed_engine import override_save

        def megatron_state() -> dict[str, Any]:
            done = int(engine.global_steps)
            # Saved inside train_batch, before Megatron's loop counts the iteration's samples.
            saved = copy.copy(args)
            saved.iteration = done
            saved.consumed_train_samples = self.samples.consumed(done)
            saved.consumed_train_tokens = saved.consumed_train_samples * int(args.seq_length)
            return {
                "args": saved,
                "checkpoint_version": 3.0,
                "iteration": done,
                "tokens": saved.consumed_train_tokens,
                UNIVERSAL_CHECKPOINT_INFO: _universal_checkpoint_info([engine]),
            }

        self.save_override = override_save(engine, megatron_state)
        return engine


def scheduler_loads_by_setting(scheduler: Any) -> None:
    """Make a Megatron ``OptimizerParamScheduler``'s ``load_state_dict`` set its step count.

    Megatron's loads *add* the saved ``num_steps`` to the scheduler's own (``self.step(increment=
    num_steps)``): right for the fresh scheduler of a ``--load``, wrong wherever ds-swift loads a
    state into a scheduler that has stepped (a global checkpoint reloaded under survivors, an undo,
    the kept state): the count went on past the schedule and the second step after a checkpoint
    fallback took the wrong learning rate (a pp 4 run ended with 70 of 96 tensors different).
    Other schedulers (DeepSpeed's, torch's) already set, and are left alone.
    """
    if (
        scheduler is None
        or type(scheduler).__name__ != "OptimizerParamScheduler"
        or not hasattr(scheduler, "num_steps")
    ):
        return
    if getattr(scheduler.load_state_dict, "__func__", None) is _load_by_setting:
        return  # prepared already (the kept scheduler of a survivor)
    # A bound method, not a closure: a deep copy of the scheduler rebinds it to the copy.
    scheduler.load_state_dict = types.MethodType(_load_by_setting, scheduler)


def _load_by_setting(self: Any, state_dict: dict[str, Any]) -> None:
    self.num_steps = 0
    type(self).load_state_dict(self, state_dict)


def scheduler_tokens_from_steps(scheduler: Any, seq_length: int) -> None:
    """Make a Megatron ``OptimizerParamScheduler``'s ``step`` count its tokens from its own state.

    DeepSpeed steps it with the global batch size (its ``step(increment)``; Megatron's own call
    would be the same), and the scheduler then reads the tokens consumed from Megatron's
    ``args.consumed_train_tokens``, which Megatron's loop updates after ``train_batch`` returns: in
    an iteration ds-swift trains again inside ``train_batch`` after a recovery that went back, that
    count is still the one from before the failure, and a token-based schedule
    (``--lr-warmup-tokens``, ``--lr-decay-tokens``) took another learning rate. The scheduler's
    ``num_steps`` counts the samples consumed (restored with its state by every recovery), so the
    tokens are ``num_steps * seq_length``, what the failure-free run's ``args`` say at that step.
    """
    if (
        scheduler is None
        or type(scheduler).__name__ != "OptimizerParamScheduler"
        or not hasattr(scheduler, "num_steps")
        or seq_length <= 0
        or "token_num" not in inspect.signature(type(scheduler).step).parameters  # megatron-core's counts none
    ):
        return
    if getattr(scheduler.step, "__func__", None) is _step_tokens_from_steps:
        return
    scheduler.swift_seq_length = seq_length
    scheduler.step = types.MethodType(_step_tokens_from_steps, scheduler)


def _step_tokens_from_steps(self: Any, increment: int, token_num: int | None = None) -> None:
    if token_num is None:
        token_num = int(self.num_steps) * int(self.swift_seq_length)
    type(self).step(self, increment, token_num)


def key_megatron_rng_tracker(module: Any, inputs: Any) -> None:
    """Forward pre-hook: reseed Megatron's model-parallel RNG tracker from the seed ds-swift just
    gave this forward pass (a function of its position).

    Megatron draws attention dropout from that tracker (``get_cuda_rng_tracker().fork()``), whose
    state otherwise runs on from whatever ran before: a replacement starts it afresh and survivors
    advanced it in the failed iteration, so a recovered run would drop other elements.
    """
    import torch
    from megatron.core import mpu, tensor_parallel

    # megatron.core.tensor_parallel.random's names: 'model-parallel-rng', seed + 2718 + tp rank.
    seed = (torch.initial_seed() + 2718 + mpu.get_tensor_model_parallel_rank()) % (1 << 63)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed)  # leaves the default generator as it was
