"""Item order: epochs, seeded shuffle, rank/world and worker split, resume (pure code).

A :class:`Plan` turns the catalog (item sizes) into the sequence of items that one consumer
reads: epoch after epoch, each epoch a permutation of all items derived from ``(seed, epoch)``
alone (so every rank computes the same one), split into disjoint shares per rank and, inside a
rank, per DataLoader worker. It yields :class:`Step` ``(epoch, index, item)``: ``index`` counts
the steps of this share within the epoch, ``item`` indexes the catalog.

Nothing here does I/O or starts threads. Memory is a few arrays of C ints: for 1,000,000 items
about 8 MB of sizes plus 4 MB per cached epoch (at most :data:`EPOCHS_CACHED` epochs).
Computing one epoch walks every item in Python (about 1-3 s per million items).

How an epoch's order is made and split into shares (by bytes or by count, with ``equal_steps``
or without), with the bounds of each split, is in :mod:`cachepipe.plan_split` (pure functions);
where rank, world size and worker come from when they are not given, in
:mod:`cachepipe.plan_ranks`. Both are re-exported here. A plan's share of each epoch, with
``partition="epoch"`` or ``"fixed"`` (the notes on both), is computed and kept by its base class,
in :mod:`cachepipe.plan_shares`; this module keeps the positions in a plan and its resume state.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, Literal, NamedTuple

from .catalog import Item
from .plan_ranks import _check_rank, default_rank_world, default_worker
from .plan_shares import EPOCHS_CACHED, _Shares
from .plan_split import (
    RUN,  # noqa: F401 - importable from here, as before
    deal,
    equalise,
    permutation,
    split,
    split_all,
)

# the split's functions, the ranks' defaults and EPOCHS_CACHED: importable from here, as before
__all__ = [
    "EPOCHS_CACHED",
    "Cursor",
    "Frontier",
    "GrowingPlan",
    "Plan",
    "Step",
    "deal",
    "default_rank_world",
    "default_worker",
    "equalise",
    "permutation",
    "split",
    "split_all",
    "tick",
]

STATE_VERSION = 1
_SHIFT = 32  # a tick is epoch << 32 | index
_MASK = (1 << _SHIFT) - 1
_MAX_ITEMS = 1 << 32
_EMPTY_EPOCHS_LIMIT = 1000  # an endless plan whose share stays empty this long is a mistake


class Cursor(NamedTuple):
    """A position in a plan: ``index`` counts the steps of this share within ``epoch``."""

    epoch: int
    index: int  # type: ignore[assignment]  # a field named like tuple.index, on purpose


class Step(NamedTuple):
    """One planned read: the ``index``-th item of this share in ``epoch`` is catalog ``item``."""

    epoch: int
    index: int  # type: ignore[assignment]  # a field named like tuple.index, on purpose
    item: int

    @property
    def tick(self) -> int:
        """This position as one int, ordered like ``(epoch, index)``."""
        return (self.epoch << _SHIFT) | self.index


def tick(epoch: int, index: int) -> int:
    """``(epoch, index)`` as one int, ordered lexicographically (see :attr:`Step.tick`)."""
    return (epoch << _SHIFT) | index


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} {value!r}: expected an integer >= {low}")
    return value


class Plan(_Shares):
    """The item order of one consumer: epochs, seeded shuffle, rank and worker shares, resume.

    Args:
        sizes: the catalog, as item sizes in bytes or :class:`~cachepipe.catalog.Item` objects;
            a step's ``item`` indexes this sequence. An ``array('q')`` is used as it is, not
            copied (do not modify it).
        epochs: number of passes, or None for endless.
        shuffle: a new permutation every epoch (False: catalog order every epoch).
        seed: with ``epoch``, the only input of the permutation.
        rank, world_size: this process's share; both None (default): :func:`default_rank_world`.
        worker, num_workers: this DataLoader worker's share of the rank's share.
        balance: ``"bytes"`` (default) or ``"count"`` (see :mod:`cachepipe.plan_split`).
        partition: ``"epoch"`` (default) or ``"fixed"`` (see :mod:`cachepipe.plan_shares`).
        equal_steps: None (default: shares as the walk gives them), ``"pad"`` or ``"drop"``:
            every rank the same number of steps per epoch (see :mod:`cachepipe.plan_split`).
        start: the first position to yield (usually from :meth:`load_state_dict`).

    Raises:
        ValueError: a bad argument, named with its value and what is accepted.
    """

    def __init__(
        self,
        sizes: Sequence[int] | Sequence[Item],
        *,
        epochs: int | None = 1,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        worker: int = 0,
        num_workers: int = 1,
        balance: Literal["bytes", "count"] = "bytes",
        partition: Literal["epoch", "fixed"] = "epoch",
        equal_steps: Literal["pad", "drop"] | None = None,
        start: Cursor | tuple[int, int] | None = None,
    ) -> None:
        if len(sizes) and isinstance(sizes[0], Item):
            self.sizes = array("q", (item.size for item in sizes))  # type: ignore[union-attr]
        elif isinstance(sizes, array) and sizes.typecode == "q":
            self.sizes = sizes  # shared, not copied (a catalog's, or a node's lanes'): read only
        else:
            self.sizes = array("q", sizes)  # type: ignore[arg-type]
        if len(self.sizes) and min(self.sizes) < 0:
            i = next(i for i, size in enumerate(self.sizes) if size < 0)
            raise ValueError(f"sizes[{i}] = {self.sizes[i]}: expected a size >= 0 bytes")
        if len(self.sizes) >= _MAX_ITEMS:
            raise ValueError(f"{len(self.sizes)} items: at most {_MAX_ITEMS - 1} are supported")
        if epochs is not None:
            _check_int("epochs", epochs, 1)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed {seed!r}: expected an integer")  # noqa: TRY004 - ValueError is what callers of this public function already catch
        if rank is None and world_size is None:
            rank, world_size = default_rank_world()
        elif rank is None or world_size is None:
            raise ValueError(f"rank {rank!r}, world_size {world_size!r}: give both or neither")
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0)
        _check_rank(rank, world_size, "given")
        _check_int("num_workers", num_workers, 1)
        _check_int("worker", worker, 0)
        _check_rank(worker, num_workers, "given", ("worker", "num_workers"))
        if balance not in ("bytes", "count"):
            raise ValueError(f"balance {balance!r}: expected 'bytes' or 'count'")
        if partition not in ("epoch", "fixed"):
            raise ValueError(f"partition {partition!r}: expected 'epoch' or 'fixed'")
        if equal_steps not in (None, "pad", "drop"):
            raise ValueError(f"equal_steps {equal_steps!r}: expected None, 'pad' or 'drop'")
        # with "drop", n >= world_size * num_workers still leaves each rank at least num_workers items
        if epochs is None and len(self.sizes) < world_size * num_workers:
            raise ValueError(
                f"{len(self.sizes)} items for world_size {world_size} x num_workers {num_workers}: "
                "an endless plan needs at least one item per share"
            )
        self.n_items = len(self.sizes)
        self.epochs, self.shuffle, self.seed = epochs, bool(shuffle), seed
        self.rank, self.world_size, self.worker, self.num_workers = rank, world_size, worker, num_workers
        self.balance, self.partition, self.equal_steps = balance, partition, equal_steps
        self._lock = threading.Lock()  # the epoch caches may be read by the fetcher and the cache
        self._shares: OrderedDict[int, array[int]] = OrderedDict()
        self._mine: bytearray | None = None  # partition="fixed": copies of each item in this (rank, worker)
        self._twice = False  # partition="fixed": an item is in _mine twice ("pad")
        self._digest: str | None = None
        self.start = Cursor(0, 0)
        if start is not None:
            self.start = self.normalise(Cursor(*start))

    def __repr__(self) -> str:
        return (
            f"Plan({self.n_items} items, epochs={self.epochs}, shuffle={self.shuffle}, seed={self.seed}, "
            f"rank={self.rank}/{self.world_size}, worker={self.worker}/{self.num_workers})"
        )

    # ---- positions -------------------------------------------------------------------
    def done(self, epoch: int) -> bool:
        """True when ``epoch`` is past the last epoch of a finite plan."""
        return self.epochs is not None and epoch >= self.epochs

    def normalise(self, cursor: Cursor | tuple[int, int]) -> Cursor:
        """The position of the next step at or after ``cursor`` (skipping ends of epochs and
        empty shares); ``(epochs, 0)`` once a finite plan is exhausted.

        Raises:
            ValueError: a negative position, or an index beyond the end of its epoch's share.
        """
        epoch, index = cursor
        if (
            isinstance(epoch, bool)
            or not isinstance(epoch, int)
            or isinstance(index, bool)
            or not isinstance(index, int)
            or epoch < 0
            or index < 0
        ):
            raise ValueError(f"position {tuple(cursor)!r}: expected (epoch, index) of integers >= 0")
        if self.done(epoch):
            if (epoch, index) != (self.epochs, 0):
                raise ValueError(f"position {tuple(cursor)!r}: beyond the end of a {self.epochs}-epoch plan")
            return Cursor(epoch, 0)
        length = len(self.share(epoch))
        if index > length:
            raise ValueError(f"position {tuple(cursor)!r}: epoch {epoch} has {length} steps for this share")
        empty = 0
        while index == len(self.share(epoch)):
            epoch, index = epoch + 1, 0
            if self.done(epoch):
                break
            empty += 1
            if empty > _EMPTY_EPOCHS_LIMIT:
                raise ValueError(f"{self!r}: no items for this share in {_EMPTY_EPOCHS_LIMIT} consecutive epochs")
        return Cursor(epoch, index)

    def after(self, step: Step | Cursor | tuple[int, ...]) -> Cursor:
        """The position of the step that follows ``step``."""
        return self.normalise(Cursor(step[0], step[1] + 1))

    def steps(self, start: Cursor | tuple[int, int] | None = None) -> Iterator[Step]:
        """Yield the steps from ``start`` (default :attr:`start`) to the end of the plan."""
        epoch, index = self.normalise(self.start if start is None else start)
        while not self.done(epoch):
            share = self.share(epoch)
            for j in range(index, len(share)):
                yield Step(epoch, j, share[j])
            epoch, index = self.normalise(Cursor(epoch, len(share)))

    def __iter__(self) -> Iterator[Step]:
        return self.steps()

    def future(self, start: Cursor | tuple[int, int], horizon: int) -> Iterator[Step]:
        """The next ``horizon`` steps from ``start`` (fewer at the end of a finite plan)."""
        return islice(self.steps(start), horizon)

    # ---- resume ----------------------------------------------------------------------
    def sizes_digest(self) -> str:
        """A digest of the item sizes: a state is only valid for the catalog it was made on."""
        if self._digest is None:
            self._digest = hashlib.blake2b(self.sizes.tobytes(), digest_size=16).hexdigest()
        return self._digest

    def _config(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "n_items": self.n_items,
            "sizes_digest": self.sizes_digest(),
            "epochs": self.epochs,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "world_size": self.world_size,
            "rank": self.rank,
            "num_workers": self.num_workers,
            "worker": self.worker,
            "balance": self.balance,
            "partition": self.partition,
            # only when set: a state (and a journal's plan key) of equal_steps=None is the one saved before it existed
            **({} if self.equal_steps is None else {"equal_steps": self.equal_steps}),
        }

    def state_dict(self, consumed: Step | Cursor | tuple[int, ...] | None = None) -> dict[str, Any]:
        """A JSON-able state to resume from: the configuration and the next unconsumed position.

        Args:
            consumed: the last consumed step (resume after it); None: resume at :attr:`start`.
        """
        nxt = self.start if consumed is None else self.after(consumed)
        return {**self._config(), "epoch": nxt.epoch, "index": nxt.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: iteration restarts at its next unconsumed step.

        Raises:
            ValueError: the state was made by a different configuration (the first differing
                key is named, with both values), or is malformed.
        """
        mine = self._config()
        missing = [k for k in (*mine, "epoch", "index") if k not in state and k != "equal_steps"]
        if missing:
            raise ValueError(f"plan state is missing {missing}: not a state_dict() of a Plan")
        if state["n_items"] is None and "listed" in state:  # saved while the listing streamed (GrowingPlan)
            listed = state["listed"]
            if not isinstance(listed, int) or not 0 <= listed <= self.n_items:
                raise ValueError(
                    f"plan state was saved after {listed!r} listed items, this plan has {self.n_items} items: cannot resume"
                )
            digest = hashlib.blake2b(self.sizes[:listed].tobytes(), digest_size=16).hexdigest()
            if digest != state["listed_digest"]:
                raise ValueError(
                    f"plan state was saved with other sizes of the first {listed} items than this plan's: cannot resume"
                )
            mine = {k: v for k, v in mine.items() if k not in ("n_items", "sizes_digest")}
        mine.setdefault("equal_steps", None)  # a state without the key: None (saved without it, or before it existed)
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(
                    f"plan state was saved with {key}={state.get(key)!r}, this plan has {key}={value!r}: cannot resume"
                )
        self.start = self.normalise(Cursor(state["epoch"], state["index"]))


