"""ds_swift.exit_process: the atexit handlers run, open files are flushed, the code is kept."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_files_are_flushed_and_atexit_handlers_run_and_the_code_is_kept(tmp_path: Path) -> None:
    done = _run(
        tmp_path,
        """
        import atexit, ds_swift
        import torch.distributed  # its deprecated reduce_op warns on any attribute read
        log = open("log.txt", "w")  # never closed: its buffer holds the line
        log.write("last line\\n")
        atexit.register(lambda: open("atexit.txt", "w").write("ran"))
        print("to stdout", end="")
        ds_swift.exit_process(3)
        """,
    )
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "log.txt").read_text() == "last line\n"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert done.stdout == "to stdout"
    assert "Warning" not in done.stderr, done.stderr  # nothing said on the way out


def test_a_running_non_daemon_thread_gets_a_normal_exit(tmp_path: Path) -> None:
    done = _run(
        tmp_path,
        """
        import threading, time, ds_swift
        def work():
            time.sleep(0.5)
            open("thread.txt", "w").write("finished")
        threading.Thread(target=work).start()
        ds_swift.exit_process(None)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "thread.txt").read_text() == "finished"
