"""Direct S3 requests for the fsspec backend (object GETs and listing pages): s3fs's client
decides where and how, botocore signs each request, ``http.client`` sends it.

Why: an s3fs GET costs about 2 ms of client CPU in aiobotocore (hooks, signing, parsing and a
hop through s3fs's event-loop thread); a presigned URL from s3fs still costs about 0.65 ms
(aiobotocore's presign machinery plus the hop), and botocore's parse of a listing page about
0.15 ms per key (a datetime per LastModified). Folders of small files on a fast link are limited
by that CPU (``benchmarks/bench_link.py``). Here a request is one signature by botocore's own
:class:`~botocore.auth.S3SigV4Auth` (about 0.1 ms) and a plain keep-alive HTTP request; a listing
page is parsed with :mod:`xml.etree.ElementTree` for keys, sizes and ETags only.

Nothing about the request is decided here. Once per bucket (and again after
:attr:`DirectGet.RETAKE_AFTER` seconds or a 403) a *probe* asks s3fs's own client for a
GetObject of a made-up key and stops it in botocore's ``before-sign`` event, before anything is
signed or sent. The probe reads the URL the client resolved (endpoint, path or virtual-host
addressing, the bucket's redirect-cached region) and the signing region, name and version; the
credentials are the client's own. Buckets the client signs any other way (S3 Express sessions,
SigV4a, SigV2), and a bucket that S3 says is in another region (``x-amz-bucket-region`` on a
301, 307 or 400), are left to s3fs, whose client follows such redirects: the methods return
None and the backend asks s3fs.

Credentials: a frozen copy is signed with. Refreshable credentials (assumed roles, instance
metadata, SSO) are refreshed through the client's credentials object as soon as botocore says
that they need it (checked before every request), and the copy is taken again at least every
:attr:`DirectGet.RETAKE_AFTER` seconds in case s3fs's client refreshed them meanwhile. A 403
takes a new probe and a new copy and tries once more.

Reading a body: on Linux 5.8 or later the kernel is asked to gather up to :data:`LOW_WATER`
bytes before it wakes the reader (``SO_RCVLOWAT``; :mod:`cachepipe.stores.s3direct_marks` says why,
and how much for each read). The connection's timeout (:attr:`DirectGet.TIMEOUT`) then runs
until that many bytes came, not one: a stream slower than 256 KiB a minute times out and is
retried as any stalled one.

Aborting (:meth:`DirectGet.abort`, when the pipeline closes): the sockets of the requests in
flight are shut down (``shutdown(SHUT_RDWR)``: a thread blocked in ``recv`` wakes at once, which a
``close`` from another thread does not promise), each such request raises
:class:`~cachepipe.errors.StoreClosedError`, and so does every later one before it connects. A
connect in flight is not aborted (its socket is not ours until it returns): it waits at most
:attr:`DirectGet.connect_timeout`, then fails the same way; nor is a probe (it sends nothing; a
credential refresh inside it is botocore's).

Forks: used in a process forked from the one that made it (a DataLoader worker given the
dataset's ``store=``), a :class:`DirectGet` starts there with no pooled connection (the parent's
idle ones are closed there, their descriptors only: they stay open for the parent), no request in
flight (an abort there shuts down none of the parent's sockets), new locks (a thread of the parent
probing at the fork held one for ever there) and no route: it probes again through a filesystem
made there (its ``renew``, the store's). Before, processes sent requests on the same connections
and read each other's responses: a GET got another object's bytes, or failed reading a body as
its status line (:mod:`cachepipe.stores.forks`).

Errors leave this module as ``OSError`` (HTTP statuses, shaped like botocore's errors),
``ConnectionError``, ``TimeoutError``, :class:`~cachepipe.errors.StoreClosedError` or botocore's
exceptions; the fsspec backend translates them at its one seam. Retrying is the core's, as for
every store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import logging
import os
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar
from urllib.parse import quote, urlsplit

import botocore
import fsspec.asyn
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.exceptions import NoCredentialsError

from ..errors import StoreClosedError
from .base import CONNECT_TIMEOUT
from .forks import keep_parents, renew_after_fork
from .s3direct_marks import (
    BODY_AHEAD,  # noqa: F401 - importable from here, as before
    LOW_WATER,  # noqa: F401 - importable from here, as before
    MIN_MARK,  # noqa: F401 - importable from here, as before
    _marks_help,
    _receive_buffer,
    _set_low_water,
    body_read,
    kernel_at_least,  # noqa: F401 - importable from here, as before
)
from .s3direct_replies import HTTPStatusError, _Page, _parse_listing
from .s3direct_route import _DEFAULT_PORTS, _PROBE_EVENT, _SIGV4, _Probed, _Route

__all__ = ["ConnectTimeoutError", "DirectGet"]


class ConnectTimeoutError(TimeoutError):
    """No connection to the endpoint within :attr:`DirectGet.connect_timeout` (named
    like botocore's, which the error seam tells apart the same way)."""


log = logging.getLogger("cachepipe.stores.s3direct")

_READ = 1024 * 1024  # bytes per read of a response body
_T = TypeVar("_T")


class DirectGet:
    """GETs of S3 object ranges and listing pages without the SDK in the data path, over
    keep-alive ``http.client`` connections (kept per host for the next request of any thread,
    the one used last first), object bodies streamed in 1 MiB reads.

    Args:
        fs: the s3fs filesystem whose client addresses, signs for and authenticates the requests.
        renew: makes that filesystem anew, in a process forked from this one (the parent's s3fs
            instance refuses to run there); None: the parent's is asked, and refuses (see the
            module's docstring, "Forks").
    """

    RETAKE_AFTER = 60.0
    """Seconds after which a bucket's probe and credential copy are taken again."""
    TIMEOUT = 60.0
    """Seconds for each read of a response (a connect: :attr:`connect_timeout`)."""

    def __init__(self, fs: Any, renew: Callable[[], Any] | None = None) -> None:
        self._fs = fs
        self._renew = renew
        self._lock = threading.Lock()  # guards _idle, _closed, _aborted, _busy and _sdk_buckets
        self._probing = threading.Lock()  # one thread probes; the others wait for its route
        self._routes: dict[str, _Route] = {}
        self._sdk_buckets: set[str] = set()  # buckets whose requests s3fs sends
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}  # by (scheme, netloc), last used last
        self._closed = False
        self._aborted = False  # abort(): requests in flight are cut, later ones refused
        self._busy: set[socket.socket] = set()  # sockets of requests in flight (abort shuts them down)
        self._ssl: ssl.SSLContext | None = None  # made on the first https connection (loading CAs costs ~30 ms)
        given = (getattr(fs, "config_kwargs", None) or {}).get("connect_timeout")
        self.connect_timeout = CONNECT_TIMEOUT if given is None else float(given)
        """Seconds for a connect: the filesystem's ``config_kwargs["connect_timeout"]``, else
        :data:`cachepipe.stores.base.CONNECT_TIMEOUT`."""
        renew_after_fork(self)

    @property
    def fs(self) -> Any:
        """The s3fs filesystem: in a process forked from the one that made this object, one made
        there (by ``renew``) at its first use."""
        fs = self._fs
        if fs is None and self._renew is not None:  # forked; two threads at once: fsspec's cache makes one
            fs = self._fs = self._renew()
        return fs

    def _forked(self) -> None:
        """In a process just forked from this object's (:mod:`cachepipe.stores.forks`): new locks
        (the parent's threads held them, for ever here), no pooled connection (the parent's idle
        ones closed here: their descriptors in this process, nothing sent), no request in flight
        (abort here shuts down none of the parent's sockets), no route (its credentials and
        their refresh are the parent's client's: probed again through this process's own
        filesystem, made at its first use)."""
        self._lock = threading.Lock()
        self._probing = threading.Lock()
        pooled = [conn for idle in self._idle.values() for conn in idle]
        self._idle, self._busy, self._routes = {}, set(), {}
        for conn in pooled:
            with contextlib.suppress(OSError):
                conn.close()  # this process's descriptor: the parent's connection stays open, for the parent
        if self._renew is not None:
            keep_parents(self._fs)
            self._fs = None

    @staticmethod
    def usable(fs: Any, storage_options: dict[str, Any]) -> bool:
        """True for a plain s3fs filesystem: no versioning, requester-pays, SSE-C or other extra
        request parameters, no custom TLS verification, proxies or botocore settings other than
        retries and pool size (which the direct path has no use for), S3 addressing style
        (which the probe follows) and the connect timeout (which it applies too), which it would
        not apply."""
        client_kwargs = storage_options.get("client_kwargs") or {}
        config_kwargs = storage_options.get("config_kwargs") or {}
        return (
            getattr(fs, "protocol", None) in (("s3", "s3a"), "s3")
            and not getattr(fs, "version_aware", False)
            and not getattr(fs, "req_kw", None)
            and not storage_options.get("s3_additional_kwargs")
            and set(config_kwargs) <= {"retries", "max_pool_connections", "s3", "connect_timeout"}
            and set(config_kwargs.get("s3") or {}) <= {"addressing_style"}
            and set(client_kwargs) <= {"endpoint_url", "region_name"}
            and os.environ.get("HTTPS_PROXY") is None
            and os.environ.get("HTTP_PROXY") is None
            and os.environ.get("https_proxy") is None
            and os.environ.get("http_proxy") is None
        )

    # ---- routes: what s3fs's client would send ---------------------------------------
    async def _probe(self, bucket: str) -> _Route | None:
        """Ask s3fs's client how it sends a GetObject to ``bucket`` (nothing is sent)."""
        await self.fs.set_session()
        client = await self.fs.get_s3(bucket)
        key = f"cachepipe-probe/{uuid.uuid4().hex}"
        hook_id = f"cachepipe-{key}"

        def stop(request: Any, signing_name: str, region_name: str, signature_version: Any, **_: Any) -> None:
            if not urlsplit(request.url).path.endswith(f"/{key}"):
                return  # another request of the same (shared) client
            signing = request.context.get("signing") or {}
            raise _Probed(
                request.url,
                signature_version,
                signing.get("signing_name") or signing_name,
                signing.get("region") or region_name,
                "identity_cache" in signing or "request_credentials" in signing,
            )

        client.meta.events.register_first(_PROBE_EVENT, stop, unique_id=hook_id)
        try:
            await client.get_object(Bucket=bucket, Key=key)
        except _Probed as probed:
            found = probed
        else:  # the hook did not run: this botocore sends GetObject some other way
            return None
        finally:
            client.meta.events.unregister(_PROBE_EVENT, unique_id=hook_id)
        url = urlsplit(found.url)
        if url.query or not url.path.endswith(f"/{key}") or url.scheme not in ("http", "https"):
            return None
        if found.signature_version is botocore.UNSIGNED:
            signer = credentials = refresh_needed = None
        elif found.signature_version in _SIGV4 and found.signing_name == "s3" and not found.own_identity:
            # botocore's accessor of the client's own credentials (private, "subject to change":
            # without it this bucket is left to s3fs rather than signed with other credentials)
            get_credentials = getattr(client, "_get_credentials", None)
            if get_credentials is None:
                return None
            credentials = get_credentials()
            if credentials is None:
                raise NoCredentialsError
            signer = S3SigV4Auth(await credentials.get_frozen_credentials(), "s3", found.region)
            refresh_needed = getattr(credentials, "refresh_needed", None)
        else:
            return None
        prefix = url.path[: -len(key)]
        host = url.netloc.rsplit(":", 1)[0] if url.port == _DEFAULT_PORTS[url.scheme] else url.netloc
        return _Route(url.scheme, url.netloc, host, prefix, found.region, signer, refresh_needed, credentials, time.monotonic())

    @staticmethod
    async def _refreeze(route: _Route) -> _Route:
        """``route`` with a new frozen copy of its (refreshable) credentials: botocore refreshes
        them first if they are due."""
        frozen = await route.credentials.get_frozen_credentials()
        return dataclasses.replace(route, signer=S3SigV4Auth(frozen, "s3", route.region))

    @staticmethod
    def _current(route: _Route | None, stale: _Route | None) -> bool:
        return (
            route is not None
            and route is not stale
            and time.monotonic() - route.taken < DirectGet.RETAKE_AFTER
            and not (route.refresh_needed is not None and route.refresh_needed())
        )

    def _route(self, bucket: str, stale: _Route | None = None) -> _Route | None:
        """The route to ``bucket``, probed again if it is older than :attr:`RETAKE_AFTER` or is
        ``stale`` (it got a 403); with fresh credentials if botocore says they need a refresh.
        None: s3fs sends this bucket's requests."""
        route = self._routes.get(bucket)
        if self._current(route, stale):
            return route
        if bucket in self._sdk_buckets:
            return None
        with self._probing:
            route = self._routes.get(bucket)
            if self._current(route, stale):
                return route
            if bucket in self._sdk_buckets:
                return None
            if route is not None and route is not stale and time.monotonic() - route.taken < self.RETAKE_AFTER:
                route = fsspec.asyn.sync(self.fs.loop, self._refreeze, route)
            else:
                route = fsspec.asyn.sync(self.fs.loop, self._probe, bucket)
            if route is None:
                self._to_sdk(bucket)
            else:
                self._routes[bucket] = route
            return route  # type: ignore[no-any-return]  # fsspec's sync() is untyped

    def _to_sdk(self, bucket: str) -> None:
        """From now on s3fs sends every request to ``bucket``."""
        with self._lock:
            self._sdk_buckets.add(bucket)
            self._routes.pop(bucket, None)

    def credentials(self, bucket: str) -> Any:
        """The frozen botocore credentials that a GET from ``bucket`` is signed with now: refreshed
        when botocore says they are due, copied again at least every :attr:`RETAKE_AFTER` seconds;
        ``botocore.UNSIGNED`` if it is sent unsigned; None if s3fs sends that bucket's requests."""
        route = self._route(bucket)
        if route is None:
            return None
        return botocore.UNSIGNED if route.signer is None else route.signer.credentials

    def url(self, bucket: str, key: str) -> str | None:
        """The URL (unsigned) that a GET of ``key`` in ``bucket`` is sent to, as s3fs's client
        resolves it; None if s3fs sends that bucket's requests itself."""
        route = self._route(bucket)
        return None if route is None else route.origin + route.prefix + quote(key, safe="/~")

    # ---- connections -----------------------------------------------------------------
    def _conn(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        """The connection to ``netloc`` used last and idle now (its congestion window the widest,
        the least likely to have been closed by the server), or a new one; the caller's until
        :meth:`_done` or :meth:`_drop`."""
        with self._lock:
            if self._aborted:
                raise self._aborted_error()
            idle = self._idle.get((scheme, netloc))
            if idle:
                return idle.pop()
        if scheme == "https":
            with self._lock:
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
            return http.client.HTTPSConnection(netloc, timeout=self.TIMEOUT, context=self._ssl)
        return http.client.HTTPConnection(netloc, timeout=self.TIMEOUT)

    def _connect(self, conn: http.client.HTTPConnection) -> None:
        """Connect ``conn`` within :attr:`connect_timeout` seconds (then reads wait
        up to :attr:`TIMEOUT`). Raises :class:`ConnectTimeoutError` when no connection came."""
        conn.timeout = self.connect_timeout
        try:
            conn.connect()
        except TimeoutError as exc:
            conn.close()
            raise ConnectTimeoutError(f"no connection to {conn.host}:{conn.port} within {self.connect_timeout:g} s") from exc
        finally:
            conn.timeout = self.TIMEOUT
        if conn.sock is not None:
            conn.sock.settimeout(self.TIMEOUT)

    def _enter(self, sock: socket.socket | None) -> socket.socket | None:
        """Count ``sock`` (a connected request's) in flight, for :meth:`abort`; raises
        :class:`~cachepipe.errors.StoreClosedError` if the store was aborted meanwhile."""
        with self._lock:
            if self._aborted:
                raise self._aborted_error()
            if sock is not None:
                self._busy.add(sock)
        return sock

    def _leave(self, sock: socket.socket | None) -> None:
        """``sock`` is no longer in flight: :meth:`abort` leaves it alone from now on (so it may be
        closed, and its descriptor reused, without abort shutting down another socket)."""
        if sock is not None:
            with self._lock:
                self._busy.discard(sock)

    def _aborted_error(self) -> StoreClosedError:
        return StoreClosedError(f"request to {self.fs!r} aborted: the store was closed")

    def _done(self, scheme: str, netloc: str, conn: http.client.HTTPConnection, sock: socket.socket | None = None) -> None:
        """Give ``conn`` back after a response read to its end: kept for the next request if it is
        still open (not when the server said it would close it, nor after :meth:`_drop` or
        :meth:`abort`). ``sock``: its socket, no longer in flight."""
        self._leave(sock)
        if conn.sock is not None:
            with self._lock:
                if not self._closed:
                    self._idle.setdefault((scheme, netloc), []).append(conn)
                    return
        conn.close()

    def _drop(
        self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse | None = None, sock: socket.socket | None = None
    ) -> None:
        """Close ``conn`` and ``resp``, a response on it: when the server said it would close the
        connection, http.client let go of the socket and only the response holds it (until the
        garbage collector, if a traceback keeps the response). ``sock``: its socket, no longer in flight."""
        self._leave(sock)
        if resp is not None:
            resp.close()
        conn.close()

    # ---- requests -------------------------------------------------------------------
    def _exchange(
        self,
        operation: str,
        bucket: str,
        target: Callable[[_Route], str],
        headers: dict[str, str],
        read: Callable[[http.client.HTTPResponse, http.client.HTTPConnection, socket.socket | None], _T],
    ) -> _T | None:
        """Send a signed GET of ``target(route)`` (path and query) to ``bucket`` and return
        ``read(response, its connection, the connection's socket)`` (the connection is
        given back for the next request unless ``read`` dropped it); None, with nothing read, if s3fs
        must send it. Each request is logged at DEBUG as ``direct <operation>: <path>`` (as s3fs
        logs its calls)."""
        route = None
        for attempt in (0, 1):  # a 403: probe and copy the credentials again, once
            route = self._route(bucket, stale=route if attempt else None)
            if route is None:
                return None
            path = target(route)
            # Host set here: botocore then need not parse it from the URL, and http.client sends this one
            signed = {"Host": route.host, **headers}
            if route.signer is not None:
                request = AWSRequest("GET", route.origin + path, headers=signed)
                route.signer.add_auth(request)
                signed = dict(request.headers.items())
            conn = self._conn(route.scheme, route.netloc)
            log.debug("direct %s: %s", operation, path)
            resp = None
            sock = None  # the response's: http.client lets go of it when the server will close it
            try:
                if conn.sock is None:
                    self._connect(conn)
                sock = self._enter(conn.sock)
                conn.request("GET", path, headers=signed)
                resp = conn.getresponse()
                if resp.status == 403 and attempt == 0:
                    resp.read()
                    self._done(route.scheme, route.netloc, conn, sock)
                    continue
                if resp.status in (301, 307, 400) and resp.getheader("x-amz-bucket-region", route.region) != route.region:
                    resp.read()  # the bucket is in another region: s3fs's client follows that
                    self._done(route.scheme, route.netloc, conn, sock)
                    self._to_sdk(bucket)
                    return None
                result = read(resp, conn, sock)
                if self._aborted:  # cut short by abort (a body read to a short count): not a result
                    raise self._aborted_error()
            except http.client.HTTPException as exc:
                self._drop(conn, resp, sock)
                if self._aborted:
                    raise self._aborted_error() from exc
                if isinstance(exc, http.client.IncompleteRead):
                    raise
                raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
            except Exception as exc:
                self._drop(conn, resp, sock)
                if self._aborted and not isinstance(exc, StoreClosedError):
                    raise self._aborted_error() from exc
                raise
            except BaseException:
                self._drop(conn, resp, sock)
                raise
            self._done(route.scheme, route.netloc, conn, sock)
            return result
        raise AssertionError("unreachable")

    def get(self, bucket: str, key: str, out: BinaryIO, start: int, end: int, etag: str | None = None) -> int | None:
        """Write bytes ``[start, end)`` of object ``key`` in ``bucket`` to ``out``; return how many
        were written, or None without writing anything if s3fs must send this request (a bucket
        signed in a way this path does not implement, or a region redirect). ``etag``: the
        request is conditional on it (``If-Match``; a refusal is HTTP 412)."""
        quoted = quote(key, safe="/~")

        def read(resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, sock: socket.socket | None) -> int:
            if resp.status != 206 and not (resp.status == 200 and start == 0):
                raise HTTPStatusError(resp.status, resp.reason, resp.read())
            written, mark = 0, 1
            marked = sock if _marks_help(sock, resp.length) else None
            while written < end - start and not resp.isclosed():  # closed: the body ended (a range past its end)
                room = 0 if marked is None else _receive_buffer(marked)  # it grows as the connection speeds up
                want, size = body_read(resp.length, min(_READ, end - start - written), room)
                if want != mark and marked is not None:
                    _set_low_water(marked, want)
                    mark = want
                chunk = resp.read(size)
                if not chunk:
                    break
                out.write(chunk)
                written += len(chunk)
            if written == end - start and resp.status == 206:
                if mark != 1 and marked is not None:  # the next response's head must not wait for a mark
                    _set_low_water(marked, 1)
                resp.read()  # nothing left: keeps the connection reusable
            else:
                self._drop(conn, resp, sock)
            return written

        headers = {"Range": f"bytes={start}-{end - 1}"}
        if etag is not None:
            headers["If-Match"] = f'"{etag}"'
        return self._exchange("GetObject", bucket, lambda route: route.prefix + quoted, headers, read)

    def list_page(
        self, bucket: str, prefix: str, max_keys: int, token: str | None = None, start_after: str | None = None
    ) -> _Page | None:
        """One ListObjectsV2 page of ``bucket`` under ``prefix`` (keys after ``start_after``, if
        given): ``([(key, size, etag), ...], continuation token or None on the last page)``, keys
        in order; None if s3fs must send it.

        Parsed with :mod:`xml.etree.ElementTree` (what botocore parses with), reading only keys,
        sizes and ETags: botocore's parser also turns every LastModified into a datetime with
        dateutil, which cost about 0.3 ms of client CPU per listed key."""
        query = {"list-type": "2", "prefix": prefix, "max-keys": str(max_keys), "encoding-type": "url"}
        if token is not None:
            query["continuation-token"] = token
        if start_after:
            query["start-after"] = start_after
        # sorted and encoded as SigV4's canonical query string wants it (botocore signs it as sent)
        encoded = "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items()))

        def read(resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, sock: socket.socket | None) -> _Page:  # noqa: ARG001 - the callback's signature is fixed by its caller
            body = resp.read()
            if resp.status != 200:
                raise HTTPStatusError(resp.status, resp.reason, body)
            return _parse_listing(body)

        return self._exchange("ListObjectsV2", bucket, lambda route: f"{route.prefix[:-1] or '/'}?{encoded}", {}, read)

    def close(self) -> None:
        """Close the idle connections; one in use is closed when its request ends."""
        with self._lock:
            self._closed = True
            conns = [conn for idle in self._idle.values() for conn in idle]
            self._idle = {}
        for conn in conns:
            conn.close()

    def abort(self) -> None:
        """Cut the requests in flight and refuse later ones (see the module's docstring): each
        raises :class:`~cachepipe.errors.StoreClosedError`. Idempotent; from any thread. The
        sockets are shut down under the lock that their requests' threads take before closing
        them, so a descriptor closed and reused meanwhile is never shut down."""
        with self._lock:
            self._aborted = self._closed = True
            for sock in self._busy:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # not connected any more (the peer closed it): nothing to wake
            conns = [conn for idle in self._idle.values() for conn in idle]
            self._idle = {}
        for conn in conns:
            conn.close()
