"""ds-swift's one logging channel: stdlib :mod:`logging` under the ``ds_swift`` logger.

Every line ds-swift says goes through a logger named ``ds_swift.<module>`` and comes out on
stderr as ``[ds-swift] rank <r>: <text>`` (``[ds-swift] <text>`` where no rank applies): the
form operators, the job runner's output checks and the dist tests already read. :func:`say` is the
one-line call for it; a module that logs a lot takes :func:`logger`.

The handler is installed once, on the ``ds_swift`` logger, at import: ds-swift's lines are its
user interface (fallbacks, lost protections, costs), not debug output an application must opt in
to. Records still propagate, so an application's own handlers (and pytest's ``caplog``) see them
too; an application that wants them only there removes :data:`HANDLER` from the ``ds_swift``
logger. The handler writes to whatever ``sys.stderr`` is at the time (pytest's capture, a
launcher that redirects it), flushing each line.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

__all__ = ["HANDLER", "ROOT", "logger", "rank_here", "say", "say_here"]

ROOT = "ds_swift"


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler on the current ``sys.stderr`` (looked up per line, never kept)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


class _Prefixed(logging.Formatter):
    """``[ds-swift] rank <r>: <text>`` (the record's ``rank``), ``[ds-swift] <text>`` without one
    (the record's ``prefix`` in place of ``ds-swift``: the launcher's lines say ``ds-swift-launch``)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{record.exc_text}"
        rank, prefix = getattr(record, "rank", None), getattr(record, "prefix", "ds-swift")
        return f"[{prefix}] rank {rank}: {text}" if rank is not None else f"[{prefix}] {text}"


def _install() -> logging.Handler:
    root = logging.getLogger(ROOT)
    for h in root.handlers:  # a reload of this module must not print every line twice
        if isinstance(h, logging.StreamHandler) and type(h).__name__ == "_Stderr":
            return h
    handler = _Stderr()
    handler.setFormatter(_Prefixed())
    root.addHandler(handler)
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)  # ds-swift's informational lines (costs, plans) are shown by default
    return handler


HANDLER = _install()


def logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__``; a name outside ``ds_swift`` is put under it)."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def rank_here() -> int | None:
    """This process's rank in torch.distributed's default group, where one is up (None: none, or
    torch.distributed not imported: looked up without importing torch, so the launcher and the
    planner stay light)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank())


def say(
    msg: str, rank: int | None = None, *, level: int = logging.INFO, name: str = ROOT, prefix: str = "ds-swift"
) -> None:
    """One line on ds-swift's channel: ``[ds-swift] rank <rank>: <msg>`` on stderr (``rank`` None:
    ``[ds-swift] <msg>``). ``level``: WARNING for what every operator must see (a fallback, a
    protection turned off); ``name``: the logger (the calling module's ``__name__``); ``prefix``:
    the tag in brackets (``ds-swift-launch`` for the launcher's lines)."""
    logger(name).log(level, msg, extra={"rank": rank, "prefix": prefix}, stacklevel=2)


def say_here(msg: str, *, level: int = logging.INFO, name: str = ROOT) -> None:
    """:func:`say` tagged with this process's rank (:func:`rank_here`): for code that is not told
    its rank (a hook, a kept state) but runs in a worker."""
    logger(name).log(level, msg, extra={"rank": rank_here(), "prefix": "ds-swift"}, stacklevel=2)
