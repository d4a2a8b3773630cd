"""The public surface is curated: __all__ lists exactly what is documented, and nothing else leaks."""

import types

import cachepipe

EXPECTED = {
    "Pipeline",
    "CachedItem",
    "Stats",
    "map",
    "MapResult",
    "Client",
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
    "StoreUnreachableError",
    "VerificationError",
    "PrepareOverflowError",
    "ArchiveError",
    "UnsafeMemberError",
    "ArchiveTooLargeError",
    "ChecksumError",
}


def test_exported_members():
    assert set(cachepipe.__all__) == EXPECTED
    public = {n for n, v in vars(cachepipe).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public - {"annotations"} == EXPECTED


def test_every_export_is_documented():
    for name in cachepipe.__all__:
        assert getattr(cachepipe, name).__doc__, f"{name} has no docstring"


def test_errors_are_builtin_subclasses():
    assert issubclass(cachepipe.ConfigError, ValueError)
    assert issubclass(cachepipe.UnsafeKeyError, ValueError)
    assert issubclass(cachepipe.EmptySourceError, FileNotFoundError)
    assert issubclass(cachepipe.StoreUnavailableError, ConnectionError)
    assert issubclass(cachepipe.StoreUnreachableError, ConnectionError)
    assert issubclass(cachepipe.UnknownItemError, KeyError)
    assert issubclass(cachepipe.UnsafeMemberError, ValueError) and issubclass(
        cachepipe.ArchiveTooLargeError, cachepipe.ArchiveError
    )
    assert issubclass(cachepipe.ChecksumError, OSError)
