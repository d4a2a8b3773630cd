"""The capacity ledger: what the bytes under a cache directory are accounted to. Pure: no I/O,
no locks (the cache holds its condition variable around every call).

Invariant: ``foreign + overhead + reserved <= capacity`` after every :meth:`Ledger.reserve`; the
bytes on disk are never more than the ledger counts, because space is reserved before a
download starts and released (:meth:`Ledger.reaped`) only after the files are deleted.

- ``foreign``: bytes under the directory that cachepipe does not manage (found at open, or left
  by a deletion that failed); counted, never deleted.
- ``overhead``: the budget of cachepipe's own state files (journal, saved listing).
- ``reserved``: bytes reserved for items: downloading, published, handed out, being deleted.
- ``reaping``: the part of ``reserved`` whose items are being deleted (the room they will free).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["Ledger"]


@dataclass
class Ledger:
    """Bytes by owner under one capacity (all in bytes)."""

    capacity: int = 0
    foreign: int = 0
    overhead: int = 0
    reserved: int = 0
    reaping: int = 0

    @property
    def used(self) -> int:
        """Bytes accounted: foreign + state budget + reserved items."""
        return self.foreign + self.overhead + self.reserved

    @property
    def limit(self) -> int:
        """The largest item that can ever fit: the capacity less foreign bytes and the state budget."""
        return self.capacity - self.foreign - self.overhead

    @property
    def free(self) -> int:
        """Bytes that can be reserved now."""
        return self.capacity - self.used

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes can be reserved now."""
        return self.used + size <= self.capacity

    def reserve(self, size: int) -> None:
        """Count ``size`` bytes as reserved (the caller checked :meth:`fits`, or overcommits knowingly)."""
        self.reserved += size

    def release(self, size: int) -> None:
        """Release a reservation whose files were never written or are already gone."""
        self.reserved -= size

    def reaping_started(self, size: int) -> None:
        """An item of ``size`` reserved bytes is being deleted: its room is on its way."""
        self.reaping += size

    def reaped(self, size: int, left: int) -> None:
        """The deletion of an item of ``size`` reserved bytes ended; ``left`` bytes of it could not
        be deleted and count as foreign until the next open clears them."""
        self.reserved -= size
        self.reaping -= size
        self.foreign += left

    def held(self, change: int, left: int = 0) -> None:
        """Bytes of deleted items still on disk (a file a consumer holds open on NFS), tried again:
        ``change`` more of them count as reserved (not as being deleted: a download waits for
        them, or evicts others, rather than counting on their room; not as foreign: an item is
        not judged too large for them), fewer as they go; ``left`` of them count as foreign."""
        self.reserved += change
        self.foreign += left

    def over_capacity(self) -> bool:
        """Whether the ledger, less the items being deleted, is over the capacity (a capacity
        lowered since the items were reserved)."""
        return self.used - self.reaping > self.capacity

    def room_beside(self, held: int) -> int:
        """The room every reservation but ``held`` bytes of them leaves, once released."""
        return self.capacity - self.foreign - self.overhead - held

    def check_room(self, where: str, overhead: int | None = None) -> None:
        """Raise ConfigError if foreign bytes and ``overhead`` (default: the current state budget)
        leave no room for any item; ``where`` names the cache directory."""
        overhead = self.overhead if overhead is None else overhead
        if self.foreign + overhead >= self.capacity:
            raise ConfigError(
                f"cache_dir {where!r} holds {self.foreign} bytes not managed by cachepipe and needs "
                f"{overhead} bytes for its state, not less than the capacity of {self.capacity} bytes; "
                "empty it or raise the capacity"
            )
