import os

import pytest

from cachepipe.catalog import check_key, group_items
from cachepipe.errors import UnsafeKeyError
from cachepipe.stores.base import ObjectInfo


def objs(*keys, size=1):
    return [ObjectInfo(k, size) for k in keys]


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("", "empty key"),
        ("/abs/x", "absolute"),
        ("a\\b/c", "backslash"),
        ("a/b\x00c", "NUL"),
        ("a/\x07", "control"),
        ("a//b", "empty path segment"),
        ("a/../b", "'..'"),
        ("../a", "'..'"),
        ("a/./b", "'.'"),
        ("a/" + "x" * 256, "longer than 255"),
        (".cachepipe/x", "reserved"),
        ("a/\ud800", "lone surrogate"),  # (a manifest's JSON can hold one; no file name can)
        ("a/" + "\udfff" * 70, "lone surrogate"),  # a long segment: its length was measured by encoding it, which raised
    ],
)
def test_unsafe_keys_rejected_with_key_named(key, reason):
    with pytest.raises(UnsafeKeyError) as info:
        check_key(key)
    assert reason in str(info.value)
    assert repr(key) in str(info.value)


def test_safe_keys():
    assert check_key("folder1/video.mp4") == ["folder1", "video.mp4"]
    assert check_key("a b/ü.txt") == ["a b", "ü.txt"]
    assert check_key("..a/b..") == ["..a", "b.."]


def test_group_folders_streams_in_key_order():
    listing = objs("a-b/x", "a/1", "a/sub/2", "b/3", "loose.txt")
    items = list(group_items(listing))
    assert [i.name for i in items] == ["a-b", "a", "b"]
    a = items[1]
    assert [f.rel for f in a.files] == ["1", "sub/2"] and a.size == 2 and not a.is_file


def test_group_is_lazy():
    def gen():
        yield ObjectInfo("a/1", 1)
        yield ObjectInfo("b/1", 1)
        raise AssertionError("read past what was needed")

    it = group_items(gen())
    assert next(it).name == "a"


def test_directory_markers_skipped():
    items = list(group_items([ObjectInfo("a/", 0), ObjectInfo("a/f", 3), ObjectInfo("a/sub/", 0)]))
    assert [(i.name, [f.rel for f in i.files]) for i in items] == [("a", ["f"])]


def unsafe(items):
    """``{name: the error's message}`` of the unsafe items."""
    return {item.name: str(item.unsafe) for item in items if item.unsafe is not None}


def test_nonempty_key_with_trailing_slash_makes_its_item_unsafe():
    items = list(group_items([ObjectInfo("a/f/", 5), ObjectInfo("b/f", 1)]))
    assert [i.name for i in items] == ["a", "b"]
    assert isinstance(items[0].unsafe, UnsafeKeyError) and "empty path segment" in str(items[0].unsafe)
    assert items[0].files[0].key == "a/f/" and items[1].unsafe is None


def test_file_and_folder_collision_makes_its_item_unsafe():
    items = list(group_items(objs("a/x", "a/x/y", "b/x")))
    assert [i.name for i in items] == ["a", "b"]
    assert unsafe(items).keys() == {"a"} and "collides" in unsafe(items)["a"] and "a/x/y" in unsafe(items)["a"]


def test_collision_in_files_mode():
    items = list(group_items(objs("s/000.tar", "s/000.tar/x", "s/001.tar"), "files"))
    assert [i.name for i in items] == ["s/000.tar", "s/000.tar/x", "s/001.tar"]
    assert unsafe(items).keys() == {"s/000.tar/x"} and "collides" in unsafe(items)["s/000.tar/x"]


def test_a_file_collides_with_a_later_key_under_it_across_the_keys_sorted_between_them():
    # keys that sort between a file and the keys under it ('!', '-', '.' come before '/')
    keys = ("s/a", "s/a!b", "s/a-b", "s/a.txt", "s/a/x")
    assert "collides with the file 's/a'" in unsafe(group_items(objs(*keys), "files"))["s/a/x"]
    assert "collides with the file 'a'" in unsafe(group_items(objs(*keys)))["s"]  # inside the folder s: a, a!b, ... a/x


