"""Swift configs as the entry points read them, for tests: parsed and checked against the strategies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_swift.config import SwiftConfig
from ds_swift.recovery.registry import checked

__all__ = ["swift_config"]


def swift_config(section: Mapping[str, Any] | None = None) -> SwiftConfig:
    """The ``swift`` section ``section`` as ``ds_swift.initialize`` reads it: parsed
    (:meth:`SwiftConfig.from_dict`) and checked against the registered strategies
    (:func:`ds_swift.recovery.registry.checked`)."""
    return checked(SwiftConfig.from_dict(section))
