"""The pass of a :class:`~cachepipe.pipeline.Pipeline`: its catalog, its plan, the fetch order
given to the fetcher, and the resume point that consumed steps move.

:class:`_Pass` is the part of :class:`~cachepipe.pipeline.Pipeline` (its base class, not used
alone) that runs at :meth:`~cachepipe.pipeline.Pipeline.open` and in the producer thread:

- which catalog (:func:`~cachepipe.sourcing.obtain_catalog`, or a listing that streams:
  :meth:`_Pass._streams`), which of its items fit (:meth:`_Pass._fitting`), and the plan over
  them, recovered from the cache's journal or from a state loaded (:meth:`_Pass._catalog`);
- the fetch order: steps given their sequence numbers in runs of :data:`PLAN_RUN`
  (:meth:`_Pass._steps`, :meth:`_Pass._stream_steps`);
- the resume point (the plan's :class:`~cachepipe.plan.Frontier`): a step is in flight from
  its issue until consumed (acknowledged, or failed and reported), and the cache journals the
  position once every step before it is consumed (:meth:`_Pass._consume`); a resume must match
  the plan's key (:func:`_plan_key`).

It is a base class rather than an object of its own because :class:`~cachepipe.node.NodePipeline`
replaces its catalog step (:meth:`_Pass._catalog`) and reads the same state; the attributes it
shares with :class:`~cachepipe.pipeline.Pipeline` are declared below. The public methods stay on
:class:`~cachepipe.pipeline.Pipeline`, the front-end.
"""

from __future__ import annotations

import json
import logging
import threading
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from .backoff import backoff_delay
from .blocks import round_up
from .broker import Broker
from .cache import Cache
from .catalog import Catalog, Item, Names
from .config import PipelineConfig
from .delivered import _Held, _held
from .errors import ConfigError, EmptySourceError, OversizeError, UnsafeKeyError
from .fetcher import Planned
from .listing import StreamingListing, empty_source
from .plan import Cursor, Frontier, GrowingPlan, Plan, Step, default_rank_world
from .plan import tick as plan_tick
from .retention import PlanFuture, make_policy
from .sourcing import fitting_items, make_plan, obtain_catalog
from .stores import Store

__all__ = ["PLAN_RUN"]

log = logging.getLogger("cachepipe")

PLAN_RUN = 64
"""The most steps the producer is given at once (see :class:`cachepipe.fetcher.Fetcher`): it
starts those that need no wait together, a round or two of each lock for them."""


def _log_oversize_skipped(error: OversizeError) -> None:
    """Log an item skipped as larger than the capacity (``on_oversize="skip"``), without the
    error's advice to pass that option."""
    log.warning("skipping item %r (on_oversize='skip'): %s", error.item, error.reason)


def _unsafe_refused(item: str, error: UnsafeKeyError) -> UnsafeKeyError:
    """The error that refuses a listing with an item whose key cannot be stored safely
    (``on_error="raise"``), saying how to read the rest."""
    advice = (
        f"item {item!r} cannot be stored in the cache (nothing of it is written); on_error='skip' skips it in "
        "its turn (logged, counted in items_skipped) and reads the other items"
    )
    return UnsafeKeyError(error.key, error.reason, advice)


