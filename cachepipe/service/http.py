"""The daemon's HTTP connections: deadlines, size limits and connection slots, under the
standard library's ``socketserver`` (the routes are in :mod:`.api`; why this and not an
asyncio server is in its docstring).

Invariants: a request is read under deadlines, not per-read timeouts (a client that trickles
bytes does not extend them); its request line and headers never exceed ``MAX_HEADER`` bytes;
at most ``max_clients`` connections are open, and a full server ends one whose client has
gone, else the connection that has waited longest for its client, before refusing a new one; a server that closes ends a
connection while it waits for its client, and one whose request is being answered once its
answer is written (a consumer's ``next`` woken by the stop gets its 503). An answer is written
under a deadline too: ``header_timeout`` for a client to take it, and no more than
``STOP_GRACE`` once the server closes; an answer not taken in time ends its connection, with
nothing more written on it (:class:`Unread`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import http.client
import io
import logging
import select
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from ..logfallback import RateLimit
from ..pipeline import CachedItem
from .errors import ClientGone
from .metrics import Metrics

if TYPE_CHECKING:
    from ..node import SkippedStep, Taken
    from ..plan import Cursor
    from .config import ServiceConfig

__all__ = [
    "MAX_HEADER",
    "STOP_GRACE",
    "DeadlineReader",
    "Deadlines",
    "HeaderBudget",
    "HeadersTooLarge",
    "Late",
    "Server",
    "Service",
    "Tcp6Server",
    "TcpServer",
    "UnixServer",
    "Unread",
    "end",
]

log = logging.getLogger("cachepipe.service.api")

MAX_HEADER = 64 * 1024  # request line and headers, in all
# Seconds an answer has to be taken by its client once the server closes (the daemon stops):
# enough for any client that reads, where header_timeout would hold the stop for one that does not.
STOP_GRACE = 2.0


class Service(Protocol):
    """What the API needs of the daemon (:class:`cachepipe.service.daemon.Daemon` is one).

    The API and its server depend on this, not on the daemon module, so that the daemon can
    build the API without an import circle.
    """

    metrics: Metrics

    @property
    def running(self) -> bool: ...

    def health(self) -> tuple[bool, dict[str, Any]]: ...

    def status(self) -> dict[str, Any]: ...

    def take_many(
        self, name: str, timeout: float | None, count: int, acks: list[Any] | None = None, markers: bool = True
    ) -> list[CachedItem]: ...

    def finish(self, verb: str, path: Any, lease: Any = None) -> tuple[str, str]: ...

    def finish_many(self, verb: str, items: list[Any]) -> tuple[str, list[str]]: ...

    def register_job(self, name: str, spec: dict[str, Any]) -> tuple[bool, dict[str, Any]]: ...

    def delete_job(self, name: str) -> None: ...

    def take_lane(
        self,
        name: str,
        rank: int,
        worker: int,
        cursor: Cursor,
        timeout: float | None,
        count: int = 1,
        max_bytes: int | None = None,
        report_skips: bool = False,
    ) -> list[Taken] | list[SkippedStep]: ...

    def consume_lane(self, name: str, rank: int, worker: int, cursor: Cursor) -> None: ...

    def manifest_limit(self) -> int: ...

    def upload_manifest(self, body: BinaryIO, length: int) -> dict[str, Any]: ...

    def index_source(self, source: str, items: str) -> dict[str, Any]: ...

    def manifest_bytes(self, digest: str) -> bytes: ...


class Late(TimeoutError):
    """A deadline of the request passed (HTTP 408)."""


class Unread(ClientGone):
    """An answer that could not be written whole: its client did not take it in time (see
    :meth:`Server.answering`), or went away. Its connection ends, with nothing more written on it."""


class HeadersTooLarge(http.client.HTTPException):
    """Request line and headers over ``MAX_HEADER`` bytes (``parse_request`` answers 431)."""


class DeadlineReader(io.RawIOBase):
    """A socket's input under one deadline at a time (``deadline``: a ``time.monotonic()``
    value, or None). Each read waits only for what is left of it, so the deadline holds for
    the whole phase however the client spreads its bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline: float | None = None
        self.phase = ""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.deadline is None:
            self._sock.settimeout(None)
        else:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise Late(self.phase)
            self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            raise Late(self.phase) from None
        except OSError as exc:  # the client's connection failed (reset): not an error of the request's work
            raise ClientGone(f"the client's connection failed while its request {self.phase} arrived: {exc}") from exc


