"""An epoch's order and its split into shares (pure code): :func:`permutation` (the seeded
shuffle every rank computes alike), :func:`split` and :func:`split_all` (the walk by bytes or by
count), :func:`equalise` and :func:`deal` (``equal_steps``: the same number of steps per rank).
:class:`cachepipe.plan.Plan` calls them for one (rank, worker); a node's
:class:`cachepipe.lanes.NodePlan` for several plans at once. :mod:`cachepipe.plan` re-exports
every name.

Splitting by bytes, and its bound
---------------------------------
``balance="bytes"`` (default) walks the epoch's permutation and gives each item to the part
(rank, or worker inside a rank) with the fewest bytes so far; ties go to the part with fewer
items, then to the lower part number. Every part runs the same walk, so the parts are disjoint
and together cover the epoch exactly once.

Claim: after every step, for any two parts ``a`` and ``b``, ``bytes(a) - bytes(b) <= s_max``,
the size of the largest item walked so far. Proof by induction: it holds at the start (all 0).
A step gives an item of size ``s <= s_max`` to a part ``m`` with the fewest bytes. Pairs
without ``m`` are unchanged. For any other part ``r``: ``(B_m + s) - B_r <= s <= s_max``
because ``B_m <= B_r``; and ``B_r - (B_m + s) <= B_r - B_m <= s_max`` by induction. QED.

Counts are not balanced by bytes: one rank may get one large item while another gets many
small ones, so ranks can run different numbers of steps in an epoch (a DDP collective then
hangs: see ``equal_steps`` below, or use ``Join``). With equal sizes the tie-break makes the
walk a round-robin, and counts differ by at most one; with any sizes the first ``parts`` items go to distinct parts, so when
there are at least as many items as parts, every rank gets at least one item per epoch.
``balance="count"`` deals the permutation out round-robin instead: counts differ by at most
one, bytes are not bounded.

Equal steps per rank, and their bound
-------------------------------------
DDP needs every rank to run the same number of steps in an epoch. ``equal_steps="pad"`` (like
torch's ``DistributedSampler``) extends the epoch's permutation with its first items again
until its length is a multiple of ``world_size``; ``equal_steps="drop"`` (like its
``drop_last=True``) leaves its last ``n % world_size`` items out of the epoch. The adjusted
permutation is then *dealt* (:func:`deal`) in rounds of ``world_size`` consecutive items, one
item per rank per round: with ``balance="count"`` round-robin, with ``balance="bytes"`` the
round's largest item to the rank with the fewest bytes so far, its second largest to the rank
with the second fewest, and so on (ties: earlier item in the walk; lower rank). Every rank gets
exactly ``len / world_size`` items. ``equal_steps=None`` (default) is the walk above, unchanged.

Claim: after every round, for any two ranks ``a`` and ``b``, ``bytes(a) - bytes(b) <= s_max``,
the size of the largest item dealt so far. Proof by induction: it holds at the start (all 0).
In a round, number the ranks by bytes before it, ``B_1 <= ... <= B_w``, and the round's items by
size, ``s_1 >= ... >= s_w``: rank ``i`` gets ``s_i``. For ``i < j``: ``(B_i + s_i) - (B_j + s_j)
<= s_i - s_j <= s_max`` because ``B_i <= B_j``; and ``(B_j + s_j) - (B_i + s_i) <= B_j - B_i <=
s_max`` because ``s_j <= s_i``, by induction. QED. A last round of fewer items than parts
(inside a rank, below) is the same round with items of size 0 for the rest.

Inside a rank, the DataLoader workers' split is dealt the same way (rounds of ``num_workers``
items, the last one possibly short) when ``equal_steps`` is set: then every rank's workers get
the same counts (``m // k`` or one more, the same number of each on every rank, for a rank's
``m`` items and ``k`` workers), so a DataLoader that batches each worker's items (``batch_size``
> 1) makes the same number of batches on every rank. The greedy walk does not: two ranks of 10
items each could split them 5 + 5 and 6 + 4, which with batches of 4 are 4 and 3 batches.

With ``"pad"``, an item may be read twice in an epoch (by two ranks, or, by bytes, by one);
with ``"drop"``, up to ``world_size - 1`` items are not read in that epoch (each epoch others,
with ``shuffle`` and ``partition="epoch"``).
"""

from __future__ import annotations

import hashlib
import heapq
import random
from array import array
from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["RUN", "deal", "equalise", "permutation", "split", "split_all"]


