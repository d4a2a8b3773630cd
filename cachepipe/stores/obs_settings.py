"""The OBS backend's settings (pure: reads only its arguments): the endpoint and the credentials
resolved from ``storage_options``, the ``OBS_*`` environment and the SDK's providers, in that
order (:func:`_resolve_settings`); the ``obs://bucket/prefix/`` URL (:func:`_parse_url`); the
options that are secrets, which no message shows. What each setting means is in
:mod:`cachepipe.stores.obs`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cachepipe.errors import ConfigError

_ENDPOINT_KEYS = ("server", "endpoint", "endpoint_url")
_CREDENTIAL_KEYS = ("access_key_id", "secret_access_key", "security_token")
_SECRET_KEYS = ("secret_access_key", "security_token", "proxy_password")
REDACTED_FROM = 6
"""Characters a secret has at least for :func:`redact` to replace it wherever a message holds it.
A shorter one (a one-letter test key, a short proxy password) would be found inside ordinary
words, and replacing it there made the message unreadable (``"The specified key..."`` with the
secret ``e``: ``"Th*** sp***cifi***d k***y..."``): it is replaced only where it stands alone,
not inside a word or a longer value (no letter or digit beside it)."""
_ENV_KEYS = {
    "access_key_id": "OBS_ACCESS_KEY_ID",
    "secret_access_key": "OBS_SECRET_ACCESS_KEY",
    "security_token": "OBS_SECURITY_TOKEN",
}
_ENV_ENDPOINT = "OBS_ENDPOINT"

# ObsClient arguments this backend cannot honour: the streaming read and the error seam rely on
# http.client responses and exceptions, which these modes replace (use_http_conns even wraps
# every network error into a bare Exception).
_UNSUPPORTED = {
    "use_http_conns": "the requests-based transport hides network errors in a bare Exception",
    "use_http2": "the HTTP/2 transport is not supported by the streaming read",
    "client_mode": "only the default 'obs' mode is supported",
    "pool_size": "it only applies to use_http_conns, which is not supported",
    "trust_env": "it only applies to use_http_conns, which is not supported",
}
# ObsClient pops this one from **kwargs itself, so the signature does not show it.
_EXTRA_CLIENT_ARGS = ("id_token_credentials_provider",)
# Our defaults for the SDK, each overridable through storage_options:
# - max_retry_count=0: the core retries transient errors with backoff; the SDK's own loop
#   (sleeping 0.2, 0.4, 0.8 s) would multiply the attempts and hide the failure from the core.
# - long_conn_mode=True: keep-alive connections in the client's pool (the SDK default opens a
#   new TCP/TLS connection per request); ObsStore.close() closes them.
_CLIENT_DEFAULTS: dict[str, Any] = {"max_retry_count": 0, "long_conn_mode": True}


@dataclass(frozen=True)
class _Settings:
    """Connection settings resolved from storage_options, the environment and the SDK defaults."""

    endpoint: str
    credential_source: str  # "explicit", "env" or "provider"
    client_kwargs: dict[str, Any] = field(repr=False)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The values that messages must not show (the secret key, the token, a proxy password)."""
        return tuple(str(self.client_kwargs[k]) for k in _SECRET_KEYS if self.client_kwargs.get(k))