@pytest.mark.parametrize("mode", ["folders", "files"])
def test_an_unsafe_key_costs_its_item_only_and_the_catalog_keeps_it_in_its_place(mode):
    keys = ("a/f", "b//c", "b/d", "c/../x", "d/f", "e\\f/g", "f/f")
    items = list(group_items(objs(*keys), mode))
    catalog = Catalog.from_listing(objs(*keys), mode)
    assert list(catalog) == items and len(items) == (7 if mode == "files" else 6)
    assert {catalog.name(i): str(e) for i, e in catalog.unsafe.items()} == unsafe(items)
    assert [catalog[i].unsafe is not None for i in range(len(catalog))] == [i.unsafe is not None for i in items]
    reasons = set(unsafe(items).values())
    assert any("empty path segment" in r for r in reasons) and any("'..'" in r for r in reasons)
    assert any("backslash" in r for r in reasons) and len(reasons) == 3


def test_a_loose_object_with_an_unsafe_key_is_no_item():
    items = list(group_items(objs("a/f", "a\\b")))
    assert [(i.name, i.unsafe) for i in items] == [("a", None)]


def test_the_collision_check_keeps_only_files_that_a_later_key_may_be_under():
    """It kept every key listed (files mode: a set of every key and folder of the listing, more
    memory than the catalog itself for millions of single files); a file is kept now only until
    the sorted keys pass every key that could be under it."""
    from cachepipe.catalog import _TreeCheck

    check = _TreeCheck()
    for i in range(10_000):
        key = f"shard{i:05d}/clip.mp4"
        check.add(key, key.split("/"))
        check.add(key + ".json", (key + ".json").split("/"))
    assert len(check._open) <= 2 and len(check._ends) <= 2


def test_files_mode():
    items = list(group_items(objs("000.tar", "001.tar", "sub/002.tar", size=5), "files"))
    assert [i.name for i in items] == ["000.tar", "001.tar", "sub/002.tar"]
    assert all(i.is_file and i.size == 5 and i.files[0].rel == "" for i in items)


def test_unsorted_listing_rejected():
    with pytest.raises(ValueError, match="out of order"):
        list(group_items(objs("b/1", "a/1")))


# ---- the columnar catalog ----------------------------------------------------------------
import gzip  # noqa: E402
import json  # noqa: E402
from array import array  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cachepipe import state  # noqa: E402
from cachepipe.catalog import Catalog, FileEntry, Item, Names  # noqa: E402

MD5 = "0123456789abcdef0123456789abcdef"
ETAGS = [MD5, MD5.upper(), "0123456789abcdef0123456789abcde-", "d41d8cd98f00b204e9800998ecf8427e-3", "", "W/x", None, "é" * 32]


def mixed_listing():
    """Non-ASCII names, several files, nested folders, every kind of etag, a directory marker."""
    keys = ["a-b/x", "a/1", "a/sub/2", "a/sub/deep/3", "b/", "b/ü.txt", "z z/ /e", "日本/動画.mp4", "日本/文字.txt"]
    return [ObjectInfo(k, 0 if k.endswith("/") else i + 1, ETAGS[i % len(ETAGS)]) for i, k in enumerate(keys)]


def test_catalog_round_trips_names_keys_sizes_and_etags():
    items = list(group_items(mixed_listing()))
    catalog = Catalog(items)
    assert list(catalog) == items and len(catalog) == len(items) == 5
    assert [catalog[i] for i in range(-5, 0)] == items and catalog[1:3] == items[1:3]
    assert catalog[1].files[2] == FileEntry("a/sub/deep/3", "sub/deep/3", 4, ETAGS[3])
    assert [f.etag for item in catalog for f in item.files] == [f.etag for item in items for f in item.files]
    assert list(catalog.sizes) == [item.size for item in items]
    assert list(catalog.names) == [item.name for item in items] == ["a-b", "a", "b", "z z", "日本"]
    assert catalog.name_bytes == sum(len(item.name.encode()) for item in items)
    assert list(Catalog.from_listing(mixed_listing())) == items
    assert list(catalog.entries()) == [(i.name, [(f.rel, f.size, f.etag) for f in i.files]) for i in items]


