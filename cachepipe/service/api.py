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
its next request; a late request is answered 408 and its connection closed. Request line and
headers are capped at ``MAX_HEADER`` bytes in all (431), the body at ``MAX_BODY`` (413); a body
that is not JSON, or nested too deeply to parse, is a 400, and so is a ``Content-Length`` that is
given twice or is not a plain number. When ``max_clients`` connections are open, a new one ends
the connection that has waited longest for its client (idle, or still sending a request), so
connections that send nothing useful cannot lock consumers out; only when every connection is
busy being answered is the new one refused (503).

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
"""

from __future__ import annotations

import errno
import grp
import io
import json
import logging
import os
import re
import select
import selectors
import socket
import stat
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from .. import __version__
from ..client import MAX_BATCH
from ..errors import ConfigError, ItemFailedError, LaneConflictError, UnknownItemError
from ..pipeline import CachedItem
from ..plan import Cursor
from .config import SOCKET_PATH_MAX, ServiceConfig
from .errors import StoppingError, UnavailableError, UnknownPipelineError
from .http import (
    MAX_HEADER,
    DeadlineReader,
    Deadlines,
    HeaderBudget,
    Late,
    Service,
    Tcp6Server,
    TcpServer,
    UnixServer,
)
from .jobs import JobConflictError
from .metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from ..node import SkippedStep, Taken

__all__ = ["ApiServer", "Deadlines", "Service", "item_json"]

log = logging.getLogger("cachepipe.service.api")

MAX_BODY = 1024 * 1024
_DIGITS = re.compile(r"^[0-9]+$")
_NEXT_RE = re.compile(r"^/v1/pipelines/([^/]+)/next$")
_JOB_RE = re.compile(r"^/v1/jobs/([^/]+)(/take|/consume)?$")
_JSON = "application/json"


class BadRequest(ValueError):
    """A malformed request (HTTP 400, or ``status`` when given)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def item_json(pipeline: str, item: CachedItem) -> dict[str, Any]:
    """The body of a ``next`` answer."""
    return {
        "pipeline": pipeline,
        "name": item.name,
        "path": str(item),  # the path, as a string (no Path made)
        "lease": item.lease,
        "size": item.size,
        "files": list(item.files),
    }


def _error_for(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, BadRequest):
        return exc.status, "bad_request" if exc.status == 400 else HTTPStatus(exc.status).phrase.lower().replace(" ", "_")
    for kind, status, code in (
        (UnknownPipelineError, 404, "not_found"),
        (UnknownItemError, 409, "lease_conflict"),
        (JobConflictError, 409, "conflict"),
        (LaneConflictError, 409, "lane_conflict"),
        (TimeoutError, 408, "timeout"),
        (ItemFailedError, 502, "item_failed"),
        (StoppingError, 503, "stopping"),
        (UnavailableError, 503, "unavailable"),
        (ValueError, 400, "bad_request"),
    ):
        if isinstance(exc, kind):
            return status, code
    return 500, "internal"


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
            self.raw_requestline = budget.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.send_error(414, explain="request line over 65536 bytes")
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
                {"error": "bad_request" if code == 400 else HTTPStatus(code).phrase.lower().replace(" ", "_"), "message": text},
            )
        except OSError:
            pass  # the client went away

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
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            status = 499  # the client went away
        except Exception as exc:  # every failure becomes an HTTP error; unexpected ones are logged in full
            status, code = _error_for(exc)
            if status == 500:
                log.exception("%s %s failed", method, path)
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
                raise ConnectionResetError(errno.ECONNRESET, "the consumer closed its connection while its request waited")
            if count is None:
                return self._reply(200, item_json(name, items[0]))
            return self._reply(200, {"pipeline": name, "items": [item_json(name, item) for item in items]})
        except OSError:
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
            raise ConnectionResetError(f"the client closed the connection after {len(raw)} of {length} body bytes")
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
        self.connection.settimeout(self.server.deadlines.header)  # a client that does not read its answer
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"Server: {self.server_version}"]
        if status != 204:
            lines += [f"Content-Type: {content_type}", f"Content-Length: {len(raw)}"]
        if self.server.daemon_stopping():
            self.close_connection = True
        if self.close_connection:
            lines.append("Connection: close")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (raw if status != 204 else b""))
        return status


