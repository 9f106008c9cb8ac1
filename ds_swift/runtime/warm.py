"""A warm spare worker: started before any failure, imported, and waiting for its assignment.

A replacement started cold spends seconds before it can join the job: the interpreter, the
imports of torch, DeepSpeed and megatron-core, the CUDA context. A spare agent therefore starts
its workers ahead of time as ``python -m ds_swift.runtime.warm [--module] SCRIPT ARGS...``
(``SWIFT_WARM=1``). Each one imports what the script imports (read from the script's source,
never by running it), creates the CUDA context of its local GPU, and blocks reading one JSON line
from stdin. When the spare takes over a machine, its agent writes that line, the assignment: the
worker environment a cold replacement would have been started with (rank, generation, job store,
``SWIFT_REPLACEMENT=1``). The worker puts it into ``os.environ`` and runs the script in-process
as ``__main__`` with :mod:`runpy`: same ``sys.argv``, same ``sys.path[0]``, same exit code, and
every import already in ``sys.modules``.

Why a pipe from the agent rather than a key in the job store: the agent is always the parent of
its workers, on the same host, so the pipe costs no polling (the worker wakes the moment the line
is written), keeps the job's secret out of the store, and closes by itself when the agent dies.
"""

from __future__ import annotations

import ast
import contextlib
import gc
import importlib
import json
import os
import runpy
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ds_swift.interpreter import collector_paused
from ds_swift.logs import say

__all__ = [
    "ASSIGNED_AT_ENV",
    "WARM_ENV",
    "WarmTarget",
    "held_words",
    "deepspeed_shm_op_built",
    "op_build_file",
    "preload",
    "preload_ops",
    "read_assignment",
    "run_assigned",
    "script_imports",
]

#: set (to "1") in the environment of a warm worker from its start
WARM_ENV = "SWIFT_WARM"
#: time.time() of the assignment: a warm replacement's start-up begins there, not at its process start
ASSIGNED_AT_ENV = "SWIFT_ASSIGNED_AT"

#: imported by every warm worker whatever the script says: what ds-swift itself loads in a
#: replacement before it can join (the runtime, the recovery protocol, DeepSpeed's pipeline engine)
BASE_MODULES = (
    "torch",
    "torch.distributed",
    "deepspeed",
    "deepspeed.runtime.pipe.engine",
    "ds_swift",
    "ds_swift.runtime.engine",
    "ds_swift.recovery.coordinator",
    "ds_swift.patches.deepspeed_rebuild",
    "ds_swift.patches.instructions",
    # torch's first optimizer imports it (Optimizer.__init__ through torch._compile): 1.25 s on a
    # 2-core machine, which a replacement would spend in deepspeed.initialize, after joining
    "torch._dynamo",
)


#: the module whose ``import_megatron_core`` a script may import megatron-core through
MEGATRON_IMPORT = "ds_swift.patches.megatron_import"


@dataclass(frozen=True)
class WarmTarget:
    """What the worker runs once assigned: a script path (or a module name) and its arguments."""

    script: str
    args: tuple[str, ...] = ()
    module: bool = False

    @classmethod
    def from_argv(cls, argv: list[str]) -> WarmTarget:
        module = bool(argv) and argv[0] == "--module"
        rest = argv[1:] if module else argv
        if not rest:
            raise SystemExit("usage: python -m ds_swift.runtime.warm [--module] SCRIPT [ARGS...]")
        return cls(rest[0], tuple(rest[1:]), module)

    def imports(self) -> list[str]:
        """What the script imports (:func:`script_imports`), and what a script it runs imports: a
        wrapper's argument that names a Python file (``-m ds_swift.testing.cpu_fp16_script
        pretrain_gpt.py``, whose own imports name none of Megatron's modules)."""
        names = script_imports(self.source() or "")
        for arg in self.args:
            if arg.endswith(".py") and Path(arg).is_file():
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    names.extend(script_imports(Path(arg).read_text()))
        return list(dict.fromkeys(names))

    def source(self) -> str | None:
        """The script's source text (None where it cannot be found: then only the base modules load)."""
        try:
            if not self.module:
                return Path(self.script).read_text()
            import importlib.util

            spec = importlib.util.find_spec(self.script)
            origin = spec.origin if spec is not None else None
            return Path(origin).read_text() if origin and origin.endswith(".py") else None
        except (OSError, ImportError, ValueError):
            return None


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def script_imports(source: str) -> list[str]:
    """Absolute module names the script imports anywhere (functions included, ``TYPE_CHECKING`` blocks
    not), in order of appearance: a script that imports megatron-core lazily is warmed all the same."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names: list[str] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(reversed(node.orelse))
            continue
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module != "__future__":
            names.append(node.module)
            # ``from a import b``: b may be a submodule, which ``import a`` does not load.
            names.extend(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return list(dict.fromkeys(names))


def preload(modules: Iterable[str]) -> list[str]:
    """Import ``modules`` (those that import; a name that is not a module is skipped). Returns the loaded ones.

    Warnings are silenced: the script's own workers showed them already, and a warning a module
    emits at import would otherwise appear once per warm spare.
    """
    modules = list(modules)
    loaded = []
    with warnings.catch_warnings(), collector_paused():
        warnings.simplefilter("ignore")
        if MEGATRON_IMPORT in modules and any(m.split(".")[:2] == ["megatron", "core"] for m in modules):
            # The script imports megatron-core through import_megatron_core (examples/pretrain_gpt.py):
            # so does its warm worker, or on CPU it would build the torch.compile wrappers (and import
            # torch._inductor, ~2.5 CPU-s per warm worker) that the script's own ranks never build.
            importlib.import_module(MEGATRON_IMPORT).import_megatron_core()
        for name in modules:
            if name in sys.modules:
                loaded.append(name)
                continue
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001, S112 - `from a import func` names no module; an optional import may fail
                continue
            loaded.append(name)
    return loaded


def preload_ops() -> list[str]:
    """Load the compiled ops DeepSpeed loads when a worker attaches to its world
    (``deepspeed.init_distributed``, after the worker joined its generation): the CPU accelerator's
    shared-memory comm op, whose JIT load checks its build each time, 0.36 s in a fresh process on
    a 2-core machine; once loaded, the process's next load of it is free. Returns what was loaded
    (none where the accelerator has no such op, or it cannot build: the worker then loads as before)."""
    loaded: list[str] = []
    if _build_locked("deepspeed_shm_comm"):
        return loaded  # another process builds it (or one killed while building left torch's lock): no wait here
    with contextlib.suppress(Exception), warnings.catch_warnings(), collector_paused():
        warnings.simplefilter("ignore")
        from deepspeed.comm.torch import build_shm_op

        if build_shm_op() is not None:
            loaded.append("deepspeed_shm_comm")
    return loaded


def op_build_file(name: str, file: str) -> Path | None:
    """``file`` in torch's JIT build directory of op ``name`` (``lock`` while a build runs, or after
    one was killed; ``<name>.so`` once built), or None where torch's private helper is missing."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False)) / file
    except Exception:  # noqa: BLE001 - a private helper of torch's: without it, load as before
        return None


