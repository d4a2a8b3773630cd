"""``Client``: take items from a ``cachepipe serve`` daemon, with the feel of :class:`~cachepipe.Pipeline`.

::

    from cachepipe.client import Client
    for path in Client(pipeline="train"):      # each item is acked when the loop asks for the next
        train_on(path)

    with Client(pipeline="train", auto_ack=False) as client:
        item = client.get(timeout=60)          # None once every item was delivered
        ...
        client.ack(item)                       # or client.release(item): back to the queue

The client speaks the daemon's HTTP/JSON protocol over its Unix socket (``socket``: a path,
default ``$CACHEPIPE_SOCKET`` or ``/run/cachepipe/cachepipe.sock``) or over TCP
(``socket="http://127.0.0.1:8765"``). It holds one keep-alive connection and no thread; it is
not thread-safe: use one ``Client`` per thread or process.

Errors: :class:`~cachepipe.UnknownItemError` for an ack/release the daemon rejects (not handed
out, or the lease expired and the item went to another consumer: HTTP 409), ``TimeoutError``
when no item became ready in time, ``ConnectionError`` when the daemon cannot be reached, and
:class:`StoreError` (a :class:`ServiceError`) when the daemon's store failed (its ``code`` says how:
``store_unavailable``, ``store_error``, ``empty_source``, ``source_not_found``), and
:class:`ServiceError` for any other error answer.

A daemon that is starting or restarting is waited for, up to ``startup_timeout`` seconds (default
10): its socket appears only once it is ready, so "no socket" or "refused" means "not yet", and
a ``next`` answered "stopping" is asked again of the next daemon. :meth:`Client.wait_ready`
(``cachepipe wait``) waits for a daemon explicitly.

This module holds :class:`Client`'s lifecycle, its iterator and its operations. The requests
below them that take items and finish them, and :class:`ServedItem`, are the base class
``_ItemRequests`` (:mod:`cachepipe.daemonitems`; ``ServedItem`` is importable from here too); the
connection, its retries and the error answers, its base class ``_Connection``
(:mod:`cachepipe.daemonconn`); how many items the iterator takes at once is
:mod:`cachepipe.batching`.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import quote

from .batching import ACK_AT_ONCE, HOLD, ITER_MOST, ITER_WINDOW, MAX_BATCH, LoopPace, iter_batch
from .daemonconn import (
    DEFAULT_OUTAGE_TIMEOUT,
    DEFAULT_STARTUP_TIMEOUT,
    ServiceError,
    StoreError,
    _code,
    _info,
    _Outage,
    check_address,
)
from .daemonitems import ServedItem, _ItemRequests
from .errors import UnknownItemError

# the batching policy's names, DEFAULT_OUTAGE_TIMEOUT and ServedItem: importable from here, as before
__all__ = [
    "ACK_AT_ONCE",
    "DEFAULT_OUTAGE_TIMEOUT",
    "DEFAULT_SOCKET",
    "DEFAULT_STARTUP_TIMEOUT",
    "HOLD",
    "ITER_MOST",
    "ITER_WINDOW",
    "MAX_BATCH",
    "Client",
    "LoopPace",
    "ServedItem",
    "ServiceError",
    "StoreError",
    "default_socket",
    "iter_batch",
]

log = logging.getLogger("cachepipe.client")

DEFAULT_SOCKET = "/run/cachepipe/cachepipe.sock"


def default_socket() -> str:
    """``$CACHEPIPE_SOCKET`` (the daemon reads the same variable), else the default path."""
    return os.environ.get("CACHEPIPE_SOCKET") or DEFAULT_SOCKET


_UNOPENED, _OPEN, _CLOSED = "unopened", "open", "closed"
_NOBODY: dict[type[BaseException], str] = {
    FileNotFoundError: "no socket there",
    ConnectionRefusedError: "nothing listens there (connection refused: a daemon that ended, or none on that address)",
    ConnectionResetError: "it reset each connection",
}
"""Why :meth:`Client.wait_ready` found no daemon, by the error that ended its last try."""


class Client(_ItemRequests):
    """A consumer of one pipeline of a ``cachepipe serve`` daemon.

    Args:
        pipeline: the pipeline's name; None: the daemon's only pipeline (an error if it has several).
        socket: the daemon's Unix socket path, or ``http://HOST:PORT`` for its TCP listener
            (default: ``$CACHEPIPE_SOCKET``, else ``/run/cachepipe/cachepipe.sock``).
        timeout: longest wait for one item in the iterator and :meth:`get`, in seconds
            (None: no limit); ``TimeoutError`` when it passes.
        auto_ack: in ``for item in client``, acknowledge each item when the loop asks for the
            next (default True); an item the loop stopped inside is released.
        request_timeout: seconds to wait for any other answer (status, ack...).
        markers: False when this client (and whatever it gives the paths to) acknowledges
            items only over the API (as the iterator does) or by deleting them: the daemon then
            does not watch the items it takes for a ``.done`` marker, and a ``.done`` made in
            them is ignored (deleting them still acknowledges them). With the daemon's default
            ``markers: true``, each watch costs it about half of its work per item in a batched
            hand-out (``docs/performance.md``). Default True: every item taken by :meth:`get`
            and :meth:`get_many` can be acknowledged by a marker. The items of ``for item in
            client`` with ``auto_ack`` are never watched, whatever this says: the loop
            acknowledges each of them itself (a marker could only race its ack).
        startup_timeout: seconds to keep trying while the daemon is not there to answer: its
            socket is missing or refuses connections (it is starting, or restarting), or it
            answers that it is stopping. Default 10; 0: fail at once. Only requests that
            change nothing are tried again (``next`` without an ack, status, health, metrics);
            a ``next`` that carried acks and whose daemon went away with it (stopping, killed) is
            asked again without them (they were applied, or are lost and their items come
            again); the wait is at most this long per outage (from the first attempt that finds
            no daemon, or one stopping, to an answer), never forever, however many requests an
            operation makes: a loop that ends while the daemon is away acknowledges the items
            it moved past and gives back the others within one such wait.
    """

    def __init__(
        self,
        pipeline: str | None = None,
        socket: str | os.PathLike[str] | None = None,
        *,
        timeout: float | None = None,
        auto_ack: bool = True,
        request_timeout: float = 30.0,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        markers: bool = True,
    ) -> None:
        if not isinstance(markers, bool):
            raise TypeError(f"markers {markers!r}: expected True (a .done acknowledges an item) or False (acks over the API)")
        self.markers = markers
        if isinstance(startup_timeout, bool) or not isinstance(startup_timeout, (int, float)) or not startup_timeout >= 0:
            raise ValueError(f"startup_timeout {startup_timeout!r}: expected a number of seconds >= 0 (0: do not wait)")
        self.startup_timeout = float(startup_timeout)
        self.pipeline = pipeline
        self.address = check_address(os.fspath(socket) if socket is not None else default_socket())
        self.timeout = timeout
        self.auto_ack = auto_ack
        self.request_timeout = request_timeout
        self._conn: http.client.HTTPConnection | None = None
        self._state = _UNOPENED
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Client(pipeline={self.pipeline!r}, socket={self.address!r}, state={self._state})"

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> Client:
        """Start using the client (it connects at the first request). Called by ``with`` and ``iter``.

        Raises:
            RuntimeError: already open or closed.
        """
        if self._state != _UNOPENED:
            raise RuntimeError(f"{self!r} cannot be opened again: create a new Client")
        self._state = _OPEN
        return self

    def close(self) -> None:
        """Close the connection (leases stay with the daemon until acked or expired). Idempotent."""
        self._state = _CLOSED
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> Client:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- consuming -------------------------------------------------------------------
    def __iter__(self) -> Iterator[ServedItem]:
        """Yield items until every item was delivered; opens the client if needed and closes it after.

        With ``auto_ack``, a loop whose body is quick takes the items ready in batches, one
        request each (:func:`iter_batch`: about 5 ms of the body's work, at most 64 items; one at
        a time for a body over 2.5 ms), and the items it moved past are acknowledged by the
        request that takes the next batch (an item of 1 MiB or more at once, by a request of its
        own). A batch not used up within :data:`HOLD` (the body slowed down) is ended when the
        loop next moves on: the items moved past are acknowledged and the others given back.
        An ack refused (the item was acked by hand, or its lease expired) does not hold back the
        others: they are acknowledged one by one, then the refusal is raised. Breaking out of
        the loop acknowledges what it moved past and gives back the item it stopped in and those
        it did not reach. If the acks waiting for the next request are lost (this process dies,
        the daemon restarts, the request fails), up to a batch of items the loop moved past come
        again after their leases, one before batches. With ``auto_ack`` the daemon does not
        watch the loop's items for a ``.done`` (as with ``markers=False``): a ``.done`` made in
        one is ignored; deleting one still acknowledges it (and the loop's own ack is refused).
        """
        owner = self._state == _UNOPENED
        if owner:
            self.open()
        held: deque[ServedItem] = deque()  # taken in one batch, not yet yielded
        done: list[ServedItem] = []  # the loop moved past them: acknowledged with the next request
        last: ServedItem | None = None
        pace, taken = LoopPace(), 0.0
        # the wait for a daemon that is not there, shared by the loop's acks and releases: one
        # outage, at most startup_timeout in all (its end acks, then releases: not twice that)
        outage = _Outage(self.startup_timeout, self.address, told=self._waits_told)
        watched = self.markers and not self.auto_ack  # with auto_ack the loop acknowledges every item itself
        try:
            while True:
                if last is not None and self.auto_ack:
                    done.append(last)
                    last = None
                if held and done and (time.monotonic() - taken > HOLD or done[-1].size >= ACK_AT_ONCE):
                    acks, done = done, []
                    self._ack_each(acks, outage)
                    if time.monotonic() - taken > HOLD:
                        back, held = list(held), deque()
                        self._give_back(back, outage)
                if not held:
                    acks, done = done, []  # sent with the next request: attempted exactly once
                    try:
                        batch = self._take_many(pace.batch() if self.auto_ack else 1, self.timeout, acks, watched)
                    except UnknownItemError:
                        if len(acks) < 2:
                            raise
                        self._ack_each(acks, outage)  # nothing was taken: ack the others, raise the refusal
                        batch = self._take_many(pace.batch(), self.timeout, [], watched)
                    if not batch:
                        return
                    held.extend(batch)
                    taken = time.monotonic()
                last = held.popleft()
                pace.started()
                yield last
                pace.ended()
        finally:
            if self._state == _OPEN:
                try:
                    self._ack_each(done, outage)
                except UnknownItemError as exc:  # the others were acknowledged
                    log.warning("an item the loop moved past could not be acknowledged: %s", exc)
                except (ConnectionError, ServiceError) as exc:
                    log.warning("could not acknowledge the items the loop moved past (they come again): %s", exc)
                try:  # the loop stopped inside ``last``: give it back, not evict; and those not yet yielded
                    self._give_back(([last] if last is not None and self.auto_ack else []) + list(held), outage)
                except (ConnectionError, ServiceError) as exc:
                    log.warning("could not release the loop's items (they come back after their lease_timeout): %s", exc)
            if owner:
                self.close()

    def get(self, timeout: float | None = None) -> ServedItem | None:
        """Take the next item (leased until :meth:`ack`/:meth:`release` or ``lease_timeout``);
        None when every item was delivered.

        Args:
            timeout: seconds to wait for an item (None: no limit).

        Raises:
            TimeoutError: no item became ready in time.
            ServiceError: the item failed to download (502), no such pipeline (404), the daemon
                is stopping (503).
            StoreError: the pipeline's listing, streamed while it serves, failed (see :class:`StoreError`).
            ConnectionError: the daemon cannot be reached.
        """
        return self._take(timeout, None)

    def get_many(self, count: int, timeout: float | None = None, ack: Sequence[str | os.PathLike[str]] = ()) -> list[ServedItem]:
        """Take up to ``count`` items in one request: the next one (waiting as :meth:`get`), then
        those ready after it, without waiting for more; an empty list when every item was
        delivered. For many small items, with ``ack`` (or :meth:`ack_many`), a batch costs one
        round trip.

        Args:
            count: the most items to take, 1 to 1024.
            timeout: seconds to wait for the first item (None: no limit).
            ack: items of this pipeline to acknowledge first (:class:`ServedItem` objects, or
                paths), all or none: if the acknowledgement is refused, nothing is taken.

        Raises:
            ValueError: ``count`` out of range, or more than 1024 items to acknowledge.
            UnknownItemError, TimeoutError, ServiceError, ConnectionError: as :meth:`get` and :meth:`ack`.
        """
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_BATCH:
            raise ValueError(f"count {count!r}: expected an integer from 1 to {MAX_BATCH}")
        return self._take_many(count, timeout, ack, self.markers)

    def ack_many(self, items: Sequence[str | os.PathLike[str]]) -> None:
        """Acknowledge several items of one pipeline in one request, all or none.

        Args:
            items: :class:`ServedItem` objects (their leases are sent) or paths; at most 1024.

        Raises:
            ValueError: more than 1024 items.
            ServiceError: items of more than one pipeline (HTTP 400); nothing was acknowledged.
            UnknownItemError: one of them is not handed out, or its lease expired: none was
                acknowledged (HTTP 409).
        """
        self._require_open()
        self._finish_many("ack", items)

    def ack(self, item: str | os.PathLike[str], lease: str | None = None) -> None:
        """Acknowledge an item: the daemon deletes it and frees its space.

        Args:
            item: the :class:`ServedItem` (its lease is sent) or the item's path.
            lease: the lease id, when ``item`` is a plain path (recommended: without it, the
                ack applies to whoever holds the item now).

        Raises:
            UnknownItemError: not handed out, or the lease expired (HTTP 409).
        """
        self._finish("ack", item, lease)

    def release(self, item: str | os.PathLike[str], lease: str | None = None) -> None:
        """Give an item back: it is handed out again, before any other. Raises like :meth:`ack`."""
        self._finish("release", item, lease)

    def renew(self, item: str | os.PathLike[str], lease: str | None = None) -> None:
        """Extend an item's lease by the pipeline's ``lease_timeout``. Raises like :meth:`ack`."""
        self._finish("renew", item, lease)

    # ---- visibility ------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The daemon's status: every pipeline's state and counters (``GET /v1/status``)."""
        self._require_open()
        status, data = self._request("GET", "/v1/status", None, self.request_timeout)
        if status != 200:
            self._raise_for(status, data)
        reply: dict[str, Any] = json.loads(data)
        return reply

    def delete_job(self, job: str) -> None:
        """End job ``job`` (``DELETE /v1/jobs/JOB``): the daemon stops its downloads and deletes
        its cached items. Its lanes, if any still read, would register it again and start over.

        Raises:
            ServiceError: no job of that name (404, naming the registered ones), or the daemon
                takes no jobs (404).
            ConnectionError: the daemon cannot be reached.
        """
        self._require_open()
        status, data = self._request("DELETE", f"/v1/jobs/{quote(job, safe='')}", None, self.request_timeout)
        if status != 200:
            self._raise_for(status, data)

    def health(self) -> dict[str, Any]:
        """``GET /v1/health``: ``{"status": "ok" | "degraded" | "stopping", "pipelines": ...}``
        (an unhealthy daemon's answer is returned too, not raised)."""
        self._require_open()
        status, data = self._request("GET", "/v1/health", None, self.request_timeout)
        if status not in (200, 503) or not data:
            self._raise_for(status, data)
        reply: dict[str, Any] = json.loads(data)
        return reply

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the daemon serves (its socket answers and it is not stopping); returns
        its health (``"ok"``, or ``"degraded"`` when a pipeline is down). What ``cachepipe wait``
        does: for scripts that start a daemon outside systemd.

        Args:
            timeout: seconds to wait (default ``startup_timeout``).

        Raises:
            TimeoutError: it did not become ready in time.
            ConnectionError: it cannot be reached for another reason (no permission on its socket...).
        """
        self._require_open()
        limit = self.startup_timeout if timeout is None else timeout
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0:
            raise ValueError(f"timeout {timeout!r}: expected a number of seconds >= 0")
        outage = _Outage(limit, self.address, told=self._waits_told)  # one wait: for no socket and for "stopping" alike
        waited = f"waited {limit:g} s for a cachepipe daemon to serve at {self.address}"
        while True:
            try:
                status, data = self._request("GET", "/v1/health", None, self.request_timeout, outage=outage)
            except ConnectionError as exc:
                why = None if exc.__cause__ is None else _NOBODY.get(type(exc.__cause__))
                if why is None:
                    raise
                raise TimeoutError(  # one message: not the request's own, which says to run `cachepipe wait`
                    f"{waited}: {why}; start one (`cachepipe serve --config FILE`), or name the socket one serves "
                    "(--socket or $CACHEPIPE_SOCKET)"
                ) from exc
            info = _info(data)
            if status == 200 or (status == 503 and info.get("status") == "degraded"):
                return info
            if status != 503 or not outage.pause():
                raise TimeoutError(f"{waited}: it answers HTTP {status} {info.get('status') or _code(data)}")
            self._drop()

    def metrics(self) -> str:
        """The Prometheus text exposition (``GET /metrics``)."""
        self._require_open()
        status, data = self._request("GET", "/metrics", None, self.request_timeout)
        if status != 200:
            self._raise_for(status, data)
        return data.decode()

    # ---- plumbing --------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._state == _OPEN:
            return
        if self._state == _UNOPENED:
            self.open()
            return
        raise RuntimeError(f"{self!r} is closed: create a new Client")
