"""The part of DST's listing where one rank's items' keys can be (pure): where its listing
starts (:attr:`DstRange.start_after`) and the key past which it stops (:func:`bounded`), safe
in both orders a store may list in.

The keys of an item ``n`` in DST are exactly those starting with ``n + "/"`` (its outputs and
its marker ``n/.cachepipe-done``; :func:`~cachepipe.map.remote.held_by_item` gives a key to the
longest name holding it, so a rank needs every key under its items' folders, and may read more).
A store lists in key order (S3, OBS, moto, local files) or folder by folder (SeaweedFS: ``/``
below every character, :func:`~cachepipe.grouping.tree_order`, written ``T`` below):

- In key order, the keys starting with ``n/`` are exactly those in ``[n + "/", n + "0")``
  (``"0"`` follows ``"/"``): a key at or above ``n/`` and below ``n0`` agrees with ``n`` on
  its first ``len(n)`` characters, and its next one lies in ``["/", "0")``, so it is ``/``.
- Folder by folder, ``T`` replaces ``/`` with ``\\0\\0`` and ``\\0`` with ``\\0\\1``, each other
  character with itself: a prefix-free code, so ``T(k)`` starts with ``T(n/)`` exactly when
  ``k`` starts with ``n/``, and the images of ``n``'s keys are exactly the strings in
  ``[T(n) + "\\0\\0", T(n) + "\\0\\1")``.

So over a rank's items ``W``, its keys lie below ``key_end = max(n + "0")`` in key order and
below ``tree_end = max(T(n) + "\\0\\1")`` folder by folder, and at or above ``min(n + "/")``,
``min(T(n) + "\\0\\0")`` respectively.

**Stop** (:func:`bounded`). A listing in order O yields keys increasing in O. At a key ``k``
with ``k >= key_end`` in key order, every later key of a listing in key order is above
``key_end``: none is a rank's. Likewise for ``T(k) >= tree_end`` folder by folder. The order
is not known beforehand, but each key tells: one that does not follow the key before it in key
order proves the listing is folder by folder, and vice versa. A listing may stop at ``k`` when
``k`` is past the end of every order still possible (both, until a key rules one out); a
listing in neither order (not a store's) is read to its end.

**Start** (:attr:`DstRange.start_after`). S3 and OBS list the keys after ``s`` in key order;
SeaweedFS 4.48 (measured: ``tests/test_s3_week.py``) lists those whose ``T`` is after
``T(s)``, and when ``s`` is a folder of DST, not those under ``s/`` either (its ``StartAfter``
names the folder ``s``, which it passes whole). ``s`` gives a superset of the rank's keys in
both readings when (1) ``s`` is below ``min(n + "/")`` in key order, (2) ``T(s)`` is below
``min(T(n) + "\\0\\0")``, and (3) no key of the rank starts with ``s + "/"``: ``s`` is neither
an item of ``W`` nor a folder holding one. (A key starting with ``s/`` that is no rank's is
passed over harmlessly.) :func:`dst_range` tries, for the lowest item in either order, its
name with its last character one lower and its proper prefixes, and keeps the highest (in key
order) that meets all three; a key that meets them
is also safe for a store that lists folder by folder but compares ``StartAfter`` by key, or the
reverse. None meets them (e.g. items ``a`` and ``a b``, whose lowest names are one another's
prefix in the two orders, and whose last characters are lowest): the listing starts at DST's
first key.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from ..grouping import tree_order

__all__ = ["DstRange", "bounded", "dst_range"]


@dataclass(frozen=True)
class DstRange:
    """Where a rank's listing of DST starts and ends (see the module notes).

    Attributes:
        start_after: a key below every key of the rank's items in both orders and no folder
            of theirs (list after it where the store takes ``start_after``); None: from DST's
            first key.
        key_end: every key of the rank's items is below it in key order.
        tree_end: every key of the rank's items is below it folder by folder (compared with
            :func:`~cachepipe.grouping.tree_order` of a key).
    """

    start_after: str | None
    key_end: str
    tree_end: str


def dst_range(wanted: Collection[str]) -> DstRange:
    """The :class:`DstRange` of the items named ``wanted`` (at least one)."""
    if not wanted:
        raise ValueError("dst_range: no items")
    key_first = min(wanted, key=lambda n: n + "/")
    tree_first = min(wanted, key=lambda n: tree_order(n) + "\0\0")
    key_low, tree_low = key_first + "/", tree_order(tree_first) + "\0\0"
    folders = set(wanted)  # the items and every folder holding one: (3)
    for name in wanted:
        cut = name.find("/")
        while cut > 0:
            folders.add(name[:cut])
            cut = name.find("/", cut + 1)
    start: str | None = None
    for lowest in (key_first, tree_first):
        for after in _below(lowest):
            if after < key_low and tree_order(after) < tree_low and after not in folders:
                start = after if start is None else max(start, after)
    return DstRange(
        start,
        max(n + "0" for n in wanted),
        max(tree_order(n) + "\0\1" for n in wanted),
    )


def _below(name: str) -> Iterator[str]:
    """Keys just below ``name``'s in both orders, to check: ``name`` with its last character one
    lower (a plain one: not ``/``, a control character or a surrogate), and its proper prefixes."""
    low = chr(ord(name[-1]) - 1)
    if low >= " " and low != "/" and not "\ud800" <= low <= "\udfff":
        yield name[:-1] + low
    for end in range(len(name) - 1, 0, -1):
        yield name[:end]


def bounded(keys: Iterable[str], within: DstRange) -> Iterator[str]:
    """``keys``, as a store lists them, up to the first one past ``within``'s end in every
    order the listing may still be in (see the module notes); that one is not yielded."""
    by_key = by_tree = True  # the keys so far came in key order; folder by folder
    previous, previous_tree = "", ""
    for n, key in enumerate(keys):
        tree = tree_order(key)
        if n:
            by_key = by_key and key > previous
            by_tree = by_tree and tree > previous_tree
        previous, previous_tree = key, tree
        if (by_key or by_tree) and (not by_key or key >= within.key_end) and (not by_tree or tree >= within.tree_end):
            return
        yield key
