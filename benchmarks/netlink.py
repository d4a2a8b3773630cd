"""An emulated remote link for the benchmarks: a rate cap and a round-trip delay between a client on
this machine and a server in a network namespace that this module creates.

::

    client (root namespace) --> delay proxy on 127.0.0.1 --> veth pair, tbf rate cap on both ends --> server (netns)
                                (+delay each way)             (egress of each end: both directions capped)

The kernel here has no netem, so the two halves come from different places:

- the **rate**: ``tc qdisc ... tbf`` on both ends of a veth pair whose far end is in a network
  namespace of our own (:class:`Link`, needs root, ``ip`` and ``tc``);
- the **delay**: :func:`serve_proxy`, an asyncio TCP proxy that writes every chunk it reads one
  ``delay`` after it arrived, in both directions, without holding up further reads. A new
  connection's first request is also held one round trip, for the TCP handshake a real link costs.

Every name carries the owner's pid (``cpbench<pid>``, ``cpbh<pid>``/``cpbn<pid>``), so two runs do
not collide, and :func:`remove_stale` can delete what a killed run left behind. Traffic goes only
to 127.0.0.1 and to the /30 inside the namespace (``10.200.0.0/16``).

Standalone::

    python benchmarks/netlink.py selftest [--rate 400mbit] [--rtt-ms 16]   # build, measure, tear down (root)
    python benchmarks/netlink.py proxy --upstream HOST:PORT --delay-ms 8  # only the proxy; prints its port
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import ipaddress
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

NAME_PREFIX = "cpbench"  # netns cpbench<pid>; veth ends cpbh<pid> (root namespace) and cpbn<pid> (in the netns)
SUBNETS = ipaddress.ip_network("10.200.0.0/16")
PROXY_CHUNK = 256 * 1024
PROXY_QUEUE_BYTES = 8 * 1024 * 1024  # per direction; well above rate x delay (50 MB/s x 8 ms = 400 kB)
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not between fork and exec


# ---- child processes -----------------------------------------------------------------
def _die_with_parent() -> None:
    """preexec_fn: SIGTERM when the process that started this one dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``; kept across exec). One libc call, nothing that could take a lock."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_child(argv: Sequence[str], **popen: Any) -> subprocess.Popen:
    """Start ``argv`` in a session and process group of its own (so that it can be stopped with its
    children), bound to die with this process. Call it while this process runs no other thread."""
    return subprocess.Popen(list(argv), start_new_session=True, preexec_fn=_die_with_parent, **popen)  # noqa: PLW1509


def stop_child(proc: subprocess.Popen | None, grace: float = 5.0) -> None:
    """SIGTERM the process group of ``proc`` (started by :func:`start_child`), SIGKILL after ``grace`` s."""
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def cpu_seconds(pid: int) -> float | None:
    """User+system CPU seconds used so far by process ``pid`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


# ---- the namespace and the rate cap --------------------------------------------------
def missing_requirements() -> str | None:
    """Why :class:`Link` cannot be built here (None when it can)."""
    if os.geteuid() != 0:
        return f"the emulated link needs root (network namespaces, veth and tc); this process runs as uid {os.geteuid()}"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the emulated link needs {' and '.join(missing)} (Debian package iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"'ip netns list' failed: {probe.stderr.strip()}"
    return None


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or f'exit code {proc.returncode}'}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _delete(ns: str, host_veth: str) -> None:
    """Kill what still runs in ``ns`` (only our own processes can be in it), delete it and the veth."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)  # also deletes the veth end inside
    subprocess.run(["ip", "link", "del", host_veth], capture_output=True, check=False)  # gone with its peer; just in case