def _derive(*parts: object) -> int:
    """A stable 64-bit seed from ``parts`` (Python's ``hash()`` is salted per process)."""
    text = ":".join(str(p) for p in ("cachepipe.plan", *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


RUN = 256
"""Iterations of :func:`permutation` and :func:`split_all` between two calls of their ``pause``."""


def permutation(n: int, seed: int, epoch: int, pause: Callable[[], None] | None = None) -> array[int]:
    """The permutation of ``range(n)`` for ``epoch``: a Fisher-Yates shuffle driven by
    ``random.Random(derived seed).random()``, whose output Python guarantees across versions
    (``Random.shuffle`` is not guaranteed). Same ``(n, seed, epoch)``, same permutation.
    ``pause`` is called after every :data:`RUN` swaps (a thread computing in the background
    lets the interpreter's lock go to the threads that wait for it: ``time.sleep(0)``)."""
    order = array("I", range(n))
    rand = random.Random(_derive(seed, epoch)).random  # noqa: S311 - a shuffle order, not a secret
    for top in range(n - 1, 0, -RUN):
        for i in range(top, max(top - RUN, 0), -1):
            j = int(rand() * (i + 1))
            order[i], order[j] = order[j], order[i]
        if pause is not None:
            pause()
    return order


def split(
    order: Sequence[int], sizes: Sequence[int], parts: int, part: int, balance: Literal["bytes", "count"] = "bytes"
) -> array[int]:
    """The subsequence of ``order`` that belongs to ``part`` of ``parts`` (see the module notes)."""
    if parts == 1:
        return array("I", order)
    if balance == "count":
        return array("I", order[part::parts])
    mine = array("I")
    keep = mine.append
    heap = [(0, 0, p) for p in range(parts)]  # (bytes, items, part): min bytes, then count, then part
    replace = heapq.heapreplace
    for x in order:
        b, c, p = heap[0]
        if p == part:
            keep(x)
        replace(heap, (b + sizes[x], c + 1, p))
    return mine


def split_all(
    order: Sequence[int],
    sizes: Sequence[int],
    parts: int,
    balance: Literal["bytes", "count"] = "bytes",
    pause: Callable[[], None] | None = None,
) -> list[array[int]]:
    """Every part's subsequence of ``order`` in one walk: ``split_all(...)[p] == split(..., p)``;
    ``pause`` as for :func:`permutation`."""
    if parts == 1:
        return [array("I", order)]
    if balance == "count":
        return [array("I", order[p::parts]) for p in range(parts)]
    out = [array("I") for _ in range(parts)]
    keep = [a.append for a in out]
    heap = [(0, 0, p) for p in range(parts)]
    replace = heapq.heapreplace
    for start in range(0, len(order), RUN):
        for x in order[start : start + RUN]:
            b, c, p = heap[0]
            keep[p](x)
            replace(heap, (b + sizes[x], c + 1, p))
        if pause is not None:
            pause()
    return out


def equalise(order: Sequence[int], parts: int, equal_steps: Literal["pad", "drop"] | None) -> Sequence[int]:
    """``order`` made a multiple of ``parts`` long (see the module notes): ``"pad"`` extends it
    with its first items again (cycling, if it is shorter than the padding), ``"drop"`` leaves
    out its last ``len(order) % parts`` items; None, or already a multiple: ``order`` itself."""
    n = len(order)
    if equal_steps is None or n % parts == 0 or n == 0:
        return order
    if equal_steps == "drop":
        return order[: n - n % parts]
    out = array("I", order)
    need = parts - n % parts
    while need:
        run = order[:need]
        out.extend(run)
        need -= len(run)
    return out


def deal(
    order: Sequence[int],
    sizes: Sequence[int],
    parts: int,
    balance: Literal["bytes", "count"] = "bytes",
    pause: Callable[[], None] | None = None,
) -> list[array[int]]:
    """Every part's subsequence of ``order``, dealt in rounds of ``parts`` items, one item to each
    part per round (the last round may be short): counts differ by at most one, and not at all
    when ``len(order)`` is a multiple of ``parts``. ``"count"``: round-robin; ``"bytes"``: the
    round's items by size, largest first, to the parts by bytes so far, fewest first (see the
    module notes). ``pause`` as for :func:`permutation`."""
    if parts == 1:
        return [array("I", order)]
    if balance == "count":
        return [array("I", order[p::parts]) for p in range(parts)]
    out = [array("I") for _ in range(parts)]
    keep = [a.append for a in out]
    total = [0] * parts
    ranked = list(range(parts))  # parts by (bytes, part), fewest first
    size = sizes.__getitem__
    for rounds, start in enumerate(range(0, len(order), parts), 1):
        ranked.sort(key=lambda p: (total[p], p))
        # a stable sort: items of one size keep their order in the walk (reverse=True keeps it too)
        for x, p in zip(sorted(order[start : start + parts], key=size, reverse=True), ranked, strict=False):
            keep[p](x)
            total[p] += sizes[x]
        if pause is not None and rounds % RUN == 0:
            pause()
    return out
