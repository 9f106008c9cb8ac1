"""ds-swift: expedited failure recovery for DeepSpeed + Megatron 3D-parallel training.

Turn it on with a ``"swift"`` section in the DeepSpeed JSON config and one call after
``deepspeed.initialize``::

    engine, *_ = deepspeed.initialize(...)
    engine = ds_swift.initialize(engine, ds_config)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_swift.config import ConfigError, SwiftConfig

__version__ = "0.1.0"

__all__ = ["ConfigError", "SwiftConfig", "__version__", "initialize"]

if TYPE_CHECKING:
    pass


def initialize(engine: Any, ds_config: Any = None) -> Any:
    """Wrap a DeepSpeed engine with ds-swift (see ds_swift.engine)."""
    from ds_swift.engine import initialize as _initialize

    return _initialize(engine, ds_config)
