"""The native S3 GET engine (opt-in, a prototype): ``s3://`` object GETs shorter than 1 MiB
through obstore (Python bindings of Rust's ``object_store``: hyper and tokio, SigV4 in Rust),
longer GETs and listings as before.

Opt in with the storage option ``engine="obstore"`` (``pip install 'cachepipe[native]'``); the
default stays the fsspec backend (s3fs, with :mod:`cachepipe.stores.s3direct` for GETs).

Why: on loopback SeaweedFS, 2,000 GETs of 50 KiB into files from 16 threads cost 0.50 ms of
client CPU each through obstore against 0.82 ms through s3direct (0.61x, 0.54-0.70 over five
interleaved repeats), at 1,846 GETs/s against 1,193; through a Pipeline, 0.93 against 1.25 ms per
item (0.78x). Large parts go the other way: 8 MiB ranged GETs cost 1.30 CPU s/GB against 0.85
(1.57x), whatever size of chunk obstore streams. ``benchmarks/bench_engines.py`` measures them;
``benchmarks/results-engines.txt`` holds that run.

What goes where:

- GETs shorter than :attr:`NativeS3Store.DIRECT_FROM` (1 MiB): ``obstore.get`` with a
  ``range``, the body streamed (``GetResult.stream``) into the file the fetcher hands over, chunk
  by chunk. obstore's own retries are off: retrying is the core's, as for every store.
- GETs of 1 MiB or more (an item's parts are ``part_size``, 8 MiB by default): through the
  fsspec backend's direct path (:mod:`~cachepipe.stores.s3direct`), which costs less CPU per
  byte, with its own connections, credentials and error translation. When that backend has no
  direct path (options it leaves to s3fs), every GET goes through obstore.
- Listing: through the fsspec backend (s3fs, whose pages :mod:`~cachepipe.stores.s3direct`
  requests). ``object_store`` normalises keys into its own paths: a directory marker ``dir/``
  lists as ``dir``, which would read as a zero-byte file, so its listing is not used.
- Writing (``cachepipe map``'s destination, when ``engine`` is among the options that SRC and
  DST share): ``put``, ``exists``, ``delete`` and ``check_bucket`` through the fsspec backend.

Forks: obstore's runtime (tokio's threads, one per process) does not survive a fork, and a GET
through it in a process forked after obstore ran in the parent waits forever. This module sees
that case when the parent's GETs were its own (``os.register_at_fork``): a store opened in the
child sends its GETs through the fsspec backend instead, saying so once in a warning, and so
does the parent's store object used there (a DataLoader worker given the dataset's ``store=``),
whose fsspec backend makes connections and a filesystem of its own there
(:mod:`cachepipe.stores.fsspec`, "Forks"). A fork after another library ran obstore is not seen.

Storage options: those of the s3 backend that this engine can honour, and only those (any
other raises :class:`~cachepipe.errors.ConfigError` naming what is accepted): ``endpoint_url``,
``key``, ``secret``, ``token``, ``anon``, ``client_kwargs`` (``endpoint_url``, ``region_name``),
``config_kwargs`` (``s3.addressing_style``; ``retries`` and ``max_pool_connections`` are
accepted and have no use here), and fsspec's cache options, which only the listing uses.
``addressing_style`` ``"virtual"`` at a custom endpoint addresses the bucket as botocore does:
in the host (obstore is given the endpoint with the bucket's name before its host), or in the
path where botocore puts it there (an endpoint that is an IP address, a bucket name that is no
host name).
Credentials: without ``key`` and ``secret``, obstore signs with the credentials that the direct
path signs with, those botocore finds for s3fs's client (the environment, the profiles and SSO
of ``~/.aws``, web identity, container and instance metadata). Each short GET takes them from
the direct path's route on its own thread (a dictionary look-up while the route is current;
botocore refreshes temporary ones before they are due), so that an error getting them is raised
and classified there as any of the fsspec backend's; obstore asks its credential provider for
the latest copy every :attr:`NativeS3Store.CREDENTIALS_FOR` seconds. A bucket that the direct
path leaves to s3fs (in another region, S3 Express...) has its short GETs sent by s3fs too.
Without a direct path (see above), obstore finds credentials itself: the ``AWS_*`` environment
variables, web identity, ECS and EC2 instance metadata, but not the shared files of ``~/.aws``.

Regions: obstore takes its region from ``client_kwargs`` ``region_name`` or the environment
(``AWS_REGION``), not from ``~/.aws/config`` as botocore does. When S3 redirects one of its GETs
(a bucket in another region), that GET and the store's next ones go through the fsspec backend
(whose client follows such redirects), with one warning naming ``region_name``.

Aborting (:meth:`NativeS3Store.abort`, when the pipeline closes): the fsspec backend's requests
in flight (listing pages, the GETs of 1 MiB or more) are cut as that backend cuts them. obstore's
GETs in flight are not: its blocking calls cannot be interrupted from another thread, so one
that waits on a store that stopped answering takes up to :attr:`NativeS3Store.TIMEOUT` (a read)
before it fails. Every GET after the abort, of either path, is refused with
:class:`~cachepipe.errors.StoreClosedError` before it is sent.

Errors: obstore raises ``FileNotFoundError`` and its own exception classes, whose only detail is
their text (object_store's ``Display`` of the HTTP status, the S3 error body, and hyper's and
reqwest's error kinds). :func:`_translate`, the one seam, reads the status, S3's ``Code`` and
``Message``, and the kind of connection failure from that text, which is why the extra pins
obstore's version; the tests in ``tests/test_store_native.py`` hold each mapping to it.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit, urlunsplit

import botocore
import obstore
import obstore.exceptions
from obstore.store import S3Store

from ..errors import ConfigError, ObjectChangedError, StoreClosedError, store_code
from .base import CHANGED, ObjectInfo, check_mappings, http_status_error, unreachable_error, view_of
from .fsspec import FsspecStore
from .fsspec_options import check_options as check_fsspec
from .fsspec_options import s3_endpoint, shown_endpoint

if TYPE_CHECKING:
    from obstore import GetOptions  # types only: not importable at run time
    from obstore.store import S3Credential

__all__ = ["NativeS3Store"]

log = logging.getLogger("cachepipe.stores.s3native")


class _Runtime:
    ran_in: int | None = None  # the process where obstore ran a GET first: its runtime (tokio's threads) started
    forked = False  # this process was forked after obstore ran (here or in an ancestor): it cannot run here


def _after_fork_in_child() -> None:
    _Runtime.forked = _Runtime.forked or _Runtime.ran_in is not None


os.register_at_fork(after_in_child=_after_fork_in_child)

_OBSTORE_EARLY = 300  # seconds: obstore asks for new credentials this long before they expire
_CHUNK = 64 * 1024  # min_chunk_size of a streamed body: hyper's chunks as they come, not merged into bigger buffers
_OPTIONS = frozenset(
    {"endpoint_url", "key", "secret", "token", "anon", "client_kwargs", "config_kwargs"}
    | {"skip_instance_cache", "use_listings_cache", "listings_expiry_time"}  # fsspec's, for the listing
)
_CLIENT_KWARGS = frozenset({"endpoint_url", "region_name"})
_CONFIG_KWARGS = frozenset({"s3", "retries", "max_pool_connections"})

_STATUS = re.compile(r"non-2xx status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_REDIRECT = "inner: BareRedirect"  # object_store's error for a 301 without Location: S3's for a bucket in another region
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")  # object_store's HttpErrorKind
_TRANSIENT_KINDS = frozenset({"Connect", "Request", "Interrupted", "Decode"})


def _first_line(exc: BaseException) -> str:
    """obstore's message without its ``Debug source:`` dump (dozens of lines)."""
    return str(exc).split("\n\nDebug source:", 1)[0].strip()


