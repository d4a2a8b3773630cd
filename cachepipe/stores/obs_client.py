"""The OBS backend's client: the Huawei OBS SDK (``esdk-obs-python``) imported when a store is
built (:func:`load_sdk`, so that ``import cachepipe`` works without it), and an ``obs.ObsClient``
made from the settings that :mod:`cachepipe.stores.obs_settings` resolves (:func:`_new_client`),
as :class:`~cachepipe.stores.obs.ObsStore` opens it and :func:`check_options` checks it.

Forks: the SDK negotiates a bucket's signature at a client's first request to it (a HEAD, for a
host name endpoint not in path style: OBS's own), holding one of 16 locks of its module
``obs.locks``, picked by the bucket's name, across that request. A process forked while a thread
of its parent negotiated inherited that lock held, by a thread that does not exist in it: its
first request to that bucket, through a client of its own (a DataLoader worker's store), waited
for ever. In the child each of them is replaced by a new lock (:func:`_new_locks_in_child`);
the credential providers' locks are :mod:`cachepipe.stores.obs_providers`'s.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from cachepipe.errors import ConfigError
from cachepipe.stores.obs_providers import remembering
from cachepipe.stores.obs_settings import (
    _CREDENTIAL_KEYS,
    _ENDPOINT_KEYS,
    _client_arguments,
    _parse_url,
    _resolve_settings,
    _Settings,
    _shown,
    redact,
)

__all__ = ["check_options", "load_sdk"]

_SDK_SSL_WARNINGS = (r"ssl\.PROTOCOL_TLS is deprecated", r"ssl\.OP_NO_SSL\*/ssl\.OP_NO_TLS\* options are deprecated")


def _new_locks_in_child() -> None:
    """In a process just forked (``os.register_at_fork``), where the only thread is the one that
    forked: a new lock for each of the SDK's ``obs.locks`` (see the module's docstring).

    Safe: no thread of the child holds or waits on them (the forking thread is running this, not
    a request), and the SDK takes one from that list at each negotiation (``get_lock(index)``);
    the list is changed in place, as the SDK's module holds it. A negotiation in flight in the
    parent had stored nothing yet (its client's cache is set once it is answered): the child's
    client negotiates itself."""
    locks = sys.modules.get("obs.locks")  # not imported: no request of the SDK's ran
    held = getattr(locks, "lock_list", None)
    if isinstance(held, list):
        held[:] = [threading.RLock() for _ in held]


os.register_at_fork(after_in_child=_new_locks_in_child)


def load_sdk(url: str) -> Any:
    """The Huawei OBS SDK's module (``obs``), imported.

    Raises:
        ImportError: it is not installed (naming the extra that installs it, for ``url``).
    """
    try:
        import obs
    except ImportError as exc:
        raise ImportError(
            f"{url}: the obs:// backend needs the Huawei OBS SDK; install it with pip install 'cachepipe[obs]'"
        ) from exc
    return obs


def _new_client(
    url: str, storage_options: Mapping[str, Any] | None, settings: _Settings | None = None
) -> tuple[Any, _Settings, Any]:
    """The OBS SDK's module, the settings resolved from ``storage_options`` and the environment
    (or ``settings``, resolved so before: a store's view gets a client of the store's settings),
    and a new ``obs.ObsClient`` made with them, for ``url`` (named in messages): what
    :class:`ObsStore` opens and :func:`check_options` checks. Making a client sends nothing (the
    SDK connects at the first request; it reads local files it is given: certificates, an ID
    token's configuration). Without keys, the SDK's own providers remember for a while that they
    found none (:mod:`cachepipe.stores.obs_providers`).

    Raises:
        ImportError: the OBS SDK is not installed.
        ConfigError: (a ValueError) an unknown option, no endpoint, half-given credentials, or
            arguments that ``obs.ObsClient`` refuses (naming the ones given to it).
    """
    options = storage_options or {}
    sdk = load_sdk(url)
    if settings is None:
        settings = _resolve_settings(options, os.environ, _client_arguments(sdk.ObsClient))
    try:
        with warnings.catch_warnings():
            # For an https endpoint the SDK builds ssl.SSLContext(ssl.PROTOCOL_SSLv23), which
            # warns "ssl.PROTOCOL_TLS is deprecated" on every client: nothing we pass avoids
            # it. Ignored here only, by message and module; catch_warnings touches the global
            # filter list, but only for this one constructor call.
            for message in _SDK_SSL_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=DeprecationWarning, module=r"obs\.")
            client = sdk.ObsClient(**settings.client_kwargs)
    except Exception as exc:  # the SDK validates its arguments with bare Exception (and ssl's, open's errors)
        reason = redact(f"{type(exc).__name__}: {exc}", settings.secrets)
        given = [f"server={settings.endpoint!r}"]
        given += [f"{k}={_shown(k, v)}" for k, v in options.items() if k not in _ENDPOINT_KEYS + _CREDENTIAL_KEYS]
        raise ConfigError(
            f"{url}: obs.ObsClient refused the storage options it was given ({', '.join(given)}): {reason}; "
            "expected values it takes (see esdk-obs-python's ObsClient arguments)"
        ) from exc
    if settings.credential_source == "provider" and not options.keys() & {"security_providers", "id_token_credentials_provider"}:
        # the SDK's default chain, which it asks before each request: see cachepipe.stores.obs_providers
        client.security_providers = remembering(client.security_providers)
    return sdk, settings, client


def check_options(url: str, storage_options: Mapping[str, Any] | None) -> None:
    """Refuse what :class:`ObsStore` refuses of ``url`` and ``storage_options`` before it sends
    anything (a malformed URL, an unknown option, no endpoint, half-given credentials, arguments
    that ``obs.ObsClient`` refuses when it is made): the client is made as the store makes it,
    then closed; nothing is sent.

    Raises:
        ImportError: the OBS SDK is not installed.
        ConfigError: naming the value and what would do.
    """
    _parse_url(url)
    _, _, client = _new_client(url, storage_options)
    client.close()
