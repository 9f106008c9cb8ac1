"""Swift configs as the entry points read them, for tests: parsed and checked against the strategies."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_swift.config import SwiftConfig
from ds_swift.protect.base import Site
from ds_swift.recovery.registry import checked, services_of

__all__ = ["site", "swift_config"]


def swift_config(section: Mapping[str, Any] | None = None) -> SwiftConfig:
    """The ``swift`` section ``section`` as ``ds_swift.initialize`` reads it: parsed
    (:meth:`SwiftConfig.from_dict`) and checked against the registered strategies
    (:func:`ds_swift.recovery.registry.checked`)."""
    return checked(SwiftConfig.from_dict(section))


# ---------------------------------------------------------------- a protection site
# A protection site for tests: where a worker's protections are built, without a worker.


def site(cfg: SwiftConfig, ctx: Any, hooks: Any, engine: Any = None, ckpt: Any = None) -> Site:
    """A :class:`~ds_swift.protect.base.Site` for ``cfg`` (its strategy's services), with ``engine``
    in force in generation 0 on machine 0."""
    return Site(
        cfg=cfg,
        services=services_of(cfg),
        ctx=ctx,
        hooks=hooks,
        engine=lambda: engine,
        generation=lambda: 0,
        machine=lambda: 0,
        check_after_receive=lambda: None,
        ckpt=ckpt,
        host=None,
    )
