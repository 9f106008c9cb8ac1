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
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ds_swift.config import ConfigError, SwiftConfig, load_ds_config

__all__ = ["add_arguments", "initialize", "swift_section"]


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
    section: dict[str, Any] = dict((ds_config or {}).get("swift") or {})
    path = getattr(args, "swift_config", None)
    if path:
        other = load_ds_config(path)
        if "swift" not in other:
            raise ConfigError(f"--swift-config {path!r} has no 'swift' key: write {{\"swift\": {{...}}}}")
        section = dict(other["swift"])
    if getattr(args, "swift", False):
        section["enabled"] = True
    SwiftConfig.from_dict(section)  # fail before training starts, naming the field
    return section


def initialize(
    engine: Any,
    args: argparse.Namespace,
    ds_config: dict[str, Any] | None = None,
    model_fn: Callable[[], Any] | None = None,
    batch_fn: Callable[[int, int], Any] | None = None,
) -> Any:
    """``ds_swift.initialize`` driven by Megatron arguments (``--deepspeed_config``, ``--swift``...)."""
    import ds_swift

    if ds_config is None:
        path = getattr(args, "deepspeed_config", None)
        ds_config = load_ds_config(path) if path else {}
    config = dict(ds_config)
    config["swift"] = swift_section(args, ds_config)
    return ds_swift.initialize(engine, config, model_fn=model_fn, batch_fn=batch_fn)