def test_an_items_file_sizes_and_version_from_the_columns_are_the_items():
    # Catalog.file_sizes and Catalog.version stand in for an Item at a cache's open
    # (recovery.sort_leftovers): every kind of entity tag, nested and non-ASCII paths, both modes.
    files_listing = [ObjectInfo(k, 5, e) for k, e in [("000.tar", MD5), ("001.tar", "abc-2"), ("sub/002.tar", None)]]
    for catalog in (Catalog.from_listing(mixed_listing()), Catalog.from_listing(files_listing, "files")):
        for i, item in enumerate(catalog):
            assert catalog.file_sizes(i) == {f.rel: f.size for f in item.files}
            assert catalog.version(i) == item.version
            assert catalog.version(i - len(catalog)) == item.version
    mixed = Catalog.from_listing(mixed_listing())
    assert {mixed.version(i) is None for i in range(len(mixed))} == {True, False}  # tagged items and one not
    untagged = Catalog(mode="folders")
    untagged.add("x", [("a", 1, None), ("b/c", 2, None)])
    assert untagged.version(0) is None and untagged.file_sizes(0) == {"a": 1, "b/c": 2}


def test_catalog_of_files_mode():
    listing = [ObjectInfo(k, 5, e) for k, e in [("000.tar", MD5), ("001.tar", "abc-2"), ("sub/002.tar", None)]]
    items = list(group_items(listing, "files"))
    catalog = Catalog.from_listing(listing, "files")
    assert list(catalog) == items and all(item.is_file for item in catalog)
    assert catalog[2] == Item("sub/002.tar", (FileEntry("sub/002.tar", "", 5, None),), 5, is_file=True)
    assert catalog.find("sub/002.tar") == 2 and catalog.find("sub") == -1


def test_catalog_keeps_lone_surrogates_and_control_free_unicode():
    catalog = Catalog(mode="folders")
    catalog.add("x\udcff", [("\ud800y", 3, None)])
    assert catalog[0] == Item("x\udcff", (FileEntry("x\udcff/\ud800y", "\ud800y", 3, None),), 3)
    assert catalog.find("x\udcff") == 0


def test_catalog_find_and_names_index():
    catalog = Catalog.from_listing(mixed_listing())
    for i, name in enumerate(catalog.names):
        assert catalog.find(name) == i and catalog.names.index(name) == i and name in catalog.names
    assert catalog.find("a/") == -1 and catalog.find("c") == -1 and "c" not in catalog.names
    with pytest.raises(ValueError, match="'c' is not in the catalog"):
        catalog.names.index("c")
    subset = Names(catalog, array("q", [1, 3]))
    assert list(subset) == ["a", "z z"] and subset.index("z z") == 1 and "a-b" not in subset
    with pytest.raises(ValueError, match="increasing"):
        Names(catalog, [3, 1])


def test_find_scans_a_catalog_built_out_of_order():
    items = [Item(n, (FileEntry(f"{n}/f", "f", 1),), 1) for n in ["m", "b", "z", "a"]]
    catalog = Catalog(items)
    assert [catalog.find(n) for n in ["m", "b", "z", "a", "q"]] == [0, 1, 2, 3, -1]


def test_catalog_rejects_what_it_could_not_give_back():
    catalog = Catalog([Item("a", (FileEntry("a/f", "f", 1),), 1)])
    with pytest.raises(ValueError, match="'x/g' of item 'b': expected 'b/g'"):
        catalog.append(Item("b", (FileEntry("x/g", "g", 1),), 1))
    with pytest.raises(ValueError, match=r"'c\.tar' is a single-file item, but this catalog holds folders"):
        catalog.append(Item("c.tar", (FileEntry("c.tar", "", 1),), 1, is_file=True))
    with pytest.raises(TypeError, match="'2'"):
        catalog.add("d", [("f", 1, None), ("g", "2", None)])
    with pytest.raises(ValueError, match="size -1 bytes"):
        catalog.add("d", [("f", -1, None)])
    with pytest.raises(ValueError, match="a single-file item has one"):
        Catalog(mode="files").add("e", [("f", 1, None)])
    with pytest.raises(ValueError, match="mode 'dirs'"):
        Catalog(mode="dirs")  # type: ignore[arg-type]
    assert list(catalog) == [Item("a", (FileEntry("a/f", "f", 1),), 1)]  # unchanged by the failures
    with pytest.raises(IndexError, match="index 1 out of range for 1 items"):
        catalog[1]
    with pytest.raises(TypeError, match="'0'"):
        catalog["0"]  # type: ignore[call-overload]


