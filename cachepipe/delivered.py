"""What a pipeline hands its consumer: :class:`CachedItem` (a delivered item, usable as a path),
:class:`Skipped` (an item passed over in its turn) and :class:`Stats` (a snapshot of its counters).

:func:`_held` is what a pipeline keeps of an item in flight, from planning until it is consumed:
a tuple of strings and ints, from which a :class:`CachedItem` is made at its hand-out (a
:class:`~cachepipe.pipeline.Pipeline`'s and a :class:`~cachepipe.node.NodePipeline`'s lanes').
The item's path is valid from its hand-out until it is acknowledged: :class:`CachedItem` raises
``FileNotFoundError`` once its pipeline ended its life (``_gone``).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from .catalog import Item
from .items import PathItem

__all__ = ["CachedItem", "Skipped", "Stats"]


_Held = tuple[str, int, tuple[str, ...]]
"""What a hand-out needs of an item in flight: its name, size and files' relative paths."""

_ONE_FILE = ("",)  # the files of every single-file item


def _held(item: Item) -> _Held:
    """What the pipeline keeps of ``item`` from planning until consumed: a tuple of strings and
    ints, which Python's garbage collector stops tracking at its first collection (an
    :class:`Item` stays tracked, with its files: with many items ready, every full collection
    walked them all, and every thread waited)."""
    files = tuple(item.files)
    rels = _ONE_FILE if len(files) == 1 and not files[0].rel else tuple(f.rel for f in files)
    return item.name, item.size, rels


class CachedItem(PathItem):
    """A delivered item: usable wherever a path is (``open(item / "text.txt")``, ``os.fspath``).

    Its files exist from the hand-out until the item is acknowledged, and no longer: read it
    before the loop asks for the next item (``auto_ack``) or before your ``ack``, and copy out
    what must outlive it. After :meth:`Pipeline.ack` of this object, or :meth:`Pipeline.close`
    (unless ``keep_on_close``), ``os.fspath(item)`` and ``item / "x"`` raise
    ``FileNotFoundError`` naming the item and why; a ``str`` or ``Path`` taken from it earlier
    cannot be tracked and simply points at deleted files. A process forked while the item is
    held sees the same files, deleted when the parent acks: the child must be done first.

    Attributes:
        path: the local path (a folder, or a file for single-object items).
        name: the item's name (its path relative to the source prefix and to the cache dir).
        size: total bytes, as listed.
        files: relative paths of its files as listed, in key order (``("",)`` for a single
            file). With ``unpack`` or a ``prepare`` hook, ``size`` and ``files`` still describe
            the listed objects (the archives), not what the item's folder holds after it: list
            the folder for those.
        lease: the lease token; ``ack``/``release`` of this object check it, so a consumer whose
            lease expired cannot evict the item from under the next one.
    """

    __slots__ = ("_first", "_gone", "files", "lease", "name", "size")

    def __init__(self, path: str | os.PathLike[str], item: Item, lease: str = "") -> None:
        super().__init__(path)
        self._set(_held(item), lease)

    @classmethod
    def _of(cls, path: str, held: _Held, lease: str, first: bool = False) -> CachedItem:
        """The item handed out at ``path`` (a string the cache made: not checked again), from
        what the pipeline kept of it (:func:`_held`); ``first``: see :meth:`Cache.first_hand_out`."""
        self = cls.__new__(cls)
        self._local, self._path = path, None
        self.name, self.size, self.files = held
        self.lease, self._gone, self._first = lease, None, first
        return self

    def _set(self, held: _Held, lease: str) -> None:
        self.name, self.size, self.files = held
        self.lease = lease
        self._gone: str | None = None  # why its files are gone, once they are
        self._first = False  # its first hand-out since this pipeline downloaded it (Cache.first_hand_out)

    def __fspath__(self) -> str:
        self._check()
        return self._local

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        self._check()
        return self.path / other

    def _check(self) -> None:
        if self._gone is not None:
            raise FileNotFoundError(
                errno.ENOENT,
                f"item {self.name!r} was {self._gone}: its files are deleted; read an item before it is acknowledged "
                "(auto_ack: before the loop asks for the next) and copy out what must outlive it",
                self._local,
            )

    def __repr__(self) -> str:
        return f"CachedItem({self._local!r}, size={self.size})"

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
    items_skipped: int  # turns passed over; an item left out of the plan at open (planning alone) once
    items_reused: int
    items_redelivered: int
    bytes_listed: int
    bytes_downloaded: int
    bytes_in_cache: int
    capacity: int
    requests: int
    retries: int
    hedges: int  # parts requested a second time because their first request ran late (see fetch_policy.hedge_in)
    disk_errors: int
    disk_pauses: int
    consumer_wait_seconds: float
    producer_wait_seconds: float
    download_threads: int  # threads taking parts now at most: max_concurrency, fewer where requests cost about nothing


@dataclass(frozen=True)
class Skipped:
    """An item passed over in its turn (``on_error``/``on_oversize="skip"``), as
    :meth:`Pipeline.get_or_skipped` reports it: its name, and why (the error, as text)."""

    name: str
    reason: str
