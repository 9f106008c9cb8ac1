"""ds-swift: expedited failure recovery for DeepSpeed + Megatron 3D-parallel training.

Turn it on with a ``"swift"`` section in the DeepSpeed JSON config, and two calls::

    ds_swift.init_distributed(ds_config)          # instead of deepspeed.init_distributed()
    engine, *_ = deepspeed.initialize(model=model_fn(), config=ds_config, ...)
    engine = ds_swift.initialize(engine, ds_config, model_fn=model_fn, batch_fn=batch_fn)
"""

from __future__ import annotations

from typing import Any, NoReturn

from ds_swift.config import ConfigError, SwiftConfig

__version__ = "0.1.0"

__all__ = ["ConfigError", "SwiftConfig", "__version__", "exit_process", "init_distributed", "initialize"]


def initialize(engine: Any, ds_config: Any = None, **kwargs: Any) -> Any:
    """Wrap a DeepSpeed pipeline engine with ds-swift; see :func:`ds_swift.runtime.engine.initialize`."""
    from ds_swift.runtime.engine import initialize as _initialize

    return _initialize(engine, ds_config, **kwargs)


def init_distributed(ds_config: Any = None, **kwargs: Any) -> Any:
    """Join the job (its generation, under ds-swift-launch); see :func:`ds_swift.runtime.context.init_distributed`."""
    from ds_swift.runtime.context import init_distributed as _init

    return _init(ds_config, **kwargs)


def exit_process(code: int | str | None = 0) -> NoReturn:
    """End a finished training process without the interpreter's teardown; see
    :func:`ds_swift.interpreter.exit_process`."""
    from ds_swift.interpreter import exit_process as _exit

    _exit(code)
