"""A manifest: a source listed once per job, written where every rank and node can read it.

``cachepipe index SRC -o DEST`` (or :func:`index`) lists ``SRC`` once and writes the catalog to
``DEST``, a local path or an object-store URL; ``Pipeline(..., manifest=DEST)`` then plans from
it without listing, so every process of a job plans over the same items whatever was added to
or removed from the source since.

The format is the cache's saved catalog (:func:`cachepipe.state.write_catalog`): gzip JSON
lines, a header line, then one line per item ``[name, [[rel, size, etag], ...]]``. The header::

    {"version": 1, "source": "s3://b/p/", "items": "folders", "count": 1000000,
     "digest": "<32 hex digits>", "listed_at": "2024-05-01T12:00:00Z"}

``digest`` is :meth:`cachepipe.catalog.Catalog.digest`, over the content only (not the time),
so two listings of the same data give the same digest; it is checked when the manifest is read
(with ``count`` and gzip's own CRC), and a pipeline's ``state_dict`` records it.

A local manifest read while another read of the same file is held (:func:`read_manifest`) is
not read again: a DataLoader's dataset holds the one it plans from, so its workers, forked from
it, plan from the catalog they inherit (its buffers shared, copy-on-write) instead of each
reading the whole file at every pass. The same file is the same inode, size and times, and the
same gzip trailer (the CRC-32 and length of its content, its last 8 bytes: read each time), so
a file changed in place within its times' granularity (a second on some file systems) is read
again.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from .catalog import Catalog
from .errors import ConfigError
from .listing import list_source
from .state import StateCorrupt, StateTooNew, atomic_write, catalog_header, read_catalog_header, read_catalog_items, write_catalog
from .stores import Store, open_store
from .wholefiles import naming, open_unique_temp, remove_unlocked

__all__ = ["Manifest", "check_manifest", "index", "read_manifest", "write_manifest"]

log = logging.getLogger("cachepipe")

_WHOLE = 1 << 62  # the end of a GET range that reads an object of any size to its end
_COPY = "cachepipe-index-copy-"  # the prefix of a manifest's local copy, written to be uploaded, in the temporary folder


@dataclass(frozen=True)
class Manifest:
    """A listing read from (or written to) a manifest.

    Attributes:
        location: where it is (a local path or a URL).
        source: the URL that was listed.
        items: ``"folders"`` or ``"files"``: how the listing was grouped into items.
        listed_at: when the listing ended (UTC, ISO 8601).
        digest: :meth:`Catalog.digest` of :attr:`catalog`.
        catalog: the items.
    """

    location: str
    source: str
    items: Literal["folders", "files"]
    listed_at: str
    digest: str
    catalog: Catalog

    @property
    def count(self) -> int:
        return len(self.catalog)


# Local manifests read in this process and still held by someone, by the identity of the file
# read: (device, inode, size, modification and change times in ns, gzip trailer). A file written
# again (by atomic_write: another inode) or changed in place (another mtime or ctime) is read
# anew; so is one changed in place within its times' granularity (1 s on ext4 with 128-byte
# inodes, 2 s on FAT; an inode number reused as fast), whose content's CRC-32 differs.
# (No lock of ours around it: one held by another thread at a fork would stay held in the child.)
_HELD: weakref.WeakValueDictionary[tuple[int | bytes, ...], Manifest] = weakref.WeakValueDictionary()


def held_identity(manifest: Manifest) -> tuple[int | bytes, ...] | None:
    """The identity of the file under which :func:`read_manifest` holds the read ``manifest``
    came from in this process (the held read or a copy of it at another path), or None."""
    return next((identity for identity, held in _HELD.items() if held.catalog is manifest.catalog), None)


def hold(identity: tuple[int | bytes, ...], make: Callable[[], Manifest]) -> Manifest:
    """The read of the file of ``identity`` held in this process, else ``make()``, held as that
    read from now on (``identity`` from :func:`held_identity` in the process that read it: a
    process started by spawn gets the read with it). :func:`read_manifest` returns it while that
    file is unchanged (checked at each call, as for a read of this process)."""
    held = _HELD.get(identity)
    if held is None:
        held = make()
        _HELD[identity] = held
    return held


def _is_url(location: str) -> bool:
    return "://" in location


def _split_url(location: str) -> tuple[str, str]:
    """``s3://b/p/m.gz`` as the store root ``s3://b/p/`` and the key ``m.gz``."""
    root, _, key = location.rpartition("/")
    if not key or root.endswith((":/", "://")):
        raise ConfigError(f"manifest {location!r}: expected a file path or an object URL like 's3://bucket/prefix/manifest.gz'")
    return root + "/", key


