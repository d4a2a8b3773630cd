"""An emulated remote link for the benchmarks: a rate cap and a round-trip delay **in the packet
path** between a client on this machine and a server in a network namespace that this module creates.

::

    client (root namespace)            router netns                          server netns
      cpbh<pid> ---- veth ---- cpbr<pid>   [NFQUEUE delay line]   cpbs<pid> ---- veth ---- cpbn<pid>
                               tbf on the egress of cpbr and cpbs (both directions capped)

The kernel here has no ``sch_netem`` (and no ``fq``/``etf`` qdisc for EDT timestamps), so:

- the **delay**: every packet that enters the router namespace, from either side, is sent by an
  iptables rule (``mangle PREROUTING -j NFQUEUE``) to :file:`nfq_delay.c`, a small C program
  built with gcc against libnetfilter_queue on first use. It holds each packet (in the kernel: only
  its id crosses to user space) for the one-way delay and then accepts it. TCP runs end to end
  between the client and the server, so its handshake, slow start and window growth see the real
  round trip. The queue is in a namespace of its own because a packet queued on the sending host
  would still be charged to its socket (TCP small queues would then cap the window); crossing a
  veth detaches it, as a wire does;
- the **rate**: ``tc qdisc ... tbf`` on the router's two egress devices.

Both need root, ``ip``, ``tc``, ``iptables``, gcc and libnetfilter-queue (Debian: iproute2,
iptables, gcc, libnetfilter-queue-dev); :func:`missing_requirements` says what is missing.
:func:`ping_rtt` and :func:`iperf3_goodput` measure the link that was built (Debian: iputils-ping,
iperf3).

:func:`serve_proxy`, a delaying TCP proxy on 127.0.0.1, is kept for runs without root
(``bench_link.py --no-link``): it adds a delay per chunk but terminates TCP, so the client's TCP
sees a loopback round trip (no slow start, no bandwidth-delay product) and there is no rate cap.

Every name carries the owner's pid (netns ``cpbench<pid>`` and ``cpbenchr<pid>``, veth ends
``cpbh/cpbr/cpbs/cpbn<pid>``), so two runs do not collide, and :func:`remove_stale` can delete what a
killed run left behind. The only change to the root namespace is the veth end ``cpbh<pid>`` with a
/30 address and one host route to the server's address (``10.200.0.0/16``); the iptables rule lives
in the router namespace and goes with it.

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
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NAME_PREFIX = "cpbench"  # netns cpbench<pid> (server) and cpbenchr<pid> (router); veth ends cpbh/cpbr/cpbs/cpbn<pid>
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


# ---- the namespaces, the rate cap and the delay line ---------------------------------
DELAY_SOURCE = Path(__file__).resolve().with_name("nfq_delay.c")
DELAY_QUEUE = 0  # NFQUEUE number, in the router namespace (queue numbers are per namespace)
IPERF3_PORT = 5201  # in the server namespace, where every port is ours (the S3 server uses 20000+)
_TOOLS = {"ip": "iproute2", "tc": "iproute2", "iptables": "iptables", "gcc": "gcc"}


def build_delay_line(out_dir: Path) -> Path:
    """Compile :data:`DELAY_SOURCE` into ``out_dir``; raise RuntimeError with gcc's message."""
    binary = out_dir / "nfq_delay"
    proc = subprocess.run(
        ["gcc", "-O2", "-o", str(binary), str(DELAY_SOURCE), "-lnetfilter_queue", "-lnfnetlink"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"building the delay line ({DELAY_SOURCE.name}) failed; it needs gcc and libnetfilter-queue "
            f"(Debian: libnetfilter-queue-dev): {proc.stderr.strip()[-1500:]}"
        )
    return binary


def missing_requirements() -> str | None:
    """Why :class:`Link` cannot be built here (None when it can)."""
    if os.geteuid() != 0:
        return f"the emulated link needs root (network namespaces, veth, tc, iptables); this process runs as uid {os.geteuid()}"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        packages = sorted({_TOOLS[t] for t in missing})
        return f"the emulated link needs {', '.join(missing)} (Debian packages: {' '.join(packages)})"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"'ip netns list' failed: {probe.stderr.strip()}"
    with tempfile.TemporaryDirectory(prefix="cpbench-gcc-") as tmp:
        try:
            build_delay_line(Path(tmp))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
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


def _delete(namespaces: Sequence[str], host_veth: str) -> None:
    """Kill what still runs in ``namespaces`` (only our own processes can be in them), delete them and the veth."""
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)  # also deletes the veth ends inside
    # gone with its peer (and its host route with it); just in case
    subprocess.run(["ip", "link", "del", host_veth], capture_output=True, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces, veth pairs and delay-line build dirs of runs whose process is gone; return their names."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    removed = []
    for ns, pid_text in re.findall(rf"^({NAME_PREFIX}r?(\d+))\b", listing, flags=re.MULTILINE):
        pid = int(pid_text)
        if pid != os.getpid() and not pid_alive(pid):
            _delete([ns], f"cpbh{pid}")
            removed.append(ns)
    for build in Path(tempfile.gettempdir()).glob(f"{NAME_PREFIX}-delay-*-*"):  # the delay line's build dirs
        pid_text = build.name[len(f"{NAME_PREFIX}-delay-") :].split("-", 1)[0]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and not pid_alive(int(pid_text)):
            shutil.rmtree(build, ignore_errors=True)
            removed.append(str(build))
    return removed


def _free_subnet(seed: int, exclude: Sequence[ipaddress.IPv4Network] = ()) -> ipaddress.IPv4Network:
    """A /30 of :data:`SUBNETS` that no interface on this machine uses (nor ``exclude``), tried from ``seed`` on."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    taken = {ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", used)} | set(exclude)
    subnets = list(SUBNETS.subnets(new_prefix=30))
    for i in range(len(subnets)):
        net = subnets[(seed + i) % len(subnets)]
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"no free /30 left in {SUBNETS}")


class Link:
    """A server network namespace reached from this one through a router namespace (two veth
    pairs); :meth:`cap` puts the rate cap on, :meth:`delay` the delay line.

    ``host_ip`` is this end's address, ``ns_ip`` the server namespace's; run a command inside it
    with :meth:`exec_argv` (in the router with :meth:`router_argv`). A context manager; :meth:`close`
    (also run at exit) deletes everything, killing whatever still runs in the namespaces.
    """

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns, self.router = f"{NAME_PREFIX}{pid}", f"{NAME_PREFIX}r{pid}"
        self.host_veth, self.router_host_veth = f"cpbh{pid}", f"cpbr{pid}"
        self.router_ns_veth, self.ns_veth = f"cpbs{pid}", f"cpbn{pid}"
        near = _free_subnet(pid)
        far = _free_subnet(pid + 1, [near])
        self.host_ip, self.router_host_ip = map(str, near.hosts())
        self.router_ns_ip, self.ns_ip = map(str, far.hosts())
        self.prefixlen = near.prefixlen
        self.rate: str | None = None
        self.one_way_s: float | None = None
        self.delay_proc: subprocess.Popen | None = None
        self.delay_stats = ""
        self.delay_cpu: int | None = None
        self._build_dir: str | None = None
        self._open = False

    def __enter__(self) -> Link:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        atexit.register(self.close)
        self._open = True
        p = f"/{self.prefixlen}"
        _run("ip", "netns", "add", self.router)
        _run("ip", "netns", "add", self.ns)
        _run("ip", "link", "add", self.host_veth, "type", "veth", "peer", "name", self.router_host_veth)
        _run("ip", "link", "set", self.router_host_veth, "netns", self.router)
        _run("ip", "link", "add", self.router_ns_veth, "type", "veth", "peer", "name", self.ns_veth)
        _run("ip", "link", "set", self.router_ns_veth, "netns", self.router)
        _run("ip", "link", "set", self.ns_veth, "netns", self.ns)
        _run("ip", "addr", "add", self.host_ip + p, "dev", self.host_veth)
        _run("ip", "link", "set", self.host_veth, "up")
        _run("ip", "route", "add", f"{self.ns_ip}/32", "via", self.router_host_ip, "dev", self.host_veth)
        for dev, ip in ((self.router_host_veth, self.router_host_ip), (self.router_ns_veth, self.router_ns_ip)):
            _run(*self.router_argv(["ip", "addr", "add", ip + p, "dev", dev]))
            _run(*self.router_argv(["ip", "link", "set", dev, "up"]))
        _run(*self.router_argv(["sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]))  # this namespace's only
        _run(*self.exec_argv(["ip", "addr", "add", self.ns_ip + p, "dev", self.ns_veth]))
        _run(*self.exec_argv(["ip", "link", "set", self.ns_veth, "up"]))
        _run(*self.exec_argv(["ip", "link", "set", "lo", "up"]))
        _run(*self.exec_argv(["ip", "route", "add", "default", "via", self.router_ns_ip]))

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the server namespace (``ip netns exec`` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def router_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the router namespace."""
        return ["ip", "netns", "exec", self.router, *argv]

    def cap(self, rate: str, burst: str = "70kb", latency: str = "50ms") -> None:
        """Cap both directions at ``rate`` (tc syntax, e.g. ``400mbit``): a tbf on each of the router's
        egress devices; latency bounds the queue the way a router's does. The burst is one GSO packet
        (64 KiB plus headers): with a smaller one, tbf cuts every GSO packet into ~45 MTU packets
        inside the delay line's verdict call, which then takes up to 30 ms and makes the delay late
        (measured with 64kb: mean 1.6-4.5 ms late, max 27-41 ms; with 70kb: mean 0.05 ms, max 1.8 ms)."""
        for dev in (self.router_host_veth, self.router_ns_veth):
            _run(
                *self.router_argv(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate]),
                "burst",
                burst,
                "latency",
                latency,
            )
        self.rate = rate

    def uncap(self) -> None:
        for dev in (self.router_host_veth, self.router_ns_veth):
            _run(*self.router_argv(["tc", "qdisc", "del", "dev", dev, "root"]))
        self.rate = None

    def delay(self, one_way_s: float, realtime: bool = True) -> None:
        """Hold every packet entering the router (both directions) for ``one_way_s``: start the
        delay line (built here with gcc) in the router namespace, then send all of the router's
        incoming packets to it. ``realtime``: run it SCHED_FIFO, so that a busy machine does not
        stretch the delay (it sleeps until the next packet is due).

        With two CPUs or more it is pinned to the last one, and the receive processing of the two
        end points' veths (RPS) is sent to the others. Without that, a verdict that releases
        packets also runs, in the delay line's own system call, the receiving host's TCP for them
        (and the ACKs that come back), and releases ran late: with 16 iperf3 streams, mean 2.6 ms,
        max 31 ms; with it, mean 0.08 ms, max 4 ms."""
        if self.delay_proc is not None:
            raise RuntimeError("the delay line is already on")
        self._build_dir = tempfile.mkdtemp(prefix=f"{NAME_PREFIX}-delay-{os.getpid()}-")
        binary = build_delay_line(Path(self._build_dir))
        argv = [str(binary), str(DELAY_QUEUE), f"{one_way_s * 1e6:.1f}", *(["--fifo"] if realtime else [])]
        self.delay_proc = start_child(self.router_argv(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready, _, _ = select.select([self.delay_proc.stdout], [], [], 30)
        line = self.delay_proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            rest = "" if self.delay_proc.poll() is None else self.delay_proc.stdout.read()
            self.undelay()
            raise RuntimeError(f"the delay line did not start: {(line + rest).strip() or 'no output'}")
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:
            os.sched_setaffinity(self.delay_proc.pid, {cpus[-1]})
            mask = f"{sum(1 << c for c in cpus[:-1]):x}"
            rps = "queues/rx-0/rps_cpus"
            _run("sh", "-c", f"echo {mask} > /sys/class/net/{self.host_veth}/{rps}")  # our veth end only
            _run(*self.exec_argv(["sh", "-c", f"echo {mask} > /sys/class/net/{self.ns_veth}/{rps}"]))
            self.delay_cpu = cpus[-1]
        _run(
            *self.router_argv(["iptables", "-t", "mangle", "-A", "PREROUTING", "-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE)])
        )
        self.one_way_s = one_way_s

    def undelay(self) -> str:
        """Take the delay line off; return its counters (packets, the latest release in us)."""
        if self.one_way_s is not None:
            subprocess.run(self.router_argv(["iptables", "-t", "mangle", "-F", "PREROUTING"]), capture_output=True, check=False)
            self.one_way_s = None
        if self.delay_proc is not None:
            stop_child(self.delay_proc)
            if self.delay_proc.stdout is not None:
                self.delay_stats = self.delay_proc.stdout.read().strip()
                self.delay_proc.stdout.close()
            self.delay_proc = None
        if self._build_dir is not None:
            shutil.rmtree(self._build_dir, ignore_errors=True)
            self._build_dir = None
        return self.delay_stats

    @property
    def delay_pid(self) -> int | None:
        return None if self.delay_proc is None else self.delay_proc.pid

    def close(self) -> None:
        if self._open:
            self._open = False
            self.undelay()
            _delete([self.ns, self.router], self.host_veth)
            atexit.unregister(self.close)


# ---- measuring the link --------------------------------------------------------------
def ping_rtt(target: str, count: int = 20, interval: float = 0.2) -> dict[str, Any]:
    """Round trips of ``count`` pings to ``target`` (from this namespace): median, min, max, ms."""
    if shutil.which("ping") is None:
        return {"error": "no ping (Debian package iputils-ping)"}
    proc = subprocess.run(
        ["ping", "-n", "-c", str(count), "-i", str(interval), target],
        capture_output=True,
        text=True,
        timeout=count * interval + 30,
        check=False,
    )
    times = [float(t) for t in re.findall(r"time=([\d.]+) ms", proc.stdout)]
    if not times:
        return {"error": f"ping {target}: {(proc.stderr or proc.stdout).strip()[-300:]}"}
    times.sort()
    return {
        "count": len(times),
        "lost": count - len(times),
        "median_ms": times[len(times) // 2],
        "min_ms": times[0],
        "max_ms": times[-1],
    }


def iperf3_goodput(link: Link, seconds: float = 5.0, reverse: bool = True) -> dict[str, Any]:
    """One iperf3 TCP stream across the link for ``seconds``, server in the server namespace,
    client here; ``reverse``: the server sends (the direction the benchmark downloads). Goodput
    is the receiver's payload bytes per second, slow start included."""
    if shutil.which("iperf3") is None:
        return {"error": "no iperf3 (Debian package iperf3)"}
    server = start_child(
        link.exec_argv(["iperf3", "-s", "-1", "-B", link.ns_ip, "-p", str(IPERF3_PORT)]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    argv = ["iperf3", "-c", link.ns_ip, "-p", str(IPERF3_PORT), "-t", f"{seconds:g}", "-J", *(["-R"] if reverse else [])]
    try:
        for _ in range(50):  # until the server listens
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30, check=False)
            if proc.returncode == 0 or "connect" not in proc.stdout + proc.stderr or server.poll() is not None:
                break
            time.sleep(0.1)
    finally:
        stop_child(server)
    try:
        end = json.loads(proc.stdout)["end"]
        received = end["sum_received"]
    except (ValueError, KeyError) as exc:
        return {"error": f"iperf3: {exc}: {(proc.stdout + proc.stderr).strip()[-300:]}"}
    return {
        "seconds": received["seconds"],
        "bytes": received["bytes"],
        "mb_per_s": received["bits_per_second"] / 8 / 1e6,
        "retransmits": end.get("sum_sent", {}).get("retransmits"),
        "direction": "server to client" if reverse else "client to server",
    }


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
def _selftest(rate: str, rtt: float, seconds: float) -> None:
    """Build the link, measure its round trip (ping) and one TCP stream's goodput (iperf3), tear it down."""
    with Link() as link:
        link.cap(rate)
        link.delay(rtt / 2)
        print(
            f"netns {link.ns} ({link.ns_ip}) via router {link.router}: tbf {rate} each way, "
            f"NFQUEUE delay line {rtt / 2 * 1000:g} ms each way"
        )
        print(f"ping: {ping_rtt(link.ns_ip)}")
        print(f"iperf3, server to client: {iperf3_goodput(link, seconds)}")
        print(f"iperf3, client to server: {iperf3_goodput(link, seconds, reverse=False)}")
        print(f"delay line: {link.undelay()}")
    print(f"deleted {link.ns}, {link.router} and their veth pairs")


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("selftest", help="build the link, measure round trip and rate, tear it down (root)")
    st.add_argument("--rate", default="400mbit")
    st.add_argument("--rtt-ms", type=float, default=16.0)
    st.add_argument("--seconds", type=float, default=5.0, help="seconds of each iperf3 run (default 5)")
    px = sub.add_parser("proxy", help="run the delay proxy on 127.0.0.1 (prints the port, runs until SIGTERM)")
    px.add_argument("--upstream", type=_host_port, required=True, help="HOST:PORT to forward to")
    px.add_argument("--delay-ms", type=float, required=True, help="one-way delay, added in each direction")
    args = p.parse_args(argv)
    if args.command == "proxy":
        # Nothing to flush or save: on SIGTERM leave at once, without unwinding live connections.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        asyncio.run(serve_proxy(args.upstream, args.delay_ms / 1000, on_ready=lambda port: print(port, flush=True)))
    else:
        problem = missing_requirements()
        if problem:
            print(f"netlink: {problem}", file=sys.stderr)
            return 2
        remove_stale()
        _selftest(args.rate, args.rtt_ms / 1000, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
