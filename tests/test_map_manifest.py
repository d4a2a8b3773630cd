"""A hand-built manifest (``cachepipe index`` never writes one so): a pipeline and ``cachepipe map``
plan from one the same way, or refuse it at once with the same error."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachepipe import Pipeline
from cachepipe.catalog import Catalog
from cachepipe.errors import ConfigError, UnsafeKeyError
from cachepipe.manifest import write_manifest
from cachepipe.map import map_items

COMMAND = ["sh", "-c", 'cp -r . "$CACHEPIPE_OUT/"']
OBJECTS = ("a/f", "a/g", "a/b/f", "b/f")


def _source(tmp_path: Path) -> str:
    src = tmp_path / "src"
    for key in OBJECTS:
        (src / key).parent.mkdir(parents=True, exist_ok=True)
        (src / key).write_bytes(b"x")
    return src.as_uri() + "/"


def _manifest(tmp_path: Path, source: str, mode: str, entries: list) -> Path:
    catalog = Catalog(mode=mode)
    for name, rels in entries:
        catalog.add(name, [(rel, 1, None) for rel in rels])
    location = tmp_path / "m.gz"
    write_manifest(location, source, mode, catalog)  # type: ignore[arg-type]
    return location


def _pipeline_names(tmp_path: Path, source: str, mode: str, manifest: Path) -> list[str]:
    with Pipeline(source, tmp_path / "p", "1MiB", items=mode, manifest=manifest) as pipe:  # type: ignore[arg-type]
        return [cached.name for cached in pipe]


def _map(tmp_path: Path, source: str, mode: str, manifest: Path):
    return map_items(
        COMMAND, source, str(tmp_path / "out"), cache_dir=tmp_path / "c", capacity="1MiB", manifest=str(manifest), items=mode,
        progress=False,
    )  # fmt: skip


MISFITS = {
    # a folder's name holding '/': a pipeline refused the item (not one folder), map grouped its keys
    # again into item 'a' (and with the entry 'a' beside it, one item of both)
    "a name holding /": ("folders", [("a/b", ["f"])], "item 'a/b' (entry 1) has a name holding '/'"),
    "a name holding / beside its top folder": (
        "folders",
        [("a", ["g"]), ("a/b", ["f"])],
        "item 'a/b' (entry 2) has a name holding '/'",
    ),
    # two entries of one name: a pipeline delivered two items 'a', map merged them (or refused them
    # when they listed the same file, as the object listed twice)
    "one name, two items": ("folders", [("a", ["f"]), ("a", ["g"])], "item 'a' (entry 2) is given to two items (entries 1 and 2"),
    "one name, two items of one file": ("folders", [("b", ["f"]), ("a", ["f"]), ("a", ["f"])], "item 'a' (entry 3) is given"),
    # an item without a file: a pipeline delivered an empty folder, map had no key of it and left it out
    "an item without a file": ("folders", [("a", ["f"]), ("b", [])], "item 'b' (entry 2) has no file"),
    # a file listed twice in one item: a pipeline refused the item (unsafe), map refused the manifest
    "a file twice in one item": ("folders", [("a", ["f", "f"])], "item 'a' (entry 1) lists a file twice ('a/f')"),
    # files: a key given twice: a pipeline refused the item (unsafe, listed twice), map the manifest
    "a key twice": ("files", [("a/f", [""]), ("b/f", [""]), ("a/f", [""])], "item 'a/f' (entry 3) is given to two items"),
}


@pytest.mark.parametrize("case", MISFITS)
def test_a_manifest_no_listing_could_give_is_refused_by_both_with_one_error(tmp_path, case):
    mode, entries, named = MISFITS[case]
    source = _source(tmp_path)
    manifest = _manifest(tmp_path, source, mode, entries)
    with pytest.raises(ConfigError) as by_pipeline:
        _pipeline_names(tmp_path, source, mode, manifest)
    with pytest.raises(ConfigError) as by_map:
        _map(tmp_path, source, mode, manifest)
    assert str(by_pipeline.value) == str(by_map.value)
    message = str(by_map.value)
    assert message.startswith(f"manifest {str(manifest)!r}: {named}"), message
    assert "a manifest holds a listing of the source as `cachepipe index` writes it" in message


@pytest.mark.parametrize(
    ("mode", "entries", "unsafe"),
    [
        ("folders", [("..", ["f"]), ("a", ["f"])], ".."),  # a key '../f': S3 can hold it, and index records it
        ("folders", [("", ["f"]), ("a", ["f"])], ""),  # a key '/f'
        ("folders", [("a", ["../b/f"]), ("b", ["f"])], "a"),
        ("files", [("../x", [""]), ("a/f", [""])], "../x"),
    ],
)
def test_keys_a_listing_can_hold_too_are_the_unsafe_item_s_in_both(tmp_path, mode, entries, unsafe):
    """Keys that cannot be stored but that a listing can give (S3 holds '../f' and '/f'; `cachepipe
    index` records them, with a warning) are not a misfit of the manifest: as from a listing, a
    pipeline refuses the item (on_error='raise', the default) and map records it failed and does
    the others. The two agree; this keeps them so."""
    source = _source(tmp_path)
    manifest = _manifest(tmp_path, source, mode, entries)
    with pytest.raises(UnsafeKeyError, match=f"item {unsafe!r} cannot be stored in the cache"):
        _pipeline_names(tmp_path, source, mode, manifest)
    result = _map(tmp_path, source, mode, manifest)
    assert [f.name for f in result.failed] == [unsafe] and "unsafe object key" in result.failed[0].error
    assert result.items_done == len(entries) - 1
