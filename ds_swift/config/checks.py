"""What every ``swift`` config section's checks share: the error and its wording."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ConfigError"]


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
