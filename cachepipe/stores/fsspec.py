"""The fsspec backend: ``s3://`` (s3fs), ``file://``, plain paths, ``memory://``, ``gs://``...

All errors from fsspec, s3fs, botocore and aiohttp, and from the direct S3 requests of
:mod:`cachepipe.stores.s3direct` (GETs and listing pages, for plain s3fs options), are translated in
:func:`~cachepipe.stores.fsspec_errors._translate`, the one seam of this backend (see
:mod:`cachepipe.stores.base` for the contract).

:meth:`FsspecStore.abort` cuts the requests in flight: the direct path's (their sockets shut
down), and the GETs and listing pages this store sends through an async filesystem's event loop
(s3fs, gcsfs: each runs as a task of its own there, cancelled). Requests of a synchronous
filesystem (local files, memory) are not cut (they do not wait on a network); a listing of a
filesystem other than S3 (one ``find``) and uploads (``put``, ``exists``, ``check_bucket``:
``cachepipe map``'s) are not either, and take as long as they take. Every later request is refused
with :class:`~cachepipe.errors.StoreClosedError`.

Forks: a store used in a process forked from the one that made it (a DataLoader worker given
the dataset's ``store=``) makes a filesystem of its own there, from its URL and storage options,
at its first use (:attr:`FsspecStore.fs`), and starts with new locks and no requests in flight;
its direct path with no connection and no route (:mod:`cachepipe.stores.s3direct`, "Forks").
Before, an s3fs filesystem refused to run there (fsspec's "This class is not fork-safe", raised
as an ``OSError`` by every request s3fs sends, and by the direct path's probe of a bucket's
route: each DataLoader worker's listing failed), and the direct path's pooled connections were
the parent's (:mod:`cachepipe.stores.forks`). The parent's filesystem is kept, never closed, in
the child. An object given in the storage options (s3fs's ``session``, an aiobotocore session)
is given as it is to the filesystem made there: the parent's.

The storage options are checked (and the S3 endpoint found) in :mod:`cachepipe.stores.fsspec_options`
before the store is made. The public functions of both modules, ``_translate`` and
``_filesystem_class`` are importable from here, as before.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import contextvars
import errno
import logging
import mimetypes
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, BinaryIO, NoReturn

import fsspec
import fsspec.asyn

from ..errors import ConfigError, LocalFileError, StoreClosedError
from ..fscalls import sync_folder
from .base import (
    ALREADY_GONE,
    CONNECT_TIMEOUT,
    DELETE_BATCH,
    NO_SUCH_UPLOAD,
    TEMP_SUFFIX,
    ObjectInfo,
    _local_error,
    abort_failed,
    completed_anyway,
    delete_error,
    first_page_keys,
    listed_etag,
    log_completed_anyway,
    one_request,
    open_local,
    part_size_for,
    upload_lost,
    view_of,
)
from .forks import keep_parents, renew_after_fork
from .fsspec_errors import _s3_error, _translate
from .fsspec_options import (
    _filesystem_class as _filesystem_class,  # noqa: PLC0414 - re-exported: preload() imports it from here, loading this module
)
from .fsspec_options import (
    _protocols,
    environment_endpoint,  # noqa: F401 - importable from here, as before
    s3_endpoint,
    shown_endpoint,
)
from .fsspec_options import (
    check_options as check_options,  # noqa: PLC0414 - re-exported: check_store() imports it from here, as before
)
from .localwrites import delete_local, put_local, remove_stale_temps

__all__ = ["FsspecStore"]

log = logging.getLogger("cachepipe.stores.fsspec")

_CHUNK = 8 * 1024 * 1024  # bytes per request when streaming a range
_UPLOAD_PART = 16 * 1024 * 1024  # multipart part size of uploads (files from twice this size)
PARTS_IN_FLIGHT = 4
"""Parts of one multipart upload to S3 read and sent at once: what an upload holds in memory
(s3fs's own multipart upload holds ten)."""

_NO_EXPECT: contextvars.ContextVar[bool] = contextvars.ContextVar("cachepipe_no_expect", default=False)
"""True in the task of one of this store's uploads: :func:`_drop_expect` takes botocore's
``Expect: 100-continue`` off its requests (the shared client's other requests keep it)."""


def _drop_expect(params: dict[str, Any], **_: Any) -> None:
    """A ``before-call.s3`` hook, after botocore's ``add_expect_header``: no ``Expect:
    100-continue`` on an upload of this store. aiohttp (3.14.5, the newest release) sends the head of such
    a request from a task of its own; when the connection was already closing (refused, reset as
    it opened) that task fails with ``ClientConnectionResetError`` that no one takes, and asyncio
    prints "Task exception was never retrieved" and a traceback, while the request fails on the
    lost connection and is retried. Without the header the head goes with the body, whose write
    errors aiohttp gives to the request. And aiohttp's read timeout starts once the body is sent:
    a store that took the head and never answered held the upload with no bound. The header is
    not signed (SigV4 leaves it out)."""
    if _NO_EXPECT.get():
        params["headers"].pop("Expect", None)


def _no_empty_body(request: Any, **_: Any) -> None:
    """A ``before-send.s3`` hook: an empty upload of this store is sent with no body at all
    (``Content-Length: 0`` stays). aiohttp writes an empty body's head from the same task of its
    own, at the body's end, with the same untaken failure as :func:`_drop_expect` tells; a request
    without a body has its head written as it is sent, a failure raised to the request."""
    if _NO_EXPECT.get() and request.headers.get("Content-Length") == "0":
        request.body = None


def _walks(fs: Any) -> bool:
    """Whether ``fs.find`` walks folder by folder through fsspec's own ``walk`` (http, sftp...;
    a local filesystem is walked by :func:`local_files` instead), which passes over a folder it
    cannot list (permission denied, an I/O error, a server that refuses) and lists the rest as if
    it were all: its ``on_error`` reaches the first folder only. s3fs, gcsfs and memory have a
    ``find`` of their own, one listing of the whole prefix."""
    cls = type(fs)
    if cls.find is fsspec.spec.AbstractFileSystem.find:
        return True
    generic = fsspec.asyn.AsyncFileSystem._find  # noqa: SLF001 - fsspec's own method, compared, not called
    return isinstance(fs, fsspec.asyn.AsyncFileSystem) and cls._find is generic


def _find_raising(fs: Any, root: str) -> dict[str, dict[str, Any]]:
    """``fs.find(root, detail=True)`` for a filesystem that :func:`_walks`, one ``ls`` per folder
    as its ``walk`` makes, but raising a folder's error instead of leaving its objects out. A
    folder that is gone (removed while the listing runs, or a root that does not exist: no
    objects) is passed over, as there."""
    found: dict[str, dict[str, Any]] = {}
    folders = [root]
    while folders:
        folder = folders.pop()
        try:
            entries = fs.ls(folder, detail=True)
        except FileNotFoundError:
            continue
        for info in entries:
            name = info["name"].rstrip("/")
            if info["type"] == "directory":
                if name != folder:
                    folders.append(name)
            else:
                found[info["name"]] = info
    return found


class _Renew:
    """``store.fs`` of a store held weakly (a :class:`~cachepipe.stores.s3direct.DirectGet`'s
    ``renew``: a strong reference would make a cycle, and a store let go of would wait for the
    garbage collector, with its open connections)."""

    def __init__(self, store: FsspecStore) -> None:
        self._store = weakref.ref(store)

    def __call__(self) -> Any:
        store = self._store()
        return None if store is None else store.fs


class FsspecStore:
    """A :class:`~cachepipe.stores.base.Store` over any fsspec filesystem.

    Args:
        url: the root prefix, e.g. ``s3://bucket/video/`` or ``/data/video``.
        storage_options: keyword arguments for the fsspec filesystem (for s3fs:
            ``endpoint_url``, ``key``, ``secret``, ``anon``, ``client_kwargs``...).
        chunk_size: bytes requested per GET when streaming a range (default 8 MiB).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, chunk_size: int = _CHUNK) -> None:
        self.url = url
        options = dict(storage_options or {})
        fs_cls = check_options(url, options)
        if fs_cls is not None and "s3" in _protocols(fs_cls):  # None: a chained URL, options per layer
            config = options.get("config_kwargs") or {}
            options["config_kwargs"] = {"connect_timeout": CONNECT_TIMEOUT, **config}
        self.answered = False
        """The endpoint answered a request (a refused connection is then an outage, retried, not a wrong endpoint)."""
        try:
            self._fs, root = fsspec.core.url_to_fs(url, **options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{url!r}: fsspec rejected the URL or storage_options: {type(exc).__name__}: {exc}") from exc
        self._options = options  # for a filesystem made anew in a forked process (_forked)
        self.endpoint = self._endpoint(options)
        self.root = root.rstrip("/")
        self.chunk_size = chunk_size
        self._direct: Any = None  # a DirectGet for plain s3fs options (botocore only imported then)
        self._lock = threading.Lock()  # _aborted and _running
        self._aborted = False
        self._running: set[concurrent.futures.Future[Any]] = set()  # requests in the event loop (abort cancels them)
        self._s3 = getattr(self.fs, "protocol", None) in (("s3", "s3a"), "s3")
        if self._s3:
            from .s3direct import DirectGet

            self._bucket, prefix, _ = self.fs.split_path(self.root)  # keys are relative to the root
            self._key_prefix = f"{prefix}/" if prefix else ""
            if self._bucket and DirectGet.usable(self.fs, storage_options or {}):
                self._direct = DirectGet(self.fs, _Renew(self))
        renew_after_fork(self)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem: in a process forked from the one that made this store, one made
        there at its first use (see the module's docstring, "Forks")."""
        fs = self._fs
        if fs is None:  # forked; two threads at once: fsspec's cache makes one
            fs = self._fs = fsspec.core.url_to_fs(self.url, **self._options)[0]
        return fs

    def _forked(self) -> None:
        """In a process just forked from this store's (:mod:`cachepipe.stores.forks`): a new
        lock, none of the parent's requests in flight, and the parent's filesystem let go of
        (kept, never closed here): one is made anew at the first use here (fsspec refuses to run
        an async filesystem, s3fs's, in a forked process; a synchronous one's connections, sftp's
        or ftp's, are the parent's). The direct path renews itself (:meth:`DirectGet._forked
        <cachepipe.stores.s3direct.DirectGet._forked>`), through :attr:`fs`."""
        self._lock = threading.Lock()
        self._running = set()
        keep_parents(self._fs)
        self._fs = None

    def scoped(self) -> FsspecStore:
        """A view of this store for one pipeline (see :mod:`cachepipe.stores.base`): the same
        URL, settings and filesystem (every attribute is the store's, see
        :func:`~cachepipe.stores.base.view_of`), with a direct path of its own (its own
        connections) and requests in flight of its own, so that its :meth:`abort` cuts and
        refuses its own requests only, and its :meth:`close` closes its own connections only.
        The store, and its other views, serve on."""
        view = view_of(self, _lock=threading.Lock(), _aborted=False, _running=set(), _direct=None)
        if self._direct is not None:
            from .s3direct import DirectGet

            view._direct = DirectGet(view.fs, _Renew(view))  # noqa: SLF001 - the view's own (view_of)
        renew_after_fork(view)
        return view

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    @property
    def direct(self) -> bool:
        """True if GETs go through :mod:`~cachepipe.stores.s3direct` (s3:// with options it takes), not s3fs."""
        return self._direct is not None

    def credentials(self, key: str = "") -> Any:
        """The frozen botocore credentials (``access_key``, ``secret_key``, ``token``) that the
        direct path signs this store's GETs with now, or ``botocore.UNSIGNED`` if it sends them
        unsigned; None without a direct path, or when s3fs sends the bucket's requests. Raises
        the store's errors, naming ``key`` (e.g. :class:`PermissionError` when botocore finds no
        credentials)."""
        if self._direct is None:
            return None
        with self._errors(self._where(key), sends=False):  # the probe sends nothing
            return self._direct.credentials(self._bucket)

    def _endpoint(self, options: dict[str, Any]) -> str:
        """The server this store talks to, for messages: the endpoint URL, or what stands for it."""
        protocols = _protocols(self.fs)
        if "s3" in protocols:
            return shown_endpoint(str(s3_endpoint(options) or "the AWS S3 endpoint"))
        if "file" in protocols or "local" in protocols:
            self.answered = True
            return "the local filesystem"
        if "memory" in protocols:
            self.answered = True
            return "fsspec's memory filesystem"
        return f"the {protocols[0]}:// endpoint"

    @contextmanager
    def _errors(self, where: str, sends: bool = True, first: bool = True) -> Iterator[None]:
        """The seam: translate whatever the body raises (:meth:`_raise_translated`). ``sends``:
        the body sends a request, so its success means that the endpoint answered. ``first``:
        the request may be the run's first contact with the endpoint (not a GET or an upload)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - raised again, translated
            self._raise_translated(exc, where, sends, first)
        if sends:
            self.answered = True

    def _raise_translated(self, exc: Exception, where: str, sends: bool = True, first: bool = True) -> NoReturn:
        """Raise ``exc`` as :func:`_translate` maps it (chained), or as it is; called in its
        ``except`` clause (by :meth:`_errors`, or by a loop that makes a call per chunk and
        spares itself a context manager's per-call cost)."""
        if sends and _s3_error(exc)[0] is not None:  # not an answer of STS or SSO to a credential refresh
            self.answered = True
        translated = _translate(exc, where, self.endpoint, self.answered, first)
        if translated is exc:
            raise exc
        raise translated from exc

    def _where(self, key: str) -> str:
        """``key``'s URL, for messages."""
        return f"{self.url.rstrip('/')}/{key}"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    list_page_size: int = 1000
    """Keys per listing request to S3 (S3's maximum and default is 1,000); the first request asks
    for :data:`~cachepipe.stores.base.FIRST_PAGE_KEYS` if that is fewer, but after a key (see
    :func:`~cachepipe.stores.base.first_page_keys`)."""

    def list(self, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Yield every object under the root in key order (after the key ``start_after``, if
        given: on S3 ListObjectsV2's ``StartAfter``, elsewhere the keys up to it are skipped). On
        S3, one page at a time: each page is yielded before the next is requested (a plain fsspec
        ``find`` lists everything first). On a local filesystem, the temporary files of uploads
        (``*.cachepipe.tmp``: being written, or left by a killed one) are not objects, and are
        not yielded (their count is logged)."""
        if getattr(self.fs, "protocol", None) in (("s3", "s3a"), "s3") and not getattr(self.fs, "version_aware", False):
            yield from self._list_s3(start_after)
            return
        if {"file", "local"} & set(_protocols(self.fs)):
            yield from self._list_local(start_after)
            return
        with self._errors(self.url):
            self.fs.invalidate_cache(self.root)  # a relisting must see the store as it is now
            entries = (
                _find_raising(self.fs, self.root) if _walks(self.fs) else self.fs.find(self.root, detail=True, withdirs=False)
            )
        prefix = f"{self.root}/" if self.root else ""
        for path in sorted(entries):
            info = entries[path]
            if info.get("type", "file") != "file" or not path.startswith(prefix):
                continue
            if start_after is not None and path[len(prefix) :] <= start_after:
                continue
            etag = info.get("ETag") or info.get("etag")
            yield ObjectInfo(path[len(prefix) :], int(info["size"]), listed_etag(etag))

    def _list_local(self, start_after: str | None) -> Iterator[ObjectInfo]:
        """:meth:`list` of a local filesystem: walked as it is yielded (:func:`local_files`), so
        a listing stopped early (a map rank's part of DST, :mod:`~cachepipe.map.dstrange`) reads
        no further, and the tree is never held in memory whole (one folder's entries at a time).
        As fsspec's ``find`` lists, links are not followed nor listed, and a root that is missing
        or not a folder lists nothing; but a folder that cannot be read is an error, not a silent
        gap (except fsck's :data:`LOST_FOUND`). The temporary files of uploads are left out
        (their count logged, and the first by its path)."""
        temps: list[str] = []
        with self._errors(self.url):
            for key, size in local_files(self.root, start_after):
                if key.endswith(TEMP_SUFFIX):  # put_local's, being written or left by a killed upload
                    temps.append(self._path(key))  # named by its path, to be found and removed
                    continue
                yield ObjectInfo(key, size, None)
        if temps:  # said, not passed over in silence: a file of the user's could bear the name
            log.info("%s: left out %d upload temporary file(s) (*%s), first %r", self.url, len(temps), TEMP_SUFFIX, temps[0])

    def _list_s3(self, start_after: str | None) -> Iterator[ObjectInfo]:
        bucket, key, _ = self.fs.split_path(self.root)
        prefix = f"{key}/" if key else ""
        token = None
        keys = first_page_keys(self.list_page_size, start_after)
        after = prefix + start_after if start_after is not None else prefix
        while True:
            with self._errors(self.url):
                entries, token = self._list_s3_page(bucket, prefix, token, keys, after)
            keys = self.list_page_size
            for name, size, etag in entries:
                if name == prefix:
                    continue  # the root's own directory marker
                yield ObjectInfo(name[len(prefix) :], size, etag)
            if token is None:
                return

    def _list_s3_page(
        self, bucket: str, prefix: str, token: str | None, keys: int, after: str
    ) -> tuple[builtins.list[tuple[str, int, str | None]], str | None]:  # `list` is also this class's method
        """One ListObjectsV2 page of up to ``keys`` keys: ``([(key, size, etag), ...], next
        continuation token or None)``. The first (no ``token``) starts after the whole key
        ``after``: ``prefix`` itself, or the key a restarted listing continues after. Not the
        prefix's first key: a folder marker of the prefix (what a console's "Create folder"
        makes) would take a key of the first page, which
        :func:`~cachepipe.listing.StreamingListing.wait_first_page` counts in objects."""
        start_after = after if token is None and after else None
        if self._direct is not None:
            page = self._direct.list_page(bucket, prefix, keys, token, start_after)
            if page is not None:
                return page  # type: ignore[no-any-return]  # DirectGet, held as Any so botocore stays unimported
        request = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": keys, **self.fs.req_kw}
        if token is not None:
            request["ContinuationToken"] = token
        if start_after is not None:
            request["StartAfter"] = start_after
        page = self._await(self.fs._call_s3, "list_objects_v2", **request)  # noqa: SLF001 - s3fs has no public call for one raw page
        entries = []
        for entry in page.get("Contents", ()):
            etag = entry.get("ETag")
            entries.append((entry["Key"], int(entry["Size"]), listed_etag(etag)))
        return entries, page["NextContinuationToken"] if page.get("IsTruncated") else None

    def get(self, key: str, out: BinaryIO, start: int, end: int, *, etag: str | None = None) -> int:
        """See :meth:`Store.get <cachepipe.stores.base.Store.get>`. ``etag`` makes S3 requests
        conditional (``If-Match``); other filesystems (local, memory, ...) have no such request
        and ignore it."""
        path = self._path(key)
        if self._direct is not None:
            with self._errors(self._where(key), first=False):
                got = self._direct.get(self._bucket, self._key_prefix + key, out, start, end, etag)
            if got is not None:
                return got  # type: ignore[no-any-return]  # as above
        conditional = etag is not None and self._s3
        written = 0
        pos = start
        while pos < end:
            want = min(self.chunk_size, end - pos)
            try:  # the seam, as _errors(first=False)
                if conditional:
                    data = self._await(self._get_object, path, pos, pos + want, etag)
                elif getattr(self.fs, "async_impl", False):
                    data = self._await(self.fs._cat_file, path, start=pos, end=pos + want)  # noqa: SLF001 - fsspec's async twin of cat_file, which abort can cancel
                else:
                    self._check_aborted()
                    data = self.fs.cat_file(path, start=pos, end=pos + want)
            except Exception as exc:  # noqa: BLE001 - raised again, translated
                self._raise_translated(exc, self._where(key), first=False)
            self.answered = True
            if not data:
                break
            out.write(data)
            written += len(data)
            pos += len(data)
            if len(data) < want:
                break  # short body: the caller's size check decides
        return written

    async def _get_object(self, path: str, start: int, end: int, etag: str | None) -> bytes:
        """Bytes ``[start, end)`` of ``path`` by one GetObject through s3fs's client, conditional
        on ``etag`` (what s3fs's ``cat_file`` sends, which takes no condition)."""
        bucket, key, _ = self.fs.split_path(path)
        resp = await self.fs._call_s3(  # noqa: SLF001 - s3fs has no public call for a conditional GET
            "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=f'"{etag}"', **self.fs.req_kw
        )
        body = resp["Body"]
        try:
            return await body.read()  # type: ignore[no-any-return]  # aiobotocore's stream is untyped
        finally:
            body.close()

    def _await(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` in the filesystem's event loop and wait for it (what
        ``fsspec.asyn.sync`` does), as a task that :meth:`abort` can cancel."""
        with self._lock:
            self._check_aborted()
            future = asyncio.run_coroutine_threadsafe(func(*args, **kwargs), self.fs.loop)
            self._running.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError as exc:
            raise self._aborted_error() from exc
        finally:
            with self._lock:
                self._running.discard(future)

    def _check_aborted(self) -> None:
        if self._aborted:
            raise self._aborted_error()

    def _aborted_error(self) -> StoreClosedError:
        return StoreClosedError(f"request to {self.url} at {self.endpoint} aborted: the store was closed")

    def abort(self) -> None:
        """Cut the requests in flight and refuse later ones, each with
        :class:`~cachepipe.errors.StoreClosedError` (see the module's docstring for what is not
        cut). Idempotent; from any thread."""
        with self._lock:
            self._aborted = True
            running = list(self._running)
        for future in running:
            future.cancel()  # the task is cancelled in the loop: aiohttp closes its connection
        if self._direct is not None:
            self._direct.abort()

    def close(self) -> None:
        """Close the direct GET connections (fsspec shares filesystem instances and their pools)."""
        if self._direct is not None:
            self._direct.close()

    # ---- writing (optional primitives, see WritableStore) ----------------------------
    upload_part_size: int = _UPLOAD_PART
    """Part size of multipart uploads to S3 (files of at least twice this size are uploaded in
    parts, :data:`PARTS_IN_FLIGHT` in flight; at least 5 MiB; larger for a file that would take
    more than :data:`~cachepipe.stores.base.MAX_PARTS` parts). Set it on the instance to change it."""

    def put(self, local_path: str | os.PathLike[str], key: str, *, content_type: str | None = None) -> None:
        """Upload ``local_path`` as ``key``: on S3, one PutObject (s3fs's) under ``2 * upload_part_size`` and 5 GiB,
        else a multipart upload (:meth:`_put_parts`: at most :data:`PARTS_IN_FLIGHT` parts in memory,
        aborted if it fails); on a local filesystem it is copied to a temporary name beside the target and renamed
        (:func:`~cachepipe.stores.localwrites.put_local`: one left by a killed upload is overwritten by the next put of the key).
        ``local_path`` is opened first: if it cannot be (or, on a local filesystem, read), the
        error is a :class:`~cachepipe.errors.LocalFileError` naming it, not the store's.
        ``content_type``: the object's media type on S3 (None: s3fs's guess by the file's name);
        other filesystems record none."""
        local = os.fspath(local_path)
        path = self._path(key)
        where = self._where(key)
        with open_local(local, where) as src, self._errors(where, first=False):  # src: LocalFileError, not the store's
            protocols = _protocols(self.fs)
            if "file" in protocols or "local" in protocols:
                self.fs.makedirs(self.fs._parent(path), exist_ok=True)  # noqa: SLF001 - fsspec's own parent rule for this filesystem
                put_local(src, path, where)
            elif "s3" in protocols or "s3a" in protocols:
                typed = {} if content_type is None else {"ContentType": content_type}
                size = os.fstat(src.fileno()).st_size
                part = part_size_for(size, self.upload_part_size)
                if one_request(size, part):  # one PutObject (s3fs opens the file again: it was readable a moment ago)
                    fsspec.asyn.sync(self.fs.loop, self._uploading, path, self.fs._put_file, local, path, chunksize=part, **typed)  # noqa: SLF001 - put_file's coroutine, run as _uploading
                else:
                    guessed = mimetypes.guess_type(local)[0]  # s3fs's guess, as its put_file makes it
                    typed = typed or ({"ContentType": guessed} if guessed else {})
                    parts = (local, src.fileno(), size, part, where, path, typed)
                    fsspec.asyn.sync(self.fs.loop, self._uploading, path, self._put_parts, *parts)
                    self.fs.invalidate_cache(path)  # as s3fs's put_file does
            else:
                self.fs.put_file(local, path)

    async def _uploading(self, path: str, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any, **kwargs: Any) -> Any:
        """Run the upload to ``path``, ``func(*args, **kwargs)`` (in the event loop), without ``Expect:
        100-continue`` on its requests (:func:`_drop_expect`) and an empty one without a body
        (:func:`_no_empty_body`), hooked on s3fs's client here (a client made anew has them too);
        in this task's context only, not in the caller's: the client's other requests are as they were."""
        await self.fs.set_session()
        client = await self.fs.get_s3(self.fs.split_path(path)[0])  # the bucket's (one per region with cache_regions)
        client.meta.events.register_last("before-call.s3", _drop_expect, unique_id="cachepipe-drop-expect")
        client.meta.events.register_last("before-send.s3", _no_empty_body, unique_id="cachepipe-no-empty-body")
        _NO_EXPECT.set(True)
        return await func(*args, **kwargs)

    async def _put_parts(self, local: str, fd: int, size: int, part: int, where: str, path: str, typed: dict[str, str]) -> None:
        """Upload ``size`` bytes of ``local``, open as ``fd``, to ``path`` as a multipart upload
        of parts of ``part`` bytes, :data:`PARTS_IN_FLIGHT` at most read and sent at once (s3fs's
        own sent ten). On any failure, or cancellation, the parts in flight are cancelled and
        waited for, then the upload is aborted (s3fs aborted at once and let the other parts run
        on: a part that reaches S3 as its upload is aborted may be kept, billed). An abort that
        fails is logged, naming the upload it leaves; the error raised is the upload's own. A
        completion that fails is first checked (:meth:`_found`, :func:`~cachepipe.stores.base.completed_anyway`):
        one whose answer was lost, retried by s3fs and answered ``NoSuchUpload``, completed the
        object, and the upload is done; it is aborted all the same (an object of the same bytes
        there before, whose upload's completion was refused, left it open: its parts billed). One
        answered ``NoSuchUpload`` that is not confirmed so raises
        :func:`~cachepipe.stores.base.upload_lost` (transient: upload it again)."""
        bucket, key, _ = self.fs.split_path(path)
        call = self.fs._call_s3  # noqa: SLF001 - s3fs has no public call for one request (it adds its request options)
        upload_id = (await call("create_multipart_upload", Bucket=bucket, Key=key, **typed))["UploadId"]

        async def send(number: int, offset: int) -> dict[str, Any]:
            length = min(part, size - offset)
            try:
                body = await asyncio.to_thread(os.pread, fd, length, offset)  # not in the event loop: a slow disk stalls no GET
            except OSError as exc:
                raise _local_error(exc, local, where) from exc
            if len(body) != length:  # the file shrank since its size was taken
                raise LocalFileError(errno.EIO, f"cannot read the local file to upload as {where}: it shrank", local)
            answer = await call("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": answer["ETag"]}

        tasks: builtins.list[asyncio.Task[dict[str, Any]]] = []
        in_flight: set[asyncio.Task[dict[str, Any]]] = set()
        failed: Exception | None = None  # the completion's error, of an upload whose object is there
        try:
            for number, offset in enumerate(range(0, size, part), start=1):
                if len(in_flight) >= PARTS_IN_FLIGHT:
                    done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()  # a failure raises
                tasks.append(asyncio.create_task(send(number, offset)))
                in_flight.add(tasks[-1])
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # a failure raises (the others are then cancelled, below)
            parts = [task.result() for task in tasks]  # all done
            try:
                await call(
                    "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
                return
            except Exception as exc:
                if not completed_anyway(await self._found(bucket, key), size, [p["ETag"] for p in parts]):
                    if _s3_error(exc)[1] == NO_SUCH_UPLOAD:
                        raise upload_lost(where, upload_id, exc) from exc
                    raise
                failed = exc
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # ended before the abort; their errors taken
            if await self._abort(call, bucket, key, upload_id, where) == "gone":
                log.info(ALREADY_GONE, where, upload_id)
            raise
        # the object there has the upload's bytes; aborted all the same: an upload still open had its
        # completion refused, and the object is an earlier one of the same bytes (its parts billed, else)
        log_completed_anyway(await self._abort(call, bucket, key, upload_id, where), where, upload_id, failed)

    async def _abort(self, call: Callable[..., Any], bucket: str, key: str, upload_id: str, where: str) -> str:
        """Abort multipart upload ``upload_id``: "aborted", or as :func:`~cachepipe.stores.base.abort_failed`
        says (answered ``NoSuchUpload``: "gone"; else "failed", logged)."""
        try:
            await call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # noqa: BLE001 - logged: the upload's own error is the one raised
            return abort_failed(_s3_error(exc)[1], where, upload_id, exc)
        return "aborted"

    async def _found(self, bucket: str, key: str) -> tuple[int, str | None] | None:
        """The size and ETag of the object ``key`` in ``bucket`` (one HEAD, with s3fs's retries),
        or None when there is none or the HEAD fails: asked after a completion that failed."""
        try:
            head = await self.fs._call_s3("head_object", Bucket=bucket, Key=key)  # noqa: SLF001 - as _put_parts's calls
        except Exception:  # the completion's error is the one raised
            log.debug("s3://%s/%s: no object found after a failed completion", bucket, key, exc_info=True)
            return None
        return int(head.get("ContentLength", -1)), head.get("ETag")

    def check_bucket(self) -> None:
        """Raise :class:`FileNotFoundError` if the root's bucket does not exist (one HEAD of the
        bucket, on S3; nothing elsewhere: a local destination's folders are made as it is
        written). ``cachepipe map`` asks before it runs anything, so that a mistyped destination
        fails at once instead of at every upload. A bucket that the credentials may not check
        (403, without ``s3:ListBucket``) passes: only what is sure to fail is refused.

        Raises:
            FileNotFoundError: no such bucket; other failures as in the error contract.
        """
        if not self._s3 or not self._bucket:
            return
        with self._errors(self.url):
            try:
                self.fs.info(self._bucket, refresh=True)
                return
            except PermissionError:
                return
            except FileNotFoundError:
                pass
        raise FileNotFoundError(f"no such bucket {self._bucket!r} at {self.endpoint}: {self.url}")

    def names_object(self) -> bool:
        """True if the root itself is one object (a file), not a prefix: the URL of a tar shard
        given as a source. One request."""
        with self._errors(self.url):
            return bool(self.root) and bool(self.fs.isfile(self.root))

    def exists(self, key: str) -> bool:
        """True if ``key`` exists. Asks the store (no cached listing); a missing object is False,
        any other failure raises (fsspec's own ``exists`` would return False for those too)."""
        path = self._path(key)
        with self._errors(self._where(key)):
            self.fs.invalidate_cache(path)
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                return False
        return bool(info.get("type", "file") == "file")

    def sync(self, keys: Sequence[str]) -> None:
        """Make the puts of ``keys`` durable: on a local filesystem, ``fsync`` each folder that
        holds one (a put's rename is on disk after it; one call per folder, however many files
        it holds); elsewhere nothing (an object store's PUT is durable once answered).
        ``cachepipe map`` syncs an item's outputs before it puts the marker, and the marker after:
        after a power cut, a marker there means its outputs are there too."""
        if not keys:
            return
        protocols = _protocols(self.fs)
        if "file" not in protocols and "local" not in protocols:
            return
        with self._errors(self._where(keys[0]), first=False):
            for folder in sorted({os.path.dirname(self._path(key)) for key in keys}):
                sync_folder(folder)

    def remove_stale_temps(self) -> builtins.list[str]:
        """On a local filesystem, remove the temporary files that killed uploads left under the
        root (:func:`~cachepipe.stores.localwrites.remove_stale_temps`: never a live upload's)
        and return their keys; elsewhere nothing (an object store's upload leaves no object
        until it completes). ``cachepipe map`` calls it before it reads what its destination
        holds.

        Raises:
            OSError: as in the error contract (a file that cannot be removed).
        """
        protocols = _protocols(self.fs)
        if "file" not in protocols and "local" not in protocols:
            return []
        with self._errors(self.url, first=False):
            return remove_stale_temps(self.root)

    def delete(self, keys: Sequence[str], within: str = "") -> None:
        """Delete the objects ``keys``; one that does not exist is no error. S3: one DeleteObjects
        per :data:`~cachepipe.stores.base.DELETE_BATCH` keys; a local filesystem: each file
        removed, then the folders left empty up to ``within`` (kept), each changed folder
        ``fsync``-ed (:func:`~cachepipe.stores.localwrites.delete_local`); other filesystems: fsspec's ``rm_file`` per key.

        Raises:
            PermissionError: a key the store refused to delete; other failures as in the error contract.
        """
        if not keys:
            return
        where = self._where(keys[0]) + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")
        refused: builtins.list[tuple[str, str | None, str | None]] = []  # (key, code, message)
        with self._errors(where, first=False):
            protocols = _protocols(self.fs)
            if "file" in protocols or "local" in protocols:
                delete_local(self.root, keys, within)
            elif self._s3:
                for at in range(0, len(keys), DELETE_BATCH):
                    batch = [{"Key": self._key_prefix + key} for key in keys[at : at + DELETE_BATCH]]
                    answer = self._await(  # s3fs's rm would look each key up first
                        self.fs._call_s3,  # noqa: SLF001 - s3fs has no public call for one DeleteObjects
                        "delete_objects",
                        Bucket=self._bucket,
                        Delete={"Objects": batch, "Quiet": True},
                        **self.fs.req_kw,
                    )
                    refused += [(e.get("Key", ""), e.get("Code"), e.get("Message")) for e in answer.get("Errors", ())]
                    if refused:
                        break
            else:
                for key in keys:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(self._path(key))
        if refused:
            key, code, message = refused[0]
            raise delete_error(code, message, f"{self.url.rstrip('/')}/{key[len(self._key_prefix) :]}", self.endpoint)


LOST_FOUND = "lost+found"
"""The folder that ``mkfs`` makes at the top of an ext2/3/4 file system for fsck, readable by root
alone: a local listing by another user (of a data volume's mount point) passes over it, unread,
as fsspec's ``find`` did, instead of failing on it."""


def local_files(root: str, start_after: str | None = None, prefix: str = "") -> Iterator[tuple[str, int]]:
    """``(key, size)`` of each regular file under the folder ``root``, keys relative to it, in
    key order (each folder's entries sorted by name, a folder's as ``name/``: so its files come
    where their keys sort), after the key ``start_after`` if given (a folder whose keys all sort
    before it is not entered). Walked as it is read; links are neither followed nor listed; a
    ``root`` that is missing or not a folder holds nothing (as fsspec's ``find``). A folder that
    cannot be read raises :class:`PermissionError`, except fsck's :data:`LOST_FOUND` at the top of
    a mounted file system (logged at debug level)."""
    try:
        with os.scandir(root) as found:
            entries = [(e.name + "/", e) if e.is_dir(follow_symlinks=False) else (e.name, e) for e in found]
    except (FileNotFoundError, NotADirectoryError):  # also a folder removed while it is walked
        return
    except PermissionError:
        parent, name = os.path.split(root)
        if not (prefix and name == LOST_FOUND and os.path.ismount(parent)):
            raise
        log.debug("passed over %s: it cannot be read (fsck's folder of a file system, root's alone)", root)
        return
    entries.sort(key=lambda pair: pair[0])
    for name, entry in entries:
        key = prefix + name
        if name.endswith("/"):
            if start_after is None or key > start_after or start_after.startswith(key):
                yield from local_files(entry.path, start_after, key)
        elif (start_after is None or key > start_after) and entry.is_file(follow_symlinks=False):
            try:
                yield key, entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:  # deleted meanwhile
                continue
