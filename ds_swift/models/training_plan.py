"""The 3D plan (tp x pp x dp) and batch sizes of a job, resolved from Megatron flags and the DS config.

Megatron-DeepSpeed takes the parallel sizes and the batch sizes both as flags and as DeepSpeed
config keys; a flag and a key that disagree are an error naming both, never a silent pick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PlanError", "TrainingPlan", "resolve_training_plan"]


class PlanError(ValueError):
    """Inconsistent parallel / batch flags; the message names the flag (or config key) and the fix."""


@dataclass(frozen=True)
class TrainingPlan:
    """The 3D plan and batch sizes a job runs with, resolved from Megatron flags and the DS config."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    gradient_accumulation_steps: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.dp

    def apply(self, ds_config: dict[str, Any]) -> dict[str, Any]:
        """Write the batch sizes and pipeline stages into ``ds_config`` (DeepSpeed reads them there)."""
        ds_config["train_micro_batch_size_per_gpu"] = self.micro_batch_size
        ds_config["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        ds_config["train_batch_size"] = self.global_batch_size
        pipeline = ds_config.get("pipeline")
        ds_config["pipeline"] = {**(pipeline if isinstance(pipeline, dict) else {}), "stages": self.pp}
        return ds_config


def _positive(flag: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{flag} {value!r} is invalid: a positive integer")
    return value


def resolve_training_plan(
    ds_config: dict[str, Any],
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int | None = None,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
) -> TrainingPlan:
    """Resolve tp/pp/dp and the batch sizes the way Megatron-DeepSpeed does, checking every pair.

    A flag left out (None) comes from the DeepSpeed config: pipeline stages from
    ``"pipeline": {"stages": K}`` (default 1), the micro-batch from
    ``train_micro_batch_size_per_gpu``, gradient accumulation from ``gradient_accumulation_steps``
    or ``train_batch_size``. A flag and a config key that disagree are an error, not a silent pick.
    """
    world = _positive("world size", world_size)
    tp = _positive("--tensor-model-parallel-size", tensor_model_parallel_size)
    pp, pp_name = _resolve_pp(ds_config, pipeline_model_parallel_size)
    if world % (tp * pp):
        raise PlanError(f"world size {world} is not a multiple of --tensor-model-parallel-size {tp} x {pp_name} {pp}")
    dp = world // (tp * pp)
    mbs, mbs_name = _resolve_micro_batch(ds_config, micro_batch_size)
    cfg_tbs = ds_config.get("train_batch_size")
    gas = _resolve_accumulation(ds_config, global_batch_size, mbs, mbs_name, world, tp, pp, dp)
    plan = TrainingPlan(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, gradient_accumulation_steps=gas)
    if cfg_tbs is not None and cfg_tbs != plan.global_batch_size:
        flag = "--global-batch-size" if global_batch_size is not None else "gradient_accumulation_steps"
        raise PlanError(
            f"train_batch_size={cfg_tbs} in --deepspeed_config differs from {plan.global_batch_size} "
            f"(micro-batch {mbs} x accumulation {gas} x dp {dp}); fix {flag} or train_batch_size"
        )
    return plan


def _resolve_pp(ds_config: dict[str, Any], pipeline_model_parallel_size: int | None) -> tuple[int, str]:
    """Pipeline stages, and the flag or key they came from (for the messages)."""
    pipeline = ds_config.get("pipeline") if isinstance(ds_config.get("pipeline"), dict) else {}
    cfg_stages = pipeline.get("stages", "auto") if pipeline else "auto"
    cfg_pp = None if cfg_stages in (None, "auto") else _positive("pipeline.stages in --deepspeed_config", cfg_stages)
    if pipeline_model_parallel_size is None:
        pp = cfg_pp or 1
        pp_name = "pipeline.stages in --deepspeed_config" if cfg_pp else "--pipeline-model-parallel-size (default 1)"
        return pp, pp_name
    pp = _positive("--pipeline-model-parallel-size", pipeline_model_parallel_size)
    if cfg_pp is not None and cfg_pp != pp:
        raise PlanError(
            f"--pipeline-model-parallel-size {pp} differs from pipeline.stages={cfg_pp} in --deepspeed_config: "
            "give one, or make them equal"
        )
    return pp, "--pipeline-model-parallel-size"


def _resolve_micro_batch(ds_config: dict[str, Any], micro_batch_size: int | None) -> tuple[int, str]:
    """The micro-batch size, and the flag or key it came from (for the messages)."""
    cfg_mbs = ds_config.get("train_micro_batch_size_per_gpu")
    if micro_batch_size is None:
        if cfg_mbs is None:
            raise PlanError("no micro-batch size: pass --micro-batch-size or set train_micro_batch_size_per_gpu")
        mbs_name = "train_micro_batch_size_per_gpu in --deepspeed_config"
        return _positive(mbs_name, cfg_mbs), mbs_name
    mbs_name = "--micro-batch-size"
    mbs = _positive(mbs_name, micro_batch_size)
    if cfg_mbs is not None and cfg_mbs != mbs:
        raise PlanError(
            f"--micro-batch-size {mbs} differs from train_micro_batch_size_per_gpu={cfg_mbs} in "
            "--deepspeed_config: give one, or make them equal"
        )
    return mbs, mbs_name


def _resolve_accumulation(
    ds_config: dict[str, Any],
    global_batch_size: int | None,
    mbs: int,
    mbs_name: str,
    world: int,
    tp: int,
    pp: int,
    dp: int,
) -> int:
    """Gradient accumulation steps: from --global-batch-size, else the config's steps or train batch, else 1."""
    per_step = mbs * dp  # samples one gradient-accumulation step takes over all replicas
    cfg_gas, cfg_tbs = ds_config.get("gradient_accumulation_steps"), ds_config.get("train_batch_size")
    if global_batch_size is not None:
        gbs = _positive("--global-batch-size", global_batch_size)
        if gbs % per_step:
            raise PlanError(
                f"--global-batch-size {gbs} is not a multiple of {mbs_name} {mbs} x data-parallel size {dp} "
                f"(world {world} / (tp {tp} x pp {pp}))"
            )
        gas = gbs // per_step
        if cfg_gas is not None and cfg_gas != gas:
            raise PlanError(
                f"--global-batch-size {gbs} means {gas} gradient accumulation steps (micro-batch {mbs}, dp {dp}), "
                f"but --deepspeed_config sets gradient_accumulation_steps={cfg_gas}: give one"
            )
        return gas
    if cfg_gas is not None:
        return _positive("gradient_accumulation_steps in --deepspeed_config", cfg_gas)
    if cfg_tbs is not None:
        tbs = _positive("train_batch_size in --deepspeed_config", cfg_tbs)
        if tbs % per_step:
            raise PlanError(
                f"train_batch_size={tbs} in --deepspeed_config is not a multiple of micro-batch {mbs} x dp {dp}"
            )
        return tbs // per_step
    return 1
