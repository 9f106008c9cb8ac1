"""ds-swift-launch without processes: the command line, and the workers' argv and environment.

The agent's decisions (spare, restart, abort, max failures) are in ``test_agent_decisions.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ds_swift.launch.args import Command, LaunchUsageError, parse_args
from ds_swift.launch.cli import main
from ds_swift.launch.hostfile import HostfileError, read_hostfile
from ds_swift.testing.faults import FaultSpec


def parse(*argv: str, environ: dict[str, str] | None = None):  # noqa: ANN201 - LaunchArgs
    return parse_args(list(argv), environ=environ or {})


# ---------------------------------------------------------------------- command line
@pytest.mark.parametrize("nodes_flag", ["--nnodes", "--num_nodes", "--num-nodes"])
@pytest.mark.parametrize("procs_flag", ["--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num-gpus"])
def test_deepspeed_and_torchrun_spellings(nodes_flag: str, procs_flag: str) -> None:
    args = parse(nodes_flag, "3", procs_flag, "4", "train.py")
    assert (args.nnodes, args.nproc_per_node, args.world_size) == (3, 4, 12)


def test_defaults_are_a_single_simulated_machine() -> None:
    args = parse("train.py")
    assert (args.nnodes, args.nproc_per_node, args.spares, args.max_failures) == (1, 1, 0, 3)
    assert args.restart_delay_s is None and args.node_rank is None and args.master_port is None
    assert not args.multi_host and args.job_token is None
    assert Path(args.run_dir).is_absolute()
    assert args.command == Command("train.py")


def test_script_arguments_pass_through_untouched() -> None:
    args = parse("--spares", "1", "train.py", "--nnodes", "9", "--deepspeed_config", "c.json", "-m")
    assert args.command.args == ("--nnodes", "9", "--deepspeed_config", "c.json", "-m")
    assert args.nnodes == 1 and args.spares == 1 and not args.command.module


def test_inject_repeatable_and_semicolon_separated() -> None:
    args = parse(
        "--nnodes",
        "2",
        "--inject",
        "machine=1,iteration=7,phase=backward",
        "--inject",
        "machine=0,iteration=2;machine=1,iteration=9,phase=step",
        "train.py",
    )
    assert args.inject == (FaultSpec(1, 7, "backward"), FaultSpec(0, 2), FaultSpec(1, 9, "step"))


@pytest.mark.parametrize(
    ("inject", "fragment"),
    [
        ("machine=1,iteration=7,phase=sideways", "--inject 'machine=1,iteration=7,phase=sideways'"),
        ("machine=2,iteration=1", "machine=2 does not exist: the job has machines 0..1"),
        ("machine=1", "lacks iteration="),
    ],
)
def test_bad_inject_names_the_flag(inject: str, fragment: str) -> None:
    with pytest.raises(LaunchUsageError) as info:
        parse("--nnodes", "2", "--inject", inject, "train.py")
    assert fragment in str(info.value) and "--inject" in str(info.value)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--nnodes", "0", "t.py"], "--nnodes"),
        (["--spares", "-1", "t.py"], "--spares"),
        (["--restart-delay", "soon", "t.py"], "--restart-delay"),
        (["--restart-delay", "nan", "t.py"], "--restart-delay"),
        (["--max-failures", "x", "t.py"], "--max-failures"),
    ],
)
def test_bad_numbers_are_argparse_errors(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


def test_fork_server_is_off_by_default_and_needs_python() -> None:
    assert not parse("t.py").fork_server and parse("--fork-server", "t.py").fork_server
    with pytest.raises(LaunchUsageError, match="--fork-server forks a Python interpreter"):
        parse("--fork-server", "--no_python", "--no_local_rank", "./train.sh")


def test_module_and_no_python_rules() -> None:
    assert parse("-m", "pkg.train").command.module
    with pytest.raises(LaunchUsageError, match="--no_python needs --no_local_rank"):
        parse("--no_python", "./train.sh")
    assert parse("--no_python", "--no_local_rank", "./train.sh").command == Command(
        "./train.sh", no_python=True, local_rank_arg=False
    )
    with pytest.raises(LaunchUsageError, match="exclude each other"):
        parse("--module", "--no_python", "--no_local_rank", "x")


def test_multi_host_needs_a_token_and_a_valid_node_rank() -> None:
    with pytest.raises(LaunchUsageError, match="--job-token"):
        parse("--nnodes", "2", "--node-rank", "1", "--master_addr", "10.0.0.1", "t.py")
    args = parse(
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master_addr",
        "10.0.0.1",
        "t.py",
        environ={"SWIFT_JOB_TOKEN": "abc", "SWIFT_JOB_SECRET": "k" * 32},
    )
    assert args.multi_host and args.job_token == "abc" and args.master_port == 29500
    with pytest.raises(LaunchUsageError, match="agents are 0..1 .machines. and 2..2 .spares."):
        parse("--nnodes", "2", "--spares", "1", "--node-rank", "3", "--job-token", "t", "t.py")


def test_token_from_the_environment_is_ignored_on_one_host() -> None:
    assert parse("t.py", environ={"SWIFT_JOB_TOKEN": "leaked"}).job_token is None
    assert parse("--job-token", "mine", "t.py").job_token == "mine"


def test_remote_master_addr_without_node_rank_is_refused() -> None:
    with pytest.raises(LaunchUsageError, match="--node-rank"):
        parse("--master_addr", "10.1.2.3", "t.py")


# ---------------------------------------------------------------------- hostfile
def test_hostfile_format(tmp_path: Path) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("# machines\nlocalhost slots=2\n\n127.0.0.1 slots=2  # same box\n127.0.0.2 slots=4\n")
    assert [(h.host, h.slots) for h in read_hostfile(str(hf))] == [("localhost", 2), ("127.0.0.1", 2), ("127.0.0.2", 4)]
    args = parse("--hostfile", str(hf), "--spares", "1", "t.py")
    assert (args.nnodes, args.nproc_per_node, args.spares) == (2, 2, 1)
    with pytest.raises(LaunchUsageError, match="exceeds the hostfile's slots"):
        parse("--hostfile", str(hf), "--nproc-per-node", "3", "t.py")
    with pytest.raises(LaunchUsageError, match="needs 5 hosts"):
        parse("--hostfile", str(hf), "--nnodes", "4", "--spares", "1", "t.py")


@pytest.mark.parametrize("line", ["worker-1", "worker-1 slots=x", "worker-1 slots=0", "worker-1 gpus=2"])
def test_hostfile_bad_lines(tmp_path: Path, line: str) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text(f"localhost slots=1\n{line}\n")
    with pytest.raises(HostfileError, match=f"{hf}:2"):
        read_hostfile(str(hf))


def test_remote_hostfile_prints_the_per_host_commands(tmp_path: Path) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("node-a.example slots=8\nnode-b.example slots=8\nnode-c.example slots=8\n")
    with pytest.raises(LaunchUsageError) as info:
        parse("--hostfile", str(hf), "--spares", "1", "train.py", "--lr", "1")
    msg = str(info.value)
    assert "give --launcher pdsh or --launcher ssh" in msg
    assert "on node-c.example (spare): ds-swift-launch --nnodes 2 --nproc-per-node 8 --spares 1 --node-rank 2" in msg
    assert "--master_addr node-a.example --master_port 29500" in msg and "train.py --lr 1" in msg


def test_cli_main_reports_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nnodes", "1", "--inject", "machine=3,iteration=0", "t.py"]) == 2
    assert "ds-swift-launch: error: --inject" in capsys.readouterr().err


# ---------------------------------------------------------------------- worker argv and env
def test_worker_argv_like_the_deepspeed_launcher() -> None:
    from ds_swift.launch.spawn import worker_argv

    assert worker_argv(Command("t.py", ("--x", "1")), 3, python="py") == [
        "py",
        "-u",
        "t.py",
        "--local_rank=3",
        "--x",
        "1",
    ]
    assert worker_argv(Command("t.py", local_rank_arg=False), 3, python="py") == ["py", "-u", "t.py"]
    assert worker_argv(Command("pkg.t", module=True), 0, python="py") == ["py", "-u", "-m", "pkg.t", "--local_rank=0"]
    assert worker_argv(Command("./t.sh", no_python=True, local_rank_arg=False), 0) == ["./t.sh"]


def _wenv(**kw: object):  # noqa: ANN202
    from ds_swift.jobstore.membership import WorkerEnv

    base = dict(
        rank=5,
        local_rank=1,
        world_size=8,
        machine=2,
        num_machines=4,
        generation=3,
        replacement=True,
        store_addr="10.0.0.1",
        store_port=4242,
        token="tok",
        run_dir="/r",
        inject="machine=2,iteration=1,phase=forward",
    )
    base.update(kw)
    return WorkerEnv(**base)  # type: ignore[arg-type]


def test_worker_environ() -> None:
    from ds_swift.launch.spawn import worker_environ

    env = worker_environ(_wenv(), nproc_per_node=2, op_timeout_s=7.5, base={"PATH": "/bin", "SWIFT_OP_TIMEOUT_S": "1"})
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("5", "1", "8", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "4242")
    assert (env["SWIFT_GENERATION"], env["SWIFT_REPLACEMENT"], env["SWIFT_MACHINE"]) == ("3", "1", "2")
    assert env["SWIFT_JOB_TOKEN"] == "tok" and env["SWIFT_OP_TIMEOUT_S"] == "7.5"
    assert env["SWIFT_INJECT"] == "machine=2,iteration=1,phase=forward"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # env:// init connects to the agent's store
    env = worker_environ(_wenv(), nproc_per_node=2, base={"OMP_NUM_THREADS": "4", "SWIFT_OP_TIMEOUT_S": "1"})
    assert env["OMP_NUM_THREADS"] == "4"  # the user's explicit choice wins
    assert "SWIFT_OP_TIMEOUT_S" not in env  # a stale outer value must not leak into this job


def test_describe_exit() -> None:
    from ds_swift.launch.spawn import describe_exit

    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"


def test_parsing_the_command_line_and_starting_the_fork_server_import_no_torch() -> None:
    """``ds-swift-launch --help`` and usage errors are instant, and the fork server (which imports
    torch and DeepSpeed) is started before the launcher imports torch for its job store: the two
    imports overlap. Both need these modules torch-free."""
    code = (
        "import sys, ds_swift.launch.args, ds_swift.launch.fork_client, ds_swift.launch.cli; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print(bad[:5]); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
