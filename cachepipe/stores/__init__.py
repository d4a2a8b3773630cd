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

__all__ = ["ObjectInfo", "Store", "open_store", "preload"]

_ENGINES = ("s3fs", "obstore")


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """Return the store serving ``url``, configured with ``storage_options``.

    For ``s3://`` the option ``engine`` picks the GET engine: ``"s3fs"`` (the default) or
    ``"obstore"``; other schemes take no ``engine``.
    """
    if storage_options and "engine" in storage_options:
        options = dict(storage_options)
        engine = options.pop("engine")
        if engine not in _ENGINES:
            raise ConfigError(
                f"storage_options['engine'] = {engine!r} for {url!r}: expected one of {', '.join(map(repr, _ENGINES))}"
            )
        if not url.startswith(("s3://", "s3a://")):
            raise ConfigError(f"storage_options['engine'] is an option of s3:// URLs only, not of {url!r}")
        if engine == "obstore":
            from .s3native import NativeS3Store

            return NativeS3Store(url, options)
        storage_options = options
    if url.startswith("obs://"):
        from .obs import ObsStore

        return ObsStore(url, storage_options)
    from .fsspec import FsspecStore

    return FsspecStore(url, storage_options)


def preload(url: str) -> None:
    """Import the backend that serves ``url`` now (s3fs and its HTTP stack take a second or more
    of CPU to import), so that the first :func:`open_store` for it is quick: a daemon calls it
    at start for the sources its jobs may read.

    Raises:
        ConfigError: no backend serves the URL's scheme (naming the ones that do).
        ImportError: the backend is not installed (naming the extra to install).
    """
    if url.startswith("obs://"):
        from .obs import load_sdk

        load_sdk(url)
        return
    from .fsspec import _filesystem_class

    _filesystem_class(url)