class GrowingPlan:
    """The plan of one pass in listing order over a catalog that is still being listed.

    The default pipeline (one epoch, no shuffle, one rank and worker) starts downloading while
    the listing goes on: step ``i`` is listed item ``i``, ``Step(0, i, i)``. :meth:`add` appends
    an item (:meth:`extend` a run of them); :meth:`complete` ends the listing, after which
    positions and the resume state are exactly those of ``Plan(sizes, epochs=1, seed=seed)``
    (with the same ``balance``, ``partition`` and ``equal_steps``, which one rank and worker do
    not change but a resume must match). Until then the end of the pass is unknown
    (``normalise`` leaves ``(0, n)`` as it is) and the resume state names the items listed so
    far instead of the whole catalog: ``n_items`` and ``sizes_digest`` are None, ``listed`` and
    ``listed_digest`` describe the first ``listed`` sizes, and :meth:`Plan.load_state_dict`
    accepts it if its catalog starts with them.
    """

    def __init__(
        self,
        seed: int = 0,
        balance: Literal["bytes", "count"] = "bytes",
        partition: Literal["epoch", "fixed"] = "epoch",
        equal_steps: Literal["pad", "drop"] | None = None,
    ) -> None:
        self.sizes = array("q")
        self.seed, self.balance, self.partition, self.equal_steps = seed, balance, partition, equal_steps
        self.start = Cursor(0, 0)
        self._full: Plan | None = None
        self._hash = hashlib.blake2b(digest_size=16)  # of sizes.tobytes(), kept up to date

    @property
    def n_items(self) -> int:
        return len(self.sizes)

    def add(self, size: int) -> Step:
        """The next listed item (``size`` bytes) as a step."""
        i = len(self.sizes)
        self.extend((size,))
        return Step(0, i, i)

    def extend(self, sizes: Sequence[int]) -> None:
        """:meth:`add` each of ``sizes`` (bytes), in one update of the digest: all or none."""
        if self._full is not None:
            raise RuntimeError("the listing is complete: no more items can be added")
        run = array("q", sizes)  # raises before anything is added
        self.sizes.extend(run)
        self._hash.update(run.tobytes())

    def complete(self) -> Plan:
        """The listing ended: return the plan it amounts to."""
        if self._full is None:
            self._full = Plan(
                self.sizes,
                epochs=1,
                seed=self.seed,
                rank=0,
                world_size=1,
                balance=self.balance,
                partition=self.partition,
                equal_steps=self.equal_steps,
            )
        return self._full

    def normalise(self, cursor: Cursor | tuple[int, int]) -> Cursor:
        if self._full is not None:
            return self._full.normalise(cursor)
        return Cursor(*cursor)

    def after(self, step: Step | Cursor | tuple[int, ...]) -> Cursor:
        return self.normalise(Cursor(step[0], step[1] + 1))

    def _config(self) -> dict[str, Any]:
        if self._full is not None:
            return self._full._config()  # noqa: SLF001 - same class
        empty = Plan(
            [],
            epochs=1,
            seed=self.seed,
            rank=0,
            world_size=1,
            balance=self.balance,
            partition=self.partition,
            equal_steps=self.equal_steps,
        )
        config = empty._config()  # noqa: SLF001 - same class
        return {
            **config,
            "n_items": None,
            "sizes_digest": None,
            "listed": len(self.sizes),
            "listed_digest": self._hash.hexdigest(),
        }


