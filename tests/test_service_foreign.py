"""The daemon as a consumer in another language meets it: raw HTTP over its Unix socket, not
cachepipe's own client (a Go or C++ trainer, curl in a shell script), with the mistakes and the
deaths such clients have.

The daemon runs as a real subprocess over a local source; waits are on events (an answer, a
refusal, a process exit) with deadlines.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import yaml

from cachepipe.service.testing import DaemonProcess


def folders_config(tmp_path: Path, sock: Path, count: int, **top) -> Path:
    """A daemon's config over a local source of ``count`` one-file folders."""
    src = tmp_path / "src"
    for i in range(count):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "a.bin").write_bytes(bytes(100))
    train = {"source": f"{src}/", "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB"}
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump({"socket": str(sock), **top, "pipelines": {"train": train}}))
    return path


def connect(sock: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)  # a bound on the test's own waits, not a timed assertion
    conn.connect(str(sock))
    return conn


def send(conn: socket.socket, method: str, route: str, body: dict | None = None) -> None:
    data = b"" if body is None else json.dumps(body).encode()
    head = b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (method.encode(), route.encode(), len(data))
    conn.sendall(head + data)


def answer(conn: socket.socket) -> tuple[int, dict]:
    """Read one answer: (status, JSON body); (0, {}) if the connection ended without one."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = conn.recv(65536)
        if not chunk:
            return (0, {}) if not got else (-1, {"unparsed": got.decode("latin-1")})
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = re.search(rb"\r\nContent-Length: (\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = conn.recv(65536)
        assert chunk, got
        body += chunk
    return int(head.split()[1]), json.loads(body) if body else {}


def ask(sock: Path, method: str, route: str, body: dict | None = None) -> tuple[int, dict]:
    with connect(sock) as conn:
        send(conn, method, route, body)
        return answer(conn)


def test_a_request_line_over_the_limit_is_answered_431_naming_it(tmp_path, short_dir):
    # A request line over 64 KiB raised out of the connection's handler: the client got its
    # connection closed without an answer, and the daemon logged an ERROR with a traceback.
    sock = short_dir / "api.sock"
    config = folders_config(tmp_path, sock, 1)
    with DaemonProcess(config) as daemon, connect(sock) as conn:
        conn.sendall(b"GET /v1/" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, body = answer(conn)
        assert status == 431, (status, body)
        assert body == {
            "error": "request_header_fields_too_large",
            "message": "request line over 65536 bytes: expected a method, a path and HTTP/1.1",
        }
        assert ask(sock, "GET", "/v1/health")[0] == 200
        assert "Traceback" not in daemon.log(), daemon.log()