@pytest.mark.parametrize("copier", ["columns", "pickle"])
def test_a_catalog_copied_by_its_columns_or_pickled_is_the_same_catalog(copier):
    """What a DataLoader worker started by spawn gets of the dataset's manifest (its columns,
    through shared memory), and a catalog pickled whole: the same items, unsafe items with
    their errors (an UnsafeKeyError could not be unpickled: its arguments were not its
    message's), order (a binary search, or a scan) and digest; appending to the copy goes on
    as to the original."""
    import pickle

    more = [ObjectInfo("c/../x", 1), ObjectInfo("d/f", 1), ObjectInfo("d/f/g", 1)]  # unsafe: '..', a file and a folder
    unsafe = sorted([*mixed_listing(), *more], key=lambda o: o.key)
    catalogs = [
        Catalog.from_listing(unsafe),
        Catalog.from_listing([ObjectInfo(k, 5, e) for k, e in [("000.tar", MD5), ("001.tar", "abc-2"), ("s/2", None)]], "files"),
        Catalog([Item(n, (FileEntry(f"{n}/f", "f", 1),), 1) for n in ["m", "b", "z"]]),  # out of order
        Catalog(),
    ]
    assert [len(c.unsafe) for c in catalogs] == [2, 0, 0, 0]
    for catalog in catalogs:
        if copier == "columns":
            state, columns = catalog.columns()
            copy = Catalog.from_columns(state, [bytes(memoryview(c).cast("B")) for c in columns])
        else:
            copy = pickle.loads(pickle.dumps(catalog))  # noqa: S301 - bytes made here
        assert list(copy) == list(catalog) and copy.mode == catalog.mode and copy.digest() == catalog.digest()
        assert {i: (e.key, e.reason, str(e)) for i, e in copy.unsafe.items()} == {
            i: (e.key, e.reason, str(e)) for i, e in catalog.unsafe.items()
        }
        assert [copy.find(n) for n in [*catalog.names, "q"]] == [*range(len(catalog)), -1]
        assert copy.nbytes == catalog.nbytes
        if catalog.mode == "folders":
            copy.add("zz", [("f", 1, None)])
            catalog.add("zz", [("f", 1, None)])
            assert copy.digest() == catalog.digest() and copy.find("zz") == len(catalog) - 1


def test_catalog_is_compact():
    catalog = Catalog.from_listing(ObjectInfo(f"s{i:07d}/f", 1, MD5) for i in range(10_000))
    assert catalog.nbytes == (57 + 8 + 1) * 10_000 + 4 * 8  # fixed columns, the name, the rel; four offset arrays start at 0


def test_saved_catalog_round_trip(tmp_path):
    catalog = Catalog.from_listing(mixed_listing())
    path = tmp_path / "catalog"
    state.save_catalog(path, "s3://b/p", "folders", catalog)
    loaded = state.load_catalog(path, "s3://b/p", "folders")
    assert isinstance(loaded, Catalog) and list(loaded) == list(catalog)
    assert state.load_catalog(path, "s3://b/other", "folders") is None
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    assert json.loads(lines[0])["count"] == 5 and json.loads(lines[2]) == [
        "a",
        [["1", 2, ETAGS[1]], ["sub/2", 3, ETAGS[2]], ["sub/deep/3", 4, ETAGS[3]]],
    ]
    files = Catalog.from_listing([ObjectInfo("x/y.tar", 3, MD5)], "files")
    state.save_catalog(path, "s3://b/p", "files", files)
    assert list(state.load_catalog(path, "s3://b/p", "files")) == list(files)
    assert state.load_catalog(path, "s3://b/p", "folders") is None


def test_saved_catalog_with_bad_values_is_corrupt(tmp_path):
    path = tmp_path / "catalog"
    header = json.dumps({"version": 1, "source": "s", "items": "folders", "count": 1})
    path.write_bytes(gzip.compress(f'{header}\n["a", [["f", "12", null]]]\n'.encode()))
    with pytest.raises(state.StateCorrupt, match="'12'"):
        state.load_catalog(path, "s", "folders")


