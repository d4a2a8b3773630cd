"""Store backends: :func:`open_store` picks one by URL scheme.

``obs://`` is served by the Huawei OBS SDK (extra ``obs``); every other URL by fsspec
(``s3://`` through s3fs, ``file://``, plain paths, ``memory://``, ``gs://`` with gcsfs, ...).
"""

from __future__ import annotations

from typing import Any

from .base import ObjectInfo, Store

__all__ = ["ObjectInfo", "Store", "open_store"]


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    """Return the store serving ``url``, configured with ``storage_options``."""
    if url.startswith("obs://"):
        from .obs import ObsStore

        return ObsStore(url, storage_options)
    from .fsspec import FsspecStore

    return FsspecStore(url, storage_options)
