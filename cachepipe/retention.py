"""Retention across epochs (``retain="auto"``): which acknowledged items stay on disk, and which
to evict to make room for a download; and how a policy does over an access sequence.

The policies, with the protocol the cache calls them by (the module notes), are in
:mod:`cachepipe.retention_policies`; the future access order they read, as next-use lookups
(:class:`SequenceFuture`, :class:`PlanFuture`), in :mod:`cachepipe.retention_future`. Both are
pure bookkeeping, and every name of theirs is importable from here, as before. This module
replays a sequence through a policy (:func:`run`, :func:`simulate`) and gives the bounds to
compare it with (:func:`belady_min`, :func:`compulsory_bytes`): pure, for tests and benchmarks.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .retention_future import (
    _ITEM_BITS,  # noqa: F401 - importable from here, as before
    _ITEM_MASK,  # noqa: F401 - importable from here, as before
    NEVER,
    EpochShares,  # noqa: F401 - importable from here, as before
    NextUse,
    PlanFuture,
    SequenceFuture,
    is_placeholder,
)
from .retention_policies import (
    _POLICIES,  # noqa: F401 - importable from here, as before
    LRU,
    Belady,
    NoRetention,
    RetentionPolicy,
    make_policy,
)

__all__ = [
    "LRU",
    "NEVER",
    "Belady",
    "NextUse",
    "NoRetention",
    "PlanFuture",
    "RetentionPolicy",
    "SequenceFuture",
    "SimResult",
    "belady_min",
    "compulsory_bytes",
    "is_placeholder",
    "make_policy",
    "run",
    "simulate",
]


# ---- simulation ----------------------------------------------------------------------
@dataclass(frozen=True)
class SimResult:
    """What a simulated run downloaded.

    Attributes:
        bytes: total bytes downloaded.
        per_step: bytes downloaded for each step (0: read from disk).
        lead: for each downloaded step, how many steps ahead of the consumer its download
            started (0: the consumer was already waiting for it); -1 for steps read from disk.
            With a fast network, a small lead puts the download on the consumer's critical path.
    """

    bytes: int
    per_step: array[int]
    lead: array[int]


def run(
    policy: str | RetentionPolicy,
    sequence: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
    *,
    prefetch: int | None = None,
    reserve: int = 0,
    ticks: Sequence[int] | None = None,
) -> SimResult:
    """Replay ``sequence`` through a cache of ``capacity`` bytes run by ``policy`` (a name, or
    an instance whose future uses the same ticks: positions, or ``ticks`` if given, e.g. the
    ``Step.tick`` of a plan's steps with a :class:`PlanFuture`).

    The fetcher runs as far ahead as the capacity (and ``prefetch`` steps, if given) allows,
    as a fast network would let it; when it must wait, the consumer acknowledges its next
    step. This is the worst case for retention, since pinned items take the most room.

    Raises:
        ValueError: an item does not fit in ``capacity``.
    """
    if prefetch is not None and prefetch < 1:
        raise ValueError(f"prefetch {prefetch!r}: expected at least 1 step, or None")
    sizes = sizes if isinstance(sizes, array) else array("q", sizes)
    if isinstance(policy, str):
        policy = make_policy(policy, sizes, SequenceFuture(sequence), reserve=reserve)  # type: ignore[arg-type]
    n = len(sequence)
    at = range(n) if ticks is None else ticks
    per_step = array("q", [0]) * n
    lead = array("q", [-1]) * n
    free, c, p = capacity, 0, 0
    while c < n:
        while p < n and (prefetch is None or p - c < prefetch):
            x = sequence[p]
            if not policy.on_fetch(x, at[p]):
                size = sizes[x]
                if size > free:
                    victims = policy.choose_victims(size - free, x, at[p], urgent=p == c)
                    if victims is None:
                        if p == c:
                            raise ValueError(f"item {x} of {size} bytes does not fit in capacity {capacity} (free {free})")
                        break
                    free += sum(sizes[v] for v in victims)
                    if size > free:
                        raise RuntimeError(f"{policy.name}: victims free {free} bytes, item {x} needs {size}")
                free -= size
                per_step[p] = size
                lead[p] = p - c
                policy.on_admit(x, at[p])
            p += 1
        x = sequence[c]
        if not policy.on_ack(x, at[c]):
            free += sizes[x]
        c += 1
    return SimResult(sum(per_step), per_step, lead)


def simulate(
    policy: str | RetentionPolicy,
    sequence: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
    *,
    prefetch: int | None = None,
    reserve: int = 0,
) -> int:
    """Bytes downloaded by :func:`run`."""
    return run(policy, sequence, sizes, capacity, prefetch=prefetch, reserve=reserve).bytes


def belady_min(sequence: Sequence[int], sizes: Sequence[int], capacity: int) -> int:
    """Bytes downloaded by offline Belady MIN without prefetch (each item fetched when read,
    then kept until it is the cached item with the farthest next use). With equal sizes this
    is the minimum any cache of ``capacity`` can achieve on ``sequence``; with variable sizes
    it is MIN's heuristic (the exact optimum is NP-hard).

    Raises:
        ValueError: an item does not fit in ``capacity``.
    """
    nxt = SequenceFuture(sequence)
    keys: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    used = total = 0
    for t, x in enumerate(sequence):
        size = sizes[x]
        if x in keys:
            del keys[x]
            used -= size
        else:
            total += size
            while used + size > capacity:
                if not heap:
                    raise ValueError(f"item {x} of {size} bytes does not fit in capacity {capacity}")
                negkey, v = heapq.heappop(heap)
                if keys.get(v) == -negkey:
                    del keys[v]
                    used -= sizes[v]
        key = nxt.next_use(x, t)
        if key != NEVER:
            keys[x] = key
            heapq.heappush(heap, (-key, x))
            used += size
    return total


def compulsory_bytes(sequence: Sequence[int], sizes: Sequence[int]) -> int:
    """Bytes of the distinct items of ``sequence``: a lower bound for any cache."""
    return sum(sizes[x] for x in set(sequence))