_segment = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\\x7f" + "".join(map(chr, range(32)))),
    min_size=1,
    max_size=6,
).filter(lambda s: s not in (".", "..", ".cachepipe"))
_etag = st.one_of(st.none(), st.just(MD5), st.text(max_size=40), st.binary(min_size=16, max_size=16).map(bytes.hex))


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.lists(_segment, min_size=1, max_size=3).map("/".join), st.tuples(st.integers(0, 2**40), _etag), max_size=30
    ),
    st.sampled_from(["folders", "files"]),
)
def test_catalog_holds_what_group_items_yields(objects, mode):
    listing = [ObjectInfo(k, size, etag) for k, (size, etag) in sorted(objects.items())]
    try:
        items = list(group_items(listing, mode))
    except UnsafeKeyError:  # a file and a folder of the same name: nothing to compare
        return
    catalog = Catalog.from_listing(listing, mode)
    assert list(catalog) == items == list(Catalog(items, mode))
    assert all(catalog.find(item.name) == i for i, item in enumerate(items))


def test_fitting_items_names_each_item_too_large():
    from cachepipe.errors import OversizeError
    from cachepipe.sourcing import fitting_items

    catalog = Catalog(mode="folders")
    for name, size in (("a", 10), ("b", 50), ("c", 20)):
        catalog.add(name, [["f", size, None]])
    assert fitting_items(catalog, capacity=100, occupied=40) == (None, [])  # all fit: no second index
    fitting, too_large = fitting_items(catalog, capacity=100, occupied=60)
    assert list(fitting) == [0, 2]
    assert [(e.item, e.size) for e in too_large] == [("b", 50)] and isinstance(too_large[0], OversizeError)


def test_check_keys_marks_what_a_listing_would_in_items_added_in_any_order():
    # What a manifest or a saved listing holds (Catalog.add, in the order written) was never
    # checked: a manifest could name keys that leave the cache (test_key_safety.py).
    catalog = Catalog()
    catalog.add("a", [("video.mp4", 1, None), ("text.txt", 1, None)])  # files in any order: fine
    catalog.add("b", [("x//y", 1, None)])
    catalog.add("c/d", [("f", 1, None)])
    catalog.add("e", [("f", 1, None), ("f/g", 1, None)])
    catalog.add("h", [("f", 1, None), ("f", 1, None)])
    catalog.add("i", [("../../x", 1, None)])
    catalog.check_keys()
    reasons = {catalog.name(i): e.reason for i, e in catalog.unsafe.items()}
    assert list(reasons) == ["b", "c/d", "e", "h", "i"] and catalog[0].unsafe is None
    assert "empty path segment" in reasons["b"] and "not one folder" in reasons["c/d"]
    assert "collides with the file 'f'" in reasons["e"] and reasons["h"] == "listed twice" and "'..'" in reasons["i"]
    files = Catalog(mode="files")
    for name in ("s/b", "s/a/x", "s/a", "s/b", ".cachepipe"):
        files.add(name, [("", 1, None)])
    files.check_keys()
    assert {i: e.reason for i, e in files.unsafe.items()}.keys() == {1, 3, 4}
    assert "collides with the file 's/a'" in files.unsafe[1].reason and files.unsafe[3].reason == "listed twice"


_PLAIN = ["a", "b", "c.txt", "video.mp4", "é", "日本", "x.cachepipe", "...", "x" * 255, "é" * 127, "\udc80" * 85]
_ODD = [
    ".",
    "..",
    "",
    ".cachepipe",
    "a\\b",
    "a\x01",
    "\x7f",
    "a/b",
    "a//b",
    "/a",
    "a/",
    "x" * 256,
    "é" * 128,
    "\udc80" * 86,
    "\ud800",
    "\udfff" * 70,
]


