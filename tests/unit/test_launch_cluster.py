"""SLURM node lists and environment, pdsh/ssh host selection, store URLs, agent liveness (no processes)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ds_swift.jobstore.url import StoreURL, parse_endpoints
from ds_swift.launch.args import Command, LaunchUsageError, parse_args
from ds_swift.launch.hostfile import HostEntry, filter_resources
from ds_swift.launch.remote import (
    agent_argv,
    agent_command,
    deepspeed_env,
    render,
    visible_devices_case,
    write_env_file,
)
from ds_swift.launch.slurm import SlurmStep, expand_nodelist, in_slurm_step


# ---------------------------------------------------------------------- node lists
@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5", ["gpu5"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("dgx-[1,3]-ib", ["dgx-1-ib", "dgx-3-ib"]),
        ("127.0.0.[2-4]", ["127.0.0.2", "127.0.0.3", "127.0.0.4"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node]1[", "node[a-b]", "node[3-1]"])
def test_bad_nodelists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(bad)


def slurm(nodelist: str = "node[01-03]", nodeid: int = 1, **extra: str) -> dict[str, str]:
    n = str(len(expand_nodelist(nodelist)))
    return {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": str(nodeid),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_NNODES": n,
        "SLURM_NTASKS": n,
        "SWIFT_JOB_SECRET": "k" * 32,
        **extra,
    }


def test_slurm_step_from_the_environment() -> None:
    step = SlurmStep.from_env(slurm())
    assert step.node_rank == 1 and step.hosts == ("node01", "node02", "node03") and step.job_id == "77"
    batch_script = {k: v for k, v in slurm().items() if not k.startswith("SLURM_STEP")}
    assert in_slurm_step(slurm()) and not in_slurm_step(batch_script)
    with pytest.raises(ValueError, match="ntasks-per-node=1"):
        SlurmStep.from_env(slurm(SLURM_NTASKS="24"))


def test_srun_task_becomes_a_node_agent_and_extra_nodes_are_spares() -> None:
    args = parse_args(["--nnodes", "2", "--nproc-per-node", "8", "train.py"], environ=slurm(nodeid=2))
    assert args.launcher == "slurm" and args.node_rank == 2 and args.nnodes == 2 and args.spares == 1
    assert args.master_addr == "node01" and args.master_port == 29500 and args.job_id == "77"
    assert args.job_token == "slurm-77.0"  # the same on every task, unique per job step
    # Without --nnodes every node trains; SWIFT_JOB_TOKEN wins over the derived token.
    args = parse_args(["train.py"], environ=slurm(nodeid=0, SWIFT_JOB_TOKEN="secret"))
    assert args.nnodes == 3 and args.spares == 0 and args.job_token == "secret"
    args = parse_args(["--spares", "1", "train.py"], environ=slurm(nodeid=0))
    assert (args.nnodes, args.spares) == (2, 1)
    with pytest.raises(LaunchUsageError, match="leaves 1 spares"):
        parse_args(["--nnodes", "2", "--spares", "0", "train.py"], environ=slurm())
    with pytest.raises(LaunchUsageError, match="does not fit"):
        parse_args(["--nnodes", "4", "train.py"], environ=slurm())
    assert args.job_secret == "k" * 32
    with pytest.raises(LaunchUsageError, match="export SWIFT_JOB_SECRET="):
        parse_args(["train.py"], environ={k: v for k, v in slurm().items() if k != "SWIFT_JOB_SECRET"})
    # --launcher local turns the detection off: one simulated job on this node.
    assert parse_args(["--launcher", "local", "train.py"], environ=slurm()).node_rank is None


def test_store_urls() -> None:
    assert StoreURL.parse("etcd://h1:2379,h2").endpoints == (("h1", 2379), ("h2", 2379))
    assert str(StoreURL.parse("tcp://launch:29400")) == "tcp://launch:29400"
    assert parse_endpoints("a:1,b:2") == [("a", 1), ("b", 2)]
    for bad in ("redis://x:1", "tcp://host", "etcd://", "h1:2379"):
        with pytest.raises(ValueError):
            StoreURL.parse(bad)
    with pytest.raises(LaunchUsageError, match="--store"):
        parse_args(["--store", "tcp://nohost", "t.py"], environ={})
    assert parse_args(["--store", "etcd://e1:2379,e2:2379", "t.py"], environ={}).store_url == "etcd://e1:2379,e2:2379"


# ---------------------------------------------------------------------- pdsh / ssh
HOSTS = (HostEntry("w0", 4), HostEntry("w1", 4), HostEntry("w2", 4))


def test_include_exclude_like_deepspeed() -> None:
    assert filter_resources(HOSTS, None, None) == [("w0", [0, 1, 2, 3]), ("w1", [0, 1, 2, 3]), ("w2", [0, 1, 2, 3])]
    assert filter_resources(HOSTS, "w2@w0:0,2", None) == [("w0", [0, 2]), ("w2", [0, 1, 2, 3])]
    assert filter_resources(HOSTS, None, "w1@w2:3") == [("w0", [0, 1, 2, 3]), ("w2", [0, 1, 2])]
    for include, exclude, msg in [
        ("w9", None, "not in the hostfile"),
        ("w0:7", None, "slots 0..3"),
        ("w0", "w1", "exclude each other"),
        (None, "w0@w1@w2", "leave no host"),
    ]:
        with pytest.raises(ValueError, match=msg):
            filter_resources(HOSTS, include, exclude)


def test_pdsh_arguments(tmp_path: Path) -> None:
    hf = tmp_path / "hostfile"
    hf.write_text("w0 slots=4\nw1 slots=4\nw2 slots=4\n")
    args = parse_args(
        [
            "--hostfile",
            str(hf),
            "--launcher",
            "pdsh",
            "--include",
            "w0:1,3@w2:0,1",
            "--spares",
            "0",
            "--inject",
            "machine=1,iteration=2",
            "t.py",
            "--lr",
            "1",
        ],
        environ={},
    )
    assert args.agent_hosts == ("w0", "w2") and args.agent_slots == ((1, 3), (0, 1))
    assert args.nnodes == 2 and args.nproc_per_node == 2 and args.node_rank is None
    secret_file = tmp_path / "job.secret"
    secret_file.write_text("s" * 32)
    secret_file.chmod(0o600)
    argv = agent_argv(args, "tcp://launch:1234", "tok", str(secret_file))
    assert argv[-3:] == ["t.py", "--lr", "1"]
    assert args.job_secret not in " ".join(argv)  # the secret never goes on a command line
    assert argv[argv.index("--agent-hosts") + 1] == "w0,w2" and "--node-host" not in argv  # agent_command's slot
    assert "--inject" in argv and argv[argv.index("--store") + 1] == "tcp://launch:1234"
    # w0 keeps GPUs 1,3; w2's 0,1 are the default and need nothing.
    assert render(visible_devices_case(args), None) == "case %h in w0) export CUDA_VISIBLE_DEVICES=1,3;; esac; "
    # The agent that pdsh starts on w2 finds its rank from its host name.
    agent = parse_args([*argv[: argv.index("t.py")], "--node-host", "w2", "t.py"], environ={})
    assert agent.node_rank == 1 and agent.launcher == "local" and agent.store_url == "tcp://launch:1234"
    assert agent.job_secret == "s" * 32
    with pytest.raises(LaunchUsageError, match="needs --hostfile"):
        parse_args(["--launcher", "ssh", "t.py"], environ={})
    with pytest.raises(LaunchUsageError, match="--include/--exclude"):
        parse_args(["--include", "w0", "t.py"], environ={})


def test_deepspeed_env_file_and_exported_prefixes(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("# comment\nNCCL_IB_HCA=mlx5\nFOO=a b\n")
    env = deepspeed_env(
        {"HOME": str(tmp_path / "nohome"), "NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "OTHER": "1"}, cwd=str(tmp_path)
    )
    assert env == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "NCCL_IB_HCA": "mlx5", "FOO": "a b"}
    write_env_file(str(tmp_path / "agent.env"), env)
    assert "\nexport FOO='a b'\n" in (tmp_path / "agent.env").read_text()
    line = render(agent_command(["t.py"], "/run/agent.env", "/work dir", python="/py"), None)
    assert line.endswith(
        "; cd '/work dir' && . /run/agent.env && exec /py -u -m ds_swift.launch.cli --node-host %h t.py"
    )


# ---------------------------------------------------------------------- a dead agent's machine
def test_a_dead_agents_machine_goes_to_the_spare(tmp_path: Path) -> None:
    from ds_swift.jobstore.membership import JobStore
    from ds_swift.launch.agent import JobSpec, MachineAgent
    from ds_swift.launch.control import EventLog, JobControl
    from ds_swift.launch.liveness import AgentLiveness

    store = JobStore.host("tok", port=0)
    job = JobSpec(Command("t.py"), 2, 1, 1, 3, None, "127.0.0.1", store.port, "tok", str(tmp_path))
    spawned: list[int] = []

    class Fake:
        def __init__(self, wenv) -> None:  # noqa: ANN001
            self.pid, self.rank = 1000 + len(spawned), wenv.rank
            spawned.append(wenv.machine)

        def poll(self) -> int | None:
            return None

        def signal_group(self, sig: int) -> None:
            pass

    events = EventLog(str(tmp_path))
    agents = [MachineAgent(n, job, store, events, spawn=lambda c, w, n, t: Fake(w)) for n in range(3)]
    for a in agents:
        a.start()
    assert store.get("launch/machine_of/0") == "0" and store.get("launch/machine_of/2") == ""
    # Agent 1 watches the others on a clock the test moves: agents 0 and 2 beat once, then stop;
    # agent 2 left normally, agent 0 did not: only agent 0 is dead.
    now = [0.0]
    watch = AgentLiveness(store, [1], 3, timeout_s=5.0, clock=lambda: now[0])
    AgentLiveness(store, [0, 2], 3, timeout_s=5.0).step()
    assert watch.step() == []  # sees their first beats
    now[0] = 3.0
    assert watch.step() == []  # silent for 3 s < 5 s
    AgentLiveness(store, [2], 3, timeout_s=5.0).leave()
    now[0] = 6.0
    assert watch.step() == [0] and watch.silent_for(0) == 6.0
    now[0] = 20.0
    assert watch.step() == []  # reported once
    assert watch.claim(0) and not watch.claim(0)
    agents[1].adopt_lost_machine(0, silent_s=12.0)
    assert store.failure(0) is not None and "its agent 0 is gone" in (store.failure(0) or "")
    assert JobControl(store).request(1) == (0, 0)
    agents[2].poll_store()
    assert agents[2].machine == 0 and spawned == [0, 1, 0]
    assert store.get("launch/machine_of/2") == "0"


# ---------------------------------------------------------------------- what a host sources and keeps
def _run_agent_line(tmp_path: Path, env_file: Path) -> subprocess.CompletedProcess[str]:
    # The host's line as ssh would run it, with /bin/echo in place of python: it shows whether the
    # exports were sourced and the agent started.
    line = render(agent_command(["t.py"], str(env_file), str(tmp_path), python="/bin/echo"), "localhost")
    return subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30)


def test_a_host_sources_the_exports_only_from_a_private_file_of_its_user(tmp_path: Path) -> None:
    env_file = tmp_path / "agent.env"
    write_env_file(str(env_file), {"FOO": "bar"})
    ok = _run_agent_line(tmp_path, env_file)
    assert ok.returncode == 0 and "ds_swift.launch.cli --node-host localhost t.py" in ok.stdout, ok
    # Writable by others (a shared run directory): whatever they put in it would run as this user.
    env_file.chmod(0o666)
    env_file.write_text("echo PWNED\n")
    refused = _run_agent_line(tmp_path, env_file)
    assert refused.returncode == 2 and "PWNED" not in refused.stdout, refused
    assert "is not a mode-0600 file of this user" in refused.stderr, refused.stderr
    # A symlink to a private file is not the file the launcher wrote.
    env_file.unlink()
    real = tmp_path / "elsewhere.env"
    write_env_file(str(real), {"FOO": "bar"})
    env_file.symlink_to(real)
    assert _run_agent_line(tmp_path, env_file).returncode == 2


def test_the_launch_host_deletes_the_secret_and_the_exports_when_its_agents_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ds_swift.launch import remote

    hf = tmp_path / "hostfile"
    hf.write_text("127.0.0.1 slots=1\n")
    run = tmp_path / "run"
    args = parse_args(
        ["--hostfile", str(hf), "--launcher", "ssh", "--master_addr", "127.0.0.1", "--run-dir", str(run), "t.py"],
        environ={},
    )
    seen: list[list[str]] = []

    def start_agents(launcher: str, hosts: object, command: object, env: object = None) -> list[object]:
        seen.append(sorted(p.name for p in run.iterdir()))  # what the agents would read at their start
        return [subprocess.Popen(["true"])]

    monkeypatch.setattr(remote, "start_agents", start_agents)
    assert remote.run_remote(args) == 0
    assert len(seen) == 1 and {"agent.env", "job.secret"} <= set(seen[0]), seen
    assert not (run / "job.secret").exists() and not (run / "agent.env").exists(), sorted(run.iterdir())


def test_a_plain_etcd_store_is_said_to_leave_torchs_keys_unsigned(capsys: pytest.CaptureFixture[str]) -> None:
    parse_args(["--store", "etcd://127.0.0.1:2379", "--nnodes", "1", "t.py"], environ={})
    assert "torch's own rendezvous keys" in capsys.readouterr().err
    parse_args(["--store", "etcd+https://127.0.0.1:2379", "--nnodes", "1", "t.py"], environ={})
    assert "rendezvous keys" not in capsys.readouterr().err
