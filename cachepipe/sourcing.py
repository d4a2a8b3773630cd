"""Where a pass's catalog comes from, and which of its items it can plan: the part of opening a
pipeline that is about the data, not about threads.

- :func:`list_source`: list a store into a catalog, retrying transient errors (the one listing
  with retries, for a pipeline and for ``cachepipe index``);
- :func:`empty_source`: the error of a listing that found nothing to deliver, saying why (for
  a listing that streams, :func:`list_source` and ``cachepipe index``);
- :func:`obtain_catalog`: a manifest, or the listing an earlier owner of the cache saved
  (``resume``), or a new listing; with its digest;
- :func:`fitting_items`: which items can ever fit beside the cache's foreign bytes and state
  budget (pure);
- :func:`make_plan`: the :class:`~cachepipe.plan.Plan` of the pipeline's options over them.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal

from .catalog import Catalog
from .config import PipelineConfig
from .errors import EmptySourceError, OversizeError, is_transient
from .fetcher import backoff_delay
from .manifest import check_manifest, read_manifest
from .plan import Plan
from .stores import ObjectInfo, Store

if TYPE_CHECKING:
    from .cache import Cache

__all__ = ["empty_source", "fitting_items", "list_source", "make_plan", "obtain_catalog"]

log = logging.getLogger("cachepipe")


def empty_source(source: str, items: str, objects: int, listed: int = 0) -> EmptySourceError:
    """The error of a listing of ``source`` that ended without an item to deliver, saying why:
    every one of the ``listed`` items was larger than the capacity, the prefix lists nothing
    (``objects`` 0: a wrong bucket or prefix), or its objects lie directly under it while
    ``items="folders"`` makes items of folders only."""
    what = f"no items under {source!r}: found no {items}"
    if listed:
        return EmptySourceError(f"{what} smaller than the capacity")
    if not objects:
        return EmptySourceError(
            f"{what} with objects: the source lists no objects; check the bucket and the prefix (keys are case-sensitive)"
        )
    return EmptySourceError(
        f"{what} with objects: the {objects} object{'s' if objects > 1 else ''} it lists {'lie' if objects > 1 else 'lies'} "
        "directly under it, none in a folder; "
        "items='folders' (the default) makes an item of each folder below the prefix: pass items='files' for an item "
        "per object, or give the prefix above their folder"
    )


def list_source(
    store: Store,
    items: Literal["folders", "files"],
    retries: int = 12,
    backoff: float = 0.2,
    backoff_max: float = 10.0,
    source: str = "",
    stop: threading.Event | None = None,
) -> Catalog:
    """List ``store`` into a catalog, retrying transient store errors as downloads are (the whole
    listing again: a catalog is built in one pass). ``source`` names it in the log. ``stop``: once
    set (a pipeline closing while it opens), an error is not retried and a backoff ends at once.

    Raises:
        EmptySourceError: no items (:func:`empty_source` says why).
        OSError, UnsafeKeyError, ...: a permanent error, or a transient one after ``retries``
            (or once ``stop`` is set).
    """
    stop = stop or threading.Event()
    for attempt in range(retries + 1):
        objects = _Counted(store.list())
        try:
            catalog = Catalog.from_listing(objects, items)
        except Exception as exc:
            if not is_transient(exc) or attempt == retries or stop.is_set():
                raise
            delay = backoff_delay(attempt, backoff, backoff_max)
            log.warning("listing %s failed, retry %d/%d in %.2fs: %s", source or store.url, attempt + 1, retries, delay, exc)
            if stop.wait(delay):  # a backoff in the opening thread; Ctrl-C interrupts it, and so does a close
                raise
        else:
            if not catalog:
                raise empty_source(source or store.url, items, objects.n)
            return catalog
    raise AssertionError("unreachable")


class _Counted:
    """The objects of a listing, counted as they pass (``n``)."""

    def __init__(self, objects: Iterable[ObjectInfo]) -> None:
        self._objects, self.n = objects, 0

    def __iter__(self) -> Iterator[ObjectInfo]:
        for obj in self._objects:
            self.n += 1
            yield obj


def obtain_catalog(
    cfg: PipelineConfig, store: Store, cache: Cache, stop: threading.Event | None = None
) -> tuple[Catalog, str, bool]:
    """The catalog of this pass: read from ``cfg.manifest``; else the listing an earlier owner of
    ``cache`` saved (``resume`` without ``relist``); else a new listing (saved with ``resume``;
    ``stop``: see :func:`list_source`).

    Returns:
        ``(catalog, digest, from_manifest)``.

    Raises:
        ConfigError: a manifest of another source or items mode, or unreadable.
        EmptySourceError: no items.
    """
    if cfg.manifest is not None:
        manifest = read_manifest(cfg.manifest, cfg.storage_options)
        check_manifest(manifest, cfg.source, cfg.items)
        catalog, digest, from_manifest = manifest.catalog, manifest.digest, True
    else:
        saved = cache.saved_catalog(cfg.source, cfg.items) if cfg.resume and not cfg.relist else None
        if saved is None:
            saved = list_source(store, cfg.items, cfg.retries, cfg.retry_backoff, cfg.retry_backoff_max, cfg.source, stop)
            if cfg.resume:
                cache.save_catalog(cfg.source, cfg.items, saved)
        catalog, digest, from_manifest = saved, saved.digest(), False
    if not catalog:  # a manifest's or a saved listing's (a new listing raised already)
        raise EmptySourceError(f"no items under {cfg.source!r}: found no {cfg.items} with objects")
    return catalog, digest, from_manifest


def fitting_items(catalog: Catalog, capacity: int, occupied: int) -> tuple[array[int] | None, list[OversizeError]]:
    """Which items fit beside ``occupied`` bytes (foreign files and the state budget) under
    ``capacity``: ``(None, [])`` when all do (no second index is kept), else the positions that
    fit, in order, and an :class:`OversizeError` for each that does not."""
    sizes: Sequence[int] = catalog.sizes
    limit = capacity - occupied
    if max(sizes) <= limit:
        return None, []
    fitting: array[int] = array("q")
    too_large: list[OversizeError] = []
    for i, size in enumerate(sizes):
        if size <= limit:
            fitting.append(i)
        else:
            too_large.append(OversizeError(catalog.name(i), size, capacity, occupied))
    return fitting, too_large


def make_plan(cfg: PipelineConfig, sizes: Sequence[int]) -> Plan:
    """The plan of ``cfg``'s options (epochs, shuffle, seed, shares, partition, equal steps) over ``sizes``."""
    return Plan(
        sizes,
        epochs=cfg.epochs,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        rank=cfg.rank,
        world_size=cfg.world_size,
        worker=cfg.worker,
        num_workers=cfg.num_workers,
        balance=cfg.balance,
        partition=cfg.partition,
        equal_steps=cfg.equal_steps,
    )
