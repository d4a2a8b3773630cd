"""The fsspec backend: ``s3://`` (s3fs), ``file://``, plain paths, ``memory://``, ``gs://``...

All errors from fsspec, s3fs, botocore and aiohttp, and from the direct S3 requests of
:mod:`cachepipe.stores.s3direct` (GETs and listing pages, for plain s3fs options), are translated in
:func:`_translate`, the one seam of this backend (see :mod:`cachepipe.stores.base` for the contract).

:meth:`FsspecStore.abort` cuts the requests in flight: the direct path's (their sockets shut
down), and the GETs and listing pages this store sends through an async filesystem's event loop
(s3fs, gcsfs: each runs as a task of its own there, cancelled). Requests of a synchronous
filesystem (local files, memory) are not cut (they do not wait on a network); a listing of a
filesystem other than S3 (one ``find``) and uploads (``put``, ``exists``, ``check_bucket``:
``cachepipe map``'s) are not either, and take as long as they take. Every later request is refused
with :class:`~cachepipe.errors.StoreClosedError`.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import errno
import fcntl
import inspect
import os
import shutil
import socket
import ssl
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, NoReturn
from urllib.parse import urlsplit

import fsspec
import fsspec.asyn

from ..errors import ConfigError, StoreClosedError, StoreUnavailableError, closest, store_code
from .base import (
    CONNECT_TIMEOUT,
    FIRST_PAGE_KEYS,
    NO_ANSWER,
    NO_REPLY,
    TEMP_SUFFIX,
    ObjectInfo,
    check_mappings,
    http_status_error,
    listed_etag,
    unreachable_error,
)

__all__ = ["FsspecStore"]

_CHUNK = 8 * 1024 * 1024  # bytes per request when streaming a range
_UPLOAD_PART = 16 * 1024 * 1024  # multipart part size of uploads (s3fs: files from twice this size)


_CONNECTION_NAMES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ClientOSError",
        "HTTPClientError",
        "ProxyConnectionError",
        "IncompleteRead",
        "ResponseStreamingError",
    }
)
# Options every fsspec filesystem takes (the instance cache, the listings cache, the event loop)
_FSSPEC_OPTIONS = frozenset(
    {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "asynchronous", "loop", "batch_size"}
)
# Filesystems whose accepted options are known in full: the signatures of their classes, plus, for
# s3fs, those of the aiobotocore session it passes its other keyword arguments to. (Others may
# read options from **kwargs themselves, so theirs are not checked.)
_CHECKED_PROTOCOLS = frozenset({"s3", "s3a", "file", "local", "memory"})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: causes, contexts, botocore's ``error`` and aiohttp's ``os_error``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        err = todo.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        kwargs = getattr(err, "kwargs", None)
        wrapped = [err.__cause__, err.__context__, getattr(err, "os_error", None)]
        wrapped.append(kwargs.get("error") if isinstance(kwargs, dict) else None)
        todo.extend(e for e in wrapped if isinstance(e, BaseException))


def _s3_error(exc: BaseException) -> tuple[int | None, str | None, str | None]:
    """HTTP status, S3 error code and message of a botocore ClientError behind ``exc`` (s3fs
    chains it; :class:`~cachepipe.stores.s3direct.HTTPStatusError` is shaped like it)."""
    for err in _chain(exc):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            error = response.get("Error") or {}
            if isinstance(status, int):
                return status, error.get("Code") or None, error.get("Message") or None
    return None, None, None


def _translate(exc: Exception, where: str, endpoint: str, answered: bool, first: bool = True) -> BaseException:
    """Map an exception raised by fsspec or a backend SDK to the store error contract.

    ``endpoint`` names the server (or the local filesystem) in messages; ``answered`` says whether
    it has answered a request before (a refused connection is then an outage, retried, and
    otherwise a wrong endpoint, not retried). ``first``: the request may be the run's first
    contact with the endpoint (a listing, a check); only then is a connect that timed out
    before any answer taken for an unreachable endpoint (GETs and uploads come after a listing,
    or from many processes at once, whose stores have not seen the answers: a server too busy
    to accept them all is retried).
    """
    if isinstance(exc, StoreClosedError):
        return exc  # aborted (see FsspecStore.abort): its message says so, nothing to map
    status, code, message = _s3_error(exc)
    name = type(exc).__name__
    at = f"at {endpoint}"
    if status is not None:
        return http_status_error(status, code, message, where, endpoint)
    if isinstance(exc, TypeError):  # s3fs passes unknown options on to aiobotocore, which raises this
        return ConfigError(f"{where}: storage_options rejected by the filesystem: {exc}")
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        if isinstance(exc, FileNotFoundError):
            return store_code(FileNotFoundError(exc.errno, f"not found: {where} ({exc})"), None, endpoint)
        return store_code(PermissionError(exc.errno, f"access denied to {where} {at}: {exc}"), None, endpoint)
    if name in ("NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError"):
        return store_code(PermissionError(errno.EACCES, f"no usable credentials for {where} {at}: {exc}"), None, endpoint)
    chain = list(_chain(exc))
    if any(isinstance(err, socket.gaierror) for err in chain):
        reason = next(str(err) for err in chain if isinstance(err, socket.gaierror))
        return unreachable_error(endpoint, where, f"its host name does not resolve ({reason})")
    tls = next((err for err in chain if isinstance(err, ssl.SSLError)), None)
    if tls is not None and not answered:  # an https:// endpoint that serves plain HTTP, or a CA this host lacks
        return unreachable_error(
            endpoint,
            where,
            f"the TLS handshake failed ({tls}): if the endpoint serves plain HTTP, write it http://; if its "
            "certificate is signed by a CA this host does not trust, give the CA (AWS_CA_BUNDLE, or "
            "storage_options client_kwargs={'verify': '/path/to/ca.pem'})",
        )
    refused = any(isinstance(err, ConnectionRefusedError) for err in chain)
    if refused and not answered:
        return unreachable_error(endpoint, where, "connection refused before it ever answered")
    if first and not answered and (url := _timed_out(chain, connecting=True)) is not None:
        if not _credentials_host(url):
            return unreachable_error(endpoint, where, NO_ANSWER)
        return store_code(TimeoutError(f"no answer to a connection to {url} (for {where}): {exc}"), None, endpoint)
    if first and not answered and (url := _timed_out(chain)) is not None and not _credentials_host(url):
        return unreachable_error(endpoint, where, NO_REPLY)
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:  # s3fs: SlowDown, ServiceUnavailable
        return store_code(StoreUnavailableError(f"store {at} throttled or unavailable for {where}: {exc}"), None, endpoint)
    if isinstance(exc, TimeoutError) or "Timeout" in name:
        return store_code(TimeoutError(f"timed out talking to {endpoint} for {where}: {exc}"), None, endpoint)
    if refused or isinstance(exc, ConnectionError) or name in _CONNECTION_NAMES:
        return store_code(ConnectionError(f"connection to {endpoint} failed for {where}: {name}: {exc}"), None, endpoint)
    if isinstance(exc, OSError):
        return exc
    return store_code(OSError(f"{where} {at}: {name}: {exc}"), None, endpoint)  # no errno: permanent


def _timed_out(chain: list[BaseException], connecting: bool = False) -> str | None:
    """The endpoint URL of a request that timed out in ``chain`` (botocore's error names it; ""
    if it does not: the direct path's is the store's endpoint), connecting or reading, or only
    connecting (``connecting``); None if none did."""
    for err in chain:
        name = type(err).__name__
        if "ConnectTimeout" in name if connecting else isinstance(err, TimeoutError) or "Timeout" in name:
            kwargs = getattr(err, "kwargs", None)  # botocore's ConnectTimeoutError and ReadTimeoutError, s3direct's
            return str(kwargs.get("endpoint_url") or "") if isinstance(kwargs, dict) else ""
    return None


_CREDENTIAL_HOSTS = ("169.254.169.254", "169.254.170.2", "fd00:ec2::254")  # EC2 instance metadata, ECS task role


def _credentials_host(url: str) -> bool:
    """Whether ``url`` is on a host that serves credentials (STS, SSO, OIDC, instance or task
    metadata), not the store: botocore connects to them too, inside a store's request. Every
    other host is taken for the store's own (a custom endpoint, a bucket's virtual host, one
    set by ``AWS_ENDPOINT_URL``, any AWS partition)."""
    host = (urlsplit(url).hostname or "").lower()
    return host in _CREDENTIAL_HOSTS or host.startswith(("sts.", "sts-", "oidc.", "portal.sso.", "sso."))


def environment_endpoint() -> str | None:
    """The S3 endpoint botocore takes from the environment when no ``endpoint_url`` is given
    (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, unless
    ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS``), or None."""
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() != "true":
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
            if value := os.environ.get(name, "").strip():
                return value
    return None


def s3_endpoint(options: dict[str, Any]) -> str | None:
    """The S3 endpoint that storage ``options`` name (``endpoint_url``, else ``client_kwargs``'),
    else the environment's (:func:`environment_endpoint`), or None: where botocore sends."""
    client_kwargs = options.get("client_kwargs") or {}
    return options.get("endpoint_url") or client_kwargs.get("endpoint_url") or environment_endpoint()


def check_options(url: str, options: dict[str, Any] | None) -> type | None:
    """The fsspec filesystem class serving ``url``, with ``options`` checked against it (what
    :class:`FsspecStore` refuses before it sends anything); None for a chained URL (``a::b``),
    whose options are per layer and left to fsspec.

    Raises:
        ConfigError: no filesystem serves the scheme, or an option it would ignore or fail on.
    """
    if "::" in url:
        return None
    fs_cls = _filesystem_class(url)
    _check_options(url, fs_cls, options or {})
    return fs_cls


def _check_options(url: str, fs_cls: Any, options: dict[str, Any]) -> None:
    """Raise ConfigError for a storage option that ``fs_cls`` would ignore or fail on later."""
    protocols = _protocols(fs_cls)
    if not _CHECKED_PROTOCOLS.intersection(protocols):
        return
    accepted = set(_FSSPEC_OPTIONS)
    classes: builtins.list[Any] = [c for c in fs_cls.__mro__ if c is not object]
    if "s3" in protocols:
        check_mappings(url, options)
        import aiobotocore.session  # type: ignore[import-untyped]

        classes.append(aiobotocore.session.AioSession)
    for cls in classes:
        for param in inspect.signature(cls.__init__).parameters.values():
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and param.name != "self":
                accepted.add(param.name)
    endpoints = (
        ("endpoint_url", options.get("endpoint_url")),
        ("client_kwargs['endpoint_url']", (options.get("client_kwargs") or {}).get("endpoint_url")),
    )
    for where, endpoint in endpoints:
        if endpoint is not None and "s3" in protocols:
            _check_endpoint(url, where, endpoint)
    for key in options:
        if key not in accepted:
            hint = f"did you mean {close!r}? " if (close := closest(key, accepted)) else ""
            raise ConfigError(
                f"storage_options[{key!r}] is not an option of {protocols[0]}:// ({fs_cls.__module__}.{fs_cls.__name__}) "
                f"for {url!r}; {hint}accepted: {', '.join(sorted(accepted))}"
            )


def _check_endpoint(url: str, where: str, endpoint: Any) -> None:
    """Refuse an S3 endpoint that is not an ``http(s)://host[:port]`` URL (a port of 0-65535),
    which s3fs and obstore take as it is and fail on at the first request."""
    expected = "expected a URL like 'http://10.0.0.5:9000' or 'https://s3.example.com'"
    if not isinstance(endpoint, str):
        raise ConfigError(f"storage_options {where} {endpoint!r} for {url!r} is not text: {expected}")
    scheme, sep, rest = endpoint.partition("://") if "://" in endpoint else ("", "", endpoint)
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:  # credentials in it (user:secret@host) are not shown
        endpoint = f"{scheme}{sep}***@{netloc.rpartition('@')[2]}{slash}{path}"
    if not endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f"storage_options {where} {endpoint!r} for {url!r} has no scheme: write it http://{endpoint} "
            "(or https://, as the server serves it)"
        )
    try:
        parts = urlsplit(endpoint)
    except ValueError as exc:  # an unclosed '[' of an IPv6 address
        raise ConfigError(f"storage_options {where} {endpoint!r} for {url!r} is not a valid URL ({exc}); {expected}") from None
    try:
        parts.port  # noqa: B018 - parsed on access
    except ValueError as exc:
        raise ConfigError(
            f"storage_options {where} {endpoint!r} for {url!r}: its port is not a number of 0 to 65535 ({exc}); {expected}"
        ) from None
    if not parts.hostname:
        raise ConfigError(f"storage_options {where} {endpoint!r} for {url!r} names no host; {expected}")


