"""``ds-swift-launch``: parse the command line, hand over to the launcher (a thin entry point)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .args import LaunchUsageError, parse_args

__all__ = ["entry", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except LaunchUsageError as exc:
        print(f"ds-swift-launch: error: {exc}", file=sys.stderr)
        return 2
    cmd = args.command
    if not cmd.module and not cmd.no_python and not os.path.isfile(cmd.script):
        # Otherwise every rank would exit 2 and each replacement would too, until --max-failures.
        print(f"ds-swift-launch: error: training script {cmd.script} not found", file=sys.stderr)
        return 2
    # --fork-server: its interpreter imports torch, DeepSpeed and megatron-core while this one
    # imports torch for the job store (on a small host, seconds off every job's start).
    server = None
    if args.fork_server and args.launcher not in ("pdsh", "ssh"):  # pdsh/ssh: each host's agent has its own
        from .fork_client import ForkServer

        server = ForkServer(args.command)
        server.start()
    try:
        # torch (the job store) is imported only now: --help and usage errors stay instant.
        from .launcher import run
        from .preflight import arch_list_warning, preflight

        # A configuration the strategy cannot serve is refused before any worker starts (not a hang
        # at the first failure, nor an abort inside the workers).
        why = preflight(args)
        if why is not None:
            print(f"ds-swift-launch: error: {why}", file=sys.stderr)
            return 2
        arch = arch_list_warning(os.environ, _installed("deepspeed"))
        if arch is not None:
            print(f"ds-swift-launch: warning: {arch}", file=sys.stderr)

        return run(args, server)
    finally:
        if server is not None:
            server.close()


def _installed(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def entry() -> None:
    """The ``ds-swift-launch`` command: :func:`main`, then the process ends without the
    interpreter's teardown of torch (ds_swift.exit_process: the job's end is its launcher's)."""
    from ds_swift.interpreter import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
