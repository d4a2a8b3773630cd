"""Publishing: a download's staging area, and the atomic publish of a staged item.

Write ahead, then act, then record: the intent is journaled ("I", or "J" with the item's
version), the staged item renamed into place (never over anything in the way), and the result
journaled ("P"; an intent that came to nothing, "D"). Only a complete, verified item is renamed
into place, so no consumer sees a partial one. A staging area that will not be published is
deleted, and its reservation and claim released (:meth:`_Publishing.discard`).

:class:`_Publishing` is a base class of :class:`~.core.Cache` (see :mod:`.acks` for why the cache
is built of parts), above :class:`~.reservation._Reservation`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from ..catalog import Item
from ..fscalls import rename_new
from ..removal import delete_tree
from .eviction import REAP_MIN_BYTES
from .reservation import _Reservation
from .staging import make_folders, verify

__all__: list[str] = []


class _Publishing(_Reservation):
    """Staging and publishing (see the module notes): a base of :class:`~.core.Cache`."""

    # ---- staging and publish ---------------------------------------------------------
    def stage(self, item: Item, part_size: int | None = None) -> str:
        """Create the staging area for ``item``; its path (see :meth:`.staging.Staging.stage`)."""
        return self._staging.stage(item, part_size, self.file_calls)

    def publish(self, staged: str | Path, item: Item, reserved: int | None = None, verified: bool = False) -> str:
        """Verify sizes (unless ``verified``), then atomically rename the staged item into place:
        journal the intent ("I", or "J" with the item's version), rename (never over anything in
        the way), journal the result ("P"; an intent that came to nothing, "D").

        Args:
            reserved: the bytes reserved for it, released at eviction (default: :meth:`charge`, what
                its files take in whole blocks and its folders).

        Returns:
            The item's path, a string (as :meth:`stage`'s).

        Raises:
            VerificationError: a file's size differs from the listing.
            FileExistsError: something not managed by this cache is in the way (at the item's
                path, or a link or a file where a folder above a nested item's path goes).
            OSError: the intent could not be journaled (a full disk), or the rename failed:
                nothing was published.
        """
        if not verified:
            verify(staged, item)
        (got,) = self.publish_many([(staged, item, self.charge(item) if reserved is None else reserved)])
        if isinstance(got, OSError):
            raise got
        return got

    def publish_many(self, staged: Sequence[tuple[str | Path, Item, int]]) -> list[str | OSError]:
        """:meth:`publish` for each ``(staged path, item, bytes reserved)`` whose files are
        verified, under one lock round, the intents journaled by one write.

        Returns, for each in order, its published path or why it was not published
        (``FileExistsError``: something not managed by this cache is in the way, as for
        :meth:`publish`; another
        ``OSError``: the rename failed).

        Raises:
            OSError: the intents could not be journaled (a full disk): nothing was published.
        """
        got: list[str | OSError] = []
        done: list[tuple[str, int]] = []  # (name, bytes reserved) renamed into place
        with self._cond, self._eviction.folders:
            self.record.publishing_many([(item.name, item.version) for _staged, item, _size in staged])
            for path, item, size in staged:
                final = f"{self._root}/{item.name}"
                try:
                    if "/" in item.name:  # a nested single-file item: its folders (never through a link); the
                        make_folders(self._root, item.name)  # lookup may leave this file system: let the lock go
                        rename_new(os.fspath(path), final)
                    else:
                        self.file_calls.rename_new(os.fspath(path), final)  # never over anything in the way
                except FileExistsError as exc:
                    self.record.dropped(item.name)  # its intent withdrawn: what is in the way is not ours
                    # make_folders' error names the folder and what it is; rename_new's, the path that exists
                    in_way = exc.strerror if exc.filename2 is None else f"{exc.filename2} exists"
                    got.append(
                        FileExistsError(
                            errno.EEXIST,
                            f"cannot publish item {item.name!r}: {in_way} and is not managed by cachepipe",
                        )
                    )
                    continue
                except OSError as exc:  # nothing renamed: the next open finds nothing of it in place
                    self.record.not_renamed(item.name)
                    got.append(exc)
                    continue
                done.append((item.name, size))
                if item.size < REAP_MIN_BYTES:
                    self._small[item.name] = None if item.is_file else _flat_names(item)
                self._fresh.add(item.name)
                got.append(final)
            self.record.published_many(done)
        return got

    def first_hand_out(self, name: str) -> bool:
        """Whether this is the first hand-out of published item ``name`` since this owner
        downloaded it: True once, False after (and for items recovered at open, or kept by
        retention after an ack). The daemon's marker watch looks for a stale ``.done`` only in
        the others (:mod:`cachepipe.service.markers`)."""
        try:
            self._fresh.remove(name)  # one atomic step: a name is handed out to one consumer at a time
        except KeyError:
            return False
        return True

    def discard(self, staged: str | Path, size: int, name: str) -> None:
        """Delete a staging area, release its reservation (``size``: what was reserved, the item's
        :meth:`charge`) and the claim on ``name``. Bytes that
        could not be deleted (logged, not raised) count as foreign until the next open clears
        staging, as for an acknowledged item that could not be deleted."""
        self.unreserve(size, name, left=delete_tree(staged, self.block))  # one lock round: never counted twice


def _flat_names(item: Item) -> tuple[str, ...]:
    """The names of a folder item's files, if they are at most 4 (kept in memory while it is
    published: a sample's media and caption, say) and each is directly under it; else ()."""
    names = tuple(f.rel for f in item.files)
    return () if len(names) > 4 or any("/" in name for name in names) else names
