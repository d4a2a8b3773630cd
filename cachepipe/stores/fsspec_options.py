"""The storage options of the fsspec backend (:mod:`cachepipe.stores.fsspec`), checked before
anything is sent: which fsspec filesystem class serves a URL (an unknown scheme refused, naming the
known ones), the options it takes (one it would ignore or fail on refused, naming the closest),
and the S3 endpoint that the options or the environment name (one that is no
``http(s)://host[:port]`` URL refused). Reads the environment and the filesystem classes'
signatures; sends nothing.
"""

from __future__ import annotations

import builtins
import inspect
import os
from typing import Any
from urllib.parse import urlsplit

import fsspec

from ..errors import ConfigError, closest
from .base import check_mappings

__all__ = ["check_options", "environment_endpoint", "s3_endpoint"]

# Options every fsspec filesystem takes (the instance cache, the listings cache, the event loop)
_FSSPEC_OPTIONS = frozenset(
    {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "asynchronous", "loop", "batch_size"}
)
# Filesystems whose accepted options are known in full: the signatures of their classes, plus, for
# s3fs, those of the aiobotocore session it passes its other keyword arguments to. (Others may
# read options from **kwargs themselves, so theirs are not checked.)
_CHECKED_PROTOCOLS = frozenset({"s3", "s3a", "file", "local", "memory"})


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


def shown_endpoint(endpoint: str) -> str:
    """``endpoint`` as messages and logs show it: credentials in it (``user:secret@host``) as
    ``***@host``. An endpoint URL may carry them (a proxy's); the journal must not."""
    scheme, sep, rest = endpoint.partition("://") if "://" in endpoint else ("", "", endpoint)
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return endpoint
    return f"{scheme}{sep}***@{netloc.rpartition('@')[2]}{slash}{path}"


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


_BOTO_NAMES = {
    **dict.fromkeys(("aws_access_key_id", "access_key_id", "access_key"), "s3fs calls it 'key'"),
    **dict.fromkeys(("aws_secret_access_key", "secret_access_key", "secret_key"), "s3fs calls it 'secret'"),
    **dict.fromkeys(("aws_session_token", "session_token"), "s3fs calls it 'token'"),
    **dict.fromkeys(("region_name", "region"), "a region is given as client_kwargs={'region_name': ...}"),
}
"""boto3's names of the S3 settings (a boto3 client's arguments, ~/.aws), which s3fs does not
take, -> what to write instead: the first names a user coming from boto3 writes."""


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
            if "s3" in protocols and key.lower() in _BOTO_NAMES:
                hint = f"{_BOTO_NAMES[key.lower()]}; "
            raise ConfigError(
                f"storage_options[{key!r}] is not an option of {protocols[0]}:// ({fs_cls.__module__}.{fs_cls.__name__}) "
                f"for {url!r}; {hint}accepted: {', '.join(sorted(accepted))}"
            )


def _check_endpoint(url: str, where: str, endpoint: Any) -> None:
    """Refuse an S3 endpoint that is not an ``http(s)://host[:port]`` URL (a port of 0-65535),
    or that holds credentials (``user:secret@host``), which s3fs and obstore take as it is and
    fail on at the first request."""
    expected = "expected a URL like 'http://10.0.0.5:9000' or 'https://s3.example.com'"
    if not isinstance(endpoint, str):
        raise ConfigError(f"storage_options {where} {endpoint!r} for {url!r} is not text: {expected}")
    scheme = endpoint.partition("://")[0].lower() if "://" in endpoint else ""  # HTTPS://host is https:// to botocore
    endpoint = shown_endpoint(endpoint)  # credentials in it (user:secret@host) are not shown
    if scheme and scheme not in ("http", "https"):
        raise ConfigError(
            f"storage_options {where} {endpoint!r} for {url!r}: its scheme {scheme!r} is not http or https; {expected}"
        )
    if not scheme:
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
    if "@" in parts.netloc:  # botocore takes 'user:secret@host' whole for the host name, which does not resolve
        raise ConfigError(
            f"storage_options {where} {endpoint!r} for {url!r} holds credentials (before its '@'), which the S3 "
            "client does not take from the URL: give them as storage_options key and secret, and the endpoint "
            "without them"
        )


def _protocols(fs: Any) -> tuple[str, ...]:
    """The protocols of an fsspec filesystem (class or instance): its ``protocol``, a name or several."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _filesystem_class(url: str) -> type:
    """The fsspec filesystem class serving ``url``; ConfigError naming the known schemes if none
    does; ImportError naming what to install if its backend is not installed (``cachepipe[s3]``
    for ``s3://``, fsspec's own advice for the others)."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        return fsspec.get_filesystem_class(protocol)  # type: ignore[no-any-return]  # fsspec is untyped
    except ImportError as exc:
        what = "s3fs, which is not installed: pip install 'cachepipe[s3]'" if protocol in ("s3", "s3a") else f"a backend: {exc}"
        raise ImportError(f"{protocol}:// needs {what}", name=exc.name) from exc  # the caller names the URL
    except ValueError as exc:
        known = sorted({"obs", *fsspec.available_protocols()})
        if protocol.lower() in known:  # 'S3://', 'OBS://': what a hand or a spreadsheet writes
            lower = protocol.lower() + url[len(protocol) :]
            raise ConfigError(
                f"unknown URL scheme {protocol + '://'!r} in {url!r}: schemes are lower case; expected {lower!r}"
            ) from exc
        raise ConfigError(
            f"unknown URL scheme {protocol + '://'!r} in {url!r}; cachepipe serves s3://, obs://, file:// "
            f"(or a plain path) and memory://, and fsspec also knows: {', '.join(known)}"
        ) from exc
