"""A fault-injecting TCP proxy for tests: sits between a store client and the moto server.

Faults apply to new connections, in order: ``proxy.inject("cut", 3)`` makes the next three
connections relay the request but only the first ``cut_after`` bytes of the response, then
close (a connection dropped mid-body); ``"reset"`` the same, but resets the connection (a TCP
RST: the client's read raises ``ConnectionResetError``, where a close reads as the body's end).
``"503"`` answers an S3 ``SlowDown`` error, ``"403"`` an ``AccessDenied``, ``"InvalidAccessKeyId"``
and ``"SignatureDoesNotMatch"`` a 403 with that code (rejected credentials: the moto server
accepts any), ``"redirect"`` a ``PermanentRedirect`` naming another region in
``x-amz-bucket-region``, ``"NoSuchUpload"`` a 404 with that code (a multipart upload that is no
more: what some S3 stores answer to a completion retried after the first completed it);
``"refuse"`` closes at once, ``"corrupt"`` relays the response with flipped body bytes (same
length), ``"trickle"`` relays the response in pieces of
``trickle_bytes`` a millisecond apart (a body coming in over a slow link, packet by packet).
``"stall"`` relays the first ``cut_after`` bytes of the response, then nothing, and keeps the
connection open (a stream that stops mid-body). ``proxy.drop_all()`` closes live (pooled)
connections so faults take effect. Clients see TCP segments of an Ethernet link (``SEGMENT``), not loopback's.
``proxy.requests`` holds the head of every request (request line and headers) in arrival
order, and ``proxy.ended`` those of each connection that ended (the client or the server
closed it); a request's body is not told from heads: a blank line (``\r\n\r\n``) in it, which
random bytes of 11 MiB hold about once in 400, ends a "head" of the bytes before it (which no
test's match takes for a request line). ``proxy.hold(match, gate)`` holds each request whose head ``match`` accepts until
``gate`` is set (``limit``, 30 s by default, at most; :attr:`hold_timeouts` counts the waits
that ran out); given ``answer`` (a canned fault: ``"403"``...), a held request is then answered
with it, not relayed (a request the store refuses once it is under way); given ``answer="lost"``,
it is relayed and the server handles it, but its answer is lost: the connection is closed as the
answer begins, none of it sent (an answer cut after the store did the work: the client retries a
request that was done); ``keep=True`` adds a hold to those given before (a request takes the first
that matches it). :func:`silent` is an endpoint that takes requests and never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SEGMENT = 1448  # bytes: the TCP segments of an Ethernet link (MTU 1,500), not loopback's 64 KiB
SLOWDOWN = b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
SLOWDOWN_BODY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>'  # noqa: E501 - kept whole
DENIED = b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
DENIED_BODY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
REDIRECT = (
    b"HTTP/1.1 301 Moved Permanently\r\nContent-Type: application/xml\r\nx-amz-bucket-region: eu-central-1\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n"
)
REDIRECT_BODY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code><Message>Use the eu-central-1 endpoint.</Message></Error>'  # noqa: E501 - kept whole
REJECTED = {
    "InvalidAccessKeyId": b"The AWS Access Key Id you provided does not exist in our records.",
    "SignatureDoesNotMatch": b"The request signature we calculated does not match the signature you provided.",
}
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/xml\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
NO_SUCH_UPLOAD_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchUpload</Code><Message>The specified upload does not exist. '
    b"The upload ID may be invalid, or the upload may have been aborted or completed.</Message></Error>"
)
CANNED = {
    "503": (SLOWDOWN, SLOWDOWN_BODY),
    "403": (DENIED, DENIED_BODY),
    "redirect": (REDIRECT, REDIRECT_BODY),
    "NoSuchUpload": (NOT_FOUND, NO_SUCH_UPLOAD_BODY),
}
_REJECTED_BODY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>%s</Code><Message>%s</Message></Error>'
CANNED.update({code: (DENIED, _REJECTED_BODY % (code.encode(), text)) for code, text in REJECTED.items()})
LOST = "lost"
"""The ``answer`` of :meth:`FaultProxy.hold` that relays the request and loses the server's answer."""


def once(match: Callable[[str], bool]) -> Callable[[str], bool]:
    """``match`` for the first request it accepts only (a ``hold``'s match)."""
    taken: list[str] = []

    def first(head: str) -> bool:
        if taken or not match(head):
            return False
        taken.append(head)
        return True

    return first


