"""Store backends: :func:`open_store` picks one by URL scheme.

``obs://`` is served by the Huawei OBS SDK (extra ``obs``); every other URL by fsspec
(``s3://`` through s3fs, ``file://``, plain paths, ``memory://``, ``gs://`` with gcsfs, ...).
"""

from __future__ import annotations

from typing import Any

from .base import ObjectInfo, Store

__all__ = ["ObjectInfo", "Store", "open_store", "preload"]


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """Return the store serving ``url``, configured with ``storage_options``."""
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
