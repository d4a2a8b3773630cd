"""What the API takes for its client gone: only the client's own connection failing (its
request's bytes not arriving, its answer not taken). An OSError of the same type raised by the
work of a request (a pipe or a store's connection the daemon's code uses) is that request's
failure: answered as an error and logged.

The API server runs in this process over a Unix socket, in front of a stand-in for the daemon
(the :class:`~cachepipe.service.http.Service` it is given), whose routes fail with errors the
operating system raised: a write to a pipe whose reader has gone, a read on a connection its
peer reset.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachepipe.service.api import ApiServer
from cachepipe.service.config import ServiceConfig
from cachepipe.service.metrics import Metrics


def broken_pipe() -> None:
    """Write to a pipe whose read end is closed: the kernel's EPIPE, a BrokenPipeError."""
    read, write = os.pipe()
    os.close(read)
    try:
        os.write(write, b"x")
    finally:
        os.close(write)


def connection_reset() -> None:
    """Read from a TCP connection its peer reset (closed with SO_LINGER 0): ECONNRESET."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as ours:
            theirs, _ = listener.accept()
            theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            theirs.close()
            ours.recv(1)


class Failing:
    """A daemon whose job routes fail with ``fault`` (a function raising an OS error)."""

    def __init__(self, fault: Any) -> None:
        self.metrics = Metrics(list)
        self.fault = fault

    @property
    def running(self) -> bool:
        return True

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "ok"}

    def register_job(self, name: str, spec: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        self.fault()
        return True, {"job": name}

    def take_lane(self, *args: Any, **kwargs: Any) -> list[Any]:
        self.fault()
        return []


@pytest.fixture
def serve(short_dir: Path, tmp_path: Path) -> Iterator[Any]:
    servers: list[ApiServer] = []

    def start(daemon: Failing) -> Path:
        sock = short_dir / "api.sock"
        pipeline = {"source": str(tmp_path / "src"), "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB"}
        config = ServiceConfig(socket=sock, pipelines={"p": pipeline}, markers=False)
        api = ApiServer(daemon, config)
        servers.append(api)
        api.bind()
        api.serve()
        api.publish()
        return sock

    yield start
    for api in servers:
        api.close()


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self._path))


def ask(sock: Path, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = _Unix(sock)
    try:
        conn.request(method, path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("fault", [broken_pipe, connection_reset], ids=["broken-pipe", "connection-reset"])
@pytest.mark.parametrize(
    ("method", "route", "body"),
    [
        ("PUT", "/v1/jobs/train", {"source": "s3://data/", "world_size": 1, "ranks": [0]}),
        ("POST", "/v1/jobs/train/take", {"rank": 0, "worker": 0, "epoch": 0, "index": 0}),
    ],
    ids=["register", "take"],
)
def test_a_pipe_or_connection_failing_under_a_request_is_answered_and_logged_not_taken_for_the_client_gone(
    serve, caplog, fault, method, route, body
):
    """Before, the handler took any BrokenPipeError or ConnectionResetError out of a route for
    its client gone: the connection was closed without an answer and nothing was logged, so the
    client saw the daemon drop it (a lane asked again, and again) and the operator saw nothing.
    Now only the client's own connection failing is that; this is a 500, logged with its
    traceback."""
    sock = serve(Failing(fault))
    with caplog.at_level(logging.ERROR, logger="cachepipe.service.api"):
        status, answer = ask(sock, method, route, body)  # before: http.client.RemoteDisconnected
    assert status == 500 and answer["error"] == "internal"
    expected = "Broken pipe" if fault is broken_pipe else "Connection reset by peer"
    assert expected in answer["message"]
    failed = [r for r in caplog.records if r.getMessage() == f"{method} {route} failed"]
    assert len(failed) == 1 and failed[0].exc_info is not None
