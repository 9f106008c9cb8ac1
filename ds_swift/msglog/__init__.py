"""Message logging of inter-machine pipeline sends: record format, bubble queue, writer, reader, GC.

See format.py for the on-disk format, logger.py for when things are copied and written. Names
are imported lazily so that ``ds-swift --help`` (which imports ``ds_swift.msglog.cli``) does
not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_swift.msglog.format import FormatError, RecordHeader
    from ds_swift.msglog.gc import gc_before
    from ds_swift.msglog.logger import LogStats, MessageLogError, MessageLogHandle, install_message_logging
    from ds_swift.msglog.plan import LoggingPlan, MachineBoundaryPlan
    from ds_swift.msglog.reader import CorruptRecordError, LogReader, MissingRecordError
    from ds_swift.msglog.writer import LogWriteError

_WHERE = {
    "FormatError": "format",
    "RecordHeader": "format",
    "gc_before": "gc",
    "LogStats": "logger",
    "MessageLogError": "logger",
    "MessageLogHandle": "logger",
    "install_message_logging": "logger",
    "LoggingPlan": "plan",
    "MachineBoundaryPlan": "plan",
    "CorruptRecordError": "reader",
    "LogReader": "reader",
    "MissingRecordError": "reader",
    "LogWriteError": "writer",
}

__all__ = [
    "CorruptRecordError",
    "FormatError",
    "LogReader",
    "LogStats",
    "LogWriteError",
    "LoggingPlan",
    "MachineBoundaryPlan",
    "MessageLogError",
    "MessageLogHandle",
    "MissingRecordError",
    "RecordHeader",
    "gc_before",
    "install_message_logging",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ds_swift.msglog' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ds_swift.msglog.{module}"), name)