def remove_stale() -> list[str]:
    """Delete the namespaces (and veth pairs) of earlier runs whose process is gone; return their names."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    removed = []
    for name in re.findall(rf"^({NAME_PREFIX}(\d+))\b", listing, flags=re.MULTILINE):
        ns, pid = name[0], int(name[1])
        if pid != os.getpid() and not pid_alive(pid):
            _delete(ns, f"cpbh{pid}")
            removed.append(ns)
    return removed


def _free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /30 of :data:`SUBNETS` that no interface on this machine uses, tried from ``seed`` on."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    taken = {ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", used)}
    subnets = list(SUBNETS.subnets(new_prefix=30))
    for i in range(len(subnets)):
        net = subnets[(seed + i) % len(subnets)]
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"no free /30 left in {SUBNETS}")


class Link:
    """A network namespace joined to this one by a veth pair; :meth:`cap` puts the rate cap on.

    ``host_ip`` is this end's address, ``ns_ip`` the namespace's; run a command inside with
    :meth:`exec_argv`. A context manager; :meth:`close` (also run at exit) deletes everything,
    killing whatever still runs in the namespace.
    """

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns, self.host_veth, self.ns_veth = f"{NAME_PREFIX}{pid}", f"cpbh{pid}", f"cpbn{pid}"
        net = _free_subnet(pid)
        host, peer = list(net.hosts())
        self.host_ip, self.ns_ip, self.prefixlen = str(host), str(peer), net.prefixlen
        self.rate: str | None = None
        self._open = False

    def __enter__(self) -> Link:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        atexit.register(self.close)
        self._open = True
        _run("ip", "netns", "add", self.ns)
        _run("ip", "link", "add", self.host_veth, "type", "veth", "peer", "name", self.ns_veth)
        _run("ip", "link", "set", self.ns_veth, "netns", self.ns)
        _run("ip", "addr", "add", f"{self.host_ip}/{self.prefixlen}", "dev", self.host_veth)
        _run("ip", "link", "set", self.host_veth, "up")
        _run(*self.exec_argv(["ip", "addr", "add", f"{self.ns_ip}/{self.prefixlen}", "dev", self.ns_veth]))
        _run(*self.exec_argv(["ip", "link", "set", self.ns_veth, "up"]))
        _run(*self.exec_argv(["ip", "link", "set", "lo", "up"]))

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def cap(self, rate: str, burst: str = "64kb", latency: str = "50ms") -> None:
        """Cap both directions at ``rate`` (tc syntax, e.g. ``400mbit``): a tbf on each end's egress.
        The burst is one GSO segment's worth; latency bounds the queue the way a router's does."""
        for argv in (
            ["tc", "qdisc", "replace", "dev", self.host_veth],
            self.exec_argv(["tc", "qdisc", "replace", "dev", self.ns_veth]),
        ):
            _run(*argv, "root", "tbf", "rate", rate, "burst", burst, "latency", latency)
        self.rate = rate

    def uncap(self) -> None:
        for argv in (["tc", "qdisc", "del", "dev", self.host_veth], self.exec_argv(["tc", "qdisc", "del", "dev", self.ns_veth])):
            _run(*argv, "root")
        self.rate = None

    def close(self) -> None:
        if self._open:
            self._open = False
            _delete(self.ns, self.host_veth)
            atexit.unregister(self.close)


# ---- the delay proxy -----------------------------------------------------------------
async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, not_before: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk written ``delay`` s after it arrived (and not before
    ``not_before + delay``). Reading goes on while chunks wait; at most PROXY_QUEUE_BYTES wait, then
    reading pauses and TCP flow control pushes back on the sender."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()  # b"": EOF; None: reset
    room = asyncio.Condition()
    queued = 0

    async def read_side() -> None:
        nonlocal queued
        while True:
            try:
                data = await reader.read(PROXY_CHUNK)
            except OSError:  # ConnectionResetError and friends: pass the reset on, at once
                chunks.put_nowait((0.0, None))
                return
            due = max(loop.time(), not_before) + delay
            if not data:
                chunks.put_nowait((due, b""))  # the EOF travels with the same delay
                return
            async with room:
                while queued >= PROXY_QUEUE_BYTES:
                    await room.wait()
                queued += len(data)
            chunks.put_nowait((due, data))

    async def write_side() -> None:
        nonlocal queued
        while True:
            due, data = await chunks.get()
            if data is None:
                raise ConnectionResetError("the other side reset the connection")
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            async with room:
                queued -= len(data)
                room.notify_all()

    reading = asyncio.ensure_future(read_side())
    try:
        await write_side()
    finally:
        reading.cancel()


async def _serve_connection(
    client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, upstream: tuple[str, int], delay: float
) -> None:
    loop = asyncio.get_running_loop()
    handshake_done = loop.time() + 2 * delay  # the round trip a real connect would have cost
    try:
        up_reader, up_writer = await asyncio.open_connection(*upstream, limit=4 * PROXY_CHUNK)
    except OSError:
        client_writer.close()
        return
    directions = [
        asyncio.ensure_future(_forward(client_reader, up_writer, delay, handshake_done)),
        asyncio.ensure_future(_forward(up_reader, client_writer, delay, 0.0)),
    ]
    try:
        await asyncio.gather(*directions)
    except (ConnectionError, OSError):
        pass  # one side reset: drop the connection, as a router would see it
    finally:
        for task in directions:
            task.cancel()
        for w in (client_writer, up_writer):
            w.close()


async def serve_proxy(
    upstream: tuple[str, int], delay: float, listen: tuple[str, int] = ("127.0.0.1", 0), on_ready: Any = None
) -> None:
    """Serve the delay proxy until cancelled; ``on_ready(port)`` is called once it listens."""
    server = await asyncio.start_server(lambda r, w: _serve_connection(r, w, upstream, delay), *listen, limit=4 * PROXY_CHUNK)
    if on_ready is not None:
        on_ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


class ProxyProcess:
    """:func:`serve_proxy` in a child process (its own CPU and GIL); ``endpoint`` is where to connect."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self.proc = start_child(
            [
                sys.executable,
                os.path.abspath(__file__),
                "proxy",
                "--upstream",
                f"{upstream[0]}:{upstream[1]}",
                "--delay-ms",
                repr(delay * 1000),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            stop_child(self.proc)
            raise RuntimeError(f"the delay proxy did not start (exit code {self.proc.poll()})")
        self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_child(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# ---- standalone ----------------------------------------------------------------------
def _source(bind: tuple[str, int]) -> None:
    """Self-test server: per connection, answer each request line ``N`` with N bytes."""
    srv = socket.create_server(bind)
    print(srv.getsockname()[1], flush=True)
    while True:
        conn, _ = srv.accept()
        with conn, conn.makefile("rb") as requests:
            for line in requests:
                conn.sendall(b"x" * int(line))


def _selftest(rate: str, rtt: float, mib: int) -> None:
    """Build the link, measure its round trip and single-stream rate through the proxy, tear it down."""
    with Link() as link:
        link.cap(rate)
        source = start_child(
            link.exec_argv([sys.executable, os.path.abspath(__file__), "_source", "--bind", f"{link.ns_ip}:0"]),
            stdout=subprocess.PIPE,
            text=True,
        )
        proxy = None
        try:
            port = int(source.stdout.readline())
            proxy = ProxyProcess((link.ns_ip, port), rtt / 2)
            with socket.create_connection(("127.0.0.1", proxy.port)) as conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rtts = []
                for _ in range(10):
                    t = time.perf_counter()
                    conn.sendall(b"1\n")
                    conn.recv(1)
                    rtts.append(time.perf_counter() - t)
                conn.sendall(f"{mib * 2**20}\n".encode())
                t, got, buf = time.perf_counter(), 0, bytearray(2**20)
                while got < mib * 2**20:
                    got += conn.recv_into(buf)
                seconds = time.perf_counter() - t
            print(
                f"netns {link.ns}: {link.host_ip} <-> {link.ns_ip}, tbf {rate} each way, proxy delay {rtt / 2 * 1000:g} ms each way"  # noqa: E501 - kept whole
            )
            print(
                f"round trip: median {sorted(rtts)[len(rtts) // 2] * 1000:.1f} ms (first, with the handshake: {rtts[0] * 1000:.1f} ms)"  # noqa: E501 - kept whole
            )
            print(f"one stream: {got / seconds / 1e6:.1f} MB/s ({got * 8 / seconds / 1e6:.0f} Mbit/s of payload)")
        finally:
            if proxy is not None:
                proxy.stop()
            stop_child(source)
    print(f"deleted {link.ns} and its veth pair")


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("selftest", help="build the link, measure round trip and rate, tear it down (root)")
    st.add_argument("--rate", default="400mbit")
    st.add_argument("--rtt-ms", type=float, default=16.0)
    st.add_argument("--mib", type=int, default=64, help="MiB to stream for the rate (default 64)")
    px = sub.add_parser("proxy", help="run the delay proxy on 127.0.0.1 (prints the port, runs until SIGTERM)")
    px.add_argument("--upstream", type=_host_port, required=True, help="HOST:PORT to forward to")
    px.add_argument("--delay-ms", type=float, required=True, help="one-way delay, added in each direction")
    src = sub.add_parser("_source")  # the self-test's server, run inside the namespace
    src.add_argument("--bind", type=_host_port, required=True)
    args = p.parse_args(argv)
    if args.command == "proxy":
        # Nothing to flush or save: on SIGTERM leave at once, without unwinding live connections.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        asyncio.run(serve_proxy(args.upstream, args.delay_ms / 1000, on_ready=lambda port: print(port, flush=True)))
    elif args.command == "_source":
        _source(args.bind)
    else:
        problem = missing_requirements()
        if problem:
            print(f"netlink: {problem}", file=sys.stderr)
            return 2
        remove_stale()
        _selftest(args.rate, args.rtt_ms / 1000, args.mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