def _translate(exc: Exception, where: str, endpoint: str, answered: bool) -> BaseException:
    """Map an exception raised by obstore to the store error contract (see :mod:`cachepipe.stores.base`).

    ``answered``: the endpoint has answered a request before (a refused connection is then an
    outage, retried, and otherwise a wrong endpoint, not retried).
    """
    text = str(exc)
    status = _STATUS.search(text)
    if status is not None:
        code, message = _CODE.search(text), _MESSAGE.search(text)
        return http_status_error(int(status[1]), code[1] if code else None, message[1] if message else None, where, endpoint)
    first = _first_line(exc)
    if isinstance(exc, obstore.exceptions.UnauthenticatedError):
        return store_code(
            PermissionError(errno.EACCES, f"{endpoint} rejected the credentials for {where}: {first}"), None, endpoint
        )
    if isinstance(exc, obstore.exceptions.PermissionDeniedError):
        return store_code(PermissionError(errno.EACCES, f"access denied to {where} at {endpoint}: {first}"), None, endpoint)
    if isinstance(exc, FileNotFoundError):
        return store_code(FileNotFoundError(errno.ENOENT, f"not found at {endpoint}: {where} ({first})"), None, endpoint)
    if '"dns error"' in text:
        return unreachable_error(endpoint, where, f"its host name does not resolve ({first})")
    refused = "kind: ConnectionRefused" in text
    if refused and not answered:
        return unreachable_error(endpoint, where, "connection refused before it ever answered")
    if _REDIRECT in text:  # a 301 without Location: S3's answer for a bucket in another region
        return store_code(
            OSError(f"{endpoint} redirected {where} (a bucket in another region?); set client_kwargs region_name: {first}"),
            None,
            endpoint,
        )
    kind = _HTTP_KIND.search(text)
    if (kind is not None and kind[1] == "Timeout") or "kind: TimedOut" in text:
        return store_code(TimeoutError(f"timed out talking to {endpoint} for {where}: {first}"), None, endpoint)
    if refused or (kind is not None and kind[1] in _TRANSIENT_KINDS):
        return store_code(ConnectionError(f"connection to {endpoint} failed for {where}: {first}"), None, endpoint)
    return store_code(OSError(f"{where} at {endpoint}: {type(exc).__name__}: {first}"), None, endpoint)  # no errno: permanent


