"""cachepipe: stream object-store datasets through a size-capped local cache.

Public API::

    from cachepipe import Pipeline
    with Pipeline("s3://bucket/video/", cache_dir="/mnt/ssd/cache", capacity="50GiB") as pipe:
        for path in pipe:
            train_on(path)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import map as _map_package  # noqa: F401 - loaded now so that `map` below stays the function (see the end)
from ._lazy import attach
from .logfallback import FallbackHandler as _FallbackHandler
from .logfallback import printable_records as _printable_records

if TYPE_CHECKING:
    from .client import Client
    from .config import PipelineConfig, parse_capacity, parse_size
    from .errors import (
        ArchiveError,
        ArchiveTooLargeError,
        CacheLockedError,
        CachePipeError,
        CacheRemovedError,
        ChecksumError,
        ConfigError,
        EmptySourceError,
        ItemFailedError,
        ObjectChangedError,
        OversizeError,
        PrepareOverflowError,
        StoreUnavailableError,
        StoreUnreachableError,
        UnknownItemError,
        UnsafeKeyError,
        UnsafeMemberError,
        VerificationError,
    )
    from .map.result import MapResult
    from .map.run import map_items as map  # noqa: A004 - the public name cachepipe.map
    from .pipeline import CachedItem, Pipeline, Stats
    from .stores import ObjectInfo, Store, open_store

__all__ = [
    "ArchiveError",
    "ArchiveTooLargeError",
    "CacheLockedError",
    "CachePipeError",
    "CacheRemovedError",
    "CachedItem",
    "ChecksumError",
    "Client",
    "ConfigError",
    "EmptySourceError",
    "ItemFailedError",
    "MapResult",
    "ObjectChangedError",
    "ObjectInfo",
    "OversizeError",
    "Pipeline",
    "PipelineConfig",
    "PrepareOverflowError",
    "Stats",
    "Store",
    "StoreUnavailableError",
    "StoreUnreachableError",
    "UnknownItemError",
    "UnsafeKeyError",
    "UnsafeMemberError",
    "VerificationError",
    "map",
    "open_store",
    "parse_capacity",
    "parse_size",
]

__version__ = "0.1.0"

_ERRORS = [name for name in __all__ if name.endswith("Error")]

# The public names are imported on first use (cachepipe._lazy): `import cachepipe` costs about
# 0.03 s instead of 0.35 s (pydantic, the cache, the stores), which the `cachepipe` command pays
# on every call.
__getattr__, __dir__ = attach(
    __name__,
    {
        "Client": (".client", "Client"),
        "PipelineConfig": (".config", "PipelineConfig"),
        "parse_capacity": (".config", "parse_capacity"),
        "parse_size": (".config", "parse_size"),
        **{name: (".errors", name) for name in _ERRORS},
        "MapResult": (".map.result", "MapResult"),
        "map": (".map.run", "map_items"),
        "CachedItem": (".pipeline", "CachedItem"),
        "Pipeline": (".pipeline", "Pipeline"),
        "Stats": (".pipeline", "Stats"),
        "ObjectInfo": (".stores", "ObjectInfo"),
        "Store": (".stores", "Store"),
        "open_store": (".stores", "open_store"),
    },
    globals(),
)
# Loading the subpackage cachepipe.map (above) bound its name here, to the package; the public
# cachepipe.map is the function map_items, bound on first use like the others. The subpackage is
# loaded first so that importing one of its modules later cannot bind the name to it again.
del globals()["map"]
del TYPE_CHECKING, attach  # not public names

# Warnings reach a user who configured no logging, a few lines per kind; configured handlers
# take over entirely (see cachepipe.logfallback for why not a NullHandler). First, before every
# handler: names of undecodable bytes escaped, so that a strict handler can write their lines.
_printable_records("cachepipe")
logging.getLogger("cachepipe").addHandler(_FallbackHandler())
