"""`ds-swift` command line: a thin dispatcher. Each sub-command lives beside its logic.

A sub-command module exposes ``register(subparsers) -> None``, which adds its parser and sets
``func`` (taking the parsed namespace, returning an exit code). Modules keep heavy imports
(torch, deepspeed) inside ``func`` so that ``ds-swift --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ds_swift.config import ConfigError

#: sub-command modules, in the order `--help` lists them
SUBCOMMANDS = (
    "ds_swift.plan.cli",  # ds-swift plan
    "ds_swift.sim.cli",  # ds-swift simulate
    "ds_swift.msglog.cli",  # ds-swift logs
    "ds_swift.bench.demo",  # ds-swift demo
    "ds_swift.bench.run",  # ds-swift bench
    "ds_swift.megatron.patch",  # ds-swift megatron-patch
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-swift", description="Fast failure recovery for DeepSpeed + Megatron 3D-parallel training."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only a sub-command that is absent from this build is skipped; a missing dependency
            # of one that is present must surface.
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        # One line that names the field: a traceback would bury it.
        print(f"ds-swift {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