class HeaderBudget:
    """``readline`` over the buffered input, failing once ``budget`` bytes were read in all."""

    def __init__(self, rfile: io.BufferedReader, budget: int) -> None:
        self._rfile, self.budget = rfile, budget

    def readline(self, limit: int = -1) -> bytes:
        want = self.budget + 1 if limit < 0 else min(limit, self.budget + 1)
        line = self._rfile.readline(want)
        self.budget -= len(line)
        if self.budget < 0:
            raise HeadersTooLarge(f"request line and headers over {MAX_HEADER} bytes")
        return line


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """Seconds a client has: ``header`` from a request's first byte to the end of its headers,
    ``body`` for its body, ``idle`` to start its next request."""

    header: float = 10.0
    body: float = 10.0
    idle: float = 300.0

    @classmethod
    def of(cls, config: ServiceConfig) -> Deadlines:
        return cls(config.header_timeout, config.body_timeout, config.idle_timeout)


class Server(socketserver.ThreadingMixIn):
    """Thread per connection; tracks live connections to cap them, to make room, and to end
    them at close."""

    daemon_threads = False
    block_on_close = True
    request_queue_size = 128
    timeout: float | None = 0.0  # handle_request() never blocks: our selector already saw the socket ready
    daemon: Service
    max_clients: int
    deadlines: Deadlines
    daemon_stopping: Callable[[], bool]

    def track(self, daemon: Service, max_clients: int, deadlines: Deadlines, stopping: Callable[[], bool]) -> None:
        self.daemon, self.max_clients, self.deadlines, self.daemon_stopping = daemon, max_clients, deadlines, stopping
        # live connection -> since when it waits for its client (None: busy answering a request)
        self._live: dict[socket.socket, float | None] = {}
        self._live_lock = threading.Lock()
        self._closing = False  # disconnect_all was called: a connection ends as soon as it waits
        self._closed_at = 0.0  # when disconnect_all was called (time.monotonic())
        # connection -> since when its answer is being written; notified as each write ends
        self._writing: dict[socket.socket, float] = {}
        self._written = threading.Condition(self._live_lock)
        self._ended: set[socket.socket] = set()  # ended while answered (client gone): their threads still run
        self._said = RateLimit()  # the lines of connections ended or refused at max_clients: 3 of a kind per 30 s, then a count

    def set_waiting(self, request: socket.socket, waiting: bool) -> None:
        with self._live_lock:
            if request not in self._live:
                return
            self._live[request] = time.monotonic() if waiting else None
            if waiting and self._closing:
                end(request)  # answered while the server closes: its thread reads EOF next and finishes

    @contextlib.contextmanager
    def answering(self, request: socket.socket) -> Iterator[float]:
        """Around the write of an answer on ``request``; yields the seconds its client has to
        take it: ``header_timeout``, and at most ``STOP_GRACE`` once the server closes (a write
        under way then is given ``STOP_GRACE`` from then on, see :meth:`end_stalled`)."""
        with self._live_lock:
            self._writing[request] = time.monotonic()
            limit = min(self.deadlines.header, STOP_GRACE) if self._closing else self.deadlines.header
        try:
            yield limit
        finally:
            with self._live_lock:
                del self._writing[request]
                self._written.notify_all()

    def get_request(self) -> tuple[socket.socket, Any]:
        request, address = super().get_request()  # type: ignore[misc]
        request.setblocking(True)
        return request, address

    def process_request(self, request: Any, client_address: Any) -> None:
        victim, why = None, "idle or slow the longest"
        with self._live_lock:
            full = len(self._live) >= self.max_clients
            if full:
                # first one being answered whose client has gone (a `next` waiting for a consumer killed since):
                # its request goes on in its thread until its wait ends, so no more than max_clients such
                # (threads and descriptors at most twice max_clients, whatever the clients do)
                answered = [sock for sock, since in self._live.items() if since is None]
                victim = _gone(answered) if len(self._ended) < self.max_clients else None
                waiting = [(since, n, sock) for n, (sock, since) in enumerate(self._live.items()) if since is not None]
                if victim is not None:
                    why = "whose client went away while its request was answered"
                    self._ended.add(victim)
                elif waiting:
                    victim = min(waiting)[2]  # the one that has waited longest for its client
                if victim is not None:
                    del self._live[victim]
                    full = False
            if not full:
                self._live[request] = time.monotonic()
        if victim is not None:
            said = self._said.admit(why)  # one line per connection ended: thousands under a storm of connections
            if said is not None:
                log.info("max_clients (%d) connections open: ending the one %s to make room%s", self.max_clients, why, said)
            end(victim)
        if full:
            said = self._said.admit("refused")
            if said is not None:
                log.warning("refusing a connection: %d clients already connected (max_clients)%s", self.max_clients, said)
            body = b'{"error": "unavailable", "message": "too many connections (max_clients)"}\n'
            try:
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
            except OSError:
                pass  # the refused client is gone already; nothing to tell it
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def accept_queued(self) -> None:
        """Once the accept loop has stopped: accept the connections queued on the listening
        socket, each served in its thread like any other (the daemon is stopping: a ``next`` or
        an ack is answered 503 ``stopping``), then close the socket, so that none queues up to
        wait for the end of the stop (a TCP client is refused at once). Idempotent."""
        listener: socket.socket = self.socket  # type: ignore[attr-defined]  # of the socketserver class mixed in
        if listener.fileno() < 0:
            return
        for _ in range(2 * self.request_queue_size):  # what the queue holds, and a few arriving meanwhile
            try:
                request, address = self.get_request()
            except OSError:  # none left (BlockingIOError), or accept failed (EMFILE): reset by the close below
                break
            try:
                self.process_request(request, address)
            except RuntimeError:  # no thread for it ("can't start new thread"): logged, and the connection ended
                self.handle_error(request, address)
                self.shutdown_request(request)
        listener.close()

    def shutdown_request(self, request: Any) -> None:
        with self._live_lock:
            self._live.pop(request, None)
            self._ended.discard(request)
        super().shutdown_request(request)  # type: ignore[misc]

    def disconnect_all(self) -> None:
        """End every connection waiting for its client (idle between requests, or still sending
        one): its thread sees EOF and finishes. A connection whose request is being answered is
        left to write its answer (a consumer's ``next`` woken by the stop gets its 503
        ``stopping``, not a closed connection), within ``STOP_GRACE`` (:meth:`answering`,
        :meth:`end_stalled`), and ends when it next waits (:meth:`set_waiting`):
        ``server_close`` joins its thread. Idempotent."""
        with self._live_lock:  # atomic with set_waiting: a request read meanwhile is answered
            if not self._closing:
                self._closing, self._closed_at = True, time.monotonic()
            for request, since in self._live.items():
                if since is not None:
                    end(request)

    def end_stalled(self, deadline: float) -> None:
        """After :meth:`disconnect_all`: wait until ``deadline`` (a ``time.monotonic()`` value)
        at most for the answers being written when it was called, then end the connections of
        those not written yet: their clients do not take them (an answer begun later has
        ``STOP_GRACE`` of its own). A client that reads has its answer long before."""
        with self._live_lock:
            while (left := deadline - time.monotonic()) > 0 and any(since <= self._closed_at for since in self._writing.values()):
                self._written.wait(left)
            stalled = [request for request, since in self._writing.items() if since <= self._closed_at]
            for request in stalled:  # under the lock: its thread cannot have closed it meanwhile
                end(request)  # the write fails at once, and its thread finishes
        if stalled:
            log.info(
                "ended %d connection(s) whose client did not take its answer within %g s of the stop", len(stalled), STOP_GRACE
            )

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            log.info("a client connection ended abruptly: %s", exc)
        else:
            log.exception("error while serving a connection")  # noqa: LOG004 - socketserver calls handle_error from inside its except block


def _gone(requests: list[socket.socket]) -> socket.socket | None:
    """One of ``requests`` whose client has closed (or reset) its connection, if any: readable at
    its end of file. A connection being answered is readable otherwise only with the next request
    of a client that sends it before its answer came (alive). Does not block."""
    poller = select.poll()
    for request in requests:
        poller.register(request, select.POLLIN | select.POLLRDHUP)
    by_fd = {request.fileno(): request for request in requests}
    for fd, events in poller.poll(0):
        if events & (select.POLLHUP | select.POLLERR):
            return by_fd[fd]
        try:
            if not by_fd[fd].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return by_fd[fd]
        except BlockingIOError:
            continue
        except OSError:
            return by_fd[fd]
    return None


def end(request: socket.socket) -> None:
    """Shut a connection down: its thread's read sees EOF, and the thread closes it."""
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError as exc:
        if exc.errno not in (errno.ENOTCONN, errno.EBADF):
            raise


class UnixServer(Server, socketserver.UnixStreamServer):
    pass


class TcpServer(Server, socketserver.TCPServer):
    allow_reuse_address = True


class Tcp6Server(TcpServer):
    address_family = socket.AF_INET6
