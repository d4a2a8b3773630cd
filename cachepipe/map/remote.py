"""The requests one ``cachepipe map`` run sends itself, besides its pipeline's downloads and its
uploads: the check of DST's bucket and the listings of SRC (or the read of its manifest:
:meth:`_Remote._listing`) and of DST, retried as downloads are (:meth:`_Remote._retrying`; a
listing continues where a transient error cut it, :meth:`_Remote._listed`), and which items DST
already marks done, for the version of their input listed now and the command run now
(:meth:`_Remote._done`: DST's listing tells which items have a marker, and the head of each
marker listed is read, concurrently; :func:`verdict` decides). A rank lists only the part of DST
where its share's keys can be (:mod:`~cachepipe.map.dstrange`: after a key below its first
item's, up to the first key past its last one's, in either order a store lists in), not the
whole of it. The listing of DST also tells what each item to run holds there already: for an
item whose marker is there (of another command, or of its earlier input), its upload deletes
what it does not write again (:mod:`cachepipe.map.uploader`); for one without a marker, nothing
is deleted (see :meth:`_Remote._done`).

:class:`_Remote` is the base class of :class:`~cachepipe.map.run._MapRun` (not used alone), whose
options (``cfg``) and stop event it reads.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable, Collection, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from operator import attrgetter
from typing import Any, Literal

from ..backoff import backoff_delay
from ..errors import ConfigError, is_transient
from ..listing import resumed_listing
from ..locations import inside_prefix
from ..manifest import check_manifest, read_manifest
from ..stores import Store
from ..stores.base import ObjectInfo, WritableStore
from .dstrange import bounded, dst_range
from .plan import MapConfig, MapItem, holder
from .uploader import MARKER_FORMAT, MARKER_LIMIT, marker_command, marker_format, marker_key, marker_version

__all__ = ["Checked", "verdict"]

log = logging.getLogger("cachepipe.map")

Verdict = Literal["done", "missing", "input", "command"]


def verdict(head: bytes | None, version: str | None, command: str) -> Verdict:
    """Whether an item is done, from the first bytes of its marker (``head``; None: no marker)
    and the version of its input and the command's digest now: ``"done"``; ``"missing"`` (no
    marker); ``"command"``, done by another command (or with another ``unpack``): run again;
    ``"input"``, done from another version of its input (rewritten since): run again. A marker
    that records no version or no command (an earlier cachepipe's) counts as done for it."""
    if head is None:
        return "missing"
    if marker_command(head) not in (None, command):
        return "command"
    if version is not None and marker_version(head) not in (None, version):
        return "input"
    return "done"


@dataclass
class Checked:
    """What :meth:`_Remote._done` found: the names of the items done, of those done by another
    command (to run again, in plan order), and the keys DST holds under each item to run that
    has a marker there (relative to DST: its upload deletes those it does not write again)."""

    done: set[str] = field(default_factory=set)
    command_changed: list[str] = field(default_factory=list)
    held: dict[str, list[str]] = field(default_factory=dict)


def held_by_item(keys: Iterable[str], names: Collection[str], wanted: Collection[str]) -> dict[str, list[str]]:
    """The ``keys`` of a listing of DST under each item of ``wanted``: a key is under the item of
    ``names`` (every item listed in SRC, of every rank) whose folder is the longest that holds it
    (items named ``a`` and ``a/b``: ``a/b/x`` is ``a/b``'s, never ``a``'s to delete). A key
    under no item (beside the items, or an item no longer in SRC) is no item's."""
    held: dict[str, list[str]] = {}
    for key in keys:
        name = holder(key, names)
        if name is not None and name in wanted:
            held.setdefault(name, []).append(key)
    return held


class _Remote:
    """The run's own requests to SRC and DST (see the module notes): :class:`~cachepipe.map.run._MapRun`'s base."""

    cfg: MapConfig
    _stop: threading.Event

    # -- DST and SRC requests ---------------------------------------------------------------------------
    def _retrying(self, what: str, call: Callable[[], Any]) -> Any:
        cfg = self.cfg
        for attempt in range(cfg.request_retries + 1):
            try:
                return call()
            except Exception as exc:
                if not is_transient(exc) or attempt == cfg.request_retries:
                    raise
                delay = backoff_delay(attempt, cfg.retry_backoff, cfg.retry_backoff_max)
                log.warning("%s failed, retry %d/%d in %.2fs: %s", what, attempt + 1, cfg.request_retries, delay, exc)
                if self._stop.wait(delay):  # before any job starts; the stop of a failed check wakes it (Ctrl-C too)
                    raise InterruptedError(f"stopped while retrying {what}") from exc
        raise AssertionError("unreachable")

    def _listed(
        self, store: Store, url: str, mode: Literal["folders", "files"], start_after: str | None = None
    ) -> Generator[ObjectInfo, None, None]:
        """``store``'s objects, listed through transient errors as a download is retried: a
        listing cut by one continues after the last item (of ``mode``) it read whole
        (:func:`~cachepipe.listing.resumed_listing`), not from its first page. ``start_after``:
        as :func:`~cachepipe.listing.resumed_listing`'s (DST's: :mod:`~cachepipe.map.dstrange`)."""
        cfg = self.cfg
        try:
            yield from resumed_listing(
                store,
                mode,
                cfg.request_retries,
                lambda attempt: backoff_delay(attempt, cfg.retry_backoff, cfg.retry_backoff_max),
                self._stop,  # before any job starts; the stop of a failed check wakes it (Ctrl-C too)
                url,
                start_after,
            )
        except Exception as exc:
            if is_transient(exc) and self._stop.is_set():
                raise InterruptedError(f"stopped while retrying listing {url}") from exc
            raise

    def _listing(self, src: Store) -> list[ObjectInfo]:
        """SRC's objects: listed, or read from the manifest given (every rank then plans from the
        same items, and none lists SRC). A manifest of another source or ``items`` is refused."""
        cfg = self.cfg
        if cfg.manifest is None:
            return list(self._listed(src, cfg.source, cfg.items))
        location = cfg.manifest
        manifest = self._retrying(f"reading manifest {location}", lambda: read_manifest(location, cfg.storage_options))
        check_manifest(manifest, cfg.source, cfg.items, "map run")
        log.info(
            "planning from manifest %s: %d items of %s listed at %s (SRC not listed)",
            manifest.location,
            manifest.count,
            manifest.source,
            manifest.listed_at,
        )
        entries = manifest.catalog.entries()
        if manifest.items == "files":  # an item is an object, named by its key
            objects = [ObjectInfo(name, size, etag) for name, files in entries for _, size, etag in files]
        else:
            objects = [ObjectInfo(f"{name}/{rel}", size, etag) for name, files in entries for rel, size, etag in files]
        # in key order, as a listing gives them (and plan_items takes them): a manifest holds items, and an item its
        # files, in the order they were added (write_manifest of a Catalog built with add); one listed is in order already
        objects.sort(key=attrgetter("key"))
        twice = next((a.key for a, b in pairwise(objects) if a.key == b.key), None)
        if twice is not None:
            raise ConfigError(
                f"manifest {manifest.location!r} lists the object {twice!r} twice: write it again with `cachepipe index`"
            )
        return objects

    def _done(self, dst: WritableStore, planned: list[MapItem], command: str, names: Collection[str]) -> Checked:
        """Which items DST marks done, for the version of their input listed now and for
        ``command`` (:func:`~cachepipe.map.plan.command_digest`), and what DST holds under each
        item to run. One listing of the part of DST where the keys of ``planned`` can be (a
        request per 1,000 keys; :meth:`_held_in`), which tells the items that
        have a marker; for each of those, one GET of the first
        :data:`~cachepipe.map.uploader.MARKER_LIMIT` bytes of its marker (a small body: about a
        HEAD's cost), concurrently; :func:`verdict` decides. ``names``: every item listed in SRC
        (of every rank; see :func:`held_by_item`). A SRC under DST is no item's to delete from:
        its keys are left out.

        Only an item whose marker is there (a finished attempt's, of another command or input)
        has its objects handed to the upload to delete. Objects without a marker are an attempt
        that did not finish, or one that is running now in another process (a second run onto
        the same DST; ranks whose shares overlap after SRC changed between their listings):
        deleting them could delete outputs that the other's marker is about to list. They are
        kept; those this attempt writes again are replaced."""
        checked = Checked()
        if not planned:
            return checked
        wanted = {mi.name for mi in planned}
        held = self._held_in(dst, names, wanted)
        marked = [mi for mi in planned if marker_key(mi.name) in held.get(mi.name, ())]

        def check(mi: MapItem) -> Verdict:
            body = io.BytesIO()
            try:
                dst.get(marker_key(mi.name), body, 0, MARKER_LIMIT)
            except FileNotFoundError:
                return verdict(None, mi.version, command)
            except OSError as exc:  # an empty marker (made by hand): S3 and OBS refuse any range of it
                if getattr(exc, "code", None) != "InvalidRange":  # the store's code (errors.store_code)
                    raise
            if (written := marker_format(body.getvalue())) > MARKER_FORMAT:
                raise ConfigError(
                    f"{self.cfg.dest.rstrip('/')}/{marker_key(mi.name)}: written by a later cachepipe (marker format "
                    f"{written}; this one reads {MARKER_FORMAT}): run that version, or delete the markers of the items "
                    "to run them again with this one"
                )
            found = verdict(body.getvalue(), mi.version, command)
            if found == "input":
                was = marker_version(body.getvalue())
                log.info("%s: input changed since it was done (version %s, now %s): doing it again", mi.name, was, mi.version)
            elif found == "command":
                recorded = marker_command(body.getvalue())
                log.debug("%s: done by another command (digest %s, now %s): doing it again", mi.name, recorded, command)
            return found

        found: dict[str, Verdict] = {}
        if marked:
            pool = ThreadPoolExecutor(min(16, len(marked)), thread_name_prefix="cachepipe-map-check")
            try:
                verdicts = list(pool.map(lambda mi: self._retrying(f"checking {mi.name}", lambda: check(mi)), marked))
            except BaseException:  # a check failed for good, or Ctrl-C: the checks in flight stop retrying
                self._stop.set()
                raise
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
            found = {mi.name: what for mi, what in zip(marked, verdicts, strict=True)}
        unfinished = []  # items to run that hold objects but no marker: kept
        for mi in planned:
            what = found.get(mi.name, "missing")
            if what == "done":
                checked.done.add(mi.name)
            else:
                if what == "command":
                    checked.command_changed.append(mi.name)
                if what in ("command", "input"):
                    checked.held[mi.name] = held[mi.name]
                elif mi.name in held:
                    unfinished.append(mi.name)
        if unfinished:
            log.info(
                "%d item(s) to run hold objects in DST but no marker (an attempt that did not finish, or one running now "
                "elsewhere; first: %s): those written again are replaced, the others kept; an item's marker lists its outputs",
                len(unfinished),
                unfinished[0],
            )
        if checked.command_changed:
            log.warning(
                "%d item(s) were done by another command (first: %s): %s, their outputs replaced (those not written again "
                "deleted); to keep what they hold, run the command (and --unpack) they were done with",
                len(checked.command_changed),
                checked.command_changed[0],
                "a run would do them again" if self.cfg.dry_run else "running them again",
            )
        return checked

    def _remove_stale(self, dst: WritableStore) -> None:
        """Remove the temporary files that killed uploads left in DST (a local one's
        ``*.cachepipe.tmp``: its optional ``remove_stale_temps``; never a live upload's), which
        an upload of the same key would only overwrite: under an item done since, left for good.
        Called by rank 0 alone: it walks the whole of a local DST, which the other ranks' own
        listings do not (:meth:`_held_in`)."""
        remove: Callable[[], list[str]] | None = getattr(dst, "remove_stale_temps", None)
        if remove is None:
            return
        removed = self._retrying(f"removing stale temporary files in {self.cfg.dest}", remove)
        if removed:
            log.info("removed %d temporary file(s) that killed uploads left in DST (first: %s)", len(removed), removed[0])

    def _held_in(self, dst: WritableStore, names: Collection[str], wanted: Collection[str]) -> dict[str, list[str]]:
        """:func:`held_by_item` of DST's listing, streamed (only the keys of ``wanted`` are kept;
        a listing cut by a transient error continues after the last key read, see
        :meth:`_listed`); a local DST not made yet holds none. Only the part of DST where the
        keys of ``wanted`` (a rank's share) can be is listed: after a key below them, up to the
        first key past them, in either order a store lists in (:mod:`~cachepipe.map.dstrange`)."""
        within = dst_range(wanted)
        listing = self._listed(dst, self.cfg.dest, "files", within.start_after)
        keys: Iterable[str] = bounded((o.key for o in listing), within)
        source = inside_prefix(self.cfg.dest, self.cfg.source)  # SRC under DST: an item named as its folder holds it
        if source is not None:
            keys = (key for key in keys if not key.startswith(source))
        try:
            return held_by_item(keys, names, wanted)
        except FileNotFoundError:
            return {}
        finally:
            listing.close()  # stopped past the last item: no more pages