def deepspeed_shm_op_built() -> bool:
    """Whether DeepSpeed's shm comm op is already built (its first start on a machine builds it, ~40 s)."""
    built = op_build_file("deepspeed_shm_comm", "deepspeed_shm_comm.so")
    return built is not None and built.exists()


def _build_locked(name: str) -> bool:
    """torch's JIT build lock of op ``name`` exists: a load would wait until it goes, for good where
    its holder was killed (torch's FileBaton records no owner). A warm worker does not wait for it."""
    lock = op_build_file(name, "lock")
    return lock is not None and lock.exists()


def _warm_device(local_rank: int) -> None:
    """Create the CUDA context of this worker's GPU now (a second or more at first use)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > local_rank:
        torch.cuda.set_device(local_rank)
        torch.zeros(1, device="cuda").sum().item()


def read_assignment(stream: IO[bytes]) -> dict[str, str] | None:
    """Block until the agent writes the assignment; None when the pipe closed without one."""
    line = stream.readline()
    if not line.strip():
        return None
    env = json.loads(line)["env"]
    if not isinstance(env, dict):
        raise ValueError("warm spare assignment: 'env' is not an object")
    return {str(k): str(v) for k, v in env.items()}


def run_assigned(target: WarmTarget, env: Mapping[str, str]) -> int:
    """Run the script as ``__main__`` in this process with the assignment's environment; its exit code."""
    os.environ.update(env)
    os.environ[ASSIGNED_AT_ENV] = repr(time.time())
    sys.argv = [target.script, *target.args]
    try:
        if target.module:
            runpy.run_module(target.script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target.script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return int(code or 0)
        print(code, file=sys.stderr)  # sys.exit("message"), as the interpreter reports it
        return 1
    return 0


def await_assignment(target: WarmTarget, ready: str) -> int:
    """A warm spare's worker with its imports done (``ready`` says how: imported here, or forked by
    ds_swift.runtime.forkserver): ready the device, say so, wait for the agent's assignment on stdin,
    then run the script as the assigned rank. 0 when the pool is shut down first."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    with contextlib.suppress(Exception):  # no GPU, or a broken driver: the script will say so itself
        _warm_device(local_rank)
    # The imports' objects (~400k, made with the collector paused) are all still in its youngest
    # generation: the first collections after the assignment walked them all, on the replacement's
    # start-up that every survivor waits for (0.5 s in the demo's model construction, measured).
    # Collected now, while nothing waits, and frozen: they live as long as the process, and no
    # collection walks them again.
    gc.collect()
    gc.freeze()
    say(
        f"warm spare worker (local rank {local_rank}, pid {os.getpid()}): {ready}; waiting for an assignment",
        name=__name__,
    )
    env = read_assignment(sys.stdin.buffer)
    if env is None:
        return 0  # the agent closed the pipe: the pool is being shut down
    _detach_stdin()
    return run_assigned(target, env)


def _detach_stdin() -> None:
    # A cold worker's stdin is /dev/null; the script must not see the agent's pipe.
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), 0)


def main(argv: list[str] | None = None) -> int:
    target = WarmTarget.from_argv(list(sys.argv[1:] if argv is None else argv))
    if not target.module:
        # As `python script.py` does: the script's directory first on the path (-m put the cwd there).
        sys.path[0] = str(Path(target.script).resolve().parent)
    t0 = time.monotonic()
    loaded = preload([*BASE_MODULES, *target.imports()])
    return await_assignment(target, held_words(loaded, preload_ops(), time.monotonic() - t0))


def held_words(modules: list[str], ops: list[str], seconds: float) -> str:
    """What a warm worker holds before its assignment, for its ready line."""
    held = f"{len(modules)} modules imported"
    if ops:
        held += f", compiled ops loaded ({', '.join(ops)})"
    return f"{held} in {seconds:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
