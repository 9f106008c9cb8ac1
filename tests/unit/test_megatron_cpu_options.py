"""scripts/megatron_deepspeed_cpu.sh's options (ds_swift.megatron.cpu): shape, precision, ZeRO, strategy
and the kill become the DeepSpeed config and the two launch commands; bad options are refused by name.

No Megatron-DeepSpeed run here: the script's --dry-run prints the commands it would run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds_swift.megatron.cpu import CpuRun, ds_config, launch_command, parse_run, summary_lines
from ds_swift.testing.cpu_fp16_script import script_argv

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "megatron_deepspeed_cpu.sh"


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_defaults_are_the_readme_run(tmp_path: Path) -> None:
    checkout, work, run, dry_run = parse_run([str(tmp_path / "mds")])
    assert run == CpuRun() and not dry_run and work.name == "megatron-swift-run"
    argv = launch_command(checkout, tmp_path / "w", run)
    assert argv[:7] == ["ds-swift-launch", "--nnodes", "4", "--nproc-per-node", "1", "--spares", "1"]
    assert option(argv, "--inject") == "machine=3,iteration=5,phase=backward"
    assert option(argv, "--pipeline-model-parallel-size") == "2" and option(argv, "--tensor-model-parallel-size") == "1"
    assert "--bf16" not in argv and "--fp16" not in argv
    assert option(argv, "--deepspeed_config") == str(tmp_path / "w" / "kill" / "ds_config.json")
    config = ds_config(run, tmp_path / "w" / "kill")
    assert config["zero_optimization"] == {"stage": 0} and "bf16" not in config and "fp16" not in config
    assert config["train_batch_size"] == 4 and config["swift"]["machines"]["gpus_per_node"] == 1
    assert "--inject" not in launch_command(checkout, tmp_path / "w", run, kill=False)


def test_3d_bf16_zero1_shape(tmp_path: Path) -> None:
    _, _, run, _ = parse_run(
        [
            str(tmp_path),
            "--tp",
            "2",
            "--pp",
            "2",
            "--dp",
            "2",
            "--machines",
            "4",
            "--precision",
            "bf16",
            "--zero",
            "1",
            "--kill-machine",
            "2",
            "--kill-iteration",
            "3",
            "--kill-phase",
            "forward",
            "--iters",
            "6",
            "--strategy",
            "replication",
        ]
    )
    assert run.world == 8 and run.ranks_per_machine == 2
    argv = launch_command(tmp_path / "mds", tmp_path / "w", run)
    assert option(argv, "--nnodes") == "4" and option(argv, "--nproc-per-node") == "2"
    assert option(argv, "--tensor-model-parallel-size") == "2" and option(argv, "--train-iters") == "6"
    assert option(argv, "--inject") == "machine=2,iteration=3,phase=forward" and "--bf16" in argv
    config = ds_config(run, tmp_path / "w" / "kill")
    assert config["bf16"] == {"enabled": True} and config["zero_optimization"] == {"stage": 1}
    assert config["swift"]["strategy"] == "replication" and config["swift"]["machines"]["gpus_per_node"] == 2
    assert config["train_batch_size"] == 4  # mbs 1 x dp 2 x 2 micro-batches


def test_fp16_loss_scale_and_pipeline_layers(tmp_path: Path) -> None:
    _, _, run, _ = parse_run(
        [
            str(tmp_path),
            "--pp",
            "4",
            "--dp",
            "1",
            "--machines",
            "2",
            "--precision",
            "fp16",
            "--initial-scale-power",
            "30",
        ]
    )
    argv = launch_command(tmp_path / "mds", tmp_path / "w", run)
    assert "--fp16" in argv and option(argv, "--num-layers") == "4"  # one layer per stage
    assert "--untie-embeddings-and-output-weights" not in argv
    _, _, untied, _ = parse_run([str(tmp_path), "--untie-embeddings"])
    assert "--untie-embeddings-and-output-weights" in launch_command(tmp_path / "mds", tmp_path / "w", untied)
    # started through the module that allows fp16 on DeepSpeed's CPU accelerator
    assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == [
        "ds_swift.testing.cpu_fp16_script",
        str(tmp_path / "mds" / "pretrain_gpt.py"),
    ]
    assert script_argv(["--local_rank=1", "/m/pretrain_gpt.py", "--fp16"]) == [
        "/m/pretrain_gpt.py",
        "--local_rank=1",
        "--fp16",
    ]
    assert script_argv(["/m/pretrain_gpt.py"]) == ["/m/pretrain_gpt.py"]
    assert "-m" not in launch_command(tmp_path / "mds", tmp_path / "w", CpuRun(precision="bf16"))
    fp16 = ds_config(run, tmp_path / "w" / "ref")["fp16"]
    assert fp16["enabled"] and fp16["initial_scale_power"] == 30 and fp16["loss_scale"] == 0


def test_each_run_logs_under_its_own_directory(tmp_path: Path) -> None:
    ref, kill = (ds_config(CpuRun(), tmp_path / name)["swift"]["logging"]["storage"] for name in ("ref", "kill"))
    assert ref == f"file://{tmp_path / 'ref' / 'logs'}" and kill == f"file://{tmp_path / 'kill' / 'logs'}"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--tp", "2", "--machines", "3"], "--machines 3"),  # 8 ranks do not split over 3 machines
        (["--kill-machine", "4"], "--kill-machine 4"),
        (["--kill-iteration", "9"], "--kill-iteration 9"),
        (["--tp", "3", "--machines", "2", "--pp", "2", "--dp", "1"], "--tp 3"),
        (["--precision", "fp8"], "--precision"),
        (["--zero", "2"], "--zero"),
        (["--strategy", "magic"], "--strategy"),
        (["--dp", "0"], "--dp 0"),
        (["--kill-machine", "1", "--kill-also", "1"], "--kill-also 1"),
        (["--reference", "/nowhere"], "--reference"),
    ],
)
def test_bad_options_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_run([str(tmp_path), *argv])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_summary_keeps_losses_skipped_steps_and_the_recovery() -> None:
    log = "\n".join(
        [
            " iteration        1/       8 | consumed samples:            4 | consumed tokens:          128 | elapsed time "
            "per iteration (ms): 900.1 | learning rate: 5.000E-04 | global batch size:     4 | loss scale: 1073741824.0 | "
            "actual seqlen:    32 | number of skipped iterations:   1 | number of nan iterations:   0 |",
            " iteration        2/       8 | consumed samples:            8 | consumed tokens:          256 | elapsed time "
            "per iteration (ms): 800.2 | learning rate: 1.000E-03 | global batch size:     4 | lm loss: 5.581234E+00 | "
            "loss scale: 536870912.0 | grad norm: 3.210 | num zeros: 0.0 | actual seqlen:    32 | number of skipped "
            "iterations:   0 | number of nan iterations:   0 |",
            "noise",
            "[ds-swift] recovery of generation 0 (machine 3): replication; consensus iteration 4; ...",
            "[ds-swift-launch] job finished: all 4 machines' ranks exited 0 (generation 1)",
        ]
    )
    assert summary_lines(log) == [
        "iteration 1/8 | lm loss: none (step skipped) | consumed samples: 4 | loss scale: 1073741824.0 | skipped",
        "iteration 2/8 | lm loss: 5.581234E+00 | consumed samples: 8 | loss scale: 536870912.0 | grad norm: 3.210",
        "[ds-swift] recovery of generation 0 (machine 3): replication; consensus iteration 4; ...",
        "[ds-swift-launch] job finished: all 4 machines' ranks exited 0 (generation 1)",
    ]


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_script_dry_run_prints_both_commands(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    argv = [
        "bash",
        str(SCRIPT),
        str(tmp_path / "mds"),
        str(tmp_path / "w"),
        "--tp",
        "2",
        "--pp",
        "2",
        "--dp",
        "2",
        "--precision",
        "bf16",
        "--zero",
        "1",
        "--kill-machine",
        "0",
        "--dry-run",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tp 2 x pp 2 x dp 2 over 4 machines of 2 rank(s)") and "bf16, ZeRO-1" in lines[0]
    ref = shlex.split(next(ln for ln in lines if ln.startswith("failure-free: ")).removeprefix("failure-free: "))
    kill = shlex.split(next(ln for ln in lines if ln.startswith("kill: ")).removeprefix("kill: "))
    assert "--inject" not in ref and option(kill, "--inject") == "machine=0,iteration=5,phase=backward"
    assert option(kill, "--nproc-per-node") == "2" and "--bf16" in kill
    assert not (tmp_path / "w").exists()  # a dry run writes nothing

    bad = subprocess.run([*argv[:3], "--zero", "3"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--zero" in bad.stderr and bad.stdout == ""


def test_two_machines_at_once_elastic_and_a_shared_reference(tmp_path: Path) -> None:
    """The Megatron fault matrix's needs (benchmarks/megatron_matrix.py): two machines killed at one
    instant, the elastic strategy's shrink, and one failure-free run compared with by many cases."""
    _, _, two, _ = parse_run([str(tmp_path), "--kill-machine", "0", "--kill-also", "3", "--spares", "2"])
    argv = launch_command(tmp_path / "mds", tmp_path / "w", two)
    assert option(argv, "--inject") == "machine=0+3,iteration=5,phase=backward" and option(argv, "--spares") == "2"
    _, _, elastic, _ = parse_run([str(tmp_path), "--strategy", "elastic", "--spares", "0"])
    assert "--elastic" in launch_command(tmp_path / "mds", tmp_path / "w", elastic)
    assert "--elastic" not in argv
    ref = tmp_path / "ref-work"
    (ref / "ref" / "ckpt" / "global_step8").mkdir(parents=True)
    import contextlib
    import io

    from ds_swift.megatron.cpu import prepare

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert prepare([str(tmp_path / "mds"), str(tmp_path / "w"), "--reference", str(ref)]) == 0
    assert f"REF_WORK={ref}" in out.getvalue().splitlines()


def test_the_megatron_matrix_cases_and_their_options() -> None:
    sys.path.insert(0, str(SCRIPT.parents[1] / "benchmarks"))
    try:
        from megatron_matrix import CI_CASES, all_cases
    finally:
        sys.path.pop(0)
    cases = {c.name: c for c in all_cases()}
    assert len(cases) == 3 * 3 * 6 * 8 and set(CI_CASES) <= set(cases)
    first = cases["pp2dp2/bf16/checkpoint/first"].options()
    assert option(first, "--kill-iteration") == "2" and option(first, "--save-interval") == "4"
    two = cases["tp2pp2dp2/fp16/auto/two"].options()
    assert (option(two, "--kill-machine"), option(two, "--kill-also"), option(two, "--spares")) == ("0", "3", "2")
    assert option(two, "--initial-scale-power") == "20"
    assert option(cases["pp4/fp32/elastic/m0"].options(), "--spares") == "0"
    for case in cases.values():  # every case is a valid command line of the script
        parse_run(["/mds", *case.options()])