class _FromBotocore:
    """obstore's credential provider: the credentials the direct path signs with (see the module's
    docstring), as :meth:`NativeS3Store.get` last found them on its own thread (where an error
    getting them is raised and classified as any of the store's errors, not on obstore's
    threads). Each copy is said to expire ``lifetime`` + 300 seconds from when obstore asks, so
    that obstore asks again ``lifetime`` seconds later. It holds no reference to the store (a
    store that its own obstore store referred back to would never be freed: obstore's objects
    are not traversed by the garbage collector)."""

    def __init__(self, lifetime: float) -> None:
        self.lifetime = lifetime
        self.frozen: Any = None  # botocore's frozen credentials, as a GET found them last (any thread's: each is valid)
        self.asked = 0  # how many times obstore asked (its token cache asks one at a time)

    def __call__(self) -> S3Credential:
        self.asked += 1
        frozen = self.frozen
        if frozen is None:  # not reached: get() holds a copy before its first obstore GET
            raise PermissionError(errno.EACCES, "no credentials taken from botocore yet")
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(timezone.utc) + timedelta(seconds=self.lifetime + _OBSTORE_EARLY),
        }


def _check_names(url: str, options: dict[str, Any]) -> None:
    """Raise ConfigError for an option this engine would not honour, or a ``key`` without its
    ``secret`` or the reverse."""
    accepted = f"accepted with engine='obstore': {', '.join(sorted(_OPTIONS))}"
    for key in options:
        if key not in _OPTIONS:
            raise ConfigError(f"storage_options[{key!r}] is not supported with engine='obstore' for {url!r}; {accepted}")
    check_mappings(url, options)
    client_kwargs = options.get("client_kwargs") or {}
    config_kwargs = options.get("config_kwargs") or {}
    for name, given, known in (
        ("client_kwargs", client_kwargs, _CLIENT_KWARGS),
        ("config_kwargs", config_kwargs, _CONFIG_KWARGS),
    ):
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(
                f"storage_options[{name!r}][{unknown[0]!r}] is not supported with engine='obstore' for {url!r}; "
                f"accepted: {', '.join(sorted(known))}"
            )
    if not options.get("anon") and bool(options.get("key")) != bool(options.get("secret")):
        given, missing = ("key", "secret") if options.get("key") else ("secret", "key")
        raise ConfigError(
            f"storage_options[{given!r}] is given without storage_options[{missing!r}] for {url!r}: with "
            "engine='obstore' they go together (give both, or neither)"
        )
    s3 = config_kwargs.get("s3") or {}
    if set(s3) - {"addressing_style"} or s3.get("addressing_style", "auto") not in ("auto", "path", "virtual"):
        raise ConfigError(
            f"storage_options['config_kwargs']['s3'] = {s3!r} for {url!r}: with engine='obstore' only "
            "addressing_style ('auto', 'path' or 'virtual') is supported"
        )


