"""``DaemonProcess``: run ``cachepipe serve`` as a subprocess and talk systemd's side of sd_notify.

For tests and benchmarks (ours and users'): the daemon is started with ``NOTIFY_SOCKET`` set
to a datagram socket of this object, so that waiting for readiness, reloads and heartbeats is
waiting for the daemon's own messages (``READY=1``, ``RELOADING=1``, ``WATCHDOG=1``), never
sleeping. The daemon's exit is seen through a pidfd, so a daemon that dies while we wait fails
the wait at once, with its log.

::

    with DaemonProcess("cachepipe.yaml") as daemon:   # returns once READY=1 arrived
        ...
        daemon.stop()                                  # SIGTERM, returns the exit status
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

__all__ = ["DaemonExited", "DaemonProcess"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding this cachepipe package


class DaemonExited(RuntimeError):
    """The daemon exited while we waited for one of its messages."""


class DaemonProcess:
    """A ``cachepipe serve --config CONFIG`` subprocess, running the cachepipe this process
    imported (on Python 3.11+ also when the working directory holds another one).

    Args:
        config: the config file.
        env: variables added to (or, with value None, removed from) this process's environment.
        log_path: where the daemon's stderr goes (default: a temporary file).
        command: the command line (default ``[sys.executable, -m, cachepipe.cli, serve, --config, CONFIG]``).
    """

    def __init__(
        self,
        config: str | os.PathLike[str],
        *,
        env: Mapping[str, str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.config = Path(config)
        self.command = command or [sys.executable, "-m", "cachepipe.cli", "serve", "--config", str(self.config)]
        self._env = dict(env or {})
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_path is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="cachepipe-daemon-")
            log_path = Path(self._tmp.name) / "daemon.log"
        self.log_path = Path(log_path)
        self.messages: list[str] = []  # every sd_notify message received, in order
        self._cursor = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._notify: socket.socket | None = None
        self._pidfd = -1

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> DaemonProcess:
        """Spawn the daemon and wait for READY=1.

        Raises:
            DaemonExited: it exited first (the message holds its log).
            TimeoutError: no READY=1 within ``timeout``.
        """
        name = f"cachepipe-test-{uuid.uuid4().hex}"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        notify.bind("\0" + name)
        self._notify = notify
        env = {
            k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM")
        }
        env["NOTIFY_SOCKET"] = "@" + name
        # The daemon runs the cachepipe this process imported, not one that `python -m` finds first
        # in the working directory (a benchmark run from another checkout): its folder first on
        # the path, and no working directory on it (PYTHONSAFEPATH, Python 3.11+).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        env["PYTHONSAFEPATH"] = "1"
        for key, value in self._env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)  # noqa: S603 - runs our own daemon with arguments built here
        self._pidfd = os.pidfd_open(self.proc.pid)
        try:
            self.wait_for("READY=1", timeout)
        except BaseException:
            self.close()  # the exception carries the log
            raise
        return self

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the daemon if it still runs; release the sockets and temporary files."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if self._notify is not None:
            self._notify.close()
            self._notify = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ---- talking to it ---------------------------------------------------------------
    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"  # noqa: S101 - narrows a type for mypy; not input validation
        return self.proc.pid

    def wait_for(self, line: str, timeout: float = 30.0) -> str:
        """Wait for a notify message with a line starting with ``line`` (after those already
        returned); returns the whole message.

        Raises:
            DaemonExited: the daemon exited first.
            TimeoutError: nothing matched within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            while self._cursor < len(self.messages):
                message = self.messages[self._cursor]
                self._cursor += 1
                if any(part.startswith(line) for part in message.split("\n")):
                    return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no {line!r} from the daemon within {timeout} s; got {self.messages[-5:]}\nlog:\n{self.log()}"
                )
            self._receive(remaining)

    def _receive(self, timeout: float) -> None:
        assert self._notify is not None and self.proc is not None  # noqa: PT018, S101 - one invariant; narrows a type for mypy; not input validation
        ready, _, _ = select.select([self._notify.fileno(), self._pidfd], [], [], timeout)
        if self._notify.fileno() in ready:
            self.messages.append(self._notify.recv(65536).decode())
        elif self._pidfd in ready:
            self._drain()
            if self._cursor < len(self.messages):
                return
            code = self.proc.wait()
            raise DaemonExited(f"the daemon exited with status {code}; log:\n{self.log()}")

    def _drain(self) -> None:
        assert self._notify is not None  # noqa: S101 - narrows a type for mypy; not input validation
        while True:
            try:
                self.messages.append(self._notify.recv(65536, socket.MSG_DONTWAIT).decode())
            except BlockingIOError:
                return

    def signal(self, sig: int) -> None:
        assert self.proc is not None, "not started"  # noqa: S101 - narrows a type for mypy; not input validation
        self.proc.send_signal(sig)

    def reload(self, timeout: float = 30.0) -> str:
        """SIGHUP, then wait for RELOADING=1 and the READY=1 after it; returns that READY message."""
        self.signal(signal.SIGHUP)
        self.wait_for("RELOADING=1", timeout)
        return self.wait_for("READY=1", timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait for the exit; returns the exit status."""
        assert self.proc is not None, "not started"  # noqa: S101 - narrows a type for mypy; not input validation
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
