"""Before any worker starts: can the job's recovery strategy serve the machines it is given?

The launcher reads the training script's DeepSpeed config the way the script will (its
``--deepspeed_config``, Megatron's ``--swift``/``--swift-config``/``--save`` through
:func:`ds_swift.megatron.swift_section`, and its ``--pipeline-model-parallel-size`` /
``--tensor-model-parallel-size``) and runs the checks of :mod:`ds_swift.recovery.feasible`. A
script whose config is not on its command line is not checked (nothing to read); an invalid swift
section is reported here too, before the job starts, rather than by every worker.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ds_swift.config import ConfigError, SwiftConfig, left_off, load_ds_config
from ds_swift.recovery.registry import checked

from .args import LaunchArgs

__all__ = ["arch_list_warning", "check_job", "directory_problems", "preflight", "script_namespace", "under_a_file"]


def script_namespace(script_args: Sequence[str]) -> argparse.Namespace:
    """The training script's flags that say what its swift section and plan are (the rest ignored)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--deepspeed_config", "--deepspeed-config", default=None)
    p.add_argument("--swift", action="store_true")
    p.add_argument("--swift-config", dest="swift_config", default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--save-interval", dest="save_interval", type=int, default=None)
    p.add_argument("--pipeline-model-parallel-size", dest="pipeline", type=int, default=None)
    p.add_argument("--tensor-model-parallel-size", dest="tensor", type=int, default=None)
    ns, _ = p.parse_known_args(list(script_args))
    return ns


def check_job(
    ds_config: Mapping[str, Any], script_args: Sequence[str], nnodes: int, nproc_per_node: int, elastic: bool
) -> list[str]:
    """Every requirement of the job's strategy that this job does not meet, one line each (an
    invalid swift section is one such line)."""
    from ds_swift.megatron import swift_section
    from ds_swift.recovery.feasible import LAUNCH_REQUIREMENTS, JobShape, infeasible

    ns = script_namespace(script_args)
    try:
        section = swift_section(ns, dict(ds_config))
        cfg = checked(SwiftConfig.from_dict(section))
    except ConfigError as exc:
        return [str(exc)]
    if why := left_off(section):
        return [why]
    shape = JobShape.from_ds_config(ds_config, nnodes, nproc_per_node, elastic, ns.pipeline, ns.tensor)
    return infeasible(cfg, shape, LAUNCH_REQUIREMENTS) + (directory_problems(cfg) if cfg.enabled else [])


def under_a_file(path: str | os.PathLike[str]) -> str | None:
    """The file that stands where ``path`` or a directory above it must be (None: nothing does).

    Only this is checked: a directory missing on the launcher's host may exist on the workers'
    (a file system only they mount), but a file where a directory must be is wrong everywhere."""
    for p in (Path(path).absolute(), *Path(path).absolute().parents):
        if p.exists():
            return None if p.is_dir() else str(p)
    return None


def directory_problems(cfg: SwiftConfig) -> list[str]:
    """The swift section's directories that cannot be created (a file where one must be), each named
    with its field: they failed only later, at the first save (the trained iterations lost) or as
    message logging switched off at start."""
    from ds_swift.storage.store import local_path_of

    out = []
    logs = local_path_of(cfg.logging.storage)
    for field, value, path in (
        ("checkpoint.dir", cfg.checkpoint.dir, Path(cfg.checkpoint.dir)),
        ("logging.storage", cfg.logging.storage, logs),
        ("run_dir", cfg.run_dir, Path(cfg.run_dir)),
    ):
        if path is not None and (blocker := under_a_file(path)) is not None:
            out.append(
                f"swift config: {field}={value!r} is invalid: {blocker} is a file, so the directory cannot be "
                f"created; give a directory path"
            )
    return out


def preflight(args: LaunchArgs) -> str | None:
    """The reason this job cannot be served as configured (one line per requirement), or None."""
    ns = script_namespace(args.command.args)
    if ns.deepspeed_config is None and ns.swift_config is None:
        if args.elastic:
            return (
                "--elastic: the training script's DeepSpeed config is not on its command line "
                "(--deepspeed_config FILE), so the launcher cannot check that it enables the elastic shrink; "
                "pass it, or drop --elastic"
            )
        return None
    try:
        ds_config = load_ds_config(ns.deepspeed_config) if ns.deepspeed_config else {}
    except ConfigError as exc:
        return str(exc)
    whys = check_job(ds_config, args.command.args, args.nnodes, args.nproc_per_node, args.elastic)
    return "; ".join(whys) if whys else None


_SUFFIXED_ARCH = re.compile(r"^\d+\.\d+[A-Za-z]")


def arch_list_warning(environ: Mapping[str, str], deepspeed_version: str | None) -> str | None:
    """Why the workers' DeepSpeed may fail to build its ops (None: no reason seen).

    DeepSpeed 0.19's op builder reads each ``TORCH_CUDA_ARCH_LIST`` entry as numbers: one with an
    architecture suffix such as ``9.0a`` (GPU images set such lists) makes every op it JIT-builds,
    FusedAdam at ``deepspeed.initialize`` included, fail with "invalid literal for int() with base
    10: '0a'" (seen on an H100 image with DeepSpeed 0.19.8). Pre-built ops are not affected: a
    warning, not an error."""
    value = environ.get("TORCH_CUDA_ARCH_LIST")
    if not value or deepspeed_version is None or not deepspeed_version.startswith("0.19."):
        return None
    entries = [e for e in re.split(r"[;\s,]+", value.strip()) if e]
    bad = [e for e in entries if _SUFFIXED_ARCH.match(e)]
    if not bad:
        return None
    plain = ";".join(re.sub(r"^(\d+\.\d+)[A-Za-z]+", r"\1", e) for e in entries)
    return (
        f"TORCH_CUDA_ARCH_LIST={value!r} has entries DeepSpeed {deepspeed_version}'s op builder cannot parse "
        f'({", ".join(bad)}): an op it builds at start-up (FusedAdam) fails with "invalid literal for int()"; '
        f"set TORCH_CUDA_ARCH_LIST='{plain}' (the same list without the suffixes), unless DeepSpeed's ops are pre-built"
    )