def redact(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with each of ``secrets`` replaced by ``***``, the longest first (one that holds
    another is replaced whole): one of :data:`REDACTED_FROM` characters or more wherever it is, a
    shorter one only where it stands alone (no letter or digit beside it)."""
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        if len(secret) >= REDACTED_FROM:
            text = text.replace(secret, "***")
        else:
            text = re.sub(rf"(?<![^\W_]){re.escape(secret)}(?![^\W_])", "***", text)
    return text


def _client_arguments(client_cls: type) -> frozenset[str]:
    """Names of the keyword arguments ``client_cls`` (``obs.ObsClient``) accepts."""
    names: set[str] = set(_EXTRA_CLIENT_ARGS)
    for cls in client_cls.__mro__:
        if cls is object:
            continue
        for param in inspect.signature(cls.__init__).parameters.values():  # type: ignore[misc]  # a class from the MRO, not an instance
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and param.name != "self":
                names.add(param.name)
    return frozenset(names)


def _normalize_endpoint(value: object, origin: str, is_secure: object) -> str:
    """``value`` as ``scheme://host[:port]``; ``https`` unless a scheme or ``is_secure=False`` says otherwise."""
    expected = (
        f"{origin}: expected an endpoint like 'https://obs.cn-north-4.myhuaweicloud.com' or "
        "'http://127.0.0.1:9000' (scheme, host and optional port only)"
    )
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{expected}, got {value!r}")
    value = value.strip().rstrip("/")
    if "://" not in value:
        value = ("http://" if is_secure is False else "https://") + value
    parts = urlsplit(value)
    if "@" in parts.netloc:  # do not echo it: the part before '@' may be a key pair
        raise ConfigError(f"{expected}; credentials in the endpoint are not supported")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise ConfigError(f"{expected}, got {value!r}")
    try:
        parts.port  # noqa: B018 - read for its ValueError: the SDK takes a port it cannot read for none (port 80 or 443)
    except ValueError:
        raise ConfigError(f"{expected}; its port is not a number from 0 to 65535, got {value!r}") from None
    return value


def _resolve_settings(storage_options: Mapping[str, Any], environ: Mapping[str, str], accepted: frozenset[str]) -> _Settings:
    """Resolve endpoint and credentials: explicit storage_options, then ``OBS_*`` env, then SDK providers.

    Pure: reads only its arguments. Raises ConfigError (a ValueError) for an unknown or
    unsupported key, half-given credentials, or no endpoint at all.
    """
    options = dict(storage_options)
    ours = set(_ENDPOINT_KEYS) | set(_CREDENTIAL_KEYS)
    for key in options:
        if key in ours:
            continue
        if key in _UNSUPPORTED:
            raise ConfigError(f"storage_options[{key!r}] is not supported by the obs:// backend: {_UNSUPPORTED[key]}")
        if key not in accepted:
            passthrough = sorted(accepted - ours - set(_UNSUPPORTED))
            raise ConfigError(
                f"storage_options[{key!r}] is not a setting of the obs:// backend; accepted: "
                f"server (aliases endpoint, endpoint_url), access_key_id, secret_access_key, security_token, "
                f"or an obs.ObsClient argument: {', '.join(passthrough)}"
            )

    given = [k for k in _ENDPOINT_KEYS if options.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"storage_options sets the endpoint twice ({' and '.join(given)}); keep one of them")
    if given:
        endpoint = _normalize_endpoint(options[given[0]], f"storage_options[{given[0]!r}]", options.get("is_secure"))
    elif environ.get(_ENV_ENDPOINT):
        endpoint = _normalize_endpoint(environ[_ENV_ENDPOINT], _ENV_ENDPOINT, options.get("is_secure"))
    else:
        raise ConfigError(
            "no OBS endpoint: pass storage_options['server'] (e.g. 'https://obs.cn-north-4.myhuaweicloud.com') "
            f"or set the environment variable {_ENV_ENDPOINT}"
        )

    kwargs: dict[str, Any] = dict(_CLIENT_DEFAULTS)
    kwargs.update({k: v for k, v in options.items() if k not in ours})
    kwargs["server"] = endpoint

    explicit = {k: options[k] for k in _CREDENTIAL_KEYS if options.get(k) is not None}
    from_env = {k: environ[name] for k, name in _ENV_KEYS.items() if environ.get(name)}
    if explicit:
        source, creds, names = "explicit", explicit, {k: f"storage_options[{k!r}]" for k in _CREDENTIAL_KEYS}
    elif "access_key_id" in from_env or "secret_access_key" in from_env:
        source, creds, names = "env", from_env, {k: f"${name}" for k, name in _ENV_KEYS.items()}
    else:
        source, creds, names = "provider", {}, {}
        kwargs.setdefault("security_provider_policy", "OBS_DEFAULT")
    for key in ("access_key_id", "secret_access_key") if creds else ():
        if not isinstance(creds.get(key), str) or not creds[key].strip():
            have = ", ".join(names[k] for k in creds)
            raise ConfigError(f"OBS credentials are incomplete: {have} given but {names[key]} is missing or empty")
    for key, value in creds.items():
        if isinstance(value, str) and not (value.isascii() and value.isprintable() and not any(c.isspace() for c in value)):
            # the SDK sends the key and the token in headers (Latin-1): a dash or a space pasted with
            # them failed as a bare UnicodeEncodeError, or as a signature OBS does not match
            raise ConfigError(
                f"{names[key]} holds a space, a control character or a character outside ASCII (pasted with it?); "
                "OBS access keys, secret keys and security tokens are ASCII letters, digits and signs only"
            )
    kwargs.update(creds)
    return _Settings(endpoint=endpoint, credential_source=source, client_kwargs=kwargs)


_BUCKET = re.compile(r"[A-Za-z0-9._-]+")
"""The characters a bucket name may hold (OBS's own names: lowercase letters, digits, ``-`` and
``.``; upper case and ``_`` as botocore allows them for S3): any other (a space, a control
character, ``%``) the SDK would put in the request line unquoted."""


def _parse_url(url: str) -> tuple[str, str]:
    """``obs://bucket/prefix`` -> ``(bucket, 'prefix/')``; an empty prefix stays empty.

    Split by hand, not by :func:`urllib.parse.urlsplit`, which removes every tab, CR and LF from
    a URL: ``obs://b/a\tb/`` would list the prefix ``ab/``, and ``obs://b\tc/`` the bucket ``bc``.
    """
    scheme, sep, rest = url.partition("://")
    bucket, _, path = rest.partition("/")
    if scheme.lower() != "obs" or not sep or not bucket:
        raise ConfigError(f"expected a URL like 'obs://bucket/prefix/', got {url!r}")
    if "@" in bucket or ":" in bucket:
        # Do not echo it: the part before '@' may be a key pair.
        raise ConfigError("an obs:// URL must not carry credentials or a port; use storage_options or OBS_* variables")
    if "?" in rest or "#" in rest:
        raise ConfigError(f"an obs:// URL takes no query or fragment, got {url!r}")
    if not _BUCKET.fullmatch(bucket):
        raise ConfigError(
            f"{url!r}: the bucket name {bucket!r} holds a character no bucket name has; expected lowercase letters, "
            "digits, '-' and '.' (OBS's bucket names), the bucket first and the prefix after its '/'"
        )
    prefix = path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


def _shown(key: str, value: object) -> str:
    """``value`` of the storage option ``key`` as a message shows it: a secret as ``'***'``, a
    number, a flag or a string as itself, anything else by its type (a dict may hold an ID token)."""
    if key in _SECRET_KEYS:
        return "'***'"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return f"<{type(value).__name__}>"