_SEGMENT = st.one_of(st.sampled_from(_PLAIN), st.text(alphabet="abé-", min_size=1, max_size=3))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(_SEGMENT, st.lists(_SEGMENT, min_size=1, max_size=4)), min_size=1, max_size=8),
    st.one_of(st.none(), st.sampled_from(_ODD)),
    st.booleans(),
    st.integers(0, 7),
    st.integers(0, 3),
)
def test_check_keys_over_the_buffers_marks_what_the_check_item_by_item_does(items, odd, as_name, i, k):
    # The check of plain catalogs at C speed (names and paths of one plain segment; only items
    # whose paths are out of order looked at one by one) against the check of every item; at
    # most one odd name or path (one makes the catalog not plain: the rest must still pass).
    if odd is not None:
        name, rels = items[i % len(items)]
        items[i % len(items)] = (odd, rels) if as_name else (name, [*rels[: k % len(rels)], odd, *rels[k % len(rels) + 1 :]])
    catalog = Catalog()
    for name, rels in items:
        catalog.add(name, [(rel, 1, None) for rel in rels])
    catalog.check_keys()
    everyone = {i: e for i in range(len(catalog)) if (e := catalog._folder_error(i)) is not None}
    assert {i: (e.key, e.reason) for i, e in catalog.unsafe.items()} == {i: (e.key, e.reason) for i, e in everyone.items()}


@pytest.mark.parametrize("odd", _ODD)
@pytest.mark.parametrize("as_name", [True, False])
def test_one_odd_key_in_a_plain_catalog_is_checked_as_item_by_item(odd, as_name):
    catalog = Catalog()
    catalog.add("a", [("f", 1, None), ("g", 1, None)])
    catalog.add(odd if as_name else "b", [("f", 1, None), ("h" if as_name else odd, 1, None)])
    catalog.add("c", [("video.mp4", 1, None)])
    catalog.check_keys()
    expected = catalog._folder_error(1)
    assert catalog._folder_error(0) is None and catalog._folder_error(2) is None
    assert {i: (e.key, e.reason) for i, e in catalog.unsafe.items()} == (
        {} if expected is None else {1: (expected.key, expected.reason)}
    )


def test_a_key_of_undecodable_bytes_is_a_file_name_and_one_with_a_lone_surrogate_is_not(tmp_path):
    name = os.fsdecode(b"caf\xe9")  # Latin-1 bytes, as os.listdir names them: U+DCE9
    assert check_key(f"a/{name}") == ["a", name]
    (tmp_path / name).write_bytes(b"x")
    with pytest.raises(UnicodeEncodeError):
        (tmp_path / "\ud800").write_bytes(b"x")


def test_check_keys_over_the_buffers_finds_a_path_listed_twice_and_each_kind_of_plain_key():
    catalog = Catalog()
    catalog.add("a", [("f", 1, None), ("g", 1, None)])  # in order: never looked at alone
    catalog.add("b", [("g", 1, None), ("f", 1, None), ("g", 1, None)])  # out of order: listed twice
    catalog.add("é" * 127, [("x" * 255, 1, None)])  # 254 and 255 bytes: plain
    catalog.add("..", [("f", 1, None)])  # not plain: the whole catalog is checked item by item
    catalog.check_keys()
    assert {catalog.name(i): e.reason for i, e in catalog.unsafe.items()} == {"b": "listed twice", "..": "'..' path segment"}


@settings(max_examples=200, deadline=None)
@given(
    st.sets(st.text(alphabet="ab/-.é", min_size=1, max_size=4), max_size=40),
    st.lists(st.text(alphabet="ab/-.é", min_size=1, max_size=4), max_size=40),
    st.sampled_from(["folders", "files"]),
    st.booleans(),
)
def test_find_many_finds_what_find_finds_in_any_order(names, queries, mode, view):
    # "a" sorts after "a-b" with the folders' "/" after it: the catalog's order, not the names'
    suffix = "/" if mode == "folders" else ""
    catalog = Catalog(mode=mode)
    for name in sorted(names, key=lambda n: (n + suffix).encode()):
        catalog.add(name, [("" if mode == "files" else "f", 1, None)])
    asked = [*queries, *list(names)[::2]]
    assert catalog.find_many(asked) == [catalog.find(q) for q in asked]
    if view:  # every other item: positions in the view
        seen = Names(catalog, range(0, len(catalog), 2))
        assert seen.find_many(asked) == [seen.index(q) if q in seen else -1 for q in asked]
    unsorted = Catalog(mode=mode)
    for name in sorted(names, reverse=True):
        unsorted.add(name, [("" if mode == "files" else "f", 1, None)])
    assert unsorted.find_many(asked) == [unsorted.find(q) for q in asked]