def check_options(url: str, options: dict[str, Any]) -> None:
    """Refuse what :class:`NativeS3Store` refuses before it sends anything, with the same errors
    and in the same order: an option this engine would not honour, the fsspec backend's checks
    (:func:`~cachepipe.stores.fsspec_options.check_options`: the backend that lists), then what obstore's
    ``S3Store`` refuses when it is made (made, as the store makes it, and dropped: it sends
    nothing). :func:`~cachepipe.stores.check_store` calls it for ``engine='obstore'``.

    Raises:
        ConfigError: naming the option, its value (not a credential's) and what is accepted.
    """
    _check_names(url, options)
    check_fsspec(url, options)
    _s3_store(url, options, None)


_TEXT_OPTIONS = {  # S3Store's config keys that _s3_store fills and that it takes as text only, by their storage option
    "region": "client_kwargs['region_name']",
    "access_key_id": "key",
    "secret_access_key": "secret",
    "session_token": "token",
}
_SECRET_KEYS = frozenset({"access_key_id", "secret_access_key", "session_token"})


_HOST_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_IPV4 = re.compile(r"(?:[0-9]{1,3}\.){3}[0-9]{1,3}")  # a bucket named as an IPv4 address (botocore's IPV4_RE)


def _virtual_endpoint(endpoint: str, bucket: str) -> str | None:
    """The URL to which a virtual-host request for ``bucket`` goes at the custom ``endpoint``, as
    botocore's rules for S3 make it: the bucket's name before the endpoint's host
    (``http://s3.example.com:9000`` and ``data``: ``http://data.s3.example.com:9000``). None where
    those rules address the bucket in the path even with ``addressing_style`` ``"virtual"``: a
    host that is an IP address, a bucket name that is no host name (3 to 63 characters, lower
    case letters, digits and hyphens; dotted labels of those over ``http://`` only) or that is
    written as an IPv4 address (``192.168.5.4``)."""
    parts = urlsplit(endpoint)
    try:
        ipaddress.ip_address(parts.hostname or "")
        return None
    except ValueError:
        pass
    labels = bucket.split(".")
    if not 3 <= len(bucket) <= 63 or (len(labels) > 1 and parts.scheme != "http") or _IPV4.fullmatch(bucket):
        return None
    if not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return None
    return urlunsplit((parts.scheme, f"{bucket}.{parts.netloc}", parts.path, "", ""))


