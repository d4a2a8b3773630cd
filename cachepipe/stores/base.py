"""The storage protocol every backend implements, and the one result type it returns.

A backend implements three primitives; everything else (grouping objects into items,
ranged parts, retries, verification, publishing) is written once in the core.

One more is optional for every store: ``abort()`` makes the requests in flight fail at once
(a thread blocked reading from a store that stopped answering wakes) and every later request fail
without being sent, with :class:`cachepipe.errors.StoreClosedError`; idempotent, callable from
any thread. A closing pipeline calls it (through :func:`abort_store`) before it waits for its
threads, then ``close()``. A store without it is waited for.

Another is optional, for a store given to a pipeline (``Pipeline(store=...)``, a
``CachePipeDataset``'s ``store=``, ``cachepipe.map``'s): ``scoped()`` returns a *view* of the
store for one pipeline, whose requests go where the store's go (the same URL, settings and
credentials) but on connections of its own, so that the view's ``abort()`` cuts and refuses the
view's requests only, and its ``close()`` releases what the view opened and nothing of the
store's. Whoever opens a store closes it: a pipeline aborts and closes a store it opened from its
URL, and only the view of a store given to it (:func:`scoped_store`), which so serves pipeline
after pipeline, or several at once, and stays open for its owner. A given store without
``scoped`` is neither aborted nor closed by the pipeline: its requests in flight are waited for.

Two more primitives are optional, for stores that are written to (``cachepipe map`` uploads
results through them; a store that is only read need not have them), described by
:class:`WritableStore`: ``put(local_path, key)`` uploads one local file (streamed, multipart
for large files), ``exists(key)`` tells whether an object exists and ``delete(keys)`` deletes
objects (batched: S3's and OBS's DeleteObjects take 1,000 keys a request). All follow the same
error contract; ``exists`` returns False only for "no such object", never for a failure, and
``delete`` of an object that does not exist is no error. A writable store may also have
``sync(keys)``, which makes the puts of ``keys`` durable (a local filesystem ``fsync``-s their
folders; an object store has nothing to do): ``cachepipe map`` calls it, where it is, on an item's
outputs before it puts the marker.

Error contract (the one seam where a backend translates its SDK's errors):

- ``FileNotFoundError``: no such bucket, prefix or key;
- ``PermissionError``: access denied, bad or missing credentials;
- ``TimeoutError``, ``ConnectionError`` or :class:`cachepipe.errors.StoreUnavailableError`:
  transient (timeouts, resets, 5xx, throttling); the core retries these with backoff;
- :class:`cachepipe.errors.ObjectChangedError`: a request conditional on the listed ETag was
  refused (HTTP 412): the object was rewritten since it was listed; permanent;
- any other ``OSError``: permanent.

Each translated error names the URL or key and is chained (``raise ... from exc``).
Messages never contain credentials.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol, TypeVar, runtime_checkable

from ..errors import ConfigError, LocalFileError, ObjectChangedError, StoreUnavailableError, StoreUnreachableError, store_code

__all__ = [
    "FIRST_PAGE_KEYS",
    "TEMP_SUFFIX",
    "ObjectInfo",
    "Store",
    "WritableStore",
    "abort_failed",
    "abort_store",
    "completed_anyway",
    "first_page_keys",
    "listed_etag",
    "log_completed_anyway",
    "multipart_etag",
    "part_size_for",
    "scoped_store",
    "takes_content_type",
    "takes_etag",
    "takes_start_after",
    "upload_lost",
    "view_of",
]

_log = logging.getLogger("cachepipe.stores")

COMPLETED_ANYWAY = (
    "%s: the completion of multipart upload %s failed (%s: %s), but the object is there, completed by it (its size "
    "and ETag): the upload is done"
)
"""What a store logs (at INFO) when :func:`completed_anyway` counts an upload done: the object's
URL, the upload id, the completion's error type and text."""

SAME_BYTES_KEPT = (
    "%s: the completion of multipart upload %s failed (%s: %s), and the upload was still open (aborted now): the "
    "object there is an older one of the same size and ETag (the same bytes, in the same parts), kept as the upload's"
)
"""What a store logs (at INFO) when a failed completion's object is there (:func:`completed_anyway`)
but the abort sent after it found the upload still open: its completion never took effect, and
the object at the key is an earlier upload of the same bytes (an item of ``cachepipe map`` done
again). The object's URL, the upload id, the completion's error type and text."""