class FaultProxy:
    def __init__(self, target_host: str, target_port: int, cut_after: int = 2000, trickle_bytes: int = 4096) -> None:
        self.target = (target_host, target_port)
        self.cut_after = cut_after
        self.trickle_bytes = trickle_bytes
        self.faults: deque[list] = deque()  # [kind, connections left]
        kinds = ("cut", "reset", "stall", "refuse", "corrupt", "trickle", *CANNED)
        self.injected: dict[str, int] = dict.fromkeys(kinds, 0)
        self.connections = 0
        self.requests: list[str] = []
        self.ended: list[str] = []
        self._holds: list[tuple[Callable[[str], bool], threading.Event, float, str | None]] = []
        self.hold_timeouts = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-faultproxy")
        self._lock = threading.Lock()

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(5)
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def inject(self, kind: str, count: int) -> None:
        with self._lock:
            self.faults.append([kind, count])
        self.drop_all()

    def hold(
        self,
        match: Callable[[str], bool],
        gate: threading.Event,
        limit: float = 30.0,
        answer: str | None = None,
        keep: bool = False,
    ) -> None:
        """Hold each request whose head (request line and headers) ``match`` accepts until
        ``gate`` is set, ``limit`` seconds at most (set ``gate`` before the proxy stops); then
        relay it, or answer it with ``answer`` (a key of ``CANNED``) and close the connection, or
        (``answer`` :data:`LOST`) relay it and close the connection as the server's answer begins.
        ``keep``: the holds given before stay (a request takes the first one that matches it);
        else this one replaces them."""
        if answer is not None and answer not in CANNED and answer != LOST:
            raise ValueError(f"answer {answer!r}: expected one of {sorted(CANNED)} or {LOST!r}")
        self._holds = [*self._holds, (match, gate, limit, answer)] if keep else [(match, gate, limit, answer)]

    def clear(self) -> None:
        """No more faults: pass everything through."""
        with self._lock:
            self.faults.clear()

    def drop_all(self) -> None:
        def close() -> None:
            for w in list(self._writers):
                w.transport.abort()

        self._loop.call_soon_threadsafe(close)

    # ---- the event loop thread -------------------------------------------------------
    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, SEGMENT)  # advertised to clients
        listener.bind(("127.0.0.1", 0))
        accepted: set[asyncio.BaseTransport] = set()  # the clients' connections, until each is lost

        def protocol() -> asyncio.StreamReaderProtocol:  # asyncio.start_server's, kept in ``accepted``
            return _Kept(accepted, asyncio.StreamReader(loop=self._loop), self._handle, loop=self._loop)

        server = self._loop.run_until_complete(self._loop.create_server(protocol, sock=listener))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            # A connection accepted as the proxy stops was left open (its ResourceWarning failed the
            # test running then): its transport is made in a later turn of the loop, which failed
            # once the server was closed; its handler, cancelled before it began, never closed it.
            self._loop.remove_reader(listener.fileno())  # no more accepts
            self._loop.run_until_complete(asyncio.sleep(0))  # those under way make their transports
            server.close()
            for w in list(self._writers):
                w.transport.abort()
            self._loop.run_until_complete(server.wait_closed())
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            for transport in list(accepted):  # their handlers never began
                transport.abort()
            self._loop.run_until_complete(asyncio.sleep(0))  # an abort closes its socket in a later turn
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self.connections += 1
            fault = None
            if self.faults:
                fault = self.faults[0][0]
                self.faults[0][1] -= 1
                if self.faults[0][1] == 0:
                    self.faults.popleft()
                self.injected[fault] += 1
        self._writers.add(writer)
        heads: list[str] = []  # this connection's requests
        upstream: asyncio.StreamWriter | None = None
        try:
            if fault == "refuse":
                writer.transport.abort()
                return
            if fault in CANNED:
                self._record(await reader.readuntil(b"\r\n\r\n"))  # a canned answer: nothing held
                head, body = CANNED[fault]
                writer.write(head % len(body) + body)
                await writer.drain()
                writer.close()
                return
            up_reader, upstream = await asyncio.open_connection(*self.target)
            self._writers.add(upstream)
            lost = asyncio.Event()  # a request held with answer LOST went upstream: its answer is not relayed
            await asyncio.gather(
                self._pipe(reader, upstream, record=heads, client=writer, lost=lost),
                self._pipe(up_reader, writer, fault, lost=lost),
            )
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass  # a client or upstream went away: that is what this proxy is for
        finally:
            for end in (writer, upstream):  # the pipes close them, unless cancelled before they began
                if end is not None:
                    self._writers.discard(end)
                    end.transport.abort()
            with self._lock:
                self.ended.extend(heads)

    def _record(self, heads: bytes) -> tuple[list[str], bytes]:
        """Append the complete request heads in ``heads`` to :attr:`requests`; return them and the rest."""
        *complete, rest = heads.split(b"\r\n\r\n")
        got = [h.decode("latin-1") for h in complete]
        with self._lock:
            self.requests.extend(got)
        return got, rest

    async def _held(self, heads: list[str]) -> str | None:
        """Wait for the gate of :meth:`hold` if one of ``heads`` is to be held; return the
        canned answer to give instead of relaying it, if the hold has one."""
        hold = next((h for h in self._holds if any(h[0](head) for head in heads)), None)
        if hold is None:
            return None
        if not await self._loop.run_in_executor(None, hold[1].wait, hold[2]):
            self.hold_timeouts += 1
        return hold[3]

    @staticmethod
    async def _drain_body(reader: asyncio.StreamReader, head: str, had: int) -> None:
        """Read the rest of the body of the request ``head`` (``had`` bytes of it read), unless
        the client waits for the answer before it sends the body (``Expect: 100-continue``): a
        client that sends all of it before it reads the answer (http.client, the OBS SDK's) met a
        reset connection, not the answer, when the proxy answered and closed in the middle."""
        found = re.search(r"\r\ncontent-length:\s*(\d+)", head, re.IGNORECASE)
        if found is None or re.search(r"\r\nexpect:\s*100-continue", head, re.IGNORECASE):
            return  # the body waits for the answer (botocore's uploads; cachepipe's own go without Expect)
        left = int(found.group(1)) - had
        while left > 0 and (data := await reader.read(min(left, 65536))):
            left -= len(data)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        fault: str | None = None,
        record: list[str] | None = None,
        client: asyncio.StreamWriter | None = None,
        lost: asyncio.Event | None = None,
    ) -> None:
        """Relay ``reader`` to ``writer`` (a response with ``fault`` applied; ``record``: requests,
        whose heads are appended to it too, and a held one answered to ``client`` when the hold
        says so, the connection then closed). ``lost``: set by the requests' pipe before it relays
        a request held with :data:`LOST`; the responses' pipe then ends at the answer's first
        bytes, sending none of them (the connection closes)."""
        limit = self.cut_after if fault in ("cut", "reset", "stall") else None
        sent = 0
        pending = b""
        ended = False  # at the sender's end of file
        try:
            while data := await reader.read(65536):
                if record is not None:
                    heads, pending = self._record(pending + data)
                    record.extend(heads)
                    answer = await self._held(heads)
                    if answer == LOST and lost is not None:
                        lost.set()  # before the request goes on: the answer that comes is its own
                    elif answer is not None and client is not None:  # answered here, not relayed: the client's end closes
                        await self._drain_body(reader, heads[-1], len(pending))
                        head, body = CANNED[answer]
                        client.write(head % len(body) + body)
                        with contextlib.suppress(OSError):
                            await client.drain()
                            client.close()
                            await client.wait_closed()
                        break
                if record is None and lost is not None and lost.is_set():  # the server answered: the answer is lost
                    break
                if fault == "corrupt" and sent + len(data) > 4096:  # past the headers: flip one body byte per chunk
                    data = data[:-1] + bytes([data[-1] ^ 0xFF])
                if limit is not None and sent + len(data) >= limit:
                    writer.write(data[: limit - sent])
                    await writer.drain()
                    if fault == "stall":  # open and silent until the client goes or the proxy stops
                        await writer.wait_closed()
                    if fault == "reset":  # closed with nothing lingering: the kernel sends RST, not FIN
                        sock = writer.get_extra_info("socket")
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                if fault == "trickle":
                    for at in range(0, len(data), self.trickle_bytes):
                        writer.write(data[at : at + self.trickle_bytes])
                        await writer.drain()
                        await asyncio.sleep(0.001)
                else:
                    writer.write(data)
                sent += len(data)
                await writer.drain()
            else:
                ended = True
        finally:
            try:
                if ended:
                    # what was relayed reaches the other end before this side closes: an abort
                    # dropped what drain() had left buffered (up to 64 KiB), and the moto server
                    # closes after each response, so a client slower than it got a short body
                    with contextlib.suppress(OSError):  # the other end went away meanwhile
                        writer.close()
                        await writer.wait_closed()
            finally:
                self._writers.discard(writer)
                writer.transport.abort()


