"""The public surface is curated: __all__ lists exactly what is documented, and nothing else leaks."""

import subprocess
import sys
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
    "ObjectChangedError",
    "CacheRemovedError",
}


def test_exported_members():
    assert set(cachepipe.__all__) == EXPECTED
    names = {n for n in dir(cachepipe) if not n.startswith("_")}
    public = {n for n in names if not isinstance(getattr(cachepipe, n), types.ModuleType)}
    assert public - {"annotations"} == EXPECTED


def _fresh(code: str) -> str:
    """What ``code`` prints in a fresh interpreter: the imports of the test session do not count."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout


def test_import_loads_the_public_names_on_first_use():
    """`import cachepipe` and the command's module do not import pydantic, the pipeline or the
    stores: the `cachepipe` command that only talks to a daemon (`next`, `ack`) would pay them on
    every call (0.35 s of imports, against about 0.1 s)."""
    heavy = ("pydantic", "cachepipe.config", "cachepipe.pipeline", "cachepipe.stores", "cachepipe.map.run")
    out = _fresh(f"import sys, cachepipe.cli; print([m for m in {heavy!r} if m in sys.modules])")
    assert out.strip() == "[]"
    # Every command builds the whole parser, `map`'s options too, but not map's result formatting.
    heavy += ("cachepipe.map.result",)
    out = _fresh(f"import sys, cachepipe.cli; cachepipe.cli._parser(); print([m for m in {heavy!r} if m in sys.modules])")
    assert out.strip() == "[]"
    out = _fresh("import sys, cachepipe; cachepipe.Pipeline; print('cachepipe.pipeline' in sys.modules)")
    assert out.strip() == "True"


def test_the_status_table_formats_sizes_without_pydantic():
    """`cachepipe status` formats its sizes with cachepipe.sizes, not through cachepipe.config,
    which imports pydantic (about 0.07 s of the command's 0.15 s)."""
    info = {"pipelines": {"train": {"stats": {"bytes_in_cache": 1536, "capacity": 2**30}}}}
    out = _fresh(
        f"import sys, cachepipe.cli; table = cachepipe.cli.format_status({info!r}); "
        "print('1.5 KiB' in table and '1.0 GiB' in table, [m for m in ('pydantic', 'cachepipe.config') if m in sys.modules])"
    )
    assert out.strip() == "True []"


def test_map_stays_the_function_whichever_import_comes_first():
    """The subpackage cachepipe.map binds its name in cachepipe when it is first imported: the
    public cachepipe.map must still be the function after the subpackage's modules are imported."""
    out = _fresh(
        "import cachepipe.map.cli, cachepipe.map.plan, cachepipe\n"
        "from cachepipe.map import plan\n"
        "from cachepipe import map\n"
        "print(callable(cachepipe.map), map is cachepipe.map, map.__name__, plan.__name__)"
    )
    assert out.split() == ["True", "True", "map_items", "cachepipe.map.plan"]


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
