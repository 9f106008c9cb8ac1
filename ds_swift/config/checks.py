"""What every ``swift`` config section's checks share: the error and its wording."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ConfigError", "kinds_mismatch", "machines_mismatch"]


class ConfigError(ValueError):
    """A ``swift`` config value is invalid. The message names the field and the fix."""


def _fail(path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"swift config: {path}={value!r} is invalid: {allowed}")


def _check_type(path: str, value: Any, typ: type | tuple[type, ...], allowed: str) -> None:
    # bool is an int subclass: "interval": true must not pass as 1.
    if isinstance(value, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
        raise _fail(path, value, allowed)
    if not isinstance(value, typ):
        raise _fail(path, value, allowed)
    # json.loads accepts NaN and Infinity: a NaN timeout compares false with everything and
    # would silently disable the check it configures.
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(path, value, allowed)
    if isinstance(value, str) and typ is str and not value:
        raise _fail(path, value, allowed)


def _is_machine_list(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(m, int) and not isinstance(m, bool) and m >= 0 for m in value)
    )


def machines_mismatch(gpus_per_node: int, per_machine: int, machines: int) -> str | None:
    """Why ``machines.gpus_per_node`` disagrees with the ranks the launcher puts on each machine (the
    plan's replicas, buddies and logged boundaries would count wrong), or None."""
    if gpus_per_node == per_machine:
        return None
    return (
        f"swift config: machines.gpus_per_node={gpus_per_node} is invalid: ds-swift-launch placed "
        f"{per_machine} rank(s) on each of {machines} machine(s) (--nproc-per-node); set it to {per_machine}"
    )


def kinds_mismatch(kinds: str | tuple[str, ...], stages: int) -> str | None:
    """Why a per-stage ``logging.kinds`` list does not fit the pipeline, or None."""
    if isinstance(kinds, str) or len(kinds) == stages:
        return None
    return (
        f"swift config: logging.kinds has {len(kinds)} entries for {stages} pipeline stages: give one per stage "
        '(messages or updates), or "auto"'
    )