def _put_local(local: str, path: str) -> None:
    """Copy the file ``local`` to ``path`` on a local filesystem: to ``<path>.cachepipe.tmp``
    beside it, ``fsync``-ed and renamed over it once whole, so that a reader never sees part of it.

    The temporary file's name is the same at every put of ``path``, so one that a killed upload
    left (a SIGKILL leaves it; an exception removes it) is overwritten by the next put of that
    path, not left for good. It is locked (``flock``) while it is written: a second put of the
    same path at the same time waits for the first. On a filesystem without locks (``ENOLCK``) the
    name is made unique instead (``<path>.cachepipe-<id>.tmp``), and a killed upload leaves it."""
    temp = path + TEMP_SUFFIX
    while True:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(temp, follow_symlinks=False)):
                break  # locked, and still the file of that name (a put before may have renamed or removed it)
        except FileNotFoundError:
            pass
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.ENOLCK:
                raise
            temp = f"{path}.cachepipe-{uuid.uuid4().hex[:12]}.tmp"  # no locks on this filesystem
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        os.ftruncate(fd, 0)  # what a killed upload wrote
        with open(local, "rb") as src, open(fd, "wb", closefd=False) as dst:
            shutil.copyfileobj(src, dst, 1024 * 1024)
        os.fsync(fd)  # its bytes on disk before its name: after a power cut the name holds all of them
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    finally:
        os.close(fd)


