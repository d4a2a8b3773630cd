"""Where a pass's catalog comes from, and which of its items it can plan: the part of opening a
pipeline that is about the data, not about threads.

- :func:`obtain_catalog`: a manifest, or the listing an earlier owner of the cache saved
  (``resume``), or a new listing (:func:`cachepipe.listing.list_source`, with retries); with
  its digest;
- :func:`fitting_items`: which items can ever fit beside the cache's foreign bytes and state
  budget (pure);
- :func:`make_plan`: the :class:`~cachepipe.plan.Plan` of the pipeline's options over them.

:func:`~cachepipe.listing.list_source` and :func:`~cachepipe.listing.empty_source` live in
:mod:`cachepipe.listing` (a manifest's ``cachepipe index`` lists with them too, and this module
reads manifests); they are importable from here as before.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .catalog import Catalog
from .config import PipelineConfig
from .errors import EmptySourceError, OversizeError
from .listing import empty_source, list_source
from .manifest import check_manifest, read_manifest
from .plan import Plan
from .stores import Store

if TYPE_CHECKING:
    from .cache import Cache

__all__ = ["empty_source", "fitting_items", "list_source", "make_plan", "obtain_catalog"]


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


def fitting_items(
    catalog: Catalog, capacity: int, occupied: int, block: int = 0
) -> tuple[array[int] | None, list[OversizeError]]:
    """Which items fit beside ``occupied`` bytes (foreign files and the state budget) under
    ``capacity``, each charged what it takes on a filesystem of ``block`` -byte blocks
    (:meth:`~cachepipe.catalog.Catalog.charge`; 0: its size): ``(None, [])`` when all do (no
    second index is kept), else the positions that fit, in order, and an :class:`OversizeError`
    for each that does not."""
    limit = capacity - occupied
    over = dict(catalog.over_limit(limit, block))
    if not over:
        return None, []
    sizes = catalog.sizes
    fitting = array("q", (i for i in range(len(sizes)) if i not in over))
    too_large = [
        OversizeError(catalog.name(i), sizes[i], capacity, occupied, taken=charge, block=block) for i, charge in over.items()
    ]
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
