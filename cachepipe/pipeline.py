"""``Pipeline``: the in-process front-end over the core (store, catalog, cache, fetcher, broker)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .broker import Broker, Closed, Failed, Lease
from .cache import Cache
from .catalog import Item, group_items
from .config import PipelineConfig
from .errors import EmptySourceError, OversizeError, UnknownItemError, is_transient
from .fetcher import Fetcher, backoff_delay
from .stores import Store, open_store

__all__ = ["Pipeline", "CachedItem", "Stats"]

log = logging.getLogger("cachepipe")


class CachedItem(os.PathLike):
    """A delivered item: usable wherever a path is (``open(item / "text.txt")``, ``os.fspath``).

    Attributes:
        path: the local path (a folder, or a file for single-object items).
        name: the item's name (its path relative to the source prefix and to the cache dir).
        size: total bytes.
        files: relative paths of its files, in key order (``("",)`` for a single file).
        lease: the lease token; ``ack``/``release`` of this object check it, so a consumer whose
            lease expired cannot evict the item from under the next one.
    """

    __slots__ = ("path", "name", "size", "files", "lease")

    def __init__(self, path: Path, item: Item, lease: str = "") -> None:
        self.path = path
        self.name = item.name
        self.size = item.size
        self.files = tuple(f.rel for f in item.files)
        self.lease = lease

    def __fspath__(self) -> str:
        return str(self.path)

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.path / other

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"CachedItem({str(self.path)!r}, size={self.size})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CachedItem):
            return self.path == other.path
        if isinstance(other, (str, os.PathLike)):
            return self.path == Path(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.path)


@dataclass(frozen=True)
class Stats:
    """A snapshot of a pipeline's counters. Sizes in bytes, times in seconds."""

    items_listed: int
    items_ready: int
    items_handed: int  # hand-outs, counting re-deliveries
    items_acked: int
    items_released: int
    items_failed: int
    items_skipped: int
    items_reused: int
    items_redelivered: int
    bytes_listed: int
    bytes_downloaded: int
    bytes_in_cache: int
    capacity: int
    requests: int
    retries: int
    disk_errors: int
    disk_pauses: int
    consumer_wait_seconds: float
    producer_wait_seconds: float


_UNOPENED, _OPEN, _CLOSED = "unopened", "open", "closed"