def _s3_store(url: str, options: dict[str, Any], credentials: _FromBotocore | None) -> S3Store:
    """obstore's ``S3Store`` for ``url`` and ``options`` (checked by :func:`_check_names`): the
    one place it is made, and the seam for what it refuses when it is made (its own exceptions,
    and a ``TypeError`` naming no option for a value that is not text): a ConfigError, naming the
    storage option that is not text.

    ``credentials``: the store's provider of botocore's credentials, or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("s3", "s3a") or not parts.netloc:
        raise ConfigError(f"{url!r}: engine='obstore' serves s3://bucket/prefix URLs")
    client_kwargs = options.get("client_kwargs") or {}
    endpoint = s3_endpoint(options)
    s3 = (options.get("config_kwargs") or {}).get("s3") or {}
    # virtual-host addressing only when asked for: path style works with AWS and custom endpoints alike
    virtual = s3.get("addressing_style") == "virtual"
    config: dict[str, Any] = {"virtual_hosted_style_request": virtual}
    if endpoint:
        # obstore sends a virtual-host request to its endpoint as given: it must name the bucket
        hosted = _virtual_endpoint(str(endpoint), parts.netloc) if virtual else None
        config["endpoint"] = hosted or str(endpoint)
        config["virtual_hosted_style_request"] = hosted is not None
    if client_kwargs.get("region_name"):
        config["region"] = client_kwargs["region_name"]
    if options.get("anon"):
        config["skip_signature"] = True
    elif options.get("key") or options.get("secret"):  # both (_check_names refuses one alone)
        config.update(access_key_id=options["key"], secret_access_key=options["secret"])
        if options.get("token"):
            config["session_token"] = options["token"]
    prefix = parts.path.strip("/")
    try:
        return S3Store(
            parts.netloc,
            prefix=prefix or None,
            config=config,  # type: ignore[arg-type]  # built as a plain dict; obstore checks the keys
            client_options={
                "allow_http": str(endpoint or "").startswith("http://"),
                "connect_timeout": NativeS3Store.TIMEOUT,
                "read_timeout": NativeS3Store.TIMEOUT,
                "timeout": NativeS3Store.REQUEST_TIMEOUT,
            },
            retry_config={"max_retries": 0},  # the core retries, with backoff, as for every store
            credential_provider=credentials,
        )
    except (obstore.exceptions.BaseError, TypeError, ValueError) as exc:
        why = f"{type(exc).__name__}: {_first_line(exc)}"
        for key, option in _TEXT_OPTIONS.items():  # its TypeError names no option: the value that is not text
            if key in config and not isinstance(config[key], str):
                kind = type(config[key]).__name__
                shown = f"(of type {kind}; not shown)" if key in _SECRET_KEYS else f"= {config[key]!r} (of type {kind})"
                raise ConfigError(
                    f"storage_options {option} {shown} for {url!r}: obstore "
                    f"refuses it with engine='obstore' ({why}); expected a string"
                ) from exc
        raise ConfigError(f"{url!r}: obstore rejected the storage options with engine='obstore' ({why})") from exc


class NativeS3Store:
    """A :class:`~cachepipe.stores.base.Store` for ``s3://`` whose GETs shorter than 1 MiB go through obstore.

    Args:
        url: the root prefix, ``s3://bucket/prefix/``.
        storage_options: the s3 backend's options that this engine honours (see the module's docstring).
    """

    TIMEOUT = "60s"
    """Time allowed to connect, and for each read of a response (as the direct S3 path)."""
    REQUEST_TIMEOUT = "30min"
    """Time allowed for a whole request, body included (obstore's default is 30 s, too short for a large part on a slow link)."""
    CREDENTIALS_FOR = 60
    """Seconds for which obstore uses a copy of botocore's credentials before it asks for one
    again (as :attr:`~cachepipe.stores.s3direct.DirectGet.RETAKE_AFTER`). botocore refreshes
    temporary credentials 15 minutes before they expire, so a copy is good for longer."""
    DIRECT_FROM = 1024 * 1024
    """Bytes: a GET of this many or more goes through the fsspec backend's direct path
    (:mod:`~cachepipe.stores.s3direct`), which costs less CPU per byte; a shorter one through
    obstore, which costs less per request. The two cost the same between 1 and 2 MiB on loopback
    SeaweedFS (``benchmarks/bench_engines.py``, medians of 5: obstore's CPU per GET 0.67x
    s3direct's at 256 KiB, 0.91x at 512 KiB, 0.95x at 1 MiB, 1.20x at 2 MiB, 1.57x at 8 MiB)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        options = dict(storage_options or {})
        _check_names(url, options)
        # the environment's endpoint as botocore reads it (for the listing and large GETs): obstore
        # does not read AWS_ENDPOINT_URL_S3, and its small GETs must go where the others go
        self.endpoint = shown_endpoint(str(s3_endpoint(options) or "the AWS S3 endpoint"))  # for messages
        self._said_forked = False  # logged that obstore cannot run in this (forked) process
        self._redirected = False  # S3 redirected one of obstore's GETs: the fsspec backend sends them all
        self._aborted = False  # abort(): later GETs are refused
        self._fsspec = FsspecStore(url, options)  # validates the options against s3fs as well; lists, and GETs large parts
        self._direct = self._fsspec.direct
        signs = not options.get("anon") and not (options.get("key") or options.get("secret"))
        self._credentials = _FromBotocore(self.CREDENTIALS_FOR) if signs and self._direct else None  # as the direct path signs
        self._store = _s3_store(url, options, self._credentials)

    def scoped(self) -> NativeS3Store:
        """A view of this store for one pipeline (see :mod:`cachepipe.stores.base`): the same
        obstore store, and a view of the fsspec backend (:meth:`FsspecStore.scoped
        <cachepipe.stores.fsspec.FsspecStore.scoped>`), so that its :meth:`abort` refuses and cuts
        its own requests only, and its :meth:`close` closes its own connections only."""
        return view_of(self, _aborted=False, _fsspec=self._fsspec.scoped())

    def _runtime_here(self) -> bool:
        """Whether obstore can run in this process, said once per store where it cannot (see the
        module's docstring: a process forked after obstore ran)."""
        if not _Runtime.forked:
            return True
        if not self._said_forked:
            self._said_forked = True
            log.warning(
                "%r: process %d was forked after obstore ran in process %d, and obstore cannot run in it "
                "(tokio's threads do not survive a fork); its GETs go through the fsspec backend instead",
                self,
                os.getpid(),
                _Runtime.ran_in,
            )
        return False

    def _redirect(self, exc: BaseException) -> None:
        """S3 redirected an obstore GET (a bucket in another region than obstore's): from now on
        the fsspec backend sends this store's GETs (its client follows such redirects), said once."""
        if not self._redirected:
            self._redirected = True
            log.warning(
                "%r: %s redirected a GET through obstore (a bucket in another region than obstore's?): the fsspec "
                "backend sends this store's GETs from now on; for obstore to send the short ones, set the bucket's "
                "region in storage_options client_kwargs region_name (or AWS_REGION): %s",
                self,
                self.endpoint,
                _first_line(exc),
            )

    @property
    def _answered(self) -> bool:
        """The endpoint answered a request, through either path (a refused connection is then an
        outage): one flag, the fsspec backend's, for obstore's GETs and the direct path's."""
        return self._fsspec.answered

    @_answered.setter
    def _answered(self, value: bool) -> None:
        self._fsspec.answered = value

    def __repr__(self) -> str:
        return f"NativeS3Store({self.url!r})"

    def _translated(self, exc: Exception, where: str) -> BaseException:
        if isinstance(exc, obstore.exceptions.PreconditionError):  # only a conditional GET is refused so
            self._answered = True
            changed = ObjectChangedError(f"{where} at {self.endpoint} {CHANGED} ({_first_line(exc)})")
            return store_code(changed, None, self.endpoint)
        if _STATUS.search(str(exc)) is not None or _REDIRECT in str(exc):  # an HTTP status: the endpoint answered
            self._answered = True
        return _translate(exc, where, self.endpoint, self._answered)

    def list(self, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """Every object under the root in key order (after the key ``start_after``, if given),
        listed by the fsspec backend (see the module's docstring)."""
        return self._fsspec.list(start_after)

    def get(self, key: str, out: BinaryIO, start: int, end: int, *, etag: str | None = None) -> int:
        """Write bytes ``[start, end)`` of ``key`` to ``out`` as they arrive; return how many were written.

        A range of :attr:`DIRECT_FROM` bytes or more goes through the fsspec backend's direct path
        when it has one (see the module's docstring); a shorter one through obstore, unless the
        direct path leaves the bucket to s3fs (a bucket in another region, S3 Express...), S3
        redirected one of obstore's GETs, or this process cannot run obstore (forked after it
        ran): then through the fsspec backend too. ``etag``: each request is conditional on it
        (``If-Match``; refused: :class:`~cachepipe.errors.ObjectChangedError`).
        """
        if end <= start:
            return 0  # obstore refuses an empty range
        if self._aborted:
            raise StoreClosedError(f"GET of {self.url.rstrip('/')}/{key} at {self.endpoint} refused: the store was closed")
        if (end - start >= self.DIRECT_FROM and self._direct) or self._redirected or not self._runtime_here():
            return self._fsspec.get(key, out, start, end, etag=etag)
        if self._direct:
            frozen = self._fsspec.credentials(key)  # the route's, current: cheap, and probed when due
            if frozen is None:  # s3fs sends this bucket's requests: so do we
                return self._fsspec.get(key, out, start, end, etag=etag)
            if self._credentials is not None and frozen is not botocore.UNSIGNED:
                self._credentials.frozen = frozen
        if _Runtime.ran_in is None:
            _Runtime.ran_in = os.getpid()
        where = f"{self.url.rstrip('/')}/{key}"
        redirected = None
        try:
            options: GetOptions = {"range": (start, end)}
            if etag is not None:
                options["if_match"] = f'"{etag}"'
            chunks = obstore.get(self._store, key, options=options).stream(_CHUNK)
        except (obstore.exceptions.BaseError, FileNotFoundError) as exc:
            if not (self._direct and _REDIRECT in str(exc)):
                raise self._translated(exc, where) from exc
            redirected = exc  # raised before any of the body was read: nothing written to out
        self._answered = True
        if redirected is not None:  # sent again outside the handler: its errors are not chained to obstore's
            self._redirect(redirected)
            return self._fsspec.get(key, out, start, end, etag=etag)  # which learns the bucket's region from the 301
        written = 0
        try:
            for chunk in chunks:
                out.write(chunk)  # its OSError (the disk's, not the store's) is not obstore's: not translated
                written += len(chunk)
        except obstore.exceptions.BaseError as exc:  # a body cut short, a read timed out
            raise self._translated(exc, f"{where} (after {written} bytes)") from exc
        return written

    # ---- writing (``cachepipe map``'s destination): through the fsspec backend, as the listing ----
    @property
    def upload_part_size(self) -> int:
        """Part size of multipart uploads (the fsspec backend's :attr:`~cachepipe.stores.fsspec.FsspecStore.upload_part_size`)."""
        return self._fsspec.upload_part_size

    @upload_part_size.setter
    def upload_part_size(self, value: int) -> None:
        self._fsspec.upload_part_size = value

    def put(self, local_path: str | os.PathLike[str], key: str, *, content_type: str | None = None) -> None:
        """Upload ``local_path`` as ``key`` through the fsspec backend (:meth:`FsspecStore.put
        <cachepipe.stores.fsspec.FsspecStore.put>`): obstore is an engine of GETs only."""
        self._fsspec.put(local_path, key, content_type=content_type)

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists, asked through the fsspec backend."""
        return self._fsspec.exists(key)

    def delete(self, keys: Sequence[str], within: str = "") -> None:
        """Delete ``keys`` through the fsspec backend (one DeleteObjects per 1,000 keys)."""
        self._fsspec.delete(keys, within)

    def check_bucket(self) -> None:
        """Raise :class:`FileNotFoundError` if the root's bucket does not exist (the fsspec backend's check)."""
        self._fsspec.check_bucket()

    def abort(self) -> None:
        """Cut the fsspec backend's requests in flight, and refuse every later GET, with
        :class:`~cachepipe.errors.StoreClosedError`; obstore's GETs in flight end by themselves
        (see the module's docstring, "Aborting"). Idempotent; from any thread."""
        self._aborted = True
        self._fsspec.abort()

    def close(self) -> None:
        """Close the fsspec backend's connections (obstore's pool goes with the store object). Idempotent."""
        self._fsspec.close()