NO_SUCH_UPLOAD = "NoSuchUpload"
"""The S3 (and OBS) error code of a request to a multipart upload that is no longer there: completed,
or aborted. An abort answered so leaves no parts: a store logs :data:`ALREADY_GONE`, not its
warning that the parts stay."""

ALREADY_GONE = (
    "%s: the failed upload's multipart upload %s is no longer there (its abort was answered NoSuchUpload: completed "
    "or aborted meanwhile, by another process or a lifecycle rule): no parts are left"
)
"""What a store logs (at INFO) when the abort of a failed upload is answered :data:`NO_SUCH_UPLOAD`:
the object's URL and the upload id."""

FIRST_PAGE_KEYS = 100
"""Keys a paginated store asks for in its first listing request; each later request asks for the
store's page size (1,000 on S3 and OBS). The first download waits for the first page, and a
store's time to answer a page grows with its keys: SeaweedFS took 185-191 ms for 1,000 keys and
17-21 ms for 100 (``benchmarks/probe_first_page.py``), and a short page also crosses a new
connection in fewer round trips. The one request more costs nothing that shows."""


def first_page_keys(page_size: int, start_after: str | None) -> int:
    """Keys to ask for in a listing's first request: :data:`FIRST_PAGE_KEYS` if fewer than
    ``page_size``, for the first item's sake; a listing after a key (``start_after``: one that a
    transient error cut, continued) asks full pages, as its first items were handed already, and
    so does a whole listing, which lists after ``""`` (before every key: every object), as
    nothing waits for its first item (:func:`~cachepipe.listing.resumed_listing`: ``cachepipe
    index``, a pass that is not streamed, ``cachepipe map``)."""
    return page_size if start_after is not None else min(FIRST_PAGE_KEYS, page_size)


# Error codes of S3 and OBS (which uses S3's) that mean "these credentials are wrong", not
# "these credentials may not do this", and "slow down": shared by the backends' error seams.
CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidSecurity",
        "AuthorizationHeaderMalformed",
    }
)
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "ServiceUnavailable"})


def http_status_error(status: int, code: str | None, message: str | None, where: str, endpoint: str) -> OSError:
    """The contract's error for an S3 error response: HTTP ``status``, S3 error ``code`` and
    ``message`` (None when the body had none) to a request for ``where`` at ``endpoint``. Shared
    by the S3 backends' error seams, so that each status reads and classifies the same."""
    at = f"at {endpoint}"
    detail = f"{code or 'HTTP ' + str(status)}: {message}" if message else f"{code or 'no error code'}, HTTP {status}"
    if code is None and status < 500 and status not in (408, 429):  # an S3 server's error body names its code
        detail += f"; {not_the_api(endpoint)}"
    if code in CREDENTIAL_CODES or status == 401:
        return store_code(
            PermissionError(errno.EACCES, f"{endpoint} rejected the credentials for {where} ({detail})"), code, endpoint
        )
    if status == 403 or code == "AccessDenied":
        return store_code(PermissionError(errno.EACCES, f"access denied to {where} {at} ({detail})"), code, endpoint)
    if status == 404 and code == "NoSuchBucket":
        return store_code(FileNotFoundError(errno.ENOENT, f"no such bucket {at}: {where} ({detail})"), code, endpoint)
    if status == 404:
        return store_code(FileNotFoundError(errno.ENOENT, f"not found {at}: {where} ({detail})"), code, endpoint)
    if status == 412:  # only a conditional GET (If-Match: the listed ETag) is answered so
        return store_code(ObjectChangedError(f"{where} {at} {CHANGED} ({detail})"), code, endpoint)
    if status >= 500 or status in (408, 429) or code in THROTTLE_CODES:
        return store_code(StoreUnavailableError(f"store {at} unavailable for {where} ({detail})"), code, endpoint)
    return store_code(OSError(f"{endpoint} refused {where} ({detail})"), code, endpoint)


