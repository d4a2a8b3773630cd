"""Huawei OBS backend (``obs://bucket/prefix/``) on the official SDK, ``esdk-obs-python``.

Install with ``pip install 'cachepipe[obs]'``. The SDK is imported when a store is built, so
``import cachepipe`` works without it.

Settings, first found wins:

1. ``storage_options``: ``server`` (aliases ``endpoint``, ``endpoint_url``), ``access_key_id``,
   ``secret_access_key``, ``security_token``, plus any other argument ``obs.ObsClient`` accepts
   (``timeout``, ``path_style``, ``ssl_verify``, ``max_retry_count``...);
2. environment: ``OBS_ENDPOINT``, ``OBS_ACCESS_KEY_ID``, ``OBS_SECRET_ACCESS_KEY``,
   ``OBS_SECURITY_TOKEN``;
3. the SDK's own credential providers (``security_provider_policy='OBS_DEFAULT'``: environment,
   then ECS instance metadata, then OIDC), asked by the SDK before each request; one that found
   none twice in a row is asked again only after a quiet time, from 0.5 s doubling to a minute
   (:mod:`cachepipe.stores.obs_providers`).

Error seam: the SDK does not raise for HTTP errors, it returns a result with ``status`` and
``errorCode``; it *does* raise the socket's own exceptions (``ConnectionRefusedError``,
``socket.gaierror``, ``TimeoutError``...). :meth:`ObsStore._check` maps the first and
:meth:`ObsStore._unreachable` the second, into the builtins of :mod:`cachepipe.stores.base`::

    HTTP 404 NoSuchBucket (or any 404 while listing)   FileNotFoundError  "bucket ... does not exist"
    HTTP 404 NoSuchKey / 404 without a code             FileNotFoundError  "no such object obs://..."
    HTTP 401/403 InvalidAccessKeyId, SignatureDoesNotMatch,
        InvalidToken, ExpiredToken...                   PermissionError    "credentials were rejected"
    HTTP 403 AccessDenied and other 403s                PermissionError    "access denied"
    HTTP 5xx, 429, SlowDown, throttling                 StoreUnavailableError (a ConnectionError)
    socket timeout (but at a listing or a check
        before OBS ever answered)                       TimeoutError       "timed out ... OBS endpoint"
    DNS failure; refused before OBS ever answered;
        a connect or a reply timed out at a listing
        or a check before OBS ever answered             StoreUnreachableError "cannot reach OBS endpoint" (not retried)
    refused once OBS answered, reset, TLS, broken HTTP,
        a body that ended before its Content-Length,
        an answer that ended inside its headers         StoreUnavailableError "cannot reach OBS endpoint"
    HTTP 301/307 the SDK could not follow (no Location:
        a bucket of another region)                     OSError            "... another region; set ... the endpoint"
    anything else (400, 416...)                         OSError            permanent

Messages carry the OBS error code and message; the code is also the attribute ``code`` of the
raised error and the endpoint its ``endpoint`` (:func:`cachepipe.errors.store_code`).

Each is chained (``raise ... from``) to the SDK's exception or, for a returned result, to an
:class:`ObsServiceError` built from its status, code and message. Messages never contain the
secret key, the security token or a proxy password.

Aborting (:meth:`ObsStore.abort`, when the pipeline closes): the SDK takes every connection from
its client's ``_get_server_connection`` (a private method; the store wraps it on its own client
to note each connection it hands out, and the socket each one connects). ``abort`` shuts down
those sockets (a thread blocked reading a response wakes at once, also one whose server said it
would close the connection, whose socket only the response holds), and every request after it,
and every one cut by it, raises :class:`~cachepipe.errors.StoreClosedError`. Not cut: a connect
in flight (it waits at most the SDK's ``timeout``, then is refused). The SDK closes its sockets
in its own code, without a lock of ours: a socket it closes in the instant ``abort`` shuts it
down, with another thread opening a descriptor of the same number between the two, would have
that descriptor shut down instead (a window of a system call; ``abort`` runs once, at close).
An SDK without that method (a version that renamed it) is not cut at all: its requests end by
themselves, and only the later ones are refused.

The same wrapper makes each connection's responses :class:`_WholeBody`: a body the SDK reads
(a listing's, an error's) that ends before its ``Content-Length``, or an answer that ends inside
its headers, raises (the SDK took it for a body it could not parse, or an empty one), and one whose
read raises is closed at once.

Forks: a store used in a process forked from the one that opened it (a DataLoader worker given
the dataset's ``store=``) gets a pool of connections of its own there, empty
(:meth:`ObsStore._forked`): the parent's pooled connections were taken by each process that used
the store, and two processes sending on one connection read each other's responses (a GET
returned another object's bytes). Its credential lookups are its own too
(:mod:`cachepipe.stores.obs_providers`).

The same wrapper closes a connection whose request could not be sent (a send cut by ``abort``, an
upload's body reset by the endpoint): the SDK loses such a connection without closing it, and
its socket stayed open until the garbage collector found it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.client import HTTPException, HTTPResponse, IncompleteRead, RemoteDisconnected
from typing import Any, BinaryIO

from cachepipe.errors import ConfigError
from cachepipe.stores.base import (
    ALREADY_GONE,
    DELETE_BATCH,
    NO_SUCH_UPLOAD,
    ObjectInfo,
    abort_failed,
    completed_anyway,
    delete_error,
    first_page_keys,
    listed_etag,
    log_completed_anyway,
    not_the_api,
    open_local,
    part_size_for,
    upload_lost,
    view_of,
)
from cachepipe.stores.forks import renew_after_fork
from cachepipe.stores.obs_client import _new_client
from cachepipe.stores.obs_errors import ObsServiceError, _ObsSeam
from cachepipe.stores.obs_settings import (
    _parse_url,
)

# ObsServiceError: importable from here, as before
__all__ = ["CHUNK_SIZE", "MAX_PAGE_SIZE", "ObsServiceError", "ObsStore"]

log = logging.getLogger("cachepipe.stores.obs")

CHUNK_SIZE = 1 << 20
"""Bytes read from a response body and written to ``out`` at a time (1 MiB)."""

MAX_PAGE_SIZE = 1000
"""The largest page OBS returns for one ``ListObjects`` request (objects)."""


class IncompleteBody(IncompleteRead):
    """A response body that ended (its connection closed: by the server, by the network, by
    :meth:`ObsStore.abort`) before its ``Content-Length``."""

    def __init__(self, expected: int) -> None:
        super().__init__(b"", expected)

    def __str__(self) -> str:
        return f"the connection ended {self.expected} bytes before the end of the response body"

    __repr__ = __str__


class _HeadLines:
    """A response's file object as http.client reads the response's head from it (``readline``),
    keeping the last line read: the head ended at its blank line, or at the connection's end."""

    def __init__(self, fp: Any) -> None:
        self._fp = fp
        self.last = b""

    def readline(self, limit: int = -1) -> bytes:
        self.last = self._fp.readline(limit)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)


