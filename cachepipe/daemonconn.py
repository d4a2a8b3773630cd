"""A client's one keep-alive connection to a ``cachepipe serve`` daemon (its Unix socket, or
``http://HOST:PORT``): a request and its answer, reconnecting as needed, the waits for a daemon
that is starting or restarting (:class:`_Outage`), and error answers raised as exceptions
(:class:`ServiceError`, :class:`StoreError` for the daemon's store failing, ``UnknownItemError``
for 409, ``TimeoutError`` for 408).

Invariant: a request the daemon may have carried out (it went away with it, and asking again
would change something: an ack) is never sent twice; one that never reached a daemon, or that
changes nothing, is tried again for up to ``startup_timeout``: once per outage (an
:class:`_Outage` shared by the requests of one operation, such as a loop's acks and releases
as it ends), not once per request. :class:`_Connection` is a base
class of :class:`~cachepipe.client.Client` (not used alone), under its item requests
(:class:`~cachepipe.daemonitems._ItemRequests`); its attributes are set by ``Client.__init__``.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import select
import socket as _socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from .errors import DAEMON_STORE_CODES, CachePipeError, UnknownItemError

__all__ = ["DEFAULT_OUTAGE_TIMEOUT", "DEFAULT_STARTUP_TIMEOUT", "ServiceError", "StoreError", "check_address"]

log = logging.getLogger("cachepipe.client")

DEFAULT_STARTUP_TIMEOUT = 10.0  # covers a restart: stop (close the caches) and start (open them)
DEFAULT_OUTAGE_TIMEOUT = 300.0  # a registered lane (JobClient): a crash, systemd's RestartSec=5s, and opening big caches
_POLL = (0.02, 0.05, 0.1, 0.2, 0.25)  # pauses between attempts to reach a starting daemon, then the last


def check_address(address: str) -> str:
    """``address`` if it is a daemon's address: a Unix socket path, or ``http://HOST:PORT``
    (``https://`` too) for a daemon's TCP listener (``tcp_port``).

    Raises:
        ValueError: a URL of another scheme (``ftp://x`` was taken as a socket path), or one
            without its host or with a port that is not a number, naming the value.
    """
    if "://" not in address:
        return address
    url = urlsplit(address)
    expected = "expected a Unix socket path, or http://HOST:PORT for a daemon's TCP listener (tcp_port)"
    if url.scheme not in ("http", "https"):
        raise ValueError(f"socket {address!r}: a URL of scheme {url.scheme!r}; {expected}")
    try:
        port = url.port
    except ValueError:
        raise ValueError(f"socket {address!r}: its port is not a number from 0 to 65535; {expected}") from None
    if not url.hostname or port is None:
        raise ValueError(f"socket {address!r}: {'no port' if url.hostname else 'no host'}; {expected}")
    return address


class ServiceError(CachePipeError):
    """The daemon answered with an error.

    Attributes:
        status: the HTTP status (e.g. 404 no such pipeline, 502 the item failed to download,
            503 the daemon is stopping or the pipeline is down).
        code: the daemon's error code (``"not_found"``, ``"item_failed"``, ``"unavailable"``...).
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} (HTTP {status} {code})")
        self.status = status
        self.code = code


class StoreError(ServiceError):
    """The daemon answered that its store failed what the request needed (the listing of a job's
    source or of ``POST /v1/manifests``, or of a pipeline whose listing streams). ``code`` says how:

    - ``"store_unavailable"`` (503): a timeout, reset, 5xx or throttling, left after the daemon's
      retries (``retryable`` is True): the same request may succeed later;
    - ``"empty_source"``, ``"source_not_found"`` (422): the source lists no item, or its bucket
      (or a spec's manifest) does not exist: fix the request;
    - ``"store_error"`` (502): the store refused (denied, rejected credentials) or its endpoint
      never answered: the daemon's settings or the store's.

    The message names the store and the cause.
    """

    @property
    def retryable(self) -> bool:
        """Whether asking again later may succeed (503 ``store_unavailable``)."""
        return self.status == 503


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _Connection:
    """The connection of a :class:`~cachepipe.client.Client` (see the module notes): its base."""

    # set by Client.__init__, which says what each holds
    address: str
    startup_timeout: float
    _conn: http.client.HTTPConnection | None
    _lock: threading.Lock
    _waits_told = False  # the ``cachepipe`` command sets it once it said it waits for a daemon (see _Outage)

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        conn = self._conn
        if conn is not None and conn.sock is not None and _ended(conn.sock):
            self._drop()  # the daemon closed it while idle (idle_timeout), or went away: nothing was sent on it
            conn = None
        if conn is not None:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            return conn, False
        if self.address.startswith(("http://", "https://")):
            url = urlsplit(self.address)
            cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
            conn = cls(url.hostname or "127.0.0.1", url.port, timeout=timeout)
        else:
            conn = _UnixConnection(self.address, timeout)
        self._conn = conn
        return conn, True

    def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        timeout: float,
        *,
        retry: bool | None = None,
        outage: _Outage | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, bytes]:
        """One request and its answer, reconnecting as needed.

        A connection that cannot be made because nothing listens (no socket file, or refused:
        a daemon starting or restarting) is tried again for up to ``startup_timeout``: such a
        request never reached a daemon. So is one whose connection ended before the whole
        request was sent (the daemon cannot have acted on it), and one the daemon closed before
        answering when ``retry`` (default: GET requests) says asking again changes nothing;
        otherwise (the daemon went away with the request, which it may have carried out: an ack
        must not be sent again to its successor) ``ConnectionError``. ``outage``: the wait of the
        operation this request is part of (default: one of ``startup_timeout`` for this request),
        ended by an answer other than a 503. ``raw``: bytes to send instead of ``body``.
        """
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        if raw is not None:  # a manifest upload
            payload, headers = raw, {"Content-Type": "application/gzip"}
        if retry is None:
            retry = method == "GET"
        if outage is None:
            outage = _Outage(self.startup_timeout, self.address, told=self._waits_told)
        with self._lock:
            kept = True  # the first attempt may be on a kept-alive connection the daemon closed meanwhile
            cut: BaseException | None = None  # why a connection carrying this request ended unanswered
            while True:
                conn, fresh = self._connection(timeout)
                sent = False  # until the whole request is sent, the daemon cannot have acted on it
                try:
                    conn.request(method, path, body=payload, headers=headers)
                    sent = True
                    response = conn.getresponse()
                    data = response.read()
                except TimeoutError as exc:
                    self._drop()
                    raise TimeoutError(
                        f"the cachepipe daemon at {self.address} did not answer {method} {path} within {timeout:g} s"
                    ) from exc
                except (FileNotFoundError, ConnectionRefusedError) as exc:
                    self._drop()
                    if outage.pause():
                        continue  # nothing listens yet: a daemon starting or restarting
                    if cut is not None:  # it was there, and went away with the request: not "is it running?"
                        raise ConnectionError(
                            f"the cachepipe daemon at {self.address} closed the connection before answering {method} "
                            f"{path} ({cut}), and cannot be reached now: {exc}{outage.waited()}: it stopped, or is "
                            "restarting (`cachepipe wait` waits for it to be ready)"
                        ) from exc
                    tcp = isinstance(exc, FileNotFoundError) and re.fullmatch(r"[\w.-]+:\d+|\[[0-9a-fA-F:]+\]:\d+", self.address)
                    hint = f"; a socket path, not a TCP address: write http://{self.address} for TCP" if tcp else ""
                    raise ConnectionError(
                        f"cannot reach the cachepipe daemon at {self.address}: {exc}{outage.waited()} (is `cachepipe serve` "
                        f"running? `cachepipe wait` waits for it to be ready){hint}"
                    ) from exc
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                    self._drop()
                    again = retry or not sent  # a request that may have been carried out is not sent twice
                    if again and not fresh and kept:
                        kept, cut = False, exc
                        continue  # a kept-alive connection the daemon had closed (it restarted): once more, fresh
                    if again and outage.pause():
                        cut = exc
                        continue  # the daemon went away before answering (it is stopping)
                    raise ConnectionError(
                        f"the cachepipe daemon at {self.address} closed the connection: {exc}{outage.waited()}"
                    ) from exc
                except (OSError, http.client.HTTPException) as exc:
                    self._drop()
                    raise ConnectionError(
                        f"cannot reach the cachepipe daemon at {self.address}: {exc} (is `cachepipe serve` running, "
                        "and may this user use its socket?)"
                    ) from exc
                if response.will_close:
                    self._drop()
                if response.status != 503:  # a daemon that serves (503: it is stopping, or cannot serve this)
                    outage.answered()
                return response.status, data

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _raise_for(self, status: int, data: bytes) -> None:
        info = _info(data)
        message = str(info.get("message") or data[:200].decode(errors="replace") or f"HTTP {status}")
        if status == 409:
            raise UnknownItemError(message)
        if status == 408:
            raise TimeoutError(message)
        code = str(info.get("error", ""))
        raise (StoreError if code in DAEMON_STORE_CODES else ServiceError)(status, code, message)


