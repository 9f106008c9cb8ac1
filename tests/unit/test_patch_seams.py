"""Every change to DeepSpeed / torch behaviour lives in patches/: the checker, and the p2p and collective patches' undo."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p

from ds_swift.patches._base import PatchError
from ds_swift.patches.pipe_p2p import capture_sends, drop_sends, serve_recvs
from ds_swift.patches.step_collectives import wrap_collectives

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_patch_seams.py"


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_patch_seams", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_tree_changes_deepspeed_and_torch_only_in_patches() -> None:
    found = checker().check_tree(ROOT)
    assert found == [], "\n".join(map(str, found))


OFFENDER = """
import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p
from deepspeed.utils import groups as g
import deepspeed.comm

c10d = dist.distributed_c10d

def f(engine, fn):
    p2p.send = fn                                   # 10
    g.mpu, x = None, 1                              # 11
    setattr(dist, "all_reduce", fn)                 # 12
    c10d.default_pg_timeout = 5                     # 13
    torch.backends.cudnn.deterministic = True       # 14
    del p2p._grid                                   # 15
    deepspeed.comm.cdb += 1                         # 16
    delattr(dist, "barrier")                        # 17
    engine._compute_loss = True                     # 18: a DeepSpeed engine's private state
    setattr(engine, "_step_applied", False)         # 19
    setattr(engine, name, 1)                        # 20: a computed name may be private
    ctx.engine._global_grad_norm += 1               # 21
    del eng._INSTRUCTION_MAP                        # 22
    self._engine._x, y = 1, 2                       # 23
    engine.micro_batches = 1                        # instance state: not a patch
    setattr(engine, "skipped_steps", 0)             # public: not flagged
    engine.optimizer._x = 1                         # not the engine's own
    self._engine = engine                           # the wrapper's own attribute
    p2p.recv = fn  # patch-seams: ok
    engine._y = 1  # patch-seams: ok
"""


def test_the_checker_flags_each_kind_of_write() -> None:
    found = checker().check_source(OFFENDER.lstrip("\n"), "x.py")
    assert sorted(f.line for f in found) == [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    text = {str(f) for f in found}
    assert "x.py:10: assignment to p2p.send" in text
    assert "x.py:18: assignment to engine._compute_loss (a DeepSpeed engine's private attribute)" in text


def test_the_checker_catches_the_replays_old_engine_write(tmp_path: Path) -> None:
    """What recovery/replay/engine.py did before patches/deepspeed_engine.py: now flagged."""
    (tmp_path / "ds_swift").mkdir()
    (tmp_path / "ds_swift" / "replay.py").write_text("def run(engine):\n    engine._compute_loss = True\n")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path), "ds_swift"], capture_output=True, text=True
    )
    assert run.returncode == 1 and "ds_swift/replay.py:2: assignment to engine._compute_loss" in run.stdout


def test_setup_pins_the_deepspeed_range_the_patches_support() -> None:
    """setup.py's requirement is the one range in ds_swift.patches._base, written out."""
    import re

    from ds_swift.patches._base import SUPPORTED_DEEPSPEED

    found = re.findall(r'"deepspeed([<>=!~][^"]*)"', (ROOT / "setup.py").read_text())
    low, below = SUPPORTED_DEEPSPEED
    assert found == [f">={low},<{below}"], (found, SUPPORTED_DEEPSPEED)


def test_the_checker_script_exits_1_listing_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "ds_swift").mkdir()
    (tmp_path / "ds_swift" / "bad.py").write_text("import torch.distributed as dist\ndist.barrier = print\n")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(tmp_path), "ds_swift"], capture_output=True, text=True
    )
    assert run.returncode == 1 and "ds_swift/bad.py:2: assignment to dist.barrier" in run.stdout
    (tmp_path / "ds_swift" / "bad.py").write_text("import torch.distributed as dist\ndist.barrier()\n")
    run = subprocess.run([sys.executable, str(SCRIPT), "--root", str(tmp_path), "ds_swift"], capture_output=True)
    assert run.returncode == 0


# --------------------------------------------------------------------------- the patches' undo
def test_p2p_patches_nest_refuse_twice_and_restore_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    wire: list[float] = []
    monkeypatch.setattr(p2p, "send", lambda t, dest, async_op=False: wire.append(float(t)))
    installed_send, installed_recv = p2p.send, p2p.recv
    seen: list[float] = []
    with drop_sends():
        with capture_sends(lambda t: seen.append(float(t))):
            p2p.send(torch.tensor(1.0), 1)
            with pytest.raises(PatchError, match="already patched"):
                capture_sends(lambda t: None)
        with pytest.raises(PatchError, match="already patched"):
            drop_sends()
    assert seen == [1.0] and wire == [] and p2p.send is installed_send
    with capture_sends(lambda t: seen.append(float(t))):
        p2p.send(torch.tensor(2.0), 1)
    assert seen == [1.0, 2.0] and wire == [2.0] and p2p.send is installed_send
    with serve_recvs(lambda t: t.fill_(7.0)):
        buf = torch.zeros(2)
        p2p.recv(buf, 0)
    assert buf.tolist() == [7.0, 7.0] and p2p.recv is installed_recv


def test_p2p_patch_removed_out_of_order_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p, "send", lambda t, dest, async_op=False: None)
    outer = drop_sends()
    inner = capture_sends(lambda t: None)
    with pytest.raises(PatchError, match="re-patched"):
        outer.remove()
    inner.remove()
    outer.remove()


def test_collective_wrapping_stacks_by_tag_and_restores() -> None:
    before = {n: getattr(dist, n) for n in ("all_reduce", "broadcast", "barrier")}
    calls: list[str] = []

    def make(tag: str):  # type: ignore[no-untyped-def]
        def wrap(name, fn, sig):  # type: ignore[no-untyped-def]
            def call(*args, **kw):  # type: ignore[no-untyped-def]
                calls.append(f"{tag}:{name}")
                return None

            return call

        return wrap

    with wrap_collectives("outer", make("outer")), wrap_collectives("inner", make("inner")):
        dist.all_reduce(torch.zeros(1))
        with pytest.raises(PatchError, match="already wrapped"):
            wrap_collectives("outer", make("again"))
    assert calls == ["inner:all_reduce"]
    assert {n: getattr(dist, n) for n in before} == before