class _WholeBody(HTTPResponse):
    """The responses of the connections the SDK takes (:meth:`ObsStore._noting` makes them
    read so), as the SDK reads their bodies (``read``; a GET's body the store reads itself):

    - a head (status line and headers) that the connection's end cut raises
      :class:`~http.client.RemoteDisconnected`: http.client ends the headers there, and one cut
      before its ``Content-Length`` read as a whole response with an empty body (a listing
      "that could not be parsed", a DeleteObjects answer without the keys OBS refused);
    - a body that ends before its ``Content-Length`` raises :class:`IncompleteBody`:
      http.client returns ``b""`` as at its end, and the SDK, which parses what it read and
      drops what it cannot parse, returned a listing without a body (``a listing that could not
      be parsed (HTTP 200), not an OBS answer``: a permanent error for a dropped connection, and
      for a listing cut by :meth:`ObsStore.abort`);
    - a read that raises (a reset) closes the response: the SDK closes the connection only, and
      the response of one the server said it would close holds its socket, open until the
      garbage collector found it (a descriptor, and a ResourceWarning in some later test).
    """

    def begin(self) -> None:
        fp = self.fp
        head: Any = _HeadLines(fp)  # a file object to http.client
        self.fp = head
        try:
            super().begin()
        finally:
            if self.fp is head:
                self.fp = fp
        if head.last not in (b"\r\n", b"\n"):  # http.client.getresponse closes this response and its connection
            raise RemoteDisconnected("the connection ended inside the response's head (its status line and headers)")

    def read(self, amt: int | None = None) -> bytes:
        try:
            data = super().read(amt)
        except BaseException:
            self.close()
            raise
        if amt and not data and self.length:  # http.client closed it, with bytes to come
            raise IncompleteBody(self.length)
        return data


