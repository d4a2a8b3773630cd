"""From a listing to items: what an item is (:class:`Item`, :class:`FileEntry`, its version)
and how a listing in key order is grouped into items (pure code, no I/O).

An item is either a first-level folder under the prefix (every object under ``<name>/``,
recursively) or, with ``items="files"``, a single object. A key that could escape the cache
directory or collide with another after mapping (:mod:`cachepipe.keys`) makes its item unsafe:
the item is kept, in its place, with the :class:`~cachepipe.errors.UnsafeKeyError` that names
the key and the reason (:attr:`Item.unsafe`), and is never written (the fetcher refuses it in
its turn; a pipeline with ``on_error="raise"`` refuses the listing). One bad key costs its item
only, and every process that plans from the same listing sees the same items in the same
places. :mod:`cachepipe.catalog` re-exports the public names.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .blocks import folders_made, footprint
from .errors import UnsafeKeyError
from .keys import _TreeCheck, check_key
from .stores.base import ObjectInfo, slot_setters

__all__ = ["FileEntry", "Item", "group_items", "version_of"]

log = logging.getLogger("cachepipe")


@dataclass(frozen=True, slots=True, init=False)
class FileEntry:
    """One object of an item.

    Attributes:
        key: the object key relative to the source prefix.
        rel: the local path relative to the item (``""`` for a single-file item).
        size: bytes.
        etag: the store's entity tag, or None.
    """

    key: str
    rel: str
    size: int
    etag: str | None = None

    def __init__(self, key: str, rel: str, size: int, etag: str | None = None) -> None:
        set_key, set_rel, set_size, set_etag = _FILE_ENTRY_SETTERS  # see slot_setters
        set_key(self, key)
        set_rel(self, rel)
        set_size(self, size)
        set_etag(self, etag)


_FILE_ENTRY_SETTERS = slot_setters(FileEntry, "key", "rel", "size", "etag")


@dataclass(frozen=True, slots=True, init=False)
class Item:
    """One unit of delivery: a folder of files, or a single file.

    Attributes:
        name: the item's name, also its path relative to the cache directory.
        files: its objects, in key order.
        size: total bytes of its files.
        is_file: True for a single-object item (``items="files"``).
        unsafe: why the item cannot be stored in the cache (a key of it that is unsafe, or that
            collides, see :func:`check_key`), or None. An unsafe item is never written.
    """

    name: str
    files: tuple[FileEntry, ...]
    size: int
    is_file: bool = False
    unsafe: UnsafeKeyError | None = field(default=None, compare=False)
    # (block, footprint(block)) of the last block asked (see footprint); (0, 0): none yet (no block is 0)
    _footprint: tuple[int, int] = field(default=(0, 0), init=False, compare=False, repr=False)

    def __init__(
        self, name: str, files: tuple[FileEntry, ...], size: int, is_file: bool = False, unsafe: UnsafeKeyError | None = None
    ) -> None:
        set_name, set_files, set_size, set_is_file, set_unsafe, set_footprint = _ITEM_SETTERS  # see slot_setters
        set_name(self, name)
        set_files(self, files)
        set_size(self, size)
        set_is_file(self, is_file)
        set_unsafe(self, unsafe)
        set_footprint(self, _NO_FOOTPRINT)

    def footprint(self, block: int) -> int:
        """What its files take on a filesystem of ``block`` -byte blocks (``block`` > 0):
        :func:`~cachepipe.blocks.footprint` of its files' sizes and the folders it makes
        (:func:`~cachepipe.blocks.folders_made`); :meth:`cachepipe.cache.Cache.charge` is this and
        the ``extra`` beside it. Computed once for a block, a walk of its files: kept with the
        block it is of (the item is frozen, so the value is that block's for ever), so that the
        checks, reservation, publish and release of one item (its charge is asked three or four
        times on its way) walk its files once, and a cache of another block computes its own."""
        at, taken = self._footprint  # one read: another thread may store another block's meanwhile
        if at == block:
            return taken
        files = self.files
        taken = footprint((f.size for f in files), folders_made((f.rel for f in files), self.is_file, self.name), block)
        _ITEM_SETTERS[5](self, (block, taken))
        return taken

    @property
    def version(self) -> str | None:
        """Which version of the item the listing names: 16 hex digits of a digest of its files'
        paths, sizes and entity tags, or None if no file has a tag (local files, ``memory://``).
        The journal records it with each publish, so that recovery reuses an item left on disk
        only while the store still lists that version (an object rewritten at the same size has
        another tag)."""
        return version_of([(f.rel, f.size, f.etag) for f in self.files]) if self.tagged else None

    @property
    def tagged(self) -> bool:
        """Whether any of its files has an entity tag: then it has a :attr:`version`."""
        return any(f.etag is not None for f in self.files)


_ITEM_SETTERS = slot_setters(Item, "name", "files", "size", "is_file", "unsafe", "_footprint")
_NO_FOOTPRINT = (0, 0)


def version_of(files: Sequence[tuple[str, int, str | None]]) -> str | None:
    """16 hex digits of a digest of ``(path, size, etag)`` of each of an item's files, in order;
    None if no file has an entity tag (see :attr:`Item.version`)."""
    if all(etag is None for _rel, _size, etag in files):
        return None
    digest = hashlib.blake2b(digest_size=8)
    for rel, size, etag in files:
        digest.update(f"{rel}\0{size}\0{etag or ''}\0".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def tree_order(key: str) -> str:
    """``key`` as it sorts in a listing made folder by folder (SeaweedFS's: a folder's keys before
    those of the next name, ``a/x`` before ``a b/x`` and ``a-b/x``, where S3 orders the keys
    themselves, ``" "`` and ``"-"`` before ``"/"``): its ``/`` made the lowest character. A NUL
    in a key (unsafe, but listed) is kept above it (``"\\0"`` becomes ``"\\0\\1"``, ``/``
    ``"\\0\\0"``): mapped onto ``/``, ``a\\0c/f`` would sort between ``a/b`` and ``a/z`` and
    the folder ``a`` come twice."""
    if "\0" in key:
        key = key.replace("\0", "\0\1")
    return key.replace("/", "\0\0")


def group_items(
    objects: Iterable[ObjectInfo],
    mode: Literal["folders", "files"] = "folders",
    seen: _TreeCheck | None = None,
    loose: _Loose | None = None,
) -> Iterator[Item]:
    """Group a listing into items, streaming: each item is yielded once its last object is seen.

    ``objects`` must be in strictly increasing key order (S3 lists that way), or folder by folder
    (strictly increasing in :func:`tree_order`: SeaweedFS lists that way); in either, all
    objects of a folder are contiguous. Zero-byte directory markers are skipped. Objects directly
    under the prefix (no folder) are ignored in ``"folders"`` mode. An item with a key that is
    unsafe or collides (see :func:`check_key`) is yielded in its place with :attr:`Item.unsafe`
    set to the first such key's error (a folder's name is its key's first segment, whatever
    that is): it must not be written. ``seen``: in ``"files"`` mode, the keys of a listing
    these objects continue (after its last key), checked against theirs; None: none. ``loose``:
    in ``"folders"`` mode, the objects directly under the prefix that the listing these objects
    continue met (see :class:`_Loose`), counted on in the warning that counts them; None: none.

    Raises:
        ValueError: the listing is in neither order.
    """
    is_file = mode == "files"
    for name, size, files, unsafe in _grouped(objects, mode, seen, loose):
        if is_file:  # one file, whose key is the name
            entries: tuple[FileEntry, ...] = (FileEntry(name, "", size, files[0][2]),)
        else:
            entries = tuple([FileEntry(f"{name}/{rel}", rel, file_size, etag) for rel, file_size, etag in files])
        yield Item(name, entries, size, is_file=is_file, unsafe=unsafe)


class _Loose:
    """The objects directly under the prefix (in no folder) that a listing in ``"folders"`` mode
    met, across the listings that continue it (see :meth:`continued`): the warning that counts
    them at the end counts those the listings before a cut listed up to the key it continues
    after, and does not count again those it lists anew.

    Attributes:
        n: how many, in the listings so far.
        first: the first of them ("" if none).
        upto: how many of them are at or before the last key of the last folder yielded.
        after: the key the listing continues after (None: it lists from the start): those at or
            before it were counted.
    """

    def __init__(self) -> None:
        self.n, self.first, self.upto = 0, "", 0
        self.after: str | None = None

    def continued(self, after: str) -> None:
        """A listing continues after ``after``, the last key of the last folder yielded (every key
        so far in key order): the loose objects after it are listed again, counted again."""
        self.n, self.after = self.upto, after
        if not self.n:  # in key order, the first of them comes before every other
            self.first = ""


_Files = list[tuple[str, int, str | None]]  # (rel, size, etag) of an item's files
_Entry = tuple[str, int | None, _Files, UnsafeKeyError | None]  # (name, size or None: the sum, files, why unsafe)


def _grouped(
    objects: Iterable[ObjectInfo], mode: Literal["folders", "files"], seen: _TreeCheck | None = None, loose: _Loose | None = None
) -> Iterator[tuple[str, int, _Files, UnsafeKeyError | None]]:
    """:func:`group_items` as ``(name, size, [(rel, size, etag), ...], unsafe)``, making no objects
    per item (what :meth:`Catalog.from_listing` stores). A file's key is ``name/rel``, or ``name``
    in ``"files"`` mode, where ``rel`` is empty; ``seen`` and ``loose`` as :func:`group_items`'s
    (added to)."""
    last_key: str | None = None
    last_tree = ""  # last_key in folder-by-folder order (see tree_order)
    in_order = in_tree_order = True  # the listing so far is in key order; in folder-by-folder order
    current: str | None = None
    files: _Files = []
    size = 0
    unsafe: UnsafeKeyError | None = None  # of the current folder
    first: tuple[str, list[str]] = ("", [])  # the folder's first key and its segments under the folder
    tree: _TreeCheck | None = None  # made at a folder's second file: one file cannot collide
    everything = (_TreeCheck() if seen is None else seen) if mode == "files" else None
    if loose is None:
        loose = _Loose()
    skipped, after = loose.n, loose.after  # the objects beside the folders; counted before the cut up to ``after``
    at_folder = skipped  # how many of them came before the current folder (none comes inside one, in either order)
    for obj in objects:
        key = obj.key
        if in_tree_order:  # followed only while the listing may be folder by folder
            by_folder = tree_order(key)
            in_tree_order = last_key is None or by_folder > last_tree
            last_tree = by_folder
        if last_key is not None:
            in_order = in_order and key > last_key
            if not (in_order or in_tree_order):
                raise ValueError(f"listing out of order: {key!r} after {last_key!r} (neither in key order nor folder by folder)")
        last_key = key
        if key.endswith("/") and obj.size == 0:
            continue  # a directory marker
        error: UnsafeKeyError | None = None
        try:
            segments = check_key(key)
        except UnsafeKeyError as exc:
            segments, error = key.split("/"), exc  # grouped as listed, never written
        if everything is not None:
            if error is None:
                try:
                    everything.add(key, segments)
                except UnsafeKeyError as exc:
                    error = exc
            yield key, obj.size, [("", obj.size, obj.etag)], error
            continue
        if len(segments) < 2:  # a loose object beside the folders: not part of any item
            if after is None or key > after:  # else counted by the listing before the cut
                skipped += 1
                loose.n = skipped
                if not loose.first:
                    loose.first = key
            continue
        name, inside = segments[0], segments[1:]
        if name != current:
            if files:
                loose.upto = at_folder  # those before its last key, should the listing be cut after it
                yield current, size, files, unsafe  # type: ignore[misc]
            current, files, size, tree, first, unsafe = name, [], 0, None, (key, inside), error
            at_folder = skipped
        elif unsafe is not None:
            pass  # an unsafe folder is not checked further: its first bad key names it
        elif error is not None:
            unsafe = error
        else:
            try:
                if tree is None:
                    tree = _TreeCheck()
                    tree.add(*first)
                tree.add(key, inside)
            except UnsafeKeyError as exc:
                unsafe = exc
        files.append((key[len(name) + 1 :], obj.size, obj.etag))
        size += obj.size
    if files:
        loose.upto = at_folder
        yield current, size, files, unsafe  # type: ignore[misc]
    if skipped and (current is not None or after is not None):  # with no folder at all, the listing is refused, saying so
        log.warning(
            "%d object(s) lie directly under the prefix, beside its folders, and are part of no item "
            "(items='folders' makes an item of each folder; the first: %r)",
            skipped,
            loose.first,
        )