def check_entries(catalog: Catalog, where: str) -> None:
    """Refuse a manifest's ``catalog`` (at ``where``) that holds an item no listing is grouped
    into (:meth:`Catalog.misfit`: a hand-built one): a pipeline and ``cachepipe map`` would plan
    it differently. Its keys that cannot be stored are not refused here: each such item is
    refused or skipped in its turn, as from a listing.

    Raises:
        ConfigError: naming the item, its entry, what is wrong and what a manifest holds.
    """
    misfit = catalog.misfit()
    if misfit is not None:
        i, why = misfit
        raise ConfigError(
            f"manifest {where!r}: item {catalog.name(i)!r} (entry {i + 1}) {why}; a manifest holds a listing of the "
            "source as `cachepipe index` writes it: write it with `cachepipe index SRC -o ...` (or write_manifest of "
            "Catalog.from_listing)"
        )


def write_manifest(
    location: str | os.PathLike[str],
    source: str,
    items: Literal["folders", "files"],
    catalog: Catalog,
    storage_options: dict[str, Any] | None = None,
    *,
    listed_at: str | None = None,
) -> Manifest:
    """Write ``catalog`` (the listing of ``source``) to ``location``: a local path (written
    atomically) or an object URL (uploaded with the store's ``put``, whole or not at all).

    Raises:
        ConfigError: a URL with no object name, or a store that cannot be written to.
        OSError: as the file system or the store (see :mod:`cachepipe.stores.base`).
    """
    where = os.fspath(location)
    when = listed_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    header = catalog_header(source, items, catalog, listed_at=when)
    if not _is_url(where):
        atomic_write(Path(where), lambda fh: write_catalog(fh, header, catalog))
    else:
        root, key = _split_url(where)
        store = open_store(root, storage_options)
        try:
            put = getattr(store, "put", None)
            if put is None:
                raise ConfigError(f"manifest {where!r}: the store of {root!r} cannot be written to; write it to a local path")
            _upload(put, key, where, lambda fh: write_catalog(fh, header, catalog))
        finally:
            store.close()
    return Manifest(where, source, items, when, header["digest"], catalog)


def _upload(put: Callable[[str, str], None], key: str, where: str, write: Callable[[Any], None]) -> None:
    """Write a manifest (``write(fh)``) to a local copy in the temporary folder (``$TMPDIR``) and
    ``put`` it as ``key`` (of ``where``); the copy is removed.

    The copy is locked while it is written and uploaded (:func:`~cachepipe.wholefiles.open_unique_temp`),
    and copies that writers killed before they removed theirs left are removed first (their lock
    is free), so a killed ``cachepipe index -o URL`` leaves its copy only until the next one runs
    (a temporary folder that cannot be listed, mode 1733, is not searched: a warning).
    The copy's name ends with ``key``: a store that guesses an object's media type by the local
    file's name guesses it from the key's suffix."""
    folder = tempfile.gettempdir()
    try:
        with os.scandir(folder) as entries:
            stale = [e.path for e in entries if e.name.startswith(_COPY)]
    except OSError as exc:  # a folder that may be written, not listed (mode 1733): housekeeping, not the upload's
        log.warning("not looking for copies of manifests that killed runs left in %s: %s", folder, exc)
        stale = []
    for path in stale:
        if remove_unlocked(path):
            log.info("removed %s, the copy of a manifest that a killed `cachepipe index` left", path)
    fd, local, _ = open_unique_temp(folder, _COPY, "-" + key[-64:])
    try:
        # a full temporary folder: said with the path, not as a bare errno
        with naming(f"cannot write {local!r}, the copy of {where} to upload"), open(fd, "wb", closefd=False) as fh:
            write(fh)
        put(local, key)  # the lock held meanwhile: a later index does not take it for a dead writer's
    finally:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local)
        finally:
            os.close(fd)


def read_manifest(location: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Manifest:
    """Read and check the manifest at ``location`` (a local path or an object URL).

    A local file is not read again while a :class:`Manifest` read from it (the same file,
    unchanged: its device, inode, size, mtime and ctime, and its gzip trailer, the CRC-32 of its
    content) is held in this process or in the one it was forked from: the same catalog is
    returned (never modified; shared by the pipelines that plan from it).

    Raises:
        FileNotFoundError: there is none (named).
        ConfigError: it is not a manifest, or it is truncated or altered (its item count or
            digest does not match its header).
        OSError: as the store (see :mod:`cachepipe.stores.base`).
    """
    where = os.fspath(location)
    if not _is_url(where):
        try:
            local = open(where, "rb")  # noqa: SIM115 - closed by the with below; only the open's error is named
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                errno.ENOENT, f"manifest {where!r}: no such file; write it with `cachepipe index SRC -o {where}`"
            ) from exc
        with local as fh:
            st = os.fstat(fh.fileno())
            # gzip's trailer, the CRC-32 and length of the content: 8 bytes, not the file
            trailer = os.pread(fh.fileno(), 8, st.st_size - 8) if st.st_size >= 8 else b""
            identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, trailer)
            held = _HELD.get(identity)
            if held is not None:  # this file, read in this process (or the one it was forked from)
                return held if held.location == where else replace(held, location=where)
            manifest = _parse(fh, where)
        _HELD[identity] = manifest  # while the caller holds it
        return manifest
    root, key = _split_url(where)
    store = open_store(root, storage_options)
    try:
        with tempfile.TemporaryFile(prefix="cachepipe-manifest-") as fh:
            store.get(key, fh, 0, _WHOLE)  # reads to the object's end; a short body fails the gzip CRC
            fh.seek(0)
            return _parse(fh, where)
    finally:
        store.close()


