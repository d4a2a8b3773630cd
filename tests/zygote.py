"""A fork server for a test's child processes: it imports once, then forks a child per run.

A test that starts a child process per run (a soak killing its consumer over and over) spends most
of each run's start in imports: cachepipe, and s3fs with its HTTP stack, about a second of CPU.
:class:`Zygote` starts one process (this file run as a script) that imports the child's module
and the backend of a URL once, then forks a child for each :meth:`Zygote.spawn`; the child runs
``module.main(cfg)`` with its stdin, stdout and stderr on pipes of the test's, and exits with
what it returns, as the module run as a script would. :class:`Forked` stands for it as a
:class:`subprocess.Popen` does (``stdin``, ``stdout``, ``stderr``, ``pid``, ``kill``, ``wait``,
``poll``, ``communicate``): SIGKILL reaches it through a pidfd (no pid reuse), its exit status
comes from the zygote, which reaps it.

The zygote forks with one thread and nothing started (no event loop, no connection): a child is
a fresh consumer process whose modules are already imported.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

MESSAGE = 1 << 16


class Zygote:
    """The fork server for ``module`` (importable from tests/, with ``main(cfg) -> int``); ``url``:
    the backend it serves is imported too (:func:`cachepipe.stores.preload`). A context manager;
    closing it ends the zygote (a child still running is the caller's to kill first)."""

    def __init__(self, module: str, url: str = "", env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, module, url, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        self._sock = ours
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()  # the zygote reads the end of its requests and exits
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def spawn(
        self, cfg: dict[str, Any], stdin: IO[Any] | None = None, stdout: IO[Any] | None = None, stderr: IO[Any] | None = None
    ) -> Forked:
        """Fork a child that runs ``main(cfg)``, its stdin, stdout and stderr on the files given,
        else on pipes (:attr:`Forked.stdin`, :attr:`Forked.stdout`, :attr:`Forked.stderr`)."""
        stdin_r, stdin_w = os.pipe() if stdin is None else (os.dup(stdin.fileno()), -1)
        (stdout_r, stdout_w), (stderr_r, stderr_w) = _output(stdout), _output(stderr)
        theirs = [stdin_r, stdout_w, stderr_w]
        try:
            with self._lock:
                socket.send_fds(self._sock, [json.dumps(cfg).encode()], theirs)
                pid, pidfd = self._receive_started()
        finally:
            for fd in theirs:
                os.close(fd)
        return Forked(
            self,
            pid,
            pidfd,
            None if stdin_w < 0 else open(stdin_w, "w"),  # closed by the caller, as Popen's are
            None if stdout_r < 0 else open(stdout_r),
            None if stderr_r < 0 else open(stderr_r),
        )

    def _receive_started(self) -> tuple[int, int]:
        while True:
            message, fds = self._receive(None)
            words = message.split()
            if words[0] == "started":
                return int(words[1]), fds[0]

    def _receive(self, timeout: float | None) -> tuple[str, list[int]]:
        """One message of the zygote's: "started PID" (with the child's pidfd) or "exited PID CODE",
        which is noted; raises TimeoutError after ``timeout`` s, EOFError if the zygote is gone."""
        if not select.select([self._sock], [], [], timeout)[0]:
            raise TimeoutError(f"no word from the zygote in {timeout} s")
        data, fds, _flags, _addr = socket.recv_fds(self._sock, MESSAGE, 1)
        if not data:
            raise EOFError(f"the zygote is gone (exit status {self.proc.poll()})")
        message = data.decode()
        words = message.split()
        if words[0] == "exited":
            self._exits[int(words[1])] = int(words[2])
        return message, fds

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        """The exit status of child ``pid``, waiting up to ``timeout`` s for it (0: not at all);
        None if it has not exited by then."""
        with self._lock:
            while pid not in self._exits:
                try:
                    self._receive(timeout)
                except TimeoutError:
                    return None
            return self._exits[pid]


def _output(given: IO[Any] | None) -> tuple[int, int]:
    """(the test's end, the child's) of where a child writes: a new pipe, or a copy of the
    descriptor of the file ``given`` (the test's end: -1)."""
    if given is None:
        return os.pipe()
    return -1, os.dup(given.fileno())


class Forked:
    """A child forked by a :class:`Zygote`, used as a :class:`subprocess.Popen` (text mode)."""

    def __init__(
        self, zygote: Zygote, pid: int, pidfd: int, stdin: IO[str] | None, stdout: IO[str] | None, stderr: IO[str] | None
    ) -> None:
        self._zygote = zygote
        self.pid = pid
        self._pidfd = pidfd
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return  # reaped (its pidfd is closed)
        with contextlib.suppress(ProcessLookupError):  # it has exited, not yet reaped
            signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """As :meth:`subprocess.Popen.communicate` with no input: close stdin, read stdout and
        stderr (those on pipes) to their end, wait for the exit; ``(stdout, stderr)``. Raises
        :class:`subprocess.TimeoutExpired` after ``timeout`` s (the child is left running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None:
            self.stdin.close()
        got: dict[int, list[bytes]] = {f.fileno(): [] for f in (self.stdout, self.stderr) if f is not None and not f.closed}
        open_fds = list(got)
        while open_fds:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(open_fds, [], [], left)[0]
            if not ready:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    got[fd].append(chunk)
                else:
                    open_fds.remove(fd)
        out = [
            b"".join(got.get(f.fileno(), [])).decode() if f is not None and not f.closed else ""
            for f in (self.stdout, self.stderr)
        ]
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out[0], out[1]

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_status(self.pid, timeout)
            if self.returncode is not None:
                os.close(self._pidfd)
        return self.returncode

    def __del__(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)


# ---- the zygote's side ------------------------------------------------------------------
def serve(sock: socket.socket, main: Any) -> None:
    """Fork a child per request until the test closes its end; reap them and report each exit."""
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        ready = select.select([sock, *children], [], [])[0]
        for fd in ready:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _pid, status = os.waitpid(pid, 0)
                sock.send(f"exited {pid} {os.waitstatus_to_exitcode(status)}".encode())
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE, 3)
            if not data:
                return
            pid = os.fork()
            if pid == 0:
                _child(sock, [*children], fds, json.loads(data), main)
            for passed in fds:
                os.close(passed)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            socket.send_fds(sock, [f"started {pid}".encode()], [pidfd])


def _child(sock: socket.socket, siblings: list[int], fds: list[int], cfg: dict[str, Any], main: Any) -> None:
    """In the forked child: stdin, stdout and stderr on the test's pipes, then ``main(cfg)``; exits
    with what it returns (an exception: its traceback on stderr, status 1)."""
    sock.close()
    for fd in siblings:
        os.close(fd)
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    raise SystemExit(main(cfg))


if __name__ == "__main__":
    module, url, fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path.insert(0, str(Path(__file__).parent))
    main = importlib.import_module(module).main
    if url:
        from cachepipe.stores import preload

        preload(url)
    assert threading.active_count() == 1, threading.enumerate()  # a fork copies no other thread
    serve(socket.socket(fileno=fd), main)
