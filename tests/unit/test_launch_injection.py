"""``--launcher pdsh|ssh`` cannot be injected: what the hostfile, SLURM and ``.deepspeed_env`` say
never becomes a command, ssh never reads a host as an option, ``%h`` fills only the launcher's slot,
and no secret is on a command line (``ps`` shows argv to every user of a host).

``run_remote`` runs for real (it serves the job store on a free loopback port) with ``Popen``
replaced by a recorder; the recorded pdsh/ssh command is then run by ``bash`` the way each host
would run it (pdsh's own ``%`` rules for pdsh), with a stand-in interpreter that records the
agent's argv and environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ds_swift.launch import remote
from ds_swift.launch.args import LaunchUsageError, parse_args
from ds_swift.launch.remote import deepspeed_env

JOB_SECRET = "job-secret-for-the-injection-tests-0123456789"
ENV_SECRET = "hf_env_file_token_42"
HOSTS = ("w0", "w1")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to run the hosts' command")


# ---------------------------------------------------------------------- .deepspeed_env and host names
def test_an_injected_deepspeed_env_name_is_refused_with_its_file_and_line(tmp_path: Path) -> None:
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("# ok\nNCCL_DEBUG=INFO\nFOO;touch /tmp/pwned;BAR=1\n")
    with pytest.raises(
        LaunchUsageError, match=rf"{re.escape(str(env_file))}:3: 'FOO;touch /tmp/pwned;BAR=1' is not KEY"
    ):
        deepspeed_env({"HOME": str(tmp_path / "nohome")}, cwd=str(tmp_path))
    env_file.write_text("NO_EQUALS_SIGN\n")
    with pytest.raises(LaunchUsageError, match=r":1: .*fix or remove that line"):
        deepspeed_env({"HOME": str(tmp_path / "nohome")}, cwd=str(tmp_path))


@pytest.mark.parametrize("launcher", ["pdsh", "ssh"])
@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("-oProxyCommand=touch${IFS}/tmp/pwned", "starts with '-'"),
        ("w1;reboot", "not a host name"),
        ("$(id)", "not a host name"),
        ("w[1-3]", "not a host name"),
        ("fe80::1", "IPv6"),
    ],
)
def test_a_hostfile_host_that_is_not_a_host_name_is_refused_with_its_line(
    tmp_path: Path, launcher: str, host: str, why: str
) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"w0 slots=1\n{host} slots=1\n")
    with pytest.raises(LaunchUsageError, match=rf"--hostfile {re.escape(str(hostfile))}:2: host .*{re.escape(why)}"):
        parse_args(["--hostfile", str(hostfile), "--launcher", launcher, "t.py"], environ={})


def test_a_slurm_node_list_host_that_is_not_a_host_name_is_refused() -> None:
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_NODEID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NODELIST": "n1,-oProxyCommand=x",
    }
    with pytest.raises(LaunchUsageError, match=r"--launcher slurm: the SLURM node list .* starts with '-'"):
        parse_args(["t.py"], environ=env)


# ---------------------------------------------------------------------- what pdsh and ssh are given
class _Recorder:
    """Stands in for subprocess.Popen in launch.remote: records argv, and the exports file as it was
    while the agents started (run_remote removes it once they end)."""

    def __init__(self, env_file: Path) -> None:
        self.env_file = env_file
        self.calls: list[list[str]] = []
        self.env_text: str | None = None

    def __call__(self, argv: list[str], **_: Any) -> _Recorder:
        self.calls.append(list(argv))
        if self.env_file.exists():
            self.env_text = self.env_file.read_text()
        self.returncode = 0
        return self

    def poll(self) -> int:
        return 0

    def wait(self) -> int:
        return 0

    def kill(self) -> None:
        pass


def _launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: str, user_args: list[str], env_text: str = ""
) -> tuple[_Recorder, Path]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    (tmp_path / "t.py").write_text("")
    (tmp_path / ".deepspeed_env").write_text(env_text)
    dump = tmp_path / "dump"
    dump.mkdir()
    # The interpreter each host starts: records its argv and environment, one file per host ($5 is
    # the host: python -u -m ds_swift.launch.cli --node-host HOST ...).
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {dump}/"$5".argv\nenv > {dump}/"$5".env\n')
    fake_python.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SWIFT_JOB_SECRET", JOB_SECRET)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    run_dir = tmp_path / "run"
    recorder = _Recorder(run_dir / "agent.env")
    args = parse_args(
        [
            "--hostfile",
            str(hostfile),
            "--launcher",
            launcher,
            "--master_addr",
            "127.0.0.1",
            "--run-dir",
            str(run_dir),
            "t.py",
            *user_args,
        ]
    )
    with monkeypatch.context() as patched:  # only while run_remote runs: the test starts bash itself
        patched.setattr(remote.subprocess, "Popen", recorder)
        assert remote.run_remote(args) == 0
    return recorder, dump


def _pdsh_expand(command: str, host: str) -> str:
    """What pdsh makes of its command for one host (pdsh src/common/pipecmd.c: %h, %u, %n, %%)."""
    subs = {"h": host, "u": "user", "n": "0", "%": "%"}
    return re.sub(r"%(.)", lambda m: subs.get(m.group(1), m.group(0)), command)


def _host_lines(launcher: str, calls: list[list[str]]) -> dict[str, str]:
    """host -> the shell line that host runs."""
    if launcher == "pdsh":
        (argv,) = calls
        hosts = argv[argv.index("-w") + 1].split(",")
        return {h: _pdsh_expand(argv[-1], h) for h in hosts}
    return {argv[-2]: argv[-1] for argv in calls}


def _agent_argv(line: str) -> list[str]:
    """The agent's arguments in a host's shell line (after ``-m ds_swift.launch.cli``)."""
    words = shlex.split(line)
    return words[words.index("ds_swift.launch.cli") + 1 :]


def _run_hosts(lines: dict[str, str], cwd: Path, env_file: Path, env_text: str | None) -> None:
    assert env_text is not None, "no exports file while the agents started"
    env_file.write_text(env_text)
    env_file.chmod(0o600)  # as the launch host writes it: each host sources only this user's 0600 file
    for line in lines.values():
        done = subprocess.run(
            ["bash", "-c", line], cwd=cwd, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr


def test_ssh_gets_double_dash_before_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder, _ = _launch(tmp_path, monkeypatch, "ssh", [])
    assert len(recorder.calls) == len(HOSTS)
    for argv, host in zip(recorder.calls, HOSTS):
        assert argv[0] == "ssh" and argv[argv.index(host) - 1] == "--", argv
        assert all(not a.startswith("-") for a in argv[argv.index("--") + 1 : -1])


@pytest.mark.parametrize("launcher", ["pdsh", "ssh"])
def test_percent_h_in_a_user_argument_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: str
) -> None:
    user_args = ["--tag=run-%h", "--share=50%", "--who=%u%n", "--lit=%%h"]
    recorder, dump = _launch(tmp_path, monkeypatch, launcher, user_args)
    lines = _host_lines(launcher, recorder.calls)
    assert set(lines) == set(HOSTS)
    for host, line in lines.items():
        agent = _agent_argv(line)
        assert agent[-len(user_args) :] == user_args, agent  # exactly as given, on every host
        assert agent[agent.index("--node-host") + 1] == host  # the launcher's own slot is filled
    _run_hosts(lines, tmp_path, tmp_path / "run" / "agent.env", recorder.env_text)
    for host in HOSTS:  # and that is what each host's agent really gets
        got = (dump / f"{host}.argv").read_text().splitlines()
        assert got[-len(user_args) :] == user_args and got[got.index("--node-host") + 1] == host


@pytest.mark.parametrize("launcher", ["pdsh", "ssh"])
def test_no_secret_on_any_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: str) -> None:
    tricky = 'it\'s $(touch pwned); `id` & "quoted" %h'
    recorder, dump = _launch(
        tmp_path, monkeypatch, launcher, ["--lr", "1"], env_text=f"WANDB_API_KEY={ENV_SECRET}\nTRICKY={tricky}\n"
    )
    lines = _host_lines(launcher, recorder.calls)
    for argv in recorder.calls:  # the launch host's ps: pdsh's / ssh's argv
        assert not any(ENV_SECRET in a or JOB_SECRET in a for a in argv), argv
    for line in lines.values():  # each host's ps: its shell's and its agent's argv
        assert ENV_SECRET not in line and JOB_SECRET not in line, line
    _run_hosts(lines, tmp_path, tmp_path / "run" / "agent.env", recorder.env_text)
    for host in HOSTS:
        assert not any(ENV_SECRET in a or JOB_SECRET in a for a in (dump / f"{host}.argv").read_text().splitlines())
        env = dict(ln.split("=", 1) for ln in (dump / f"{host}.env").read_text().splitlines() if "=" in ln)
        assert env["WANDB_API_KEY"] == ENV_SECRET and env["TRICKY"] == tricky  # delivered, by the file
    assert not (tmp_path / "pwned").exists()


def test_exports_file_is_private_and_a_host_without_it_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder, _ = _launch(tmp_path, monkeypatch, "ssh", [], env_text="A=1\n")
    env_file = tmp_path / "run" / "agent.env"
    assert recorder.env_text is not None and not env_file.exists()  # removed once every agent ended
    line = _host_lines("ssh", recorder.calls)["w0"]
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--run-dir must be a folder every host sees" in done.stderr
    remote.write_env_file(str(env_file), {"A": "1"})
    assert env_file.stat().st_mode & 0o077 == 0
    with pytest.raises(LaunchUsageError, match="not a shell variable name"):
        remote.write_env_file(str(env_file), {"A;id": "1"})