def _match(path: str) -> tuple[str | None, str, tuple[str, ...]]:
    """(route handler name, its argument, allowed methods) for a request path."""
    fixed = {
        "/v1/health": ("health", "", ("GET",)),
        "/v1/status": ("status", "", ("GET",)),
        "/metrics": ("metrics", "", ("GET",)),
        "/v1/metrics": ("metrics", "", ("GET",)),
        "/v1/ack": ("finish", "ack", ("POST",)),
        "/v1/release": ("finish", "release", ("POST",)),
        "/v1/renew": ("finish", "renew", ("POST",)),
    }
    if path in fixed:
        return fixed[path]
    match = _NEXT_RE.match(path)
    if match:
        return "next", match.group(1), ("POST",)
    if path == "/v1/manifests":
        return "manifest", "", ("PUT", "POST")
    if path.startswith("/v1/manifests/") and path.count("/") == 3:
        return "manifest", path.rsplit("/", 1)[1], ("GET",)
    match = _JOB_RE.match(path)
    if match:
        name = unquote(match.group(1))  # JobClient quotes it: a name with "/" arrives whole, and is refused
        if match.group(2) is None:
            return "job", name, ("PUT", "DELETE")
        return match.group(2)[1:], name, ("POST",)
    return None, "", ()


#: the keys each route's JSON body may have (a job's spec is checked by its model, .jobs.JobSpec)
_BODY_KEYS = {
    "next": frozenset({"timeout", "ack", "acks", "count", "markers"}),
    "finish": frozenset({"path", "lease", "items"}),
    "take": frozenset({"rank", "worker", "epoch", "index", "timeout", "count", "max_bytes", "report_skips"}),
    "consume": frozenset({"rank", "worker", "epoch", "index"}),
    "manifest": frozenset({"source", "items"}),
}


_ACK_KEYS = frozenset({"path", "lease"})
_ACKS_IN = {"next": ("ack", "acks"), "finish": ("items",)}  # the body keys holding ack objects (or lists of them)


def _check_keys(method: str, path: str, route: str, body: dict[str, Any]) -> None:
    """Refuse a body key the route does not know, and a key of an ack object other than
    ``path`` and ``lease`` (400, naming it and the keys taken): a misspelt option ("time_out",
    "leese": an ack without its lease applies to whoever holds the item) or one this daemon is
    too old for ("report_skips") would otherwise be ignored, silently. A GET or DELETE takes no
    body key (a job's ``DELETE`` with ``{"force": true}`` would do what a plain one does)."""
    known = frozenset() if method in ("GET", "DELETE") else _BODY_KEYS.get(route)
    if known is not None:
        _refuse_unknown(f"{method} {path}", body, known, "in the body")
    for key in _ACKS_IN.get(route, ()):
        value = body.get(key)
        for ack in value if isinstance(value, list) else [value]:
            if isinstance(ack, dict):  # other shapes are refused by the route, naming them
                _refuse_unknown(f"{method} {path}", ack, _ACK_KEYS, f"in an object of {key!r}")


def _refuse_unknown(request: str, given: dict[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        names, expected = ", ".join(repr(k[:40]) for k in unknown[:5]), ", ".join(repr(k) for k in sorted(known))
        taken = f"expected some of {expected}" if known else "it takes none"
        raise BadRequest(f"{request}: unknown key(s) {names} {where}: {taken}")


def _taken_json(job: str, taken: Taken | SkippedStep) -> dict[str, Any]:
    from ..node import SkippedStep  # loaded with the first job: not at the daemon's start

    if isinstance(taken, SkippedStep):  # asked for with report_skips: no path
        cursor = taken.cursor
        return {
            "job": job,
            "skipped": True,
            "name": taken.name,
            "reason": taken.reason,
            "epoch": cursor.epoch,
            "index": cursor.index,
            "next": list(taken.after),
        }
    item = taken.item
    return {
        "job": job,
        "name": item.name,
        "path": str(item),  # the path, as a string (no Path made)
        "size": item.size,
        "files": list(item.files),
        "epoch": taken.cursor.epoch,
        "index": taken.cursor.index,
        "next": list(taken.after),
    }


def _lane(body: dict[str, Any]) -> tuple[int, int, Cursor]:
    """``(rank, worker, cursor)`` of a lane request, checked."""
    values = []
    for key, default in (("rank", None), ("worker", 0), ("epoch", 0), ("index", 0)):
        value = body.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadRequest(f"{key!r} {value!r}: expected an integer >= 0" + (" (required)" if default is None else ""))
        values.append(value)
    rank, worker, epoch, index = values
    return rank, worker, Cursor(epoch, index)


class _TcpHandler(_Handler):
    disable_nagle_algorithm = True


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
        return not self._daemon.running and self._thread is not None

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
        socket, or one that serves). The rename is atomic and keeps the mode and group.

        Raises:
            OSError: a live daemon started serving on the path meanwhile.
        """
        path = self._config.socket
        if self._path is None or self._path == path:
            return
        _clear_stale(path)
        os.rename(self._path, path)
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
        self._unlink()
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join()
            for server in self._servers:
                server.accept_queued()

    def close(self) -> None:
        """End every connection, join their threads, close and remove the socket. Idempotent."""
        if self._wake_r < 0:
            return
        self.stop_accepting()
        self._thread = None
        for server in self._servers:
            server.disconnect_all()
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