class ObsStore(_ObsSeam):
    """The objects under ``obs://bucket/prefix/``, read through ``esdk-obs-python``.

    Args:
        url: ``obs://bucket/prefix/``; the prefix may be empty (the whole bucket) and gets a
            trailing ``/`` if it lacks one.
        storage_options: connection settings, see the module docstring. Default: none (all from
            the environment and the SDK providers).
        page_size: objects per ``ListObjects`` request, 1 to 1000. Default 1000.

    Attributes:
        url: the root URL as ``obs://bucket/prefix/`` (no credentials).
        bucket: the bucket name.
        prefix: the root prefix inside the bucket, ``''`` or ending in ``/``.
        endpoint: the resolved endpoint, ``scheme://host[:port]`` (read-only).
        credential_source: where the credentials came from: ``"explicit"`` (storage_options),
            ``"env"`` (``OBS_*`` variables) or ``"provider"`` (the SDK's provider chain) (read-only).

    Raises:
        ImportError: the OBS SDK is not installed.
        ConfigError: (a ValueError) a malformed URL, an unknown option, no endpoint, arguments
            that ``obs.ObsClient`` refuses when it is made.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, *, page_size: int = MAX_PAGE_SIZE) -> None:
        self.bucket, self.prefix = _parse_url(url)
        self.url = f"obs://{self.bucket}/{self.prefix}"
        if not isinstance(page_size, int) or isinstance(page_size, bool) or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ConfigError(f"page_size {page_size!r}: expected an integer from 1 to {MAX_PAGE_SIZE}")
        self._page_size = page_size
        self._options = storage_options  # for the client of a view (scoped)
        sdk, settings, client = _new_client(self.url, storage_options)
        self._get_header = sdk.GetObjectHeader
        self._settings = settings
        self._secrets = settings.secrets
        self._timeout = settings.client_kwargs.get("timeout", 60)
        self._answered = False  # OBS answered a request: a refused connection is then an outage, retried
        self._use(client)

    def _use(self, client: Any) -> None:
        """Send this store's requests through ``client`` (made by ``_new_client``), noting the
        connections it takes, with nothing aborted (see the module's docstring, "Aborting")."""
        self._client = client
        self._aborted = False  # abort(): requests in flight cut, later ones refused
        self._abort_lock = threading.Lock()  # _aborted, _conns and _socks
        self._conns: weakref.WeakSet[Any] = weakref.WeakSet()  # connections the SDK took
        self._socks: weakref.WeakSet[socket.socket] = weakref.WeakSet()  # their sockets (abort shuts them down)
        take = getattr(client, "_get_server_connection", None)
        if callable(take):
            client._get_server_connection = self._noting(take)  # noqa: SLF001 - see the module's docstring, "Aborting"
        renew_after_fork(self)  # its own pool in a forked child (_forked)

    def scoped(self) -> ObsStore:
        """A view of this store for one pipeline (see :mod:`cachepipe.stores.base`): the same
        URL, settings and credentials, with a client of its own (its own pool of connections;
        making one sends nothing), so that its :meth:`abort` cuts and refuses its own requests only, and
        its :meth:`close` closes its own client only. The store, and its other views, serve on.

        Raises:
            ConfigError: the SDK refused the settings (as when this store was made).
        """
        view = view_of(self, _client=None, _aborted=False, _abort_lock=None, _conns=None, _socks=None)
        view._use(_new_client(self.url, self._options, self._settings)[2])  # noqa: SLF001 - this class's own method
        return view

    def _forked(self) -> None:
        """In a process just forked from this store's (:mod:`cachepipe.stores.forks`; the forking
        thread is the only one): an empty pool of connections, and the parent's connections
        closed here (their descriptors in this process: the parent's stay open, and nothing is
        sent on them), with a new lock for abort (see the module's docstring, "Forks")."""
        self._abort_lock = threading.Lock()
        self._conns, self._socks = weakref.WeakSet(), weakref.WeakSet()  # the parent's requests in flight
        holder = getattr(self._client, "connHolder", None)
        renew = getattr(self._client, "_init_connHolder", None)
        if not isinstance(holder, dict) or not callable(renew):
            return  # no pool (or an SDK that renamed it): nothing shared
        pooled = list(getattr(holder.get("connSet"), "queue", ()))  # not through its lock: a parent thread's
        renew()
        for conn in pooled:
            with contextlib.suppress(OSError):  # raised here, it would leave the next stores shared
                conn.close()  # http.client's: closes this process's descriptor, no shutdown (the parent's connection)

    def _noting(self, take: Callable[..., Any]) -> Callable[..., Any]:
        """The SDK's ``_get_server_connection`` that notes each connection it hands out, and
        refuses to hand one out once the store is aborted."""

        def noted(*args: Any, **kwargs: Any) -> Any:
            conn = take(*args, **kwargs)
            with self._abort_lock:
                if self._aborted:
                    conn.close()
                    raise self._aborted_error()
                if conn not in self._conns:
                    self._conns.add(conn)
                    conn.connect = self._noting_connect(conn)  # http.client connects in request(), on the SDK's thread
                    if getattr(conn, "response_class", None) is HTTPResponse:
                        conn.response_class = _WholeBody
                    if callable(getattr(conn, "send", None)):
                        conn.send = self._closing_send(conn)
                if getattr(conn, "sock", None) is not None:
                    self._socks.add(conn.sock)
            return conn

        return noted

    def _noting_connect(self, conn: Any) -> Callable[[], None]:
        """``conn.connect`` that notes the socket it connects (refused once the store is aborted).
        It refers to ``conn`` weakly, as :meth:`_closing_send` does: set on the connection, a
        strong reference made a cycle, and every connection the SDK let go of waited for the
        garbage collector (a dropped one's open socket with it)."""
        connect, own = type(conn).connect, weakref.ref(conn)

        def connected() -> None:
            live: Any = own()  # alive: its own method is running
            connect(live)
            with self._abort_lock:
                aborted = self._aborted
                if not aborted and live.sock is not None:
                    self._socks.add(live.sock)
            if aborted:
                live.close()
                raise self._aborted_error()

        return connected

    def _closing_send(self, conn: Any) -> Callable[[Any], None]:
        """``conn.send`` (every byte of a request, its head and its body, goes through it) that
        closes ``conn`` when a send fails: the SDK then loses the connection (its retry loop
        closes only a connection its request was sent on), whose socket stayed open until the
        garbage collector found it (a reset or refused upload, or a send cut by :meth:`abort`:
        a descriptor each, and a ResourceWarning)."""
        send, own = type(conn).send, weakref.ref(conn)

        def sending(data: Any) -> None:
            live: Any = own()  # alive: its own method is running
            try:
                send(live, data)
            except BaseException:
                live.close()
                raise

        return sending

    def abort(self) -> None:
        """Cut the requests in flight and refuse later ones, with
        :class:`~cachepipe.errors.StoreClosedError` (see the module's docstring, "Aborting", for
        what is not cut). Idempotent; from any thread."""
        with self._abort_lock:
            self._aborted = True
            for sock in list(self._socks):
                if sock.fileno() == -1:
                    continue  # closed
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed meanwhile, or not connected any more: nothing to wake

    def __repr__(self) -> str:
        return f"ObsStore(url={self.url!r}, endpoint={self.endpoint!r})"

    def __enter__(self) -> ObsStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client and its pooled connections. Idempotent."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- the three primitives ---------------------------------------------------------------

    def list(self, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Yield every object under the root in lexicographic key order, one page at a time
        (after the key ``start_after``, if given: the first page's ``marker``).

        Keys are relative to :attr:`prefix`; etags lose their quotes. Each page holds up to
        ``page_size`` objects (the first up to :data:`~cachepipe.stores.base.FIRST_PAGE_KEYS`
        but after a key, see :func:`~cachepipe.stores.base.first_page_keys`) and is yielded before the next one is requested.
        """
        # after the prefix's own folder marker (see FsspecStore._list_s3_page): the first page's
        # keys are all objects
        marker: str | None = (self.prefix + start_after if start_after is not None else self.prefix) or None
        last = ""
        keys = first_page_keys(self._page_size, start_after)
        while True:
            resp = self._call(
                "list",
                None,
                self._open().listObjects,
                self.bucket,
                prefix=self.prefix or None,
                marker=marker,
                max_keys=keys,
                encoding_type="url",
            )
            keys = self._page_size
            page = resp.body
            if page is None:
                hint = not_the_api(self.endpoint, "OBS")
                raise OSError(f"{self.url}: a listing that could not be parsed (HTTP {resp.status}), {hint}")
            contents = page.contents or []
            for entry in contents:
                key = entry.key
                if key == self.prefix:
                    continue  # the root's own directory marker; relative key would be ''
                if not key.startswith(self.prefix) or key <= last:
                    raise OSError(f"{self.url}: OBS listed {key!r} out of order or outside the prefix")
                last = key
                etag = listed_etag(entry.etag)
                yield ObjectInfo(key=key[len(self.prefix) :], size=int(entry.size or 0), etag=etag)
            if not page.is_truncated:
                return
            following = page.next_marker or last
            if not following or following == marker:
                raise OSError(f"{self.url}: OBS sent a truncated listing page without a way to continue after {last!r}")
            marker = following

    def get(self, key: str, out: BinaryIO, start: int, end: int, *, etag: str | None = None) -> int:
        """Write bytes ``[start, end)`` of ``key`` (relative to the root) to ``out``; return the count.

        One ranged GET, read in chunks of :data:`CHUNK_SIZE` (1 MiB) straight into ``out``; the
        object is never held in memory whole. The count is short if the server sent a short
        body (the caller verifies). ``start == end`` checks that the object exists (a HEAD) and
        writes nothing. ``etag``: the GET is conditional on it (``If-Match``; refused:
        :class:`~cachepipe.errors.ObjectChangedError`).
        """
        if not 0 <= start <= end:
            raise ValueError(f"{self._object_url(key)}: bad byte range [{start}, {end})")
        client = self._open()
        if start == end:
            self._call("head", key, client.headObject, self.bucket, self.prefix + key)
            return 0
        # The SDK percent-encodes header values, so a quoted ETag would arrive as %22...%22: bare
        header = self._get_header(range=f"bytes={start}-{end - 1}", if_match=etag)
        resp = self._call("get", key, client.getObject, self.bucket, self.prefix + key, headers=header, loadStreamInMemory=False)
        # An obs.model.ResponseWrapper: .result is the http.client.HTTPResponse, .conn its connection.
        # We read .result directly: the wrapper raises a bare Exception on a short body, where the
        # Store contract wants a short count.
        stream = resp.body.response
        try:
            if resp.status != 206 and start != 0:
                raise OSError(f"{self._object_url(key)}: OBS ignored the byte range {start}-{end - 1} (HTTP {resp.status})")
            return self._copy_body(key, stream.result, out, end - start)
        finally:
            if not stream.result.isclosed():
                # Body not read to its end (error, short read, server ignored the range): the SDK
                # would pool the connection with bytes still on it, and the next request would
                # read them as its status line. Its own flag for "close, do not pool" is _clear.
                stream.conn._clear = True  # noqa: SLF001 - the OBS SDK offers no public way to drop this connection
                # the SDK then closes the connection, not the response, whose file object would keep
                # the socket's descriptor open until it is collected (a ResourceWarning in a cycle)
                stream.result.close()
            stream.close()

    # -- writing (optional primitives, see WritableStore) ---------------------------------------

    upload_part_size: int = 16 * 1024 * 1024
    """Files larger than this are uploaded in parts of this size (OBS: 100 KiB to 5 GiB), or of
    more for a file that would take more than :data:`~cachepipe.stores.base.MAX_PARTS` parts.
    Set it on the instance to change it."""

    def put(self, local_path: str | os.PathLike[str], key: str, *, content_type: str | None = None) -> None:
        """Upload the file ``local_path`` as ``key`` (relative to the root), streamed from disk,
        as an object of the media type ``content_type`` (None: the SDK's guess by the key's suffix).

        Up to :attr:`upload_part_size` bytes: one ``PutObject``. Larger: a multipart upload,
        one part at a time (streamed from the file), aborted if any step fails (so no orphaned
        parts are left to bill); an abort that fails is logged, naming the upload it leaves, and
        the upload's own error is raised. A completion that fails (its answer lost: the SDK is
        made without retries) is first checked (:meth:`_found`,
        :func:`~cachepipe.stores.base.completed_anyway`): if OBS completed the object, the upload is done
        (and aborted all the same: an object of the same bytes there before leaves it open, else); one
        answered ``NoSuchUpload`` that is not confirmed so raises :func:`~cachepipe.stores.base.upload_lost`.
        Errors are translated at :meth:`_check` and :meth:`_unreachable` like reads; ``local_path``
        is opened first, and if it cannot be, the error is a
        :class:`~cachepipe.errors.LocalFileError` naming it (the SDK would report a file it
        cannot read as an endpoint it cannot reach).
        """
        client = self._open()
        local = os.fspath(local_path)
        with open_local(local, self._object_url(key)) as src:  # the SDK opens it again: it was readable a moment ago
            size = os.fstat(src.fileno()).st_size
        object_key = self.prefix + key
        if size <= self.upload_part_size:
            from obs import PutObjectHeader

            headers = PutObjectHeader(contentType=content_type)
            self._call("uploading", key, client.putFile, self.bucket, object_key, local, headers=headers)
            return
        from obs import CompleteMultipartUploadRequest, CompletePart

        resp = self._call("uploading", key, client.initiateMultipartUpload, self.bucket, object_key, contentType=content_type)
        upload_id = resp.body.uploadId
        failed: Exception | None = None  # the completion's error, of an upload whose object is there
        try:
            parts = []
            part_size = part_size_for(size, self.upload_part_size)
            for number, offset in enumerate(range(0, size, part_size), start=1):
                length = min(part_size, size - offset)
                part = self._call(
                    "uploading",
                    key,
                    client.uploadPart,
                    self.bucket,
                    object_key,
                    number,
                    upload_id,
                    object=local,
                    isFile=True,
                    partSize=length,
                    offset=offset,
                )
                parts.append(CompletePart(partNum=number, etag=part.body.etag))
            try:
                self._call(
                    "uploading",
                    key,
                    client.completeMultipartUpload,
                    self.bucket,
                    object_key,
                    upload_id,
                    CompleteMultipartUploadRequest(parts=parts),
                )
                return
            except Exception as exc:
                if not completed_anyway(self._found(client, object_key), size, [part.etag for part in parts]):
                    if getattr(exc, "code", None) == NO_SUCH_UPLOAD:
                        raise upload_lost(self._object_url(key), upload_id, exc) from exc
                    raise
                failed = exc
        except BaseException:
            if self._abort_upload(client, key, object_key, upload_id) == "gone":
                log.info(ALREADY_GONE, self._object_url(key), upload_id)
            raise
        # the object there has the upload's bytes; aborted all the same (see FsspecStore._put_parts)
        where = self._object_url(key)
        log_completed_anyway(self._abort_upload(client, key, object_key, upload_id), where, upload_id, failed)

    def _abort_upload(self, client: Any, key: str, object_key: str, upload_id: str) -> str:
        """Abort multipart upload ``upload_id``: "aborted", or as :func:`~cachepipe.stores.base.abort_failed`
        says (answered ``NoSuchUpload``: "gone"; else "failed", logged)."""
        try:
            self._call("aborting the upload of", key, client.abortMultipartUpload, self.bucket, object_key, upload_id)
        except Exception as exc:  # noqa: BLE001 - logged: the upload's own error is the one raised
            return abort_failed(getattr(exc, "code", None), self._object_url(key), upload_id, exc)
        return "aborted"

    def _found(self, client: Any, object_key: str) -> tuple[int, str | None] | None:
        """The size and ETag of the object ``object_key`` (one HEAD), or None when there is none
        or the HEAD fails: asked after a completion that failed (``getObjectMetadata``: the SDK's
        ``headObject`` parses no headers)."""
        try:
            resp = client.getObjectMetadata(self.bucket, object_key)
        except (OSError, HTTPException):
            log.debug("%s: no object found after a failed completion", self.url, exc_info=True)
            return None
        if getattr(resp, "status", None) != 200 or resp.body is None or resp.body.contentLength is None:
            return None
        return int(resp.body.contentLength), resp.body.etag

    def check_bucket(self) -> None:
        """Raise :class:`FileNotFoundError` if the bucket does not exist (one HEAD of the bucket):
        ``cachepipe map`` asks before it runs anything. A bucket the credentials may not check
        (403) passes.

        Raises:
            FileNotFoundError: no such bucket; other failures as in the error contract.
        """
        try:
            resp = self._open().headBucket(self.bucket)
        except (OSError, HTTPException) as exc:
            raise self._unreachable(exc, "head", "") from exc
        status = getattr(resp, "status", None)
        if isinstance(status, int):
            self._answered = True
        if status == 403:
            return
        if status == 404:  # a HEAD response has no error code
            raise self._error_for(404, "NoSuchBucket", "head", "(HTTP 404)", self._object_url(""))
        self._check(resp, "head", "")

    def names_object(self) -> bool:
        """True if the URL names one object (a tar shard), not a prefix: one HEAD of the
        prefix without its trailing ``/``. A network error raises as in the error contract (once
        the store is aborted, its :class:`~cachepipe.errors.StoreClosedError`); any answer but
        200 is False."""
        key = self.prefix.rstrip("/")
        if not key:
            return False
        try:
            resp = self._open().headObject(self.bucket, key)
        except (OSError, HTTPException) as exc:
            raise self._unreachable(exc, "head", "") from exc
        return getattr(resp, "status", None) == 200

    def exists(self, key: str) -> bool:
        """True if ``key`` (relative to the root) exists: one HEAD. A 404 is False; other failures raise.

        A HEAD response has no error code, so a missing bucket also reads as False.
        """
        try:
            resp = self._open().headObject(self.bucket, self.prefix + key)
        except (OSError, HTTPException) as exc:
            raise self._unreachable(exc, "head", key) from exc
        if isinstance(getattr(resp, "status", None), int):
            self._answered = True
        if getattr(resp, "status", None) == 404:
            return False
        self._check(resp, "head", key)
        return True

    def delete(self, keys: Sequence[str], within: str = "") -> None:
        """Delete ``keys`` (relative to the root): one DeleteObjects per
        :data:`~cachepipe.stores.base.DELETE_BATCH` keys (quiet: OBS answers with the keys it could
        not delete only). A key that does not exist is no error; ``within`` is for local
        filesystems (an object store has no folders to remove).

        Raises:
            PermissionError: a key OBS refused to delete; other failures as in the error contract.
        """
        from obs import DeleteObjectsRequest, Object

        for at in range(0, len(keys), DELETE_BATCH):
            batch = keys[at : at + DELETE_BATCH]
            request = DeleteObjectsRequest(quiet=True, objects=[Object(key=self.prefix + key) for key in batch])
            resp = self._call("deleting", batch[0], self._open().deleteObjects, self.bucket, request)
            refused = getattr(resp.body, "error", None) or []
            if refused:
                first = refused[0]
                where = f"obs://{self.bucket}/{first.key}"
                raise delete_error(first.code, first.message and self._redact(first.message), where, self.endpoint)

    # -- helpers ------------------------------------------------------------------------------

    def _open(self) -> Any:
        if self._aborted:
            raise self._aborted_error()
        if self._client is None:
            raise RuntimeError(f"{self!r} is closed")
        return self._client

    def _copy_body(self, key: str, body: Any, out: BinaryIO, length: int) -> int:
        """Copy at most ``length`` bytes of the HTTP ``body`` to ``out`` in chunks; return the count."""
        buf = memoryview(bytearray(min(CHUNK_SIZE, length)))
        written = 0
        while written < length:
            try:
                n = body.readinto(buf[: min(len(buf), length - written)])
            except (OSError, HTTPException) as exc:
                raise self._unreachable(exc, "get", key) from exc
            if not n:
                break
            chunk = buf[:n]
            while chunk:  # a raw (unbuffered) file may write less than asked
                done = out.write(chunk)
                chunk = chunk[done if done is not None else len(chunk) :]
            written += n
        if written < length and self._aborted:  # a body cut by abort: not a short body to verify
            raise self._aborted_error()
        return written
