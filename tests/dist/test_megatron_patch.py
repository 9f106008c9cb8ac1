"""patches/megatron_deepspeed_pretrain_gpt.diff turns ds-swift on in a Megatron-DeepSpeed style script.

The diff is applied (with ``patch`` and with ``git apply``) to a copy of
``examples/megatron_ds/pretrain_gpt_pre_swift.py`` named ``pretrain_gpt.py``; the patched script
trains 3 iterations under ``ds-swift-launch`` (1 machine x 2 ranks: a pipeline of 2, or tensor
parallelism of 2 with megatron-core's layers) with ds-swift active, and its losses equal those of the
unpatched script under torchrun: turning ds-swift on changes no number.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds_swift.testing.procs import ProcessSet, free_port, worker_env

ROOT = Path(__file__).resolve().parents[2]
PRE_SWIFT = ROOT / "examples" / "megatron_ds" / "pretrain_gpt_pre_swift.py"
DIFF = ROOT / "patches" / "megatron_deepspeed_pretrain_gpt.diff"
CONFIG = ROOT / "configs" / "gpt_tiny_pp2_dp2.json"
ITERS = 3
JOB_DEADLINE_S = 180.0
SCRIPT_ARGS = [
    "--deepspeed",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(ITERS),
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
]
PLANS = {
    "pp2": ["--pipeline-model-parallel-size", "2"],
    # megatron-core's ColumnParallelLinear / RowParallelLinear / vocab-parallel loss on gloo
    "tp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"],
}

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def apply_diff(tmp: Path, tool: str) -> Path:
    """A copy of the pre-integration script as ``pretrain_gpt.py``, patched by ``tool``."""
    tmp.mkdir(parents=True, exist_ok=True)
    target = tmp / "pretrain_gpt.py"
    shutil.copy(PRE_SWIFT, target)
    if tool == "patch":
        argv = ["patch", "-p1", "--forward", "--batch", "-i", str(DIFF)]
    else:
        argv = ["git", "apply", "--verbose", str(DIFF)]
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed")
    done = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return target


@pytest.mark.parametrize("tool", ["patch", "git"])
def test_diff_applies_and_adds_the_integration_lines(tmp_path: Path, tool: str) -> None:
    text = apply_diff(tmp_path, tool).read_text()
    before = PRE_SWIFT.read_text()
    for line in (
        "parser = ds_swift.megatron.add_arguments(parser)",
        "ds_swift.init_distributed(args.deepspeed_config_dict)",
        "model = ds_swift.megatron.initialize(model, args, args.deepspeed_config_dict, model_fn=model_provider,",
    ):
        assert line in text and line not in before
    assert "deepspeed.init_distributed(" not in text  # replaced, not duplicated
    assert text.index("deepspeed.initialize(") < text.index("ds_swift.megatron.initialize(")
    compile(text, "pretrain_gpt.py", "exec")


def losses(path: Path) -> list[tuple[int, float]]:
    return [(d["iteration"], d["loss"]) for d in map(json.loads, path.read_text().splitlines())]


def reference_ran(code: int | None, output: str, loss_log: Path) -> bool:
    """The plain upstream run finished. Its script ends through the interpreter's teardown, where now
    and then on gloo a C++ thread still joinable aborts the process after the last iteration
    ("terminate called without an active exception", SIGABRT; seen once in three full runs, tp2):
    with that message and every iteration in its loss log (compared by the test) the run is complete;
    any other failure is not."""
    if code == 0:
        return True
    torn = "terminate called without an active exception" in output
    return torn and loss_log.exists() and len(losses(loss_log)) == ITERS


# CI: tp 2 (the 3D plan); pp 2 with -m slow (CI time)
@pytest.mark.parametrize("plan", [pytest.param(p, marks=pytest.mark.slow) if p == "pp2" else p for p in PLANS])
def test_patched_script_trains_with_ds_swift_and_changes_no_number(
    tmp_path: Path, warm_deepspeed: None, plan: str
) -> None:
    script = apply_diff(tmp_path / "patched", "patch" if shutil.which("patch") else "git")
    ds_config = json.loads(CONFIG.read_text())
    swift = ds_config.pop("swift")  # ds-swift comes from --swift --swift-config, not the DeepSpeed config
    swift.update(
        enabled=False,
        machines={"gpus_per_node": 2},
        run_dir=str(tmp_path / "run"),
        checkpoint={"dir": str(tmp_path / "swift-ckpt"), "interval": 2},
    )
    (tmp_path / "ds_config.json").write_text(json.dumps(ds_config))
    (tmp_path / "swift.json").write_text(json.dumps({"swift": swift}))
    common = [*SCRIPT_ARGS, *PLANS[plan], "--deepspeed_config", str(tmp_path / "ds_config.json")]

    with ProcessSet(tmp_path / "logs") as procs:
        procs.spawn(
            "swift",
            [
                sys.executable,
                "-m",
                "ds_swift.launch.cli",
                "--run-dir",
                str(tmp_path / "run"),
                "--nnodes",
                "1",
                "--nproc-per-node",
                "2",
                str(script),
                *common,
                "--swift",
                "--swift-config",
                str(tmp_path / "swift.json"),
                "--loss-log",
                str(tmp_path / "swift-loss.jsonl"),
                "--save",
                str(tmp_path / "final"),
            ],
            env=worker_env(),
            cwd=tmp_path,
        )
        code = procs.wait("swift", JOB_DEADLINE_S)
        output = procs.log("swift")
        assert code == 0, output[-6000:]
        # The unpatched script, as users run it today (torchrun: ds-swift-launch's store would clash).
        procs.spawn(
            "plain",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                str(PRE_SWIFT),
                *common,
                "--loss-log",
                str(tmp_path / "plain-loss.jsonl"),
            ],
            env=worker_env(),
            cwd=tmp_path,
        )
        plain_code = procs.wait("plain", JOB_DEADLINE_S)
        plain = procs.log("plain")
        assert reference_ran(plain_code, plain, tmp_path / "plain-loss.jsonl"), plain[-6000:]

    # ds-swift was active: its planner spoke, and its periodic checkpoint (interval 2) exists.
    assert "[ds-swift] recovery plan per pipeline stage" in output, output[-4000:]
    assert (tmp_path / "swift-ckpt" / "global_step2").is_dir()
    if plan == "tp2":
        assert "ParallelBlock" in output and "ProcessCoord(pipe=0, data=0, model=1): 1" in output, output[-4000:]
    assert (tmp_path / "final" / f"global_step{ITERS}").is_dir()
    swift_losses = losses(tmp_path / "swift-loss.jsonl")
    assert [i for i, _ in swift_losses] == list(range(ITERS))
    assert swift_losses == losses(tmp_path / "plain-loss.jsonl")
