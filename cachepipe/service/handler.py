"""One connection to the daemon's API: its requests read under deadlines and size limits,
routed (:mod:`cachepipe.service.routes`) to the handler of each route, which calls the daemon
(the :class:`~cachepipe.service.http.Service` protocol) and replies with JSON.

Invariant: every request is answered (an error as ``{"error": CODE, "message": TEXT}``) or its
connection closed; a request late past its deadline is answered 408 and its connection closed,
and an item whose consumer went away before it received it is released at once. A request goes
unanswered only when its client's own socket fails (:class:`~cachepipe.service.errors.ClientGone`,
raised by the reads of the request and the write of its answer); a ``BrokenPipeError`` or
``ConnectionResetError`` from a route's work (a pipe, a store's connection) is answered 500 and
logged like any other failure.
:class:`~cachepipe.service.api.ApiServer` runs one such handler per connection.
"""

from __future__ import annotations

import io
import json
import logging
import re
import select
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from .. import __version__
from ..batching import MAX_BATCH
from ..errors import DAEMON_STORE_CODES
from .errors import ClientGone
from .http import MAX_HEADER, DeadlineReader, HeaderBudget, HeadersTooLarge, Late, Service, TcpServer, UnixServer, Unread
from .metrics import CONTENT_TYPE
from .routes import BadRequest, _check_keys, _error_for, _lane, _match, _taken_json, item_json, malformed_code

__all__: list[str] = []

log = logging.getLogger("cachepipe.service.api")

LINGER_BYTES = 64 << 20
"""The most a connection reads and drops after answering a malformed request (see
:meth:`_Handler._linger`): a client sending more gets its write failed (EPIPE) at that point."""


