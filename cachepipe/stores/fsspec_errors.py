"""The error seam of the fsspec backend (:mod:`cachepipe.stores.fsspec`): :func:`_translate` maps
what fsspec, s3fs, botocore and aiohttp raise, and what the direct S3 requests of
:mod:`cachepipe.stores.s3direct` raise (shaped like botocore's), to the store error contract (see
:mod:`cachepipe.stores.base`), from the exception and what it wraps. Pure: no request, no I/O.
"""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import Iterator
from urllib.parse import urlsplit

from ..errors import ConfigError, LocalFileError, StoreClosedError, StoreUnavailableError, store_code
from .base import NO_ANSWER, NO_REPLY, http_status_error, not_the_api, unreachable_error

__all__: list[str] = []  # the seam's functions are the backend's own: FsspecStore calls them

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
_LOCAL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a local destination's errors (not a socket's), named
_UNPARSED = ("ParseError", "ResponseParserError")  # ElementTree's (the direct path, s3fs's listing), botocore's


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
    chains it; :class:`~cachepipe.stores.s3direct_replies.HTTPStatusError` is shaped like it)."""
    for err in _chain(exc):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            error = response.get("Error") or {}
            if isinstance(status, int):
                code = error.get("Code") or None
                headers = response["ResponseMetadata"].get("HTTPHeaders") or {}
                html = str(headers.get("content-type", "")).startswith("text/html")
                if code == str(status) and html and not str(getattr(err, "operation_name", "")).startswith("Head"):
                    code = None  # botocore's stand-in for a body that is not S3's XML (a web page; a HEAD has none)
                return status, code, error.get("Message") or None
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
    if isinstance(exc, (StoreClosedError, LocalFileError, StoreUnavailableError)):
        # aborted (see FsspecStore.abort), an upload's local file (not the store's), or an outage said in our words
        # already (an upload lost: base.upload_lost): nothing to map
        return exc
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
    if type(exc) is OSError and exc.errno in _LOCAL_DISK and exc.filename is None:  # a local write's: a full disk, named
        return OSError(exc.errno, f"{exc.strerror}: {where}")
    if isinstance(exc, OSError):
        return exc
    if any(type(err).__name__ in _UNPARSED for err in chain):  # a 2xx answer that is not S3's XML: a web page
        return store_code(OSError(f"{where} {at}: {name}: {exc}; {not_the_api(endpoint)}"), None, endpoint)
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