class _Kept(asyncio.StreamReaderProtocol):
    """The protocol of :func:`asyncio.start_server`, which keeps its connection in ``accepted``
    until the connection is lost."""

    def __init__(self, accepted: set[asyncio.BaseTransport], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._accepted = accepted
        self._connection: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connection = transport
        self._accepted.add(transport)
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._connection is not None:
            self._accepted.discard(self._connection)
        super().connection_lost(exc)


@contextmanager
def silent() -> Iterator[tuple[str, threading.Event]]:
    """An endpoint that accepts connections and reads what comes, but never answers (a store that
    stopped answering): ``(url, asked)``, ``asked`` set once a request's first bytes came. Its
    connections stay open until the block ends."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    asked, stop = threading.Event(), threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed: the block ended
            conns.append(conn)
            try:
                if conn.recv(65536):
                    asked.set()
            except OSError:
                pass  # shut down: the block ended

    thread = threading.Thread(target=serve, name="test-silent")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", asked
    finally:
        stop.set()
        for sock in [server, *conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the accept, or a read
            except OSError:
                pass  # the client shut it down first
        thread.join(5)
        for sock in [server, *conns]:
            sock.close()


@contextmanager
def blackhole() -> Iterator[str]:
    """An endpoint whose connections time out, as behind a firewall that drops packets: a
    listening socket whose accept queue (backlog 0) one connection fills, so that the kernel
    drops every later SYN."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    filler = socket.create_connection(server.getsockname(), timeout=5)
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        filler.close()
        server.close()