def _parse(raw: io.BufferedIOBase | Any, where: str) -> Manifest:
    try:
        with gzip.open(raw, "rt", encoding="utf-8") as text:
            header = read_catalog_header(text, where)
            catalog = read_catalog_items(text, header, where)
        if not isinstance(header.get("source"), str) or not isinstance(header.get("digest"), str):
            raise StateCorrupt(f"{where}: a catalog without the source and digest of a manifest")
    except StateTooNew as exc:
        raise ConfigError(
            f"manifest {where!r} cannot be read by this cachepipe ({exc}): read it with that version, or write it "
            "again with this one's `cachepipe index`"
        ) from exc
    except StateCorrupt as exc:
        raise ConfigError(f"manifest {where!r} is corrupt or truncated ({exc}): write it again with `cachepipe index`") from exc
    check_entries(catalog, where)
    return Manifest(where, header["source"], header["items"], str(header.get("listed_at", "")), header["digest"], catalog)


def same_source(a: str, b: str) -> bool:
    """Whether two source URLs name the same prefix (a trailing ``/`` does not matter)."""
    return a.rstrip("/") == b.rstrip("/")


def check_manifest(manifest: Manifest, source: str, items: str, user: str = "pipeline") -> None:
    """Refuse ``manifest`` for a pipeline (or another ``user``: ``"map run"``) of ``source`` and
    ``items`` mode when it lists another.

    Raises:
        ConfigError: naming both sources, or both modes.
    """
    if not same_source(manifest.source, source):
        raise ConfigError(
            f"manifest {manifest.location!r} lists source {manifest.source!r}, this {user}'s source is {source!r}: "
            "use the same source, or index this one with `cachepipe index`"
        )
    if manifest.items != items:
        raise ConfigError(
            f"manifest {manifest.location!r} lists items={manifest.items!r}, this {user} has items={items!r}: "
            f"use items={manifest.items!r}, or index again with --items {items}"
        )


def index(
    source: str,
    location: str | os.PathLike[str],
    items: Literal["folders", "files"] = "folders",
    storage_options: dict[str, Any] | None = None,
    *,
    store: Store | None = None,
    dest_options: dict[str, Any] | None = None,
    retries: int = 12,
    retry_backoff: float = 0.2,
    retry_backoff_max: float = 10.0,
) -> Manifest:
    """List ``source`` once and write its manifest to ``location``; return it.

    Args:
        store: the store to list (default: opened from ``source`` with ``storage_options``).
        dest_options: storage options for ``location`` when it is a URL (default ``storage_options``).
        retries, retry_backoff, retry_backoff_max: how a transient store error of the listing is
            retried (the whole listing again), as a pipeline's options of these names say.

    Raises:
        EmptySourceError: nothing to list (saying whether the source lists no objects, or only
            objects outside folders with ``items="folders"``, as :class:`~cachepipe.Pipeline` does).
        OSError: as the store and the file system.

    An item with a key that cannot be stored in a cache (see :func:`cachepipe.catalog.check_key`)
    is recorded, with a warning: a pipeline reading the manifest checks its keys again and
    refuses the item or skips it in its turn, as its ``on_error`` says.
    """
    if items not in ("folders", "files"):
        raise ConfigError(f"items {items!r}: expected 'folders' or 'files'")
    where = os.fspath(location)
    if not where.strip():
        raise ConfigError(f"manifest {where!r}: expected a file path or an object URL like 's3://bucket/prefix/manifest.gz'")
    if not _is_url(where) and os.path.isdir(where):  # said before the listing: it would end in renaming onto it
        raise IsADirectoryError(
            errno.EISDIR, f"manifest {where!r}: is a folder; expected a file path, such as {os.path.join(where, 'manifest.gz')!r}"
        )
    if not _is_url(where) and not Path(where).parent.is_dir():  # said before the listing, naming the folder
        url = "" if os.path.isabs(where) else f" (an object URL needs its scheme: 's3://{where}')"  # bucket/m.gz
        raise FileNotFoundError(errno.ENOENT, f"manifest {where!r}: no such folder {str(Path(where).parent)!r}{url}")
    own = store is None
    src = open_store(source, storage_options) if store is None else store
    try:
        # transient store errors are retried, as a pipeline's listing
        catalog = list_source(src, items, retries, retry_backoff, retry_backoff_max, source=source)
    finally:
        if own:
            src.close()
    if catalog.unsafe:
        first = next(iter(catalog.unsafe))
        log.warning(
            "%s: %d item(s) hold keys that cannot be stored in a cache, recorded in the manifest; a pipeline refuses "
            "them (on_error='raise') or skips them in their turn (on_error='skip'); the first, %r: %s",
            source,
            len(catalog.unsafe),
            catalog.name(first),
            catalog.unsafe[first],
        )
    return write_manifest(location, source, items, catalog, storage_options if dest_options is None else dest_options)