def _protocols(fs: Any) -> tuple[str, ...]:
    """The protocols of an fsspec filesystem (class or instance): its ``protocol``, a name or several."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _filesystem_class(url: str) -> type:
    """The fsspec filesystem class serving ``url``; ConfigError naming the known schemes if none does."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        return fsspec.get_filesystem_class(protocol)  # type: ignore[no-any-return]  # fsspec is untyped
    except ValueError as exc:
        known = sorted({"obs", *fsspec.available_protocols()})
        raise ConfigError(
            f"unknown URL scheme {protocol + '://'!r} in {url!r}; cachepipe serves s3://, obs://, file:// "
            f"(or a plain path) and memory://, and fsspec also knows: {', '.join(known)}"
        ) from exc


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
            self.fs, root = fsspec.core.url_to_fs(url, **options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{url!r}: fsspec rejected the URL or storage_options: {type(exc).__name__}: {exc}") from exc
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
                self._direct = DirectGet(self.fs)

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
            return str(s3_endpoint(options) or "the AWS S3 endpoint")
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
    for :data:`~cachepipe.stores.base.FIRST_PAGE_KEYS` if that is fewer."""

    def list(self) -> Iterator[ObjectInfo]:
        """Yield every object under the root in key order. On S3, one page at a time: each page
        is yielded before the next is requested (a plain fsspec ``find`` lists everything first)."""
        if getattr(self.fs, "protocol", None) in (("s3", "s3a"), "s3") and not getattr(self.fs, "version_aware", False):
            yield from self._list_s3()
            return
        with self._errors(self.url):
            self.fs.invalidate_cache(self.root)  # a relisting must see the store as it is now
            entries = self.fs.find(self.root, detail=True, withdirs=False)
        prefix = f"{self.root}/" if self.root else ""
        for path in sorted(entries):
            info = entries[path]
            if info.get("type", "file") != "file" or not path.startswith(prefix):
                continue
            etag = info.get("ETag") or info.get("etag")
            yield ObjectInfo(path[len(prefix) :], int(info["size"]), listed_etag(etag))

    def _list_s3(self) -> Iterator[ObjectInfo]:
        bucket, key, _ = self.fs.split_path(self.root)
        prefix = f"{key}/" if key else ""
        token = None
        keys = min(FIRST_PAGE_KEYS, self.list_page_size)
        while True:
            with self._errors(self.url):
                entries, token = self._list_s3_page(bucket, prefix, token, keys)
            keys = self.list_page_size
            for name, size, etag in entries:
                if name == prefix:
                    continue  # the root's own directory marker
                yield ObjectInfo(name[len(prefix) :], size, etag)
            if token is None:
                return

    def _list_s3_page(
        self, bucket: str, prefix: str, token: str | None, keys: int
    ) -> tuple[builtins.list[tuple[str, int, str | None]], str | None]:  # `list` is also this class's method
        """One ListObjectsV2 page of up to ``keys`` keys: ``([(key, size, etag), ...], next
        continuation token or None)``. The first (no ``token``) starts after ``prefix`` itself: a
        folder marker of the prefix (what a console's "Create folder" makes) would take a key of
        the first page, which :func:`~cachepipe.listing.StreamingListing.wait_first_page` counts
        in objects."""
        start_after = prefix if token is None and prefix else None
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
    """Part size of multipart uploads to S3 (s3fs uploads files of at least twice this size
    in parts, several in flight; at least 5 MiB). Set it on the instance to change it."""

    def put(self, local_path: str | os.PathLike[str], key: str) -> None:
        """Upload ``local_path`` as ``key``: s3fs streams it, multipart from ``2 * upload_part_size``;
        on a local filesystem it is copied to a temporary name beside the target and renamed
        (:func:`_put_local`: one left by a killed upload is overwritten by the next put of the key)."""
        local = os.fspath(local_path)
        path = self._path(key)
        with self._errors(self._where(key), first=False):
            protocols = _protocols(self.fs)
            if "file" in protocols or "local" in protocols:
                self.fs.makedirs(self.fs._parent(path), exist_ok=True)  # noqa: SLF001 - fsspec's own parent rule for this filesystem
                _put_local(local, path)
            elif "s3" in protocols or "s3a" in protocols:
                self.fs.put_file(local, path, chunksize=self.upload_part_size)
            else:
                self.fs.put_file(local, path)

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