class Frontier:
    """The resume point when steps are consumed out of order (several consumers, leases).

    The producer :meth:`issue` s steps in plan order and gets consecutive sequence numbers;
    consumers :meth:`consume` them in any order. :attr:`position` is the first step not yet
    consumed, so a resume re-delivers only steps that were never acknowledged.
    """

    def __init__(self, plan: Plan | GrowingPlan, start: Cursor | None = None) -> None:
        self.plan = plan
        self.position = plan.normalise(plan.start if start is None else start)
        # plain tuples, not Steps: the collector stops tracking a tuple of ints, and there is one
        # per item issued and not yet consumed (benchmarks/README.md, "The garbage collector's share")
        self._issued: dict[int, tuple[int, ...]] = {}
        self._consumed: set[int] = set()
        self._next_seq = 0
        self._low = 0  # every seq below it is consumed

    def issue(self, step: Step) -> int:
        """Record the next step handed to the producer; returns its sequence number."""
        return self.issue_many([step])[0]

    def issue_many(self, steps: Sequence[Step]) -> range:
        """:meth:`issue` each of ``steps`` in order; returns their sequence numbers (consecutive)."""
        first = self._next_seq
        self._next_seq += len(steps)
        seqs = range(first, self._next_seq)
        self._issued.update(zip(seqs, map(tuple, steps), strict=True))
        return seqs

    def step(self, seq: int) -> Step:
        """The step issued as ``seq`` (issued and not yet below the frontier).

        Raises:
            KeyError: ``seq`` was never issued, or every step up to it is consumed.
        """
        return Step._make(self._issued[seq])

    def epoch_ticks(self, seqs: Sequence[int]) -> list[tuple[int, int]]:
        """``(epoch, tick)`` of the step issued as each of ``seqs`` (as :meth:`step`, without
        making the steps).

        Raises:
            KeyError: as :meth:`step`.
        """
        issued, got = self._issued, []
        for seq in seqs:
            epoch, index, _item = issued[seq]
            got.append((epoch, (epoch << _SHIFT) | index))
        return got

    def consume(self, *seqs: int) -> None:
        """Mark steps ``seqs`` consumed (acknowledged); idempotent. The position moves once per
        call, past every step then consumed in a row (a batch of acks moves it once).

        Raises:
            KeyError: one of ``seqs`` was never issued; none is marked.
        """
        low, issued = self._low, self._issued
        for seq in seqs:
            if seq >= low and seq not in issued:
                raise KeyError(f"sequence number {seq} was never issued")
        self._consumed.update(seq for seq in seqs if seq >= low)
        last = None
        while low in self._consumed:
            self._consumed.discard(low)
            last = issued.pop(low)
            low += 1
        self._low = low
        if last is not None:
            self.position = self.plan.after(last)

    def state_dict(self) -> dict[str, Any]:
        """The plan's state at the first unconsumed step."""
        return {**self.plan._config(), "epoch": self.position.epoch, "index": self.position.index}  # noqa: SLF001 - same class
