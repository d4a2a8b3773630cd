"""The daemon's HTTP/JSON API, on a Unix socket (and, if configured, a loopback TCP port).

Routes (bodies are JSON objects; every error body is ``{"error": CODE, "message": TEXT}``)::

    GET  /v1/health                  200 {"status": "ok", ...} | 503 (stopping, a pipeline down)
    GET  /v1/status                  200 {"version", "pid", "pipelines": {name: {..., "stats"}}}
    GET  /metrics                    200 Prometheus text format
    POST /v1/pipelines/NAME/next     {"timeout": s, "ack": {"path", "lease"}}  (both optional)
                                     200 {"pipeline", "name", "path", "lease", "size", "files"}
                                     204 every item was delivered | 408 none ready in time
                                     409 the "ack" failed (nothing taken) | 502 the item failed
                                     (with "count": N, up to 1024, and "acks": [{"path", "lease"}...]
                                     of up to 1024 items of NAME, acknowledged first, all or none: 200
                                     {"pipeline", "items": [up to N of those]}, the next item and
                                     those ready after it, without waiting for more)
    POST /v1/ack                     {"path": P, "lease": L}  200 | 409 not handed out / lease expired
                                     (or {"items": [{"path", "lease"}...]}: items of one pipeline,
                                     acknowledged all or none)
    POST /v1/release                 same; the item goes back to the front of the queue
    POST /v1/renew                   same; the lease is extended by lease_timeout
    PUT  /v1/jobs/JOB                a job's spec (see .jobs.JobSpec)  200 {"job", "created", "lanes", ...}
                                     400 a bad spec | 409 registered with another spec, or no room
    DELETE /v1/jobs/JOB              200: the job ended, its items are deleted | 404
    POST /v1/jobs/JOB/take           {"rank", "worker", "epoch", "index", "timeout", "count", "max_bytes",
                                     "report_skips"}
                                     200 {"job", "name", "path", "size", "files", "epoch", "index", "next"}
                                     (with "count": {"job", "items": [up to count of those]}: the
                                     item at the position, and the next ones already on disk; with
                                     "report_skips": true, an item skipped in its turn (on_error or
                                     on_oversize "skip") is answered alone as {"job", "skipped": true,
                                     "name", "reason", "epoch", "index", "next"}, not passed over)
                                     204 the lane's share ends before (epoch, index) | 408 | 502
    POST /v1/jobs/JOB/consume        {"rank", "worker", "epoch", "index"}  200: every step before it is done
    PUT  /v1/manifests               a manifest (gzip, the bytes of ``cachepipe index``; Content-Type
                                     application/gzip, up to jobs.max_manifest bytes)
                                     200 {"catalog": DIGEST, "source", "items"}: a job's spec may then
                                     say {"catalog": DIGEST} to plan from it without listing
    POST /v1/manifests               {"source", "items"}: the daemon lists the source (under
                                     jobs.sources, with jobs.options' credentials) into a manifest
                                     200 {"catalog": DIGEST, ...}
    GET  /v1/manifests/DIGEST        the manifest's bytes (application/gzip) | 404

A job's lane (``rank``, ``worker``) names its position: ``take`` hands the item at
``(epoch, index)`` of the lane's share, and both routes acknowledge every earlier step of the
lane, so asking again (a retry, a restarted consumer) is safe (see :mod:`cachepipe.node`).

Each connection is served by one thread (keep-alive: a consumer keeps its connection), so a
blocking ``next`` holds one thread; ``max_clients`` caps the connections. A consumer that
disconnects before it received its item gets it released at once.

Slow and malformed clients. A request has deadlines, not per-read timeouts (a client that
trickles one byte at a time does not extend them): ``header_timeout`` from its first byte to the
end of its headers, ``body_timeout`` for its body, ``idle_timeout`` for a connection waiting for
its next request; a late request is answered 408 and its connection closed. An answer has
``header_timeout`` to be taken by its client, and ``STOP_GRACE`` (2 s) once the daemon stops;
then its connection is closed, with nothing more written on it. Request line and
headers are capped at ``MAX_HEADER`` bytes in all (431), the body at ``MAX_BODY`` (413); a body
that is not JSON, or nested too deeply to parse, is a 400, and so is a ``Content-Length`` that is
given twice or is not a plain number. When ``max_clients`` connections are open, a new one ends
one whose client went away while its request was answered (a ``next`` waiting for a consumer
killed since; at most ``max_clients`` such at a time, whose threads run until their waits end),
else the connection that has waited longest for its client (idle, or still sending a request),
so connections that send nothing useful cannot lock consumers out; only when every connection
is busy being answered is the new one refused (503).

Why the standard library's ``http.server`` and not uvicorn (h11/httptools) or aiohttp, both of
which serve a Unix socket: what this API needs from a server is small (one JSON request per
call, tiny bodies, thread-per-connection because ``next`` blocks in ``Pipeline.get``), and the
part that was missing, deadlines on receiving a request, is not built into those servers
either: uvicorn's ``timeout_keep_alive`` covers only the idle time between requests and is
re-armed by every byte received, its request-start/request-complete timeouts are an open item
(encode/uvicorn#157); aiohttp's server has size limits but, as far as we found, no deadline on
a request's headers or body. Adopting either would mean an asyncio server, a thread pool for the
blocking ``next``, and a new dependency of the daemon (uvicorn, h11; aiohttp comes with the s3
extra only), and we would still write the deadlines ourselves. So the loop stays, with the
deadlines, limits and eviction written here once, and tested against a real daemon.

This module holds :class:`ApiServer` (the listening sockets, their file and the thread that
accepts). One connection's requests are served by :mod:`cachepipe.service.handler`; the routes,
the body keys they take and the JSON of answers and errors are :mod:`cachepipe.service.routes`.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import selectors
import socket
import stat
import threading
import time
from pathlib import Path

from ..errors import ConfigError
from .config import SOCKET_PATH_MAX, ServiceConfig
from .handler import MAX_BODY, _Handler, _TcpHandler
from .http import STOP_GRACE, Deadlines, Service, Tcp6Server, TcpServer, UnixServer
from .routes import item_json

# MAX_BODY: importable from here, as before
__all__ = ["MAX_BODY", "ApiServer", "Deadlines", "Service", "item_json"]

log = logging.getLogger("cachepipe.service.api")


_NO_LINKS = (errno.EPERM, errno.EACCES, errno.EOPNOTSUPP, errno.EMLINK)
"""Errors of a hard link that the filesystem or a security module (AppArmor without ``l``)
refuses: the socket is then renamed into place, which cannot tell a socket another daemon
published since the check (it replaces it)."""


class ApiServer:
    """The listening sockets and the thread that accepts connections.

    :meth:`bind` creates the sockets (the Unix one with its mode and group, before it listens,
    so it is never reachable with wider permissions) and makes the Unix one listen under a
    temporary name; :meth:`serve` accepts connections; :meth:`publish` renames the Unix socket
    to its configured path, so that the path exists only while a daemon is ready to answer.
    """

    def __init__(self, daemon: Service, config: ServiceConfig) -> None:
        self._daemon = daemon
        self._config = config
        self._servers: list[UnixServer | TcpServer] = []
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._socket_id: tuple[int, int] | None = None
        self._unopened: list[UnixServer | TcpServer] = []  # bound, not yet listening
        self._path: Path | None = None  # where our Unix socket is now (temporary name, then the configured one)
        self._stopped = False  # stop_accepting was called: every answer from now on closes its connection
        self.tcp_address: tuple[str, int] | None = None

    @property
    def address(self) -> str:
        text = str(self._config.socket)
        if self.tcp_address is not None:
            text += f" and http://{self.tcp_address[0]}:{self.tcp_address[1]}"
        return text

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _stopping(self) -> bool:
        return self._stopped or (not self._daemon.running and self._thread is not None)

    def bind(self) -> None:
        """Create the sockets; the Unix one listens under a temporary name (see :meth:`publish`).

        Raises:
            OSError: the socket path is taken by a live daemon or by something else.
            ConfigError: ``socket_group`` names no group.
        """
        cfg = self._config
        path = cfg.socket
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # what the start's host check cannot foresee (a /proc path, a full disk)
            raise type(exc)(exc.errno, f"socket {str(path)!r}: cannot create its directory: {exc}") from exc
        _clear_stale(path)
        _clear_starting_leftovers(path)
        temp = path.with_name(f".{path.name}.{os.getpid()}.starting")
        if len(os.fsencode(temp)) > SOCKET_PATH_MAX:
            temp = path  # no room for a longer name: bound in place, connections are refused until it listens
        _clear_stale(temp)  # a leftover of a daemon with our pid that died while starting
        unix = UnixServer(str(temp), _Handler, bind_and_activate=False)
        unix.track(self._daemon, cfg.max_clients, Deadlines.of(cfg), self._stopping)
        try:
            unix.server_bind()
            self._path = temp
            st = os.stat(temp)
            self._socket_id = (st.st_dev, st.st_ino)
            self._servers.append(unix)
            self.set_permissions(cfg.socket_mode, cfg.socket_group)
            if temp != path:
                unix.server_activate()  # listens, but under a name nobody knows yet
            else:
                self._unopened.append(unix)
        except BaseException:
            unix.server_close()
            self._unlink()
            raise
        if cfg.tcp_port is not None:
            cls = Tcp6Server if ":" in cfg.tcp_host else TcpServer
            tcp = cls((cfg.tcp_host, cfg.tcp_port), _TcpHandler, bind_and_activate=False)
            tcp.track(self._daemon, cfg.max_clients, Deadlines.of(cfg), self._stopping)
            try:
                tcp.server_bind()
            except BaseException:
                tcp.server_close()
                raise
            self._servers.append(tcp)
            self._unopened.append(tcp)
            host, port = tcp.socket.getsockname()[:2]
            self.tcp_address = (host, port)
            if host not in ("127.0.0.1", "::1", "localhost"):
                log.warning(
                    "the API listens on TCP %s:%d without authentication: anyone who can reach it can take and evict items",
                    host,
                    port,
                )

    def set_permissions(self, mode: int, group: str | None) -> None:
        """Apply ``mode`` and ``group`` to the Unix socket (also on reload)."""
        path = self._path
        if path is None:
            return
        if group is not None:
            try:
                gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            except KeyError:
                raise ConfigError(f"socket_group {group!r}: no such group on this system") from None
            os.chown(path, -1, gid)
        os.chmod(path, mode)

    def set_max_clients(self, max_clients: int) -> None:
        """Change the cap on simultaneous connections (on reload); live connections stay."""
        for server in self._servers:
            server.max_clients = max_clients

    def set_deadlines(self, deadlines: Deadlines) -> None:
        """Change the request deadlines (on reload); requests under way keep theirs."""
        for server in self._servers:
            server.deadlines = deadlines

    def serve(self) -> None:
        """Listen (if not yet) and start accepting connections in a thread; then :meth:`publish`."""
        for server in self._unopened:
            server.server_activate()
        self._unopened.clear()
        for server in self._servers:
            server.socket.setblocking(False)
        self._thread = threading.Thread(target=self._loop, name="cachepipe-api", daemon=False)
        self._thread.start()

    def publish(self) -> None:
        """Give the listening Unix socket its configured name: from now on it is reachable.

        Until then it listened under a temporary name in the same directory, so the socket
        file never exists without a daemon ready to answer on it (a client finds either no
        socket, or one that serves). The new name is a hard link made atomically, then the
        temporary one is removed: the socket keeps its mode and group, and a socket another
        daemon published meanwhile is not replaced (the link fails).

        Raises:
            OSError: a live daemon started serving on the path meanwhile.
        """
        path = self._config.socket
        if self._path is None or self._path == path:
            return
        _clear_stale(path)
        try:  # not a rename: that would replace a socket another daemon put there since the check
            os.link(self._path, path)
        except FileExistsError:
            raise OSError(
                errno.EADDRINUSE, f"socket {str(path)!r} is in use: another cachepipe daemon started serving on it"
            ) from None
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            os.rename(self._path, path)  # links refused there (a security module, a filesystem): renamed, as before
        else:
            os.unlink(self._path)  # a daemon killed before this leaves it: removed at the next start (bind)
        self._path = path

    def _loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            for server in self._servers:
                sel.register(server.fileno(), selectors.EVENT_READ, server)
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            while True:
                for key, _events in sel.select():
                    if key.data is None:
                        return
                    key.data.handle_request()

    def stop_accepting(self) -> None:
        """Stop accepting new connections (existing ones are served until :meth:`close`).

        The socket file goes first: a client connecting from now on finds no socket (and
        waits for the next daemon) rather than a listener that will never accept it. Then the
        connections already queued are accepted and served as those in flight are (503
        ``stopping``), and the listening sockets close: a TCP client connecting from now on is
        refused at once (and waits for the next daemon), not queued until the stop has ended.
        """
        self._stopped = True
        self._unlink()
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join()
            for server in self._servers:
                server.accept_queued()

    def close(self) -> None:
        """End every connection (one whose request is being answered once its answer is
        written, within ``STOP_GRACE``: see :meth:`~cachepipe.service.http.Server.disconnect_all`),
        join their threads, close and remove the socket. Idempotent."""
        if self._wake_r < 0:
            return
        self.stop_accepting()
        self._thread = None
        for server in self._servers:
            server.disconnect_all()
        grace = time.monotonic() + STOP_GRACE  # one grace for the Unix and the TCP listener's answers
        for server in self._servers:
            server.end_stalled(grace)
        for server in self._servers:
            server.server_close()  # joins the connection threads
        self._servers.clear()
        self._unlink()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1

    def _unlink(self) -> None:
        path = self._path
        if path is None:
            return
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._socket_id:  # never remove a socket another daemon made since
            path.unlink()


def _clear_starting_leftovers(path: Path) -> None:
    """Remove the temporary sockets (``.<name>.<pid>.starting``, see :meth:`ApiServer.bind`) of
    daemons killed while starting: those whose pid is gone. One of a daemon starting now, or of
    a live process that took a dead daemon's pid, is left alone."""
    prefix, suffix = f".{path.name}.", ".starting"
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(prefix) : -len(suffix)] if entry.name.startswith(prefix) and entry.name.endswith(suffix) else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass
        except OSError:
            pass  # a live process of another user


def _clear_stale(path: Path) -> None:
    """Remove a socket file left by a daemon that died; refuse if a live one answers on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            errno.EEXIST, f"socket path {str(path)!r} exists and is not a socket; remove it or choose another path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(2.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # nobody listens: a leftover of a daemon that died
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"socket {str(path)!r} is in use: another cachepipe daemon is serving on it")
