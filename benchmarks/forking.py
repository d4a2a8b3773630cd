"""A fork server for a benchmark's measuring processes: it imports once, then forks a child per measurement.

A measuring process started afresh spends a second or more importing (s3fs and its HTTP stack,
cachepipe) before its clock starts; a smoke run of twenty tiny measurements spends most of its
time there. :class:`ForkServer` starts one process (the benchmark script run with an option that
makes it call :func:`serve`) that has done those imports, and forks a child of it for each
:meth:`ForkServer.spawn`. The child runs ``run(spec)`` with its stdout and stderr on pipes of the
caller's, in a session of its own, bound to die with the server (which dies with the caller).
:class:`Forked` stands for it as a :class:`subprocess.Popen` does for what a measurement uses
(``pid``, ``returncode``, ``poll``, ``wait``, ``communicate``; :func:`netlink.stop_child` stops
its process group).

What differs from a fresh process: its peak RSS (VmHWM) starts from the pages it inherits
resident, not from all the pages its imports touched (about 20 MB less here, for cachepipe and
s3fs). CPU seconds are counted from the fork, as a fresh process counts them from its start.

The server forks with one thread and nothing started (no event loop, no connection). Requests
are served one at a time: the server waits for a child before it reads the next request.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from netlink import start_child, stop_child

MESSAGE = 1 << 16
READY_TIMEOUT = 120.0


class ForkServer:
    """The fork server started by ``argv + [fd]`` (the caller's script, with the option that makes
    it call :func:`serve` with ``fd``). Call it while this process runs no other thread
    (:func:`netlink.start_child`). :meth:`close` ends it."""

    def __init__(self, argv: Sequence[str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = start_child(
                [*argv, str(theirs.fileno())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
            )
        self.sock = ours
        try:
            if _receive(self.sock, READY_TIMEOUT) != "ready":
                raise RuntimeError("the fork server exited before it was ready")
        except BaseException:
            self.close()
            raise

    def spawn(self, spec: dict[str, Any]) -> Forked:
        """Fork a child that runs ``run(spec)``; its stdout and stderr are read by :class:`Forked`."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            socket.send_fds(self.sock, [json.dumps(spec).encode()], [out_w, err_w])
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        started = _receive(self.sock, 30.0)
        if not started.startswith("pid "):
            os.close(out_r)
            os.close(err_r)
            raise RuntimeError(f"the fork server did not start a child: {started!r}")
        return Forked(self, int(started.split()[1]), out_r, err_r)

    def close(self) -> None:
        self.sock.close()  # the server reads the end of its requests and exits
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            stop_child(self.proc)


class Forked:
    """A child of a :class:`ForkServer`, as much of a :class:`subprocess.Popen` (text mode) as a measurement uses."""

    def __init__(self, server: ForkServer, pid: int, out_fd: int, err_fd: int) -> None:
        self.pid = pid
        self.args = f"forked child {pid}"
        self.returncode: int | None = None
        self._server = server
        self._chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
        self._out_fd, self._err_fd = out_fd, err_fd
        self._open = {out_fd, err_fd}

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, as the server reaped it (negative: the signal that ended it)."""
        if self.returncode is None:
            message = _receive(self._server.sock, timeout, self.args)
            if not message.startswith("exit "):
                raise RuntimeError(f"the fork server did not report {self.args}'s exit: {message!r}")
            self.returncode = int(message.split()[1])
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read its stdout and stderr to their end and wait for it; after a
        :class:`subprocess.TimeoutExpired`, a later call goes on where it stopped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(list(self._open), [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            for fd in ready:
                data = os.read(fd, MESSAGE)
                if data:
                    self._chunks[fd].append(data)
                else:
                    self._open.discard(fd)
                    os.close(fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple(b"".join(self._chunks[fd]).decode(errors="replace") for fd in (self._out_fd, self._err_fd))  # type: ignore[return-value]


def _receive(sock: socket.socket, timeout: float | None, what: str = "the fork server") -> str:
    ready, _, _ = select.select([sock], [], [], timeout)
    if not ready:
        raise subprocess.TimeoutExpired(what, timeout or 0)
    return sock.recv(MESSAGE).decode()


def serve(fd: int, run: Callable[[dict[str, Any]], None]) -> None:
    """The server's loop on the socket ``fd``: for each request, fork a child that runs
    ``run(spec)`` (its stdout and stderr on the two descriptors sent with the request, stdin on
    /dev/null, a session of its own), report its pid, wait for it and report its exit status.
    Returns when the caller closes its end."""
    from netlink import _die_with_parent

    with socket.socket(fileno=fd) as sock:
        sock.send(b"ready")
        while True:
            try:
                message, fds, _flags, _address = socket.recv_fds(sock, MESSAGE, 2)
            except OSError:
                return
            if not message:
                return
            pid = os.fork()
            if pid == 0:  # the child: never returns
                code = 1
                try:
                    os.setsid()
                    _die_with_parent()
                    os.dup2(fds[0], 1)
                    os.dup2(fds[1], 2)
                    nothing = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(nothing, 0)
                    for used in (*fds, nothing):
                        os.close(used)
                    sock.close()
                    run(json.loads(message))
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:  # noqa: BLE001 - printed, as a fresh process would print it
                    traceback.print_exc()
                finally:
                    with contextlib.suppress(BaseException):
                        sys.stdout.flush()
                        sys.stderr.flush()
                    os._exit(code)
            for used in fds:
                os.close(used)
            sock.send(f"pid {pid}".encode())
            _, status = os.waitpid(pid, 0)
            sock.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
