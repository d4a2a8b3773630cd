"""The cache's durable state: what is published, acknowledged and consumed, in memory and in the
journal that makes it durable (the file format is in :mod:`cachepipe.state`).

Invariant: memory holds only what is journaled, or what recovery finds without its event.
Every change appends its event first (an append that fails raises and changes nothing), then
updates memory, then compacts if the journal outgrew half its budget; a compaction is rebuilt
from memory, so it never loses an event, and replaces the file atomically. Two events whose
loss recovery tolerates cost no write of their own: a publish record ("P": its intent "I" is
durable, and recovery checks the files) and a position ("C": the acks behind it stand for it)
are deferred, written in front of the next event (:meth:`cachepipe.state.Journal.defer`) or at
:meth:`Record.close`. A drop record ("D", after the files are gone) is logged, not raised, when
the disk is full.

Not thread-safe by itself: the cache holds its lock around every call.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from pathlib import Path

from .. import state
from ..plan import tick as plan_tick

__all__ = ["Record"]

log = logging.getLogger("cachepipe.cache")


class Record:
    """The journaled state of one cache directory.

    Attributes:
        published: item name -> bytes reserved for it, for every item on disk under its name.
        versions: item name -> its version (:attr:`cachepipe.catalog.Item.version`), for the items
            published or being published whose listing gave one.
        acked: ``(epoch, name)`` acknowledged at or after the position.
        cursor: ``(epoch, index)``: every step of the plan before it is consumed.
        budget: bytes the journal may take (compaction at half of it keeps it under).
    """

    def __init__(self, path: Path) -> None:
        self.journal = state.Journal(path)
        self.pass_no = 0
        self.published: dict[str, int] = {}
        self.versions: dict[str, str] = {}
        self.acked: set[tuple[int, str]] = set()
        self.cursor = (0, 0)
        self.plan = ""
        self.budget = 0
        self._deleting: set[str] = set()  # no longer published, files not yet moved away: journaled as published
        self._intents: set[str] = set()  # intents to publish journaled, renames under way: kept by a compaction
        self._acked_ticks: list[tuple[int, int, str]] = []  # heap of (tick, epoch, name) of acked

    def start(self, pass_no: int, cursor: tuple[int, int], acked: set[tuple[int, str]], plan: str) -> None:
        """Begin recording a pass (after recovery set :attr:`published`): rewrite the journal to it."""
        self.pass_no, self.cursor, self.acked, self.plan = pass_no, cursor, set(acked), plan
        self._acked_ticks = []
        self.compact()

    def compact(self) -> None:
        """Rewrite the journal from memory (atomically; on failure the old file stays in use)."""
        published = set(self.published) | self._deleting
        replay = state.Replay(self.pass_no, published, set(self._intents), set(self.acked), self.cursor, self.plan, self.versions)
        self.journal.rewrite(replay)

    def _compact_if_due(self) -> None:
        if self.journal.size > self.budget // 2:
            try:
                self.compact()
            except OSError as exc:
                log.warning("could not compact the journal %s (%s); it keeps growing until this succeeds", self.journal.path, exc)

    def set_plan(self, plan: str) -> None:
        """Record the plan's configuration (JSON), for checking a later resume against it."""
        self.plan = plan
        self.compact()

    # ---- publish ---------------------------------------------------------------------
    def publishing_many(self, items: Sequence[tuple[str, str | None]]) -> None:
        """Journal the intent to publish each of ``items``, ``(name, version or None)``, before
        their renames, by one write; until each is resolved (:meth:`published_many`,
        :meth:`dropped`, :meth:`not_renamed`), a compaction keeps its intent, so that an item
        renamed after a compaction is still ours. Raises OSError (nothing written)."""
        self.journal.append_many([("I", name) if version is None else ("J", f"{version} {name}") for name, version in items])
        for name, version in items:
            self._intents.add(name)
            if version is None:
                self.versions.pop(name, None)
            else:
                self.versions[name] = version

    def not_renamed(self, name: str) -> None:
        """The rename of ``name`` failed: nothing was published (its intent line stays until the
        next compaction; recovery skips an intent with nothing in its place)."""
        self._intents.discard(name)
        self.versions.pop(name, None)

    def published_many(self, done: Sequence[tuple[str, int]]) -> None:
        """Each ``(name, size)`` was renamed into place holding ``size`` reserved bytes. Their
        records are deferred (written in front of the next event), in one round of the
        journal's lock: the intent lines are durable, and recovery checks the files."""
        self.journal.defer_many("P", [name for name, _size in done])
        for name, size in done:
            self._intents.discard(name)
            self.published[name] = size
        self._compact_if_due()

    # ---- acknowledge -----------------------------------------------------------------
    def ack(self, acks: Sequence[tuple[str, int, int]]) -> None:
        """Journal the acks of ``(name, epoch, tick)`` (item ``name`` at the step ``tick`` of
        ``epoch``), all in one write. Raises OSError (nothing changed)."""
        self.journal.append_many([("A", f"{epoch} {name}") for name, epoch, _tick in acks])
        for name, epoch, tick in acks:
            self.acked.add((epoch, name))
            heapq.heappush(self._acked_ticks, (tick, epoch, name))

    def keep(self, name: str) -> bool:
        """Journal that acknowledged ``name`` stays on disk for a later step; False if that could
        not be written (the item must then be deleted: the ack is durable)."""
        try:
            self.journal.append("P", name)
        except OSError as exc:
            log.warning("journal: could not record that %s is kept (%s); deleting it", name, exc)
            return False
        self._compact_if_due()
        return True

    def unpublish_many(self, names: Sequence[str]) -> list[int]:
        """Acknowledged items are to be deleted (their "A" is journaled): forget them; returns
        their bytes, in order."""
        sizes = [self.published.pop(name) for name in names]
        for name in names:
            self.versions.pop(name, None)
        self._compact_if_due()
        return sizes

    # ---- drop ------------------------------------------------------------------------
    def dropping(self, name: str) -> int:
        """An unacknowledged item is to be deleted: it stays journaled as published until
        :meth:`dropped` (a crash before then finds it whole, or half-deleted in staging).
        Returns its bytes."""
        size = self.published.pop(name)
        self._deleting.add(name)
        return size

    def dropped(self, name: str) -> None:
        """A dropped item's files are moved away, or an intent to publish came to nothing because
        something not ours is in the item's place: journal "D", so that the next open does not
        take what is there for ours (a failure is logged: a name not on disk is skipped by
        recovery; a foreign file under a journaled name is removed unless it matches the listing)."""
        self._deleting.discard(name)
        self._intents.discard(name)
        self.versions.pop(name, None)
        try:
            self.journal.append("D", name)
        except OSError as exc:
            log.warning("journal: could not record that %s was deleted (%s)", name, exc)
        self._compact_if_due()

    def delete_failed(self, name: str) -> None:
        """Files of ``name`` could not be deleted: keep it journaled as published, so that the next
        open finds it ours and removes what is left."""
        self._deleting.add(name)

    # ---- position --------------------------------------------------------------------
    def advance(self, epoch: int, index: int) -> None:
        """Every step before ``(epoch, index)`` is consumed. A position not after the current one
        is ignored (consumers acking in parallel report positions out of order). Its record is
        deferred (written in front of the next event): the acks behind it stand for it until
        then."""
        if (epoch, index) <= self.cursor:
            return
        self.journal.defer("C", f"{epoch} {index}")
        if epoch > self.cursor[0]:  # acks of finished epochs are implied by the position
            self.acked = {a for a in self.acked if a[0] >= epoch}
        self.cursor = (epoch, index)
        ticks, now = self._acked_ticks, plan_tick(epoch, index)
        while ticks and ticks[0][0] < now:  # so are acks of steps before it
            _tick, e, name = heapq.heappop(ticks)
            self.acked.discard((e, name))
        self._compact_if_due()

    def close(self) -> None:
        if self.journal.is_open:
            try:
                self.journal.flush()
            except OSError as exc:
                log.warning("journal: could not write its last records (%s); the intent and ack lines cover them", exc)
        self.journal.close()