MAX_BODY = 1024 * 1024
_DIGITS = re.compile(r"^[0-9]+$")
_JSON = "application/json"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"cachepipe/{__version__}"
    sys_version = ""
    server: UnixServer | TcpServer
    rfile: io.BufferedReader

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a reader with deadlines
        self._reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        """Wait for a request (``idle_timeout``), read its line and headers (``header_timeout``,
        ``MAX_HEADER``), then route it (the body is read under ``body_timeout``)."""
        server, reader = self.server, self._reader
        server.set_waiting(self.connection, True)  # may be ended to make room from now on
        try:
            reader.deadline, reader.phase = time.monotonic() + server.deadlines.idle, "idle"
            if not self.rfile.peek(1):
                self.close_connection = True  # the client closed the connection
                return
            reader.deadline, reader.phase = time.monotonic() + server.deadlines.header, "headers"
            budget = HeaderBudget(self.rfile, MAX_HEADER)
            try:
                self.raw_requestline = budget.readline()
            except HeadersTooLarge:
                self.send_error(431, explain=f"request line over {MAX_HEADER} bytes: expected a method, a path and HTTP/1.1")
                return
            self.rfile, real = budget, self.rfile  # type: ignore[assignment]  # parse_request reads the headers
            try:
                parsed = self.parse_request()
            finally:
                self.rfile = real
            if not parsed:
                return
            handler = getattr(self, f"do_{self.command}", None)
            if handler is None:
                self.send_error(501, explain=f"method {self.command!r}: expected GET or POST")
                return
            handler()
            self.wfile.flush()
        except Late as exc:
            self.close_connection = True
            if exc.args[0] == "idle":
                log.debug("%s: closed a connection idle for %g s (idle_timeout)", self.address_string(), server.deadlines.idle)
                return
            log.info(
                "%s: request %s not received within header_timeout (%g s)",
                self.address_string(),
                exc.args[0],
                server.deadlines.header,
            )
            self._reply_late(f"request {exc.args[0]} not received within header_timeout ({server.deadlines.header:g} s)")
        except ConnectionError:
            self.close_connection = True  # gone, or ended to make room for another connection
        finally:
            server.set_waiting(self.connection, False)

    def _reply_late(self, message: str) -> None:
        try:
            self._reply(408, {"error": "request_timeout", "message": message})
        except OSError:
            pass  # a client too slow to send is often too slow to read: nothing more to tell it

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own answers (malformed request line or headers) as our JSON."""
        self.close_connection = True
        text = explain or message or HTTPStatus(code).phrase
        log.info("%s: %d %s", self.address_string(), code, text)
        try:
            self._reply(
                code,
                {"error": malformed_code(code), "message": text},
            )
        except OSError:
            return  # the client went away
        self._linger()

    def _linger(self) -> None:
        """After the answer to a malformed request, whose client may still be sending it (a
        request line of megabytes): say the answer's end (shutdown for writing), then read and
        drop what comes, up to :data:`LINGER_BYTES`, until the client closes or the request's
        ``header_timeout`` passes. Closing at once, with its input unread, failed the client's
        write (EPIPE) before it could read the answer."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            left = LINGER_BYTES
            while left > 0 and (dropped := self.rfile.read1(min(left, 1 << 16))):
                left -= len(dropped)
        except OSError:  # gone, or the deadline passed (Late): the connection ends either way
            pass

    def address_string(self) -> str:
        return self.client_address[0] if isinstance(self.client_address, tuple) else "unix"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature (BaseHTTPRequestHandler.log_message)
        log.debug("%s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature (BaseHTTPRequestHandler.log_message)
        log.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def _route(self, method: str) -> None:
        daemon = self.server.daemon
        path = self.path.partition("?")[0]
        route, arg, allowed = _match(path)
        status = 500
        try:
            body = {} if route == "manifest" and method == "PUT" else self._body()
            if route is None:
                raise BadRequest(f"no route {path!r}: see GET /v1/status, POST /v1/pipelines/NAME/next, POST /v1/ack", 404)
            if method not in allowed:
                raise BadRequest(f"{method} {path}: expected {' or '.join(allowed)}", 405)
            _check_keys(method, path, route, body)
            status = getattr(self, "_" + route)(daemon, arg, body)
        except ClientGone:  # raised for the client's own socket only: a route's BrokenPipeError is its failure
            self.close_connection = True
            status = 499  # the client went away, or does not take its answer: nothing more is written
        except Exception as exc:  # every failure becomes an HTTP error; unexpected ones are logged in full
            status, code = _error_for(exc)
            if status == 500:
                log.exception("%s %s failed", method, path)
            elif code in DAEMON_STORE_CODES or status == 507:  # the store's failure or a full disk: the message names it
                log.warning("%s %s: %d %s: %s", method, path, status, code, exc)
            extra = {"Allow": ", ".join(allowed)} if status == 405 else {}
            try:
                self._reply(status, {"error": code, "message": str(exc)}, headers=extra)
            except OSError:
                self.close_connection = True  # the client went away; nothing more to tell it
        daemon.metrics.requests.labels(route or "unknown", str(status)).inc()

    # ---- routes: each replies and returns its status -----------------------------------
    def _health(self, daemon: Service, _arg: str, _body: dict[str, Any]) -> int:
        ok, body = daemon.health()
        return self._reply(200 if ok else 503, body)

    def _status(self, daemon: Service, _arg: str, _body: dict[str, Any]) -> int:
        return self._reply(200, daemon.status())

    def _metrics(self, daemon: Service, _arg: str, _body: dict[str, Any]) -> int:
        return self._reply(200, raw=daemon.metrics.render(), content_type=CONTENT_TYPE)

    def _next(self, daemon: Service, name: str, body: dict[str, Any]) -> int:
        timeout = body.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0):
            raise BadRequest(f"'timeout' {timeout!r}: expected seconds as a number >= 0, or null for the daemon's max_wait")
        ack, acks, count = body.get("ack"), body.get("acks"), body.get("count")
        if ack is not None and not isinstance(ack, dict):
            raise BadRequest(f'\'ack\' {ack!r}: expected an object {{"path": ..., "lease": ...}}')
        if acks is not None and not (isinstance(acks, list) and all(isinstance(a, dict) for a in acks)):
            raise BadRequest(f'\'acks\' {acks!r}: expected a list of objects {{"path": ..., "lease": ...}}')
        if acks is not None and len(acks) > MAX_BATCH:
            raise BadRequest(f"'acks' of {len(acks)} items: expected at most {MAX_BATCH} per request")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_BATCH):
            raise BadRequest(f"'count' {count!r}: expected an integer from 1 to {MAX_BATCH}")
        markers = body.get("markers", True)
        if not isinstance(markers, bool):
            raise BadRequest(
                f"'markers' {markers!r}: expected true (the default: a .done made in the items acknowledges them) or "
                "false (this consumer acknowledges over the API or by deleting the item: the items are not watched)"
            )
        items = daemon.take_many(name, timeout, count or 1, [*([ack] if ack else []), *(acks or [])], markers)
        if not items:
            return self._reply(204)
        try:
            if self._peer_closed():  # over TCP the reply's write would still succeed
                raise ClientGone("the consumer closed its connection while its request waited")
            if count is None:
                return self._reply(200, item_json(name, items[0]))
            return self._reply(200, {"pipeline": name, "items": [item_json(name, item) for item in items]})
        except ClientGone:
            log.info("%s: consumer went away before receiving %s; released", name, ", ".join(i.name for i in items))
            for item in items:
                daemon.finish("release", str(item), item.lease)
            raise

    def _peer_closed(self) -> bool:
        """True if the client has closed or reset its connection (a consumer killed while its
        ``next`` waited). A waiting client sends nothing, so the socket is readable only at its
        end of file (or with the next request of a client that did not wait, which is alive).
        Over a Unix socket writing the reply would fail; over TCP the first write to a closed
        peer succeeds, and the items would be leased to nobody until ``lease_timeout``."""
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        if not poller.poll(0):
            return False
        try:
            peeked: bytes = self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True
        return not peeked

    def _job(self, daemon: Service, name: str, body: dict[str, Any]) -> int:
        if self.command == "DELETE":
            daemon.delete_job(name)
            return self._reply(200, {"job": name, "result": "deleted"})
        created, info = daemon.register_job(name, body)
        return self._reply(200, {**info, "created": created})

    def _take(self, daemon: Service, name: str, body: dict[str, Any]) -> int:
        timeout = body.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0):
            raise BadRequest(f"'timeout' {timeout!r}: expected seconds as a number >= 0, or null for the daemon's max_wait")
        rank, worker, cursor = _lane(body)
        count, max_bytes = body.get("count"), body.get("max_bytes")
        for key, value in (("count", count), ("max_bytes", max_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise BadRequest(f"{key!r} {value!r}: expected an integer >= 1, or null")
        report = body.get("report_skips", False)
        if not isinstance(report, bool):
            raise BadRequest(f"'report_skips' {report!r}: expected true or false")
        got = daemon.take_lane(name, rank, worker, cursor, timeout, count or 1, max_bytes, report)
        if not got:
            return self._reply(204)
        items = [_taken_json(name, taken) for taken in got]
        return self._reply(200, items[0] if count is None else {"job": name, "items": items})

    def _consume(self, daemon: Service, name: str, body: dict[str, Any]) -> int:
        rank, worker, cursor = _lane(body)
        daemon.consume_lane(name, rank, worker, cursor)
        return self._reply(200, {"job": name, "rank": rank, "worker": worker, "consumed_before": list(cursor)})

    def _manifest(self, daemon: Service, digest: str, body: dict[str, Any]) -> int:
        if self.command == "GET":
            return self._reply(200, raw=daemon.manifest_bytes(digest), content_type="application/gzip")
        if self.command == "POST":
            source, items = body.get("source"), body.get("items", "folders")
            if not isinstance(source, str) or not isinstance(items, str):
                raise BadRequest(f"source {source!r}, items {items!r}: expected a source URL and 'folders' or 'files'")
            return self._reply(200, daemon.index_source(source, items))
        length = self._length(daemon.manifest_limit())
        # a deadline that grows with the upload: body_timeout, plus a second per 64 MiB
        reader = self._reader
        reader.deadline, reader.phase = time.monotonic() + self.server.deadlines.body + length / 2**26, "body"
        self.close_connection = True  # a failed upload may leave body bytes unread: never reuse this connection
        try:
            info = daemon.upload_manifest(self.rfile, length)
        except Late:
            raise BadRequest(f"manifest of {length} bytes not received in time", 408) from None
        self.close_connection = False
        self.server.set_waiting(self.connection, False)
        return self._reply(200, info)

    def _finish(self, daemon: Service, verb: str, body: dict[str, Any]) -> int:
        if "items" in body:
            items = body["items"]
            if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH:
                given = f"of {len(items)} items" if isinstance(items, list) else f"{repr(items)[:80]}"  # not the whole body
                raise BadRequest(f'\'items\' {given}: expected a list of 1 to {MAX_BATCH} objects {{"path", "lease"}}')
            pipeline, names = daemon.finish_many(verb, items)
            return self._reply(200, {"pipeline": pipeline, "names": names, "result": verb})
        pipeline, name = daemon.finish(verb, body.get("path"), body.get("lease"))
        return self._reply(200, {"pipeline": pipeline, "name": name, "result": verb})

    # ---- plumbing --------------------------------------------------------------------
    def _length(self, limit: int) -> int:
        """The request's ``Content-Length``, checked (once, digits, at most ``limit``)."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise BadRequest("chunked request bodies are not supported: send Content-Length", 411)
        given = self.headers.get_all("Content-Length") or []
        if len(given) > 1:
            self.close_connection = True  # which one frames the body is ambiguous: request smuggling territory
            raise BadRequest(f"Content-Length given {len(given)} times ({', '.join(map(repr, given))}): expected it once")
        text = given[0].strip() if given else "0"
        if not _DIGITS.match(text):
            self.close_connection = True
            raise BadRequest(f"Content-Length {given[0]!r}: expected a number of bytes")
        length = int(text)
        if length > limit:
            self.close_connection = True
            raise BadRequest(f"request body of {length} bytes: expected at most {limit}", 413)
        return length

    def _body(self) -> dict[str, Any]:
        length = self._length(MAX_BODY)
        reader = self._reader
        reader.deadline, reader.phase = time.monotonic() + self.server.deadlines.body, "body"
        try:
            raw = self.rfile.read(length) if length else b""
        except Late:
            self.close_connection = True
            raise BadRequest(
                f"request body of {length} bytes not received within body_timeout ({self.server.deadlines.body:g} s)", 408
            ) from None
        if len(raw) < length:
            self.close_connection = True
            raise ClientGone(f"the client closed the connection after {len(raw)} of {length} body bytes")
        self.server.set_waiting(self.connection, False)  # the request is in: this connection is busy now
        if not raw.strip():
            return {}
        try:
            data = json.loads(raw)
        except RecursionError:
            raise BadRequest('request body is nested too deeply: expected a JSON object like {"timeout": 5}') from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadRequest(f"request body {raw[:80]!r}: expected a JSON object")
        return data

    def _reply(
        self,
        status: int,
        payload: Any = None,
        *,
        raw: bytes = b"",
        content_type: str = _JSON,
        headers: dict[str, str] | None = None,
    ) -> int:
        if payload is not None:
            raw = json.dumps(payload).encode() + b"\n"
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Server: {self.server_version}"]
        if status != 204:
            lines += [f"Content-Type: {content_type}", f"Content-Length: {len(raw)}"]
        if self.server.daemon_stopping():
            self.close_connection = True
        if self.close_connection:
            lines.append("Connection: close")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        answer = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (raw if status != 204 else b"")
        with self.server.answering(self.connection) as limit:  # a client that does not read its answer
            self.connection.settimeout(limit)
            try:
                self.wfile.write(answer)
            except OSError as exc:  # part of it may be written: never another answer on this connection
                self.close_connection = True
                if isinstance(exc, TimeoutError):
                    log.info("%s: the client did not take its %d answer within %g s", self.address_string(), status, limit)
                raise Unread(f"the {status} answer was not taken by the client: {exc}") from exc
        return status


class _TcpHandler(_Handler):
    disable_nagle_algorithm = True
