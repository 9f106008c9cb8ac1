"""The launcher's loop wakes when a worker ends, with ``--fork-server`` too (its workers are the
server's children: no SIGCHLD reaches the launcher, the server's report does)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest

from launch.launcher import Supervisor


class _Reports:
    """A fork server's report pipe, and what pump() read from it."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        self.read = b""

    def reports_fd(self) -> int:
        return self.r

    def pump(self) -> None:
        try:
            while chunk := os.read(self.r, 4096):
                self.read += chunk
        except BlockingIOError:
            pass


@pytest.mark.timeout(60)
def test_a_report_of_the_fork_server_ends_the_loops_pause() -> None:
    server = _Reports()
    loop = SimpleNamespace(server=server, _wake_r=None)
    threading.Timer(0.2, lambda: os.write(server.w, b"exit 123 -9\n")).start()
    Supervisor._sleep(loop, 600.0)  # type: ignore[arg-type]  # a pause of 10 minutes: only the report ends it
    assert server.read == b"exit 123 -9\n"  # read, so that the next pause blocks again


def test_without_a_fork_server_or_a_signal_pipe_the_pause_is_a_sleep() -> None:
    loop = SimpleNamespace(server=None, _wake_r=None)
    Supervisor._sleep(loop, 0.01)  # type: ignore[arg-type]  # a plain sleep: no fd to wait on
