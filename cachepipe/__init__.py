"""cachepipe: stream object-store datasets through a size-capped local cache.

Public API::

    from cachepipe import Pipeline
    with Pipeline("s3://bucket/video/", cache_dir="/mnt/ssd/cache", capacity="50GiB") as pipe:
        for path in pipe:
            train_on(path)
"""

from __future__ import annotations

import logging

from .client import Client
from .config import PipelineConfig, parse_capacity, parse_size
from .errors import (
    ArchiveError,
    ArchiveTooLargeError,
    CacheLockedError,
    CachePipeError,
    ChecksumError,
    ConfigError,
    EmptySourceError,
    ItemFailedError,
    OversizeError,
    PrepareOverflowError,
    StoreUnavailableError,
    StoreUnreachableError,
    UnknownItemError,
    UnsafeKeyError,
    UnsafeMemberError,
    VerificationError,
)
from .logfallback import FallbackHandler as _FallbackHandler
from .map.result import MapResult
from .map.run import map_items as map  # noqa: A004 - the public name cachepipe.map; binds the function over the subpackage's name
from .pipeline import CachedItem, Pipeline, Stats
from .stores import ObjectInfo, Store, open_store

__all__ = [
    "ArchiveError",
    "ArchiveTooLargeError",
    "CacheLockedError",
    "CachePipeError",
    "CachedItem",
    "ChecksumError",
    "Client",
    "ConfigError",
    "EmptySourceError",
    "ItemFailedError",
    "MapResult",
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

# Warnings reach a user who configured no logging, a few lines per kind; configured handlers
# take over entirely (see cachepipe.logfallback for why not a NullHandler).
logging.getLogger("cachepipe").addHandler(_FallbackHandler())