class _Pass:
    """The pass of a pipeline (see the module notes): :class:`~cachepipe.pipeline.Pipeline`'s base."""

    # set by Pipeline.__init__ and open()
    config: PipelineConfig
    _cache: Cache
    _broker: Broker[str]
    _closing: threading.Event
    _bar: Any
    _counts: dict[str, int]
    _counts_lock: threading.Lock
    # the pass's own, set by Pipeline.__init__ (see there) and by the catalog step
    _plan_lock: threading.Lock
    _inflight: dict[int, _Held]
    _listing: StreamingListing | None
    _start_state: dict[str, Any] | None
    _catalog_digest: str | None
    _resumed_complete: bool
    _future: PlanFuture | None
    _plan: Plan | GrowingPlan
    _frontier: Frontier
    _catalog_items: Catalog
    _eligible: array[int] | None
    _largest: tuple[int, int] | None = None  # see _largest_planned
    _largest_streamed: list[int] = [0, 0]  # noqa: RUF012 - replaced, never changed, by _stream (see there)
    _total_steps: int | None
    _listed: int
    _listed_bytes: int
    _too_large: list[OversizeError]  # the items _fitting found too large (left out of the plan, planning alone)

    def _streams(self, cache: Cache) -> bool:
        """Whether the listing can stream: a plain pass in listing order that needs neither the
        whole catalog up front (shuffle, shares, retention, a resume point) nor its names to
        decide which leftovers of an earlier owner to keep."""
        cfg = self.config
        return (
            cfg.epochs == 1
            and not cfg.shuffle
            and not self._shares_catalog()
            and cfg.retain == "none"
            and not cfg.resume
            and self._start_state is None
            and cfg.manifest is None
            and not cache.has_leftovers()
        )

    def _share_text(self) -> str:
        """What share of the plan this pipeline reads, for the open's log line ("" for all of it):
        a rank taken from the environment (RANK/WORLD_SIZE, torch.distributed) is otherwise unseen."""
        plan = getattr(self, "_plan", None)  # a NodePipeline plans per lane, and keeps none
        if not isinstance(plan, Plan) or plan.world_size * plan.num_workers == 1:  # a streamed plan is all of it
            return ""
        whence = "" if self.config.rank is not None else " (from RANK/WORLD_SIZE or torch.distributed)"
        worker = f", worker {plan.worker} of {plan.num_workers}" if plan.num_workers > 1 else ""
        return f"; this process reads the share of rank {plan.rank} of {plan.world_size}{whence}{worker}"

    def _shares_catalog(self) -> bool:
        """Whether other processes plan over this catalog too (ranks, DataLoader workers), each
        taking its share of one plan."""
        cfg = self.config
        world = cfg.world_size if cfg.rank is not None else default_rank_world()[1]
        return world != 1 or cfg.num_workers > 1

    def _catalog(self, store: Store, cache: Cache) -> Iterator[list[Planned]]:
        """List (or load the saved listing), recover the cache, build the plan; return the fetch order."""
        cfg = self.config
        self._future = None
        if self._streams(cache):
            return self._stream(store, cache)
        catalog, sizes, eligible, from_manifest = self._fitting(store, cache)
        plan = make_plan(cfg, sizes)
        # with a manifest, a resume must also be of the same manifest
        key = _plan_key(plan, cfg, self._catalog_digest if from_manifest else None)
        # an item on disk as listed has not been through prepare/unpack: downloaded again (those that have never match)
        try:
            cursor, acked = cache.recover(catalog, resume=cfg.resume, plan=key, reusable=not cfg.prepares)
        except ConfigError as exc:
            if eligible is None or len(eligible) == len(catalog):
                raise
            raise ConfigError(f"{exc}. {_left_out(self._too_large, 'the listing')}") from exc
        if self._start_state is not None:
            saved = self._start_state.get("catalog_digest")
            if saved is not None and saved != self._catalog_digest:
                raise ConfigError(
                    f"state was saved with catalog_digest={saved!r}, this pipeline's catalog has "
                    f"catalog_digest={self._catalog_digest!r}: cannot resume over other data"
                )
            try:
                plan.load_state_dict(self._start_state)  # an explicit position wins over the journal's
            except ValueError as exc:
                if eligible is None or self._start_state.get("n_items") != len(catalog):
                    raise
                why = _left_out(self._too_large, "the state's plan")
                raise ConfigError(f"{exc}: {why}") from exc
            cursor, acked = plan.start, set()
        elif cfg.start_epoch and tuple(cursor) == (0, 0) and not acked:  # nothing resumed
            cursor = plan.start = plan.normalise(Cursor(cfg.start_epoch, 0))
        self._check_limit(catalog, eligible, cache)
        self._plan = plan
        self._frontier = Frontier(plan, Cursor(*cursor))
        self._catalog_items, self._eligible = catalog, eligible
        self._largest = None
        if cfg.retain == "auto":
            names = Names(catalog, eligible)
            # the steps acknowledged beyond the cursor are skipped (_steps): no item's next use
            self._future = PlanFuture(plan, horizon=2, unread=_unread(names, acked))
            charges = _charges(catalog, eligible, cache.block)
            policy = make_policy("auto", charges, self._future, reserve=_reserve(cache, cfg, charges))
            cache.use_retention(policy, names, plan_tick(*cursor))
        before = _steps_before(plan, cursor)
        self._total_steps = None if cfg.epochs is None else sum(len(plan.share(e)) for e in range(cfg.epochs)) - before
        # every step left acknowledged already: at the end, or short of it where the last acks
        # were journaled beyond the cursor (a process killed before it closed)
        self._resumed_complete = (before > 0 or bool(acked)) and self._total_steps is not None and self._total_steps <= len(acked)
        return self._steps(plan, Cursor(*cursor), acked)

    def _fitting(self, store: Store, cache: Cache) -> tuple[Catalog, array[int], array[int] | None, bool]:
        """The catalog (from the manifest, a saved listing or a listing), and the sizes of the
        items that fit under the capacity beside what the cache holds otherwise: ``(catalog,
        sizes, eligible, from_manifest)``, where plan item ``i`` is catalog item ``eligible[i]``
        (``eligible`` None: every item is planned, no second list is kept).

        An item that does not fit is left out of the plan only when this process plans over the
        catalog alone. When other processes take shares of the same plan (ranks, DataLoader
        workers), every item is planned, and one over this cache's limit is skipped in its turn
        (``on_oversize="skip"``): what fits depends on each process's foreign files and, with a
        capacity given as a share of the disk, on the disk's free space at its open, and plans
        over different items would deal the items differently, some to two processes and some to
        none."""
        cfg = self.config
        catalog, self._catalog_digest, from_manifest = obtain_catalog(cfg, store, cache, self._closing)
        unsafe = catalog.unsafe
        if unsafe:  # in every process's plan, in its place: refused by the fetcher in its turn
            first = next(iter(unsafe))
            if cfg.on_error == "raise":
                raise _unsafe_refused(catalog.name(first), unsafe[first])
            log.warning(
                "%d item(s) under %s cannot be stored in the cache, and will be skipped in their turn "
                "(on_error='skip'); the first, %r: %s",
                len(unsafe),
                cfg.source,
                catalog.name(first),
                unsafe[first],
            )
        sizes = catalog.sizes
        self._listed = len(catalog)
        self._listed_bytes = sum(sizes)
        # recover() reserves the journal's budget too, and measures the state files: told here as it
        # will find them (a pass's journal naming no items), not one block for them all (an item in
        # the three blocks between was planned, then skipped in its turn)
        occupied = cache.foreign + round_up(cache.journal_budget(catalog), cache.block) + cache.state_before_recover()
        eligible, too_large = fitting_items(catalog, cache.capacity, occupied, cache.block)
        self._too_large = too_large
        if too_large and cfg.on_oversize == "raise":
            raise too_large[0]
        if eligible is not None and not eligible:
            raise EmptySourceError(f"no items under {cfg.source!r}: found no {cfg.items} smaller than the capacity")
        if self._shares_catalog():
            return catalog, sizes, None, from_manifest
        for error in too_large:
            _log_oversize_skipped(error)
            self._counts["skipped"] += 1
        return catalog, sizes if eligible is None else array("q", (sizes[i] for i in eligible)), eligible, from_manifest

    def _check_limit(self, catalog: Catalog, eligible: array[int] | None, cache: Cache) -> None:
        """With ``on_oversize="raise"``, raises :class:`OversizeError`
        for the first item that takes more than the cache can hold once recovered (state files
        and foreign files counted; each item charged its files in whole blocks and its folders,
        :meth:`Cache.charge`). With ``"skip"``, such an item (left in by :meth:`_fitting`'s
        estimate, made before the state files were measured) is skipped in its turn, when its
        room is reserved (:meth:`Cache.acquire` raises for it)."""
        if self.config.on_oversize == "raise":
            planned = range(len(catalog)) if eligible is None else eligible  # _fitting raised for the others
            for i, charge in catalog.over_limit(cache.limit, cache.block):
                if i in planned:
                    item = catalog[i]
                    raise OversizeError(
                        item.name, item.size, cache.capacity, cache.capacity - cache.limit, taken=charge, block=cache.block
                    )

    def _largest_planned(self) -> tuple[int, int]:
        """``(charge, listed size)`` of the planned item that takes the most room in the cache
        (:meth:`Cache.charge`), measured once a pass: a walk of every item's files. A streamed
        listing's plan keeps no catalog: the largest it admitted so far."""
        catalog: Catalog | None = getattr(self, "_catalog_items", None)
        if catalog is None:
            charge, size = self._largest_streamed
            return charge, size
        if self._largest is None:
            block, sizes = self._cache.block, catalog.sizes
            planned = range(len(catalog)) if self._eligible is None else self._eligible
            self._largest = max(((catalog.charge(i, block), sizes[i]) for i in planned), default=(0, 0))
        return self._largest

    def _steps(self, plan: Plan, cursor: Cursor, acked: set[tuple[int, str]]) -> Iterator[list[Planned]]:
        """The fetch order, run in the producer thread, in runs of up to :data:`PLAN_RUN` steps
        (issued in one round of the plan's lock): each step gets the next sequence number.
        Steps acknowledged before a restart are consumed at once, not fetched."""
        prepared = -1
        for run in _in_runs(plan.steps(cursor), PLAN_RUN):
            epochs = {step.epoch for step in run} - {prepared}
            if self._future is not None:
                for epoch in sorted(epochs):
                    self._future.prepare(epoch)  # next-use lookups, computed outside the cache's lock
                    prepared = epoch
            catalog, eligible = self._catalog_items, self._eligible
            items = [catalog[step.item if eligible is None else eligible[step.item]] for step in run]
            seqs = self._issue(run, items)
            planned: list[Planned] = []
            for seq, step, item in zip(seqs, run, items, strict=True):
                if (step.epoch, item.name) in acked:
                    self._broker.skip(seq)
                    self._consume([seq])
                else:
                    planned.append((seq, item, step.tick))
            if planned:
                yield planned

    def _issue(self, steps: list[Step], items: list[Item]) -> range:
        """Give ``steps`` (of ``items``) their sequence numbers, in one round of the plan's lock;
        they are in flight until consumed."""
        held = [_held(item) for item in items]  # outside the lock, which the consumers' acks take
        with self._plan_lock:
            seqs = self._frontier.issue_many(steps)
            self._inflight.update(zip(seqs, held, strict=True))
        return seqs

    def _stream(self, store: Store, cache: Cache) -> Iterator[list[Planned]]:
        """Start the streaming listing (see :mod:`cachepipe.listing`); return the fetch order.

        Waits for the first page: a listing error, an oversize item (``on_oversize="raise"``) or
        an item with an unsafe key (``on_error="raise"``) in it is raised here; later ones reach
        the consumer in their turn.
        """
        cfg = self.config
        cache.recover(Catalog(), resume=False)  # nothing of an earlier owner's to keep (see _streams)
        plan = GrowingPlan(seed=cfg.seed, balance=cfg.balance, partition=cfg.partition, equal_steps=cfg.equal_steps)
        self._plan, self._frontier = plan, Frontier(plan)
        self._total_steps = None

        largest = [0, 0]  # the planned item that takes the most room: its charge and listed size
        self._largest_streamed = largest

        def admit(run: list[Item]) -> list[bool]:  # in the listing thread, in listing order
            if cfg.on_error == "raise":
                bad = next((k for k, item in enumerate(run) if item.unsafe is not None), None)
                if bad == 0:
                    raise _unsafe_refused(run[0].name, run[0].unsafe)  # type: ignore[arg-type]  # not None: bad
                if bad is not None:
                    run = run[:bad]  # the unsafe item comes first in the next call (the rest is given again)
            keeps: list[bool] = []
            # each item's charge: what it takes on the disk, as the cache reserves it (Cache.charge)
            names, charges = [item.name for item in run], [cache.charge(item) for item in run]
            limits = cache.note_listed(names, charges, [not item.tagged for item in run]) or [cache.limit]  # none: closed
            for item, charge, limit in zip(run, charges, limits, strict=False):  # the first len(limits) items
                if charge > limit:
                    error = OversizeError(
                        item.name, item.size, cache.capacity, cache.capacity - limit, taken=charge, block=cache.block
                    )
                    if cfg.on_oversize == "raise":
                        raise error  # the first item of the run: note_listed stops before an oversize one
                    _log_oversize_skipped(error)
                    self._count("skipped")
                keeps.append(charge <= limit)
                if charge <= limit and charge > largest[0]:
                    largest[:] = charge, item.size
            with self._plan_lock:
                plan.extend([item.size for item, keep in zip(run, keeps, strict=False) if keep])
            return keeps

        def complete() -> None:  # in the listing thread, once it listed everything
            with self._plan_lock:
                full = plan.complete()
            cache.set_plan(_plan_key(full, cfg))
            self._total_steps = full.n_items
            if self._bar is not None:
                self._bar.total = full.n_items
                self._bar.refresh()

        listing = StreamingListing(
            store, cfg.items, admit, complete, cfg.retries, lambda n: backoff_delay(n, cfg.retry_backoff, cfg.retry_backoff_max)
        )
        self._listing = listing
        listing.start()
        listing.wait_first_page()
        if listing.done and plan.n_items == 0:
            raise empty_source(cfg.source, cfg.items, listing.objects, listing.listed, store)
        return self._stream_steps(listing)

    def _stream_steps(self, listing: StreamingListing) -> Iterator[list[Planned]]:
        """The fetch order of a streaming listing, run in the producer thread: the items listed
        and not yet planned, up to :data:`PLAN_RUN` at a time (issued in one round of the plan's
        lock)."""
        index = 0
        while True:
            items = listing.take_many(PLAN_RUN)
            if not items:
                break
            indices = range(index, index + len(items))
            index += len(items)
            seqs = self._issue([Step(0, i, i) for i in indices], items)
            yield list(zip(seqs, items, indices, strict=True))  # epoch 0: a step's tick is its index
        if listing.stopped:
            return
        if index == 0:
            raise empty_source(self.config.source, self.config.items, listing.objects, listing.listed)

    def _consume(self, seqs: Sequence[int]) -> None:
        """Steps are done (acknowledged, or failed and reported): move the resume point."""
        with self._plan_lock:
            before = self._frontier.position
            for seq in seqs:
                self._inflight.pop(seq, None)
            self._frontier.consume(*seqs)
            after = self._frontier.position
        if after != before:
            self._cache.advance(after.epoch, after.index)

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] += 1