def _ended(sock: _socket.socket) -> bool:
    """Whether a kept-alive connection, idle between two requests, has ended: the daemon closed
    it (``idle_timeout``, a stop) or reset it. Nothing else can be waiting to be read on it."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def _info(data: bytes) -> dict[str, Any]:
    try:
        info = json.loads(data) if data else {}
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _code(data: bytes) -> str:
    """The ``error`` code of an error answer ("" if none)."""
    return str(_info(data).get("error", ""))


class _Outage:
    """How long we have been waiting for a daemon at ``address`` to be there; the pauses between
    attempts. One clock for an operation, however many requests it makes: it starts at the
    first attempt that finds no daemon (or one that is stopping) and ends when a daemon answers
    (:meth:`answered`); within one outage the wait is at most ``limit`` in all. A wait that may
    last longer than a start's (``DEFAULT_STARTUP_TIMEOUT``, e.g. a registered lane waiting out
    a restart) is logged as it begins: it is not silent."""

    def __init__(self, limit: float, address: str, *, told: bool = False) -> None:
        self.limit = limit
        self.address = address
        self._told = told  # the wait was said already (the ``cachepipe`` command's own line): not logged too
        self._since: float | None = None
        self._pauses = 0

    def pause(self) -> bool:
        """Wait a little before the next attempt; False (at once) once ``limit`` has passed."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
            if self.limit > DEFAULT_STARTUP_TIMEOUT and not self._told:
                log.warning("the cachepipe daemon at %s is not answering yet: trying for up to %g s", self.address, self.limit)
        left = self._since + self.limit - now
        if left <= 0:
            return False
        time.sleep(min(_POLL[min(self._pauses, len(_POLL) - 1)], left))
        self._pauses += 1
        return True

    def answered(self) -> None:
        """A daemon answered: the outage (if any) has ended, and the next one waits ``limit`` again."""
        self._since = None
        self._pauses = 0

    def waited(self) -> str:
        """For an error message: how long we kept trying."""
        return f" (tried for {self.limit:g} s)" if self._since is not None and self.limit > 0 else ""
