"""Store backends: :func:`open_store` picks one by URL scheme.

``obs://`` is served by the Huawei OBS SDK (extra ``obs``); every other URL by fsspec
(``s3://`` through s3fs, ``file://``, plain paths, ``memory://``, ``gs://`` with gcsfs, ...).
An ``s3://`` URL with the storage option ``engine="obstore"`` is served by
:class:`~cachepipe.stores.s3native.NativeS3Store` (extra ``native``; an opt-in prototype).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import ObjectInfo, Store

__all__ = ["ObjectInfo", "Store", "check_store", "open_store", "preload"]

_ENGINES = ("s3fs", "obstore")


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """Return the store serving ``url``, configured with ``storage_options``.

    For ``s3://`` the option ``engine`` picks the GET engine: ``"s3fs"`` (the default) or
    ``"obstore"``; other schemes take no ``engine``.
    """
    engine, options = _engine(url, storage_options)
    if engine == "obstore":
        from .s3native import NativeS3Store

        return NativeS3Store(url, options)
    if url.startswith("obs://"):
        from .obs import ObsStore

        return ObsStore(url, options)
    from .fsspec import FsspecStore

    return FsspecStore(url, options)


def check_store(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Refuse what :func:`open_store` would refuse of ``url`` and ``storage_options`` before it
    sends anything (an unknown scheme or ``engine``, a storage option the backend does not
    take, an S3 ``endpoint_url`` that is no ``http(s)://host[:port]`` URL, an ``obs://`` URL with
    no endpoint, or with arguments the OBS SDK's client refuses when it is made, a value
    obstore's ``S3Store`` refuses with ``engine="obstore"``), with the same errors; nothing is
    sent (an ``obs://`` URL's client, and obstore's ``S3Store``, are made, as the store makes
    them, and dropped: they connect only at a request). The backend is
    imported (as :func:`preload` does). ``cachepipe serve --check`` calls it for
    each pipeline, so that it refuses what ``serve`` would.

    Raises:
        ConfigError: naming the value and what would do.
        ImportError: the backend is not installed (naming the extra to install).
    """
    engine, options = _engine(url, storage_options)
    if url.startswith("obs://"):
        from .obs_client import check_options as check_obs

        check_obs(url, options)
        return
    if engine == "obstore":  # checked as NativeS3Store checks them: its own options, s3fs's, then obstore's S3Store
        from .s3native import check_options as check_native

        check_native(url, options or {})
        return
    from .fsspec import check_options

    check_options(url, options)


def _engine(url: str, storage_options: dict[str, Any] | None) -> tuple[str | None, dict[str, Any] | None]:
    """The GET engine that ``storage_options`` picks for ``url`` (None: the backend's own), and
    the options without it; ConfigError for an unknown engine, or one given to a URL not ``s3://``."""
    if not storage_options or "engine" not in storage_options:
        return None, storage_options
    options = dict(storage_options)
    engine = options.pop("engine")
    if engine not in _ENGINES:
        raise ConfigError(f"storage_options['engine'] = {engine!r} for {url!r}: expected one of {', '.join(map(repr, _ENGINES))}")
    if not url.startswith(("s3://", "s3a://")):
        raise ConfigError(f"storage_options['engine'] is an option of s3:// URLs only, not of {url!r}")
    return engine, options


def preload(url: str) -> None:
    """Import the backend that serves ``url`` now (s3fs and its HTTP stack take a second or more
    of CPU to import), so that the first :func:`open_store` for it is quick: a daemon calls it
    at start for the sources its jobs may read.

    Raises:
        ConfigError: no backend serves the URL's scheme (naming the ones that do).
        ImportError: the backend is not installed (naming the extra to install).
    """
    if url.startswith("obs://"):
        from .obs_client import load_sdk

        load_sdk(url)
        return
    from .fsspec import _filesystem_class

    _filesystem_class(url)