def _charges(catalog: Catalog, eligible: array[int] | None, block: int) -> array[int]:
    """What each planned item takes in the cache (:meth:`Cache.charge`), by plan position: the
    retention policy's sizes, in the ledger's bytes (its victims must free what a download
    waits for). A walk of every item's files (``retain="auto"`` only)."""
    planned = range(len(catalog)) if eligible is None else eligible
    return array("q", (catalog.charge(i, block) for i in planned))


def _reserve(cache: Cache, cfg: PipelineConfig, charges: array[int]) -> int:
    """The bytes ``retain="auto"`` keeps for the downloads ahead (the policy's ``reserve``):
    room for ``2 * large_requests`` (at least 16) of the largest planned item, a quarter of the
    cache at most; in the ledger's bytes, as the policy's sizes (``charges``) and the pinned
    bytes it is held against are (reckoned from the largest listed size, it kept room for a
    fraction of that many items of small files)."""
    return min(cache.limit // 4, max(2 * cfg.large_requests, 16) * max(charges, default=0))


def _unread(names: Names, acked: set[tuple[int, str]]) -> list[tuple[int, int]]:
    """The steps acknowledged before a restart, ``(epoch, name)``, as ``(epoch, plan item)``:
    consumed without a read (see :class:`~cachepipe.retention.PlanFuture`)."""
    steps = list(acked)
    found = names.find_many([name for _epoch, name in steps])
    return [(epoch, item) for (epoch, _name), item in zip(steps, found, strict=True) if item >= 0]


def _in_runs(steps: Iterator[Step], size: int) -> Iterator[list[Step]]:
    """``steps`` in lists of up to ``size``; if ``steps`` raises, the steps it gave before the
    error first (their items are delivered before it), then the error."""
    run: list[Step] = []
    try:
        for step in steps:
            run.append(step)
            if len(run) == size:
                yield run
                run = []
    except Exception:
        if run:
            yield run
        raise
    if run:
        yield run


def _plan_key(plan: Plan, cfg: PipelineConfig, catalog_digest: str | None = None) -> str:
    """The plan's configuration (its position excluded), the source and the items mode it was
    made of, and ``catalog_digest`` if given, as JSON: what a resume must match (an item count
    and sizes alone match another source's listing of items of the same sizes)."""
    key = {k: v for k, v in plan.state_dict().items() if k not in ("epoch", "index")}
    key["source"], key["items"] = cfg.source, cfg.items
    if catalog_digest is not None:
        key["catalog_digest"] = catalog_digest
    return json.dumps(key, sort_keys=True)


def _steps_before(plan: Plan, cursor: tuple[int, int]) -> int:
    """How many of this share's steps come before ``cursor`` (for the progress bar's total)."""
    epoch, index = cursor
    return sum(len(plan.share(e)) for e in range(epoch)) + index


def _left_out(too_large: list[OversizeError], whose: str) -> str:
    """Why a plan without the items of ``too_large`` (those that do not fit the capacity, as
    :func:`~.sourcing.fitting_items` found them) may not be the plan that a state loaded or a
    pass kept in the cache continues, and what to do; ``whose``: where the items left out are
    (the state's plan, or the listing). Names the one that takes the most room with its size as
    listed and what it takes in whole blocks, which decided it."""
    largest = max(too_large, key=lambda error: error.taken)
    return (
        f"{len(too_large)} item(s) of {whose} do not fit this cache and were left out of this one "
        f"(on_oversize='skip'): the largest, {largest.item!r}, is {largest.reason}; resume with a capacity that holds them"
    )