def delete_error(code: str | None, message: str | None, where: str, endpoint: str) -> OSError:
    """The contract's error for a key that a batch delete (S3's and OBS's DeleteObjects) could not
    delete: the batch's answer is a success (HTTP 200) that lists such keys with an S3 error
    ``code`` and ``message`` each, and no status; read as :func:`http_status_error` reads the
    status that the code goes with (a 403 for a refusal, a 503 for throttling or an internal
    error, else a 400: permanent). Shared by the backends' seams."""
    if code == "AccessDenied" or code in CREDENTIAL_CODES:
        status = 403
    elif code in THROTTLE_CODES or code == "InternalError":
        status = 503
    else:
        status = 400
    return http_status_error(status, code, message, f"deleting {where}", endpoint)


DELETE_BATCH = 1000
"""Keys per DeleteObjects request (S3's and OBS's maximum)."""

MAX_PARTS = 10_000
"""Parts of one multipart upload at most: S3 and OBS number them 1 to 10,000."""


MAX_PUT = 5 * 1024**3
"""The largest object one PutObject sends (S3's and OBS's limit, 5 GiB): s3fs's ``put_file``
makes a multipart upload of its own from there."""


def one_request(size: int, part: int) -> bool:
    """Whether an upload of ``size`` bytes in parts of ``part`` is one PutObject: under two parts,
    and under :data:`MAX_PUT`."""
    return size < min(2 * part, MAX_PUT)