class Pipeline:
    """Stream the items under ``source`` through a size-capped cache at ``cache_dir``.

    ``for path in pipe`` yields :class:`CachedItem` paths; with ``auto_ack=True`` (default) each is
    evicted when the loop asks for the next. Use it as a context manager so that an exception or a
    ``break`` stops the downloads at once.

    Args:
        source: dataset URL (see :class:`~cachepipe.config.PipelineConfig`).
        cache_dir: cache directory, owned exclusively while open.
        capacity: hard cap on bytes under ``cache_dir``: an int, ``"50GiB"``, ``"1.5GB"``,
            ``"512M"``, ``"1g"`` or ``"80%"`` of free space.
        store: a :class:`~cachepipe.stores.Store` to use instead of opening ``source``
            (for tests and custom backends).
        **options: every other field of :class:`~cachepipe.config.PipelineConfig`.

    Raises:
        ValueError: a malformed option (pydantic's ``ValidationError`` names the field, the value
            and what is accepted).
    """

    def __init__(self, source: str, cache_dir: str | os.PathLike[str], capacity: int | str, *, store: Store | None = None, **options: Any) -> None:
        self.config = PipelineConfig(source=source, cache_dir=Path(cache_dir), capacity=capacity, **options)
        self._store = store
        self._state = _UNOPENED
        self._lock = threading.Lock()
        self._items: dict[str, Item] = {}
        self._counts = {"handed": 0, "acked": 0, "released": 0, "skipped": 0}
        self._bar: Any = None

    def __repr__(self) -> str:
        return f"Pipeline({self.config.source!r}, cache_dir={str(self.config.cache_dir)!r}, state={self._state})"

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> Pipeline:
        """List the source, take the cache, start downloading. Called by ``with`` and ``iter``.

        Raises:
            RuntimeError: the pipeline is already open or closed.
            CacheLockedError: another pipeline owns ``cache_dir``.
            EmptySourceError: nothing to deliver under ``source``.
            OversizeError: an item is larger than the capacity (``on_oversize="raise"``).
            UnsafeKeyError: an object key cannot be mapped safely into the cache.
        """
        with self._lock:
            if self._state != _UNOPENED:
                raise RuntimeError(f"{self!r} cannot be opened again: create a new Pipeline")
            self._state = _CLOSED  # until it is open: a failed open cannot be retried on this object
            cfg = self.config
            store = self._store or open_store(cfg.source, cfg.storage_options)
            cache = Cache(cfg.cache_dir, cfg.capacity)
            broker: Broker[Path] = Broker(ordered=cfg.ordered, lease_timeout=cfg.lease_timeout)
            fetcher: Fetcher | None = None
            try:
                cache.open()
                try:
                    items = self._catalog(store, cache)
                    fetcher = Fetcher(store, cache, broker, items, cfg)
                    if cfg.progress:
                        from tqdm.auto import tqdm

                        self._bar = tqdm(total=len(items), unit="item", desc="cachepipe", dynamic_ncols=True)
                    self._store, self._cache, self._broker, self._fetcher = store, cache, broker, fetcher
                    self._items = {item.name: item for _seq, item in items}
                    self._listed_bytes = sum(item.size for _seq, item in items)
                    self._listed = len(items) + self._counts["skipped"] + self._resumed
                    fetcher.start()
                    self._state = _OPEN
                except BaseException:
                    if fetcher is not None:
                        broker.close()
                        cache.interrupt()
                        fetcher.stop()
                    cache.close()
                    raise
            except BaseException:
                if self._bar is not None:
                    self._bar.close()
                store.close()
                raise
            log.info("opened %s: %d items, %d bytes, capacity %d bytes", cfg.source, len(items), self._listed_bytes, cache.capacity)
        return self

    def _catalog(self, store: Store, cache: Cache) -> list[tuple[int, Item]]:
        cfg = self.config
        listing = cache.saved_catalog(cfg.source, cfg.items) if cfg.resume and not cfg.relist else None
        if listing is None:
            listing = self._list(store)
            if cfg.resume:
                cache.save_catalog(cfg.source, cfg.items, listing)
        acked = cache.recover(listing, resume=cfg.resume)
        planned: list[tuple[int, Item]] = []
        for item in listing:
            if item.size > cache.limit:
                error = OversizeError(item.name, item.size, cache.capacity, cache.capacity - cache.limit)
                if cfg.on_oversize == "raise":
                    raise error
                log.warning("skipping %s", error)
                self._counts["skipped"] += 1
            elif item.name not in acked:
                planned.append((len(planned), item))
        self._resumed = len(acked)
        if not listing or (not planned and not acked):
            what = "items larger than the capacity" if self._counts["skipped"] else f"{cfg.items} with objects"
            raise EmptySourceError(f"no items under {cfg.source!r}: found no {what}")
        return planned

    def _list(self, store: Store) -> list[Item]:
        """List the source into items, retrying transient store errors like downloads are."""
        cfg = self.config
        for attempt in range(cfg.retries + 1):
            try:
                return list(group_items(store.list(), cfg.items))
            except Exception as exc:
                if not is_transient(exc) or attempt == cfg.retries:
                    raise
                delay = backoff_delay(attempt, cfg.retry_backoff, cfg.retry_backoff_max)
                log.warning("listing %s failed, retry %d/%d in %.2fs: %s", cfg.source, attempt + 1, cfg.retries, delay, exc)
                time.sleep(delay)  # a backoff in the opening thread; Ctrl-C interrupts it
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Stop every thread, remove staging files and (unless ``keep_on_close``) published items.

        Idempotent. Consumers blocked in the iterator stop; further use raises ``RuntimeError``.
        """
        with self._lock:
            state, self._state = self._state, _CLOSED
        if state != _OPEN:
            return
        self._broker.close()
        self._cache.interrupt()
        self._fetcher.stop()
        self._cache.close(keep=self.config.keep_on_close)
        self._store.close()
        if self._bar is not None:
            self._bar.close()
        log.info("closed %s", self.config.source)

    def __enter__(self) -> Pipeline:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- consuming -------------------------------------------------------------------
    def __iter__(self) -> Iterator[CachedItem]:
        """Yield items until all are delivered. Opens the pipeline if needed, and then closes it
        when the loop ends (prefer ``with`` so that ``break`` and errors close it at once)."""
        owner = self._state == _UNOPENED
        if owner:
            self.open()
        last: CachedItem | None = None
        try:
            while True:
                if last is not None and self.config.auto_ack:
                    self.ack(last)
                    last = None
                try:
                    last = self.get()
                except RuntimeError:
                    if self._state == _CLOSED:
                        return  # closed by another thread
                    raise
                if last is None:
                    return
                yield last
        finally:
            if last is not None and self.config.auto_ack and self._state == _OPEN:
                self.release(last)  # the loop stopped inside this item: give it back, not evict
            if owner:
                self.close()

    def get(self, timeout: float | None = None) -> CachedItem | None:
        """Take the next item (leased until :meth:`ack` or :meth:`release`); None when all are delivered.

        Blocks up to ``timeout`` seconds (None: no limit). Safe to call from several threads.

        Raises:
            TimeoutError: no item became ready in time.
            ItemFailedError: the next item failed (``on_error="raise"``); the cause is chained.
            RuntimeError: the pipeline is not open.
        """
        self._require_open()
        while True:
            try:
                got = self._broker.take(timeout)
            except Closed:
                raise RuntimeError(f"{self!r} is closed") from None
            if got is None:
                return None
            if isinstance(got, Failed):
                if self.config.on_error == "skip":
                    log.warning("skipping failed item: %s", got.error)
                    self._count("skipped")
                    continue
                raise got.error
            self._count("handed")
            if self._bar is not None:
                self._bar.update(1)
                self._bar.set_postfix(cache=f"{self._cache.used / 2**20:.0f}/{self._cache.capacity / 2**20:.0f}MiB", refresh=False)
            return CachedItem(got.value, self._items[got.name], got.id)

    def ack(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        """Acknowledge a delivered item: delete its files and free its space now.

        Args:
            path: the :class:`CachedItem` (its lease is checked) or its local path.
            lease: the lease token to check when ``path`` is a plain path (optional).

        Raises:
            UnknownItemError: ``path`` is not an item currently handed out (never delivered,
                already acknowledged, released, or its lease expired). Nothing is freed twice.
        """
        name = self._lease(path, "ack", lease).name
        self._cache.evict(name)
        self._count("acked")

    def release(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        """Give a delivered item back: it is handed out again, before any other.

        Raises:
            UnknownItemError: ``path`` is not an item currently handed out (see :meth:`ack`).
        """
        self._lease(path, "release", lease)
        self._count("released")

    def renew(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        """Extend the lease of a delivered item by ``lease_timeout`` (a consumer still at work).

        Raises:
            UnknownItemError: ``path`` is not an item currently handed out (see :meth:`ack`).
        """
        self._lease(path, "renew", lease)

    def _lease(self, path: str | os.PathLike[str], verb: str, lease: str | None) -> Lease[Path]:
        self._require_open()
        if isinstance(path, CachedItem):
            name, lease = path.name, lease or path.lease
        else:
            name = self._name_of(Path(path))
        action = {"ack": self._broker.ack, "release": self._broker.release, "renew": self._broker.renew}[verb]
        try:
            return action(name, lease)
        except KeyError:
            raise UnknownItemError(
                f"cannot {verb} {os.fspath(path)!r}: not an item handed out by this pipeline "
                "(never delivered, already acknowledged or released, or its lease expired)"
            ) from None

    def _name_of(self, path: Path) -> str:
        try:
            return Path(os.path.abspath(path)).relative_to(self._cache.root).as_posix()
        except ValueError:
            return f"<outside the cache: {path}>"

    # ---- visibility ------------------------------------------------------------------
    def stats(self) -> Stats:
        """A snapshot of the counters (see :class:`Stats`)."""
        self._require_open(allow_closed=True)
        c = self._fetcher.counters
        counts = self._broker.counts()
        with self._lock:
            mine = dict(self._counts)
        return Stats(
            items_listed=self._listed,
            items_ready=counts["ready"],
            items_handed=mine["handed"],
            items_acked=mine["acked"],
            items_released=mine["released"],
            items_failed=c.items_failed,
            items_skipped=mine["skipped"],
            items_reused=c.items_adopted,
            items_redelivered=self._broker.redelivered,
            bytes_listed=self._listed_bytes,
            bytes_downloaded=c.bytes_downloaded,
            bytes_in_cache=self._cache.used,
            capacity=self._cache.capacity,
            requests=c.requests,
            retries=c.retries,
            disk_errors=c.disk_errors,
            disk_pauses=c.disk_pauses,
            consumer_wait_seconds=self._broker.wait_seconds,
            producer_wait_seconds=c.producer_wait_seconds,
        )

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _require_open(self, allow_closed: bool = False) -> None:
        if self._state == _OPEN or (allow_closed and self._state == _CLOSED):
            return
        raise RuntimeError(f"{self!r} is {self._state}: " + ("use it inside 'with' or call open()" if self._state == _UNOPENED else "create a new Pipeline"))
