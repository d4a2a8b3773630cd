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
    UnknownItemError,
    UnsafeKeyError,
    UnsafeMemberError,
    VerificationError,
)
from .map.result import MapResult
from .map.run import map_items as map  # binds cachepipe.map to the function, over the subpackage's name
from .pipeline import CachedItem, Pipeline, Stats
from .stores import ObjectInfo, Store, open_store

__all__ = [
    "Pipeline",
    "CachedItem",
    "map",
    "MapResult",
    "Client",
    "Stats",
    "PipelineConfig",
    "parse_size",
    "parse_capacity",
    "Store",
    "ObjectInfo",
    "open_store",
    "CachePipeError",
    "ConfigError",
    "UnsafeKeyError",
    "OversizeError",
    "EmptySourceError",
    "CacheLockedError",
    "UnknownItemError",
    "ItemFailedError",
    "StoreUnavailableError",
    "VerificationError",
    "PrepareOverflowError",
    "ArchiveError",
    "UnsafeMemberError",
    "ArchiveTooLargeError",
    "ChecksumError",
]

__version__ = "0.1.0"

logging.getLogger("cachepipe").addHandler(logging.NullHandler())
