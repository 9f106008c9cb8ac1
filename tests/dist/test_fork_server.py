"""``ds-swift-launch --fork-server`` (launch/fork_client.py, ds_swift/runtime/forkserver.py): workers
forked from one pre-imported interpreter behave as the agent expects of a worker process: each runs
the script as ``__main__`` with its own arguments and whole environment (nothing of the server's
left over), in a process group of its own (the agent kills a machine with ``killpg``), stdin at
/dev/null, and its exit code, or the signal that killed it, comes back as ``Popen`` gives it. A warm
spare's worker is forked too, and runs the script once its agent hands it a rank. All of it whether
the server is started by its launcher or forked by the session's zygote (tests/dist/conftest.py), which
also forks a module as ``python -m`` would run it (a harness's launcher), with the exit code back."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ds_swift.jobstore.worker_env import WorkerEnv
from ds_swift.launch.args import Command
from ds_swift.launch.fork_client import ZYGOTE_ENV, ForkServer, ZygoteChild
from ds_swift.launch.spawn import assign_warm
from ds_swift.runtime.forkserver import _fork_unsafe

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    out = os.environ["FS_OUT"] + "." + os.environ["RANK"]
    info = {"name": __name__, "argv": sys.argv, "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
            "stdin": sys.stdin.read(), "leftover": os.environ.get("FS_SERVER_ONLY"), "rank": os.environ["RANK"],
            "torch": "torch" in sys.modules}
    with open(out + ".tmp", "w") as f:
        json.dump(info, f)
    os.rename(out + ".tmp", out)
    if os.environ["RANK"] == "1":
        time.sleep(60)  # killed by the test
    sys.exit(int(os.environ["RANK"]) + 3)
    """
)


def wenv(rank: int) -> WorkerEnv:
    return WorkerEnv(
        rank=rank,
        local_rank=rank,
        world_size=2,
        machine=0,
        num_machines=1,
        generation=0,
        replacement=False,
        store_addr="127.0.0.1",
        store_port=1,
        token="t",
        run_dir="",
        inject="",
    )


def wait_for(path: Path, timeout_s: float = 60.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)
    return json.loads(path.read_text())


def zygote() -> str:
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        pytest.skip(f"no session zygote ({ZYGOTE_ENV} unset: SWIFT_TEST_ZYGOTE=0 or SWIFT_TEST_FORK_SERVER=0)")
    return path


@pytest.mark.parametrize("zygote_forked", [True, False], ids=["zygote", "started"])
def test_forked_workers_get_their_own_args_environment_group_and_exit_code(tmp_path: Path, zygote_forked: bool) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = Command(str(script), ("--flag", "x"))
    env = {**os.environ, "FS_SERVER_ONLY": "1"}
    env.pop(ZYGOTE_ENV, None)
    server = ForkServer(command, base_env={**env, ZYGOTE_ENV: zygote()} if zygote_forked else env)
    workers = []
    try:
        server.wait_ready()  # what the launcher does before its agents' first tick
        base = {**os.environ, "FS_OUT": str(tmp_path / "out")}
        workers += [server.spawn(command, wenv(r), 2, None, base_env=base) for r in (0, 1)]
        infos = [wait_for(tmp_path / f"out.{r}") for r in (0, 1)]
        for r, (w, info) in enumerate(zip(workers, infos, strict=True)):
            assert info["name"] == "__main__" and info["argv"] == [str(script), f"--local_rank={r}", "--flag", "x"]
            assert info["pid"] == w.pid == info["pgid"] == info["sid"] != os.getpid(), info
            assert info["stdin"] == "" and info["leftover"] is None and info["rank"] == str(r), info
            assert info["torch"], "the server imports torch once, before it forks"
        deadline = time.monotonic() + 60
        while workers[0].poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert workers[0].poll() == 3 and workers[1].poll() is None
        workers[1].signal_group(signal.SIGKILL)
        while workers[1].poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert workers[1].poll() == -signal.SIGKILL
        # A warm spare's worker (local rank 1) waits for its assignment, then is rank 2's worker.
        warm = server.spawn_warm(command, 1, 2, base_env=base)
        assert warm.poll() is None and not (tmp_path / "out.2").exists()
        worker = assign_warm(warm, wenv(2), 2, None, base_env=base)
        assert worker is not None
        workers.append(worker)
        info = wait_for(tmp_path / "out.2")
        assert info["argv"] == [str(script), "--local_rank=1", "--flag", "x"] and info["rank"] == "2", info
        assert info["pid"] == warm.pid == info["pgid"] and info["stdin"] == "" and info["leftover"] is None, info
        while worker.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert worker.poll() == 5
    finally:
        for w in workers:
            w.signal_group(signal.SIGKILL)
        server.close()
    assert server.proc is not None and server.proc.returncode == 0
    assert isinstance(server.proc, ZygoteChild) == zygote_forked


MODULE = textwrap.dedent(
    """
    import json, os, sys
    json.dump({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("ZY_ONLY"),
               "sid": os.getsid(0), "pid": os.getpid(), "torch": "torch" in sys.modules}, sys.stdout)
    sys.stdout.flush()
    if sys.argv[1] == "sleep":
        import time
        time.sleep(60)  # killed by the test
    sys.exit(int(sys.argv[1]))
    """
)


def test_the_zygote_forks_a_module_as_python_m_with_its_exit_code(tmp_path: Path) -> None:
    path = zygote()
    (tmp_path / "zy_module.py").write_text(MODULE)
    env = {**os.environ, "ZY_ONLY": "yes", "PYTHONPATH": str(tmp_path)}
    children = []
    try:
        for arg in ("7", "sleep"):
            with open(tmp_path / f"out.{arg}", "wb") as out:
                children.append(
                    ZygoteChild.fork(path, [arg], env, (out.fileno(), out.fileno()), "zy_module", str(tmp_path))
                )
        ended, sleeping = children
        assert ended.wait(timeout=60) == 7
        info = json.loads((tmp_path / "out.7").read_text())
        assert info == {
            "name": "__main__", "argv": ["7"], "cwd": str(tmp_path), "env": "yes",
            "sid": ended.pid, "pid": ended.pid, "torch": True,
        }, info  # fmt: skip  # one expected record, as the child wrote it
        assert sleeping.poll() is None
        sleeping.kill()
        assert sleeping.wait(timeout=60) == -signal.SIGKILL
    finally:
        for child in children:
            child.kill()


def test_a_server_with_a_thread_refuses_to_fork() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        assert "started a thread" in str(_fork_unsafe())
    finally:
        stop.set()
        thread.join()