def part_size_for(size: int, wanted: int) -> int:
    """The part size of a multipart upload of ``size`` bytes: ``wanted``, or the least size that
    makes at most :data:`MAX_PARTS` parts where ``wanted`` would make more (a file of 200 GiB in
    parts of 16 MiB would take 12,800: S3 and OBS refuse the part numbered 10,001, after 156 GiB
    were sent)."""
    return max(wanted, -(-size // MAX_PARTS))


def multipart_etag(part_etags: Sequence[str]) -> str | None:
    """The ETag that S3 and OBS give the object a multipart upload of parts with ``part_etags``
    (their ETags as the store answered them, in order) completes: ``<MD5 of the parts' MD5s>-<n>``,
    lower case, without quotes. None when a part's ETag is not 32 hex digits (not an MD5's form):
    the object's cannot be told then. (S3 documents that the ETags of objects encrypted with SSE-C
    or SSE-KMS are not MD5s of their data; computed from the part ETags as answered, the form holds
    where the store forms it so, and an object whose ETag differs is not taken for the upload's.)"""
    digests = []
    for etag in part_etags:
        hexed = etag.strip('"').lower()
        if len(hexed) != 32 or hexed.strip("0123456789abcdef"):
            return None
        digests.append(bytes.fromhex(hexed))
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def upload_lost(where: str, upload_id: str, exc: BaseException) -> StoreUnavailableError:
    """The error of a completion answered :data:`NO_SUCH_UPLOAD` whose object is not the upload's,
    or could not be asked (:func:`completed_anyway` False): its first answer may have been lost
    (the store completed it, and the client's retry found no upload), or the upload was aborted
    meanwhile (a lifecycle rule, another process). Transient: uploading again is right either way.
    Before, it was raised as not found, for good: ``cachepipe map`` failed the item."""
    return StoreUnavailableError(
        f"{where}: the completion of multipart upload {upload_id} was answered {NO_SUCH_UPLOAD}, and the object there "
        f"could not be confirmed as the upload's: the first completion's answer may have been lost, or the upload "
        f"was aborted meanwhile; upload it again ({type(exc).__name__}: {exc})"
    )


def abort_failed(code: str | None, where: str, upload_id: str, exc: BaseException) -> str:
    """What the abort of multipart upload ``upload_id`` that raised ``exc`` (its store error
    ``code``) means: "gone" (answered :data:`NO_SUCH_UPLOAD`: completed or aborted already, no
    parts left), else "failed", with the warning that names the upload whose parts stay."""
    if code == NO_SUCH_UPLOAD:
        return "gone"
    _log.warning(
        "%s: the failed upload's multipart upload %s could not be aborted (%s: %s): its parts stay in the bucket, "
        "billed and not listed, until aborted (S3: aws s3api abort-multipart-upload) or removed by a lifecycle rule "
        "(S3: AbortIncompleteMultipartUpload; OBS: expiration of fragments)",
        where,
        upload_id,
        type(exc).__name__,
        exc,
    )
    return "failed"


def log_completed_anyway(aborted: str, where: str, upload_id: str, failed: BaseException | None) -> None:
    """Say (at INFO) why an upload whose completion failed (``failed``) is done, by what its abort
    sent after it found (``aborted``: "aborted", "gone" or "failed", whose warning is said already):
    an older object of the same bytes kept (:data:`SAME_BYTES_KEPT`), or the upload's own
    (:data:`COMPLETED_ANYWAY`)."""
    if aborted != "failed":
        said = SAME_BYTES_KEPT if aborted == "aborted" else COMPLETED_ANYWAY
        _log.info(said, where, upload_id, type(failed).__name__, failed)


def completed_anyway(found: tuple[int, str | None] | None, size: int, part_etags: Sequence[str]) -> bool:
    """Whether a multipart upload of ``size`` bytes in parts with ``part_etags``, whose completion
    failed, is done all the same: ``found``, the ``(size, ETag)`` of the object at its key now
    (None: none there, or it could not be asked), is the object that the upload completes, its
    size and its :func:`multipart_etag`. So it is when the store completed it and its answer was
    lost: the client's retry of the completion is answered ``NoSuchUpload`` (by some S3 stores), or
    the lost answer is the error (OBS's SDK, which cachepipe makes without retries). An ETag that cannot
    be told (:func:`multipart_etag` None) is not taken for the upload's: the completion's error
    stands."""
    expected = multipart_etag(part_etags)
    if found is None or expected is None:
        return False
    found_size, found_etag = found
    return found_size == size and (listed_etag(found_etag) or "").lower() == expected


CHANGED = (
    "changed since it was listed: its ETag is no longer the listed one "
    "(list again to read it: a new pass, relist=True, or a manifest indexed again)"
)
"""What an :class:`~cachepipe.errors.ObjectChangedError` says, after the object's URL: the same
words from every backend."""


def check_mappings(url: str, options: Mapping[str, Any]) -> None:
    """Refuse an S3 storage option that holds options of its own (``client_kwargs``,
    ``config_kwargs``, ``config_kwargs['s3']``) given as something other than a mapping, which
    the checks that read it and the SDK would fail on with a bare ``TypeError``. The value is
    not shown (a string there may be a credential misplaced).

    Raises:
        ConfigError: naming the option and the type given.
    """
    config = options.get("config_kwargs")
    for where, value in (
        ("client_kwargs", options.get("client_kwargs")),
        ("config_kwargs", config),
        ("config_kwargs['s3']", config.get("s3") if isinstance(config, Mapping) else None),
    ):
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(
                f"storage_options {where} for {url!r} is a value of type {type(value).__name__}: expected a mapping "
                "of option names to values, such as {'region_name': 'us-east-1'}"
            )


def listed_etag(raw: str | None) -> str | None:
    """A listed ETag as the core keeps it: without its quotes; None when there is none, or when
    it is weak (``W/"..."``: ``If-Match`` compares strongly, so a GET conditional on a weak tag
    is refused every time; such an object is read without the condition)."""
    if not raw or raw.startswith("W/"):
        return None
    return raw.strip('"') or None


def takes_etag(store: Any) -> bool:
    """Whether ``store.get`` names a parameter ``etag`` (every backend of cachepipe's does; a
    store written for an older cachepipe and passed as ``store=`` may not): the core passes the
    listed ETag only to a ``get`` that names it. A ``**kwargs`` does not count: such a ``get``
    may hand its keywords on to a call that takes no ``etag``."""
    return _names(getattr(store, "get", None), "etag")


def takes_content_type(store: Any) -> bool:
    """Whether ``store.put`` names a keyword ``content_type`` (the object's media type, where the
    store records one: S3, OBS), as :func:`takes_etag` tells of ``get``: ``cachepipe map`` gives a
    completion marker its type only through a ``put`` that names it."""
    return _names(getattr(store, "put", None), "content_type")


def takes_start_after(store: Any) -> bool:
    """Whether ``store.list`` names a parameter ``start_after`` (every backend of cachepipe's
    does), as :func:`takes_etag` tells of ``get``: a listing restarted after a transient error
    continues after the last key it delivered only through a ``list`` that names it; another
    store is listed again from its start."""
    return _names(getattr(store, "list", None), "start_after")


def _names(method: Any, name: str) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a callable with no signature to read (a C function), or none
        return False
    param = params.get(name)
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def abort_store(store: Any) -> None:
    """``store.abort()`` if the store has one (every backend of cachepipe's does; a store passed
    as ``store=`` may not, and is then waited for): its requests in flight fail at once, and its
    later ones are refused (see the module's docstring)."""
    abort = getattr(store, "abort", None)
    if callable(abort):
        abort()


def scoped_store(store: Any) -> Any:
    """``store.scoped()`` if the store has one (every backend of cachepipe's does): a view of it
    for one pipeline, which the pipeline aborts and closes without touching the store (see the
    module's docstring); None if it has none, or its ``scoped`` returns None."""
    scoped = getattr(store, "scoped", None)
    return scoped() if callable(scoped) else None


_T = TypeVar("_T")
_VIEW_CLASSES: dict[type, type] = {}  # a store class -> its views' class, made once (store classes are few)


def view_of(store: _T, **own: Any) -> _T:
    """A view of ``store`` for a backend's ``scoped()``: an object of a subclass of the store's
    class (so its methods, a subclass's too, run on the view) whose attributes are the store's,
    read and written through to it (a subclass's counters and settings stay one), but for
    ``own``, the view's own (its requests in flight, its abort, its connections)."""
    cls = type(store)
    view_cls = _VIEW_CLASSES.get(cls)
    if view_cls is None:
        # a setting the class gives a value and an instance may set (list_page_size...): the store's
        settings = {name: _forwarded(name) for name in dir(cls) if not name.startswith("__") and _plain(getattr(cls, name))}
        spec = {"__getattr__": _view_get, "__setattr__": _view_set, **settings}
        view_cls = _VIEW_CLASSES[cls] = type(cls.__name__, (cls,), spec)
    view: Any = object.__new__(view_cls)
    view.__dict__.update(own, _viewed=store)
    return view  # type: ignore[no-any-return]  # an object of a subclass of store's class


def _plain(value: Any) -> bool:
    """Whether a class attribute is a plain value (not a method, property or other descriptor)."""
    return not callable(value) and not hasattr(type(value), "__get__")


def _forwarded(name: str) -> property:
    """A view's property ``name``: the store's attribute, read and written through."""

    def read(view: Any) -> Any:
        return getattr(view.__dict__["_viewed"], name)

    def write(view: Any, value: Any) -> None:
        setattr(view.__dict__["_viewed"], name, value)

    return property(read, write)


def _view_get(view: Any, name: str) -> Any:
    """An attribute of a view (:func:`view_of`) that is not its own: the store's."""
    try:
        store = view.__dict__["_viewed"]
    except KeyError:
        raise AttributeError(name) from None
    return getattr(store, name)


def _view_set(view: Any, name: str, value: Any) -> None:
    """Set an attribute of a view (:func:`view_of`): its own if it is, else the store's."""
    if name in view.__dict__:
        view.__dict__[name] = value
    else:
        setattr(view.__dict__["_viewed"], name, value)


CONNECT_TIMEOUT = 10.0
"""Seconds to wait for a connection to an S3 endpoint (botocore's default is 60, with up to 5
attempts per call): a firewall that drops packets makes every connect wait this long. Before the
endpoint ever answered, such a timeout fails at once (:func:`unreachable_error`); after, it is
retried like any timeout. ``storage_options["config_kwargs"]["connect_timeout"]`` sets it."""

TEMP_SUFFIX = ".cachepipe.tmp"
"""A local destination's file is written as ``<path>.cachepipe.tmp`` and renamed to ``<path>``
(:meth:`WritableStore.put`); ``cachepipe map`` refuses outputs named so."""


def open_local(local: str, where: str) -> BinaryIO:
    """The local file ``local`` that an upload sends to ``where``, opened for reading (unbuffered).

    The backends' ``put`` opens it before any request, outside their error seam: an error here
    is the machine's, a :class:`~cachepipe.errors.LocalFileError` naming the file, never the
    store's refusal (a ``PermissionError`` from ``put`` means the store refused the write)."""
    try:
        return open(local, "rb", buffering=0)  # the caller closes it
    except OSError as exc:
        raise _local_error(exc, local, where) from exc


def read_local(src: BinaryIO, where: str, size: int = 1024 * 1024) -> bytes:
    """Up to ``size`` bytes from ``src`` (from :func:`open_local`); its read errors are
    :class:`~cachepipe.errors.LocalFileError` too."""
    try:
        return src.read(size)
    except OSError as exc:
        raise _local_error(exc, str(src.name), where) from exc


def _local_error(exc: OSError, local: str, where: str) -> LocalFileError:
    return LocalFileError(exc.errno, f"cannot read the local file to upload as {where}: {exc.strerror or exc}", local)


DROPPED = "packets dropped: a firewall, or a wrong host"
"""What an endpoint that never accepts a connection most likely is (both S3 and OBS seams say it)."""

NO_ANSWER = f"no answer to a connection before it ever answered ({DROPPED})"
"""Why an endpoint is unreachable when its first connection timed out (see :data:`CONNECT_TIMEOUT`)."""


def not_the_api(endpoint: str, service: str = "S3") -> str:
    """What an error answer without the ``service``'s error code (or a listing that is not its XML)
    most likely means: an endpoint that is another server, such as a storage system's web console
    on the port beside its API's. (A HEAD answer has no body, but botocore and the OBS seam give
    it a code or read it apart.)"""
    return f"not an {service} answer: is {endpoint} the store's {service} API endpoint, not a web console or another service?"


NO_REPLY = (
    "it took the connection but sent no reply to the first request before the read timed out "
    "(a wrong port, or a service there that does not speak HTTP)"
)
"""Why an endpoint is unreachable when the first request's reply timed out, before it ever
answered (the run's first contact only: a listing or a check)."""


def unreachable_error(endpoint: str, where: str, why: str) -> StoreUnreachableError:
    """The contract's error for an endpoint that cannot be reached at all (``why``: its host
    name does not resolve, it refused before it ever answered, or its connections time out
    before it ever answered): not retried, since it points at a wrong ``endpoint_url`` or a
    network that drops its packets. Shared by the S3 backends' error seams."""
    check = "the URL" if where.startswith(("http://", "https://")) else "the endpoint_url"  # an http source: its own host
    return store_code(StoreUnreachableError(f"cannot reach {endpoint} for {where}: {why}; check {check}"), None, endpoint)


@dataclass(frozen=True, slots=True, init=False)
class ObjectInfo:
    """One listed object.

    Attributes:
        key: path relative to the store's root prefix, ``/``-separated, exactly as listed
            (not yet checked for safety: the catalog does that).
        size: size in bytes.
        etag: the store's entity tag without quotes, or None when unknown or weak (see
            :func:`listed_etag`).
    """

    key: str
    size: int
    etag: str | None = None

    def __init__(self, key: str, size: int, etag: str | None = None) -> None:
        set_key, set_size, set_etag = _OBJECT_INFO_SETTERS  # see slot_setters
        set_key(self, key)
        set_size(self, size)
        set_etag(self, etag)


def slot_setters(cls: type, *names: str) -> tuple[Any, ...]:
    """The setters of the slots ``names`` of ``cls``, a frozen dataclass with slots, for its own
    ``__init__``: dataclass's sets each field by ``object.__setattr__``, about twice the
    instructions of its slot's descriptor (one object per listed object and item is made)."""
    return tuple(cls.__dict__[name].__set__ for name in names)


_OBJECT_INFO_SETTERS = slot_setters(ObjectInfo, "key", "size", "etag")


@runtime_checkable
class Store(Protocol):
    """An object store rooted at one URL prefix.

    Attributes:
        url: the root URL, for messages (never contains credentials).
    """

    url: str

    def list(self) -> Iterator[ObjectInfo]:
        """Yield every object under the root, recursively, in lexicographic key order (S3's), or
        folder by folder (a folder's keys before those of the next name, ``a/x`` before
        ``a b/x``: SeaweedFS's; :func:`~cachepipe.grouping.tree_order`).

        Paginated and streamed: the first objects are yielded before the listing ends.
        Zero-byte directory markers (keys ending in ``/``) may be yielded; the catalog skips them.

        Optional: a parameter ``start_after: str | None = None`` (every backend of cachepipe has
        it; the protocol leaves it out so that stores written without it still match): given a
        key (relative to the root), only the objects listed after it, in the store's order, are
        yielded: S3's ListObjectsV2 ``StartAfter``, OBS's ``marker``; local files and
        ``memory://`` skip the keys up to it; a paginated store asks full pages then (see
        :func:`first_page_keys`), also after ``""`` (before every key: a whole listing, which
        lists every object). A listing restarted after a transient error passes the last
        key of the last item it delivered, while every key it was given came in key order
        (:class:`~cachepipe.listing.StreamingListing`, :func:`~cachepipe.listing.resumed_listing`
        for a whole listing): a store that lists folder by folder (SeaweedFS) is listed again
        from its start. SeaweedFS 4.48 answers ``StartAfter=s`` with the keys after ``s`` in its
        own order, folder by folder, and past everything under ``s/`` where ``s`` is a folder
        (measured, tests/test_s3_week.py): a rank of ``cachepipe map`` lists DST after a key
        chosen to be below its keys in either reading (:mod:`cachepipe.map.dstrange`). A
        ``list`` without a parameter named ``start_after`` is always listed from its start (see
        :func:`takes_start_after`).
        """
        ...

    def get(self, key: str, out: BinaryIO, start: int, end: int) -> int:
        """Write bytes ``[start, end)`` of object ``key`` to ``out`` at its current position.

        Streams in chunks (never the whole object in memory). ``out`` is not buffered: each
        ``write`` is one system call, so write chunks as they come off the connection, not
        small pieces of them. Returns the number of bytes written, which may be short if the
        store sent a short body; the caller verifies.

        Optional: a keyword-only ``etag: str | None = None`` after ``end`` (every backend of
        cachepipe has it; the protocol leaves it out so that stores written without it still
        match). The core then passes the ETag the listing gave for ``key``, without quotes. A
        store that can make the request conditional on it (S3's and OBS's ``If-Match``) does,
        and raises :class:`~cachepipe.errors.ObjectChangedError` when the store refuses it; one
        that cannot ignores it. A ``get`` without a parameter named ``etag`` is called without
        it (see :func:`takes_etag`).
        """
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...


@runtime_checkable
class WritableStore(Store, Protocol):
    """A :class:`Store` that can also be written to: the destination of ``cachepipe map``.

    The three methods are optional for stores that are only read, which is why they live in this
    sub-protocol and not in :class:`Store` (an ``isinstance(x, Store)`` check keeps accepting
    read-only stores).
    """

    def put(self, local_path: str | os.PathLike[str], key: str) -> None:
        """Upload the local file ``local_path`` as object ``key`` (relative to the root), replacing it.

        Streams from the file (never the whole file in memory); files larger than the
        backend's part size go up as a multipart upload, aborted on failure. The object
        appears whole or not at all (on object stores; local filesystems write a temporary
        file and rename it).

        A store may also take a keyword ``content_type`` (the object's media type, e.g.
        ``"application/json"``; None: the store's own guess, by the file's name), not part of
        this signature so that a store without it still matches; cachepipe passes it only to a
        ``put`` that names it (:func:`takes_content_type`).
        """
        ...

    def exists(self, key: str) -> bool:
        """True if object ``key`` exists; False only when the store says it does not.

        Other failures (denied, unreachable) raise as in the error contract.
        """
        ...

    def delete(self, keys: Sequence[str], within: str = "") -> None:
        """Delete the objects ``keys`` (relative to the root); one that does not exist is no error.

        Object stores send a batch delete per :data:`DELETE_BATCH` keys. A local filesystem
        removes each file, then the folders that this leaves empty, up to ``within`` (a folder
        relative to the root, kept; default: the root), and ``fsync``-s each folder it changed,
        so that the deletions are on disk when it returns. A key that could not be deleted
        raises as in the error contract (a ``PermissionError`` for a refusal).
        """
        ...
