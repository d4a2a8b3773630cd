"""The records of a node's lanes (:mod:`cachepipe.lanequeues`): one per planned step of a lane
(``_Planned``, which for the step that downloads an item also keeps the one copy of it that
later steps share), one per lane (``_LaneState``: where it is, what it holds, whether it waits),
and ``_MovedAway``, which a consumer's wait raises when another consumer of its lane moved the
lane. :class:`~cachepipe.lanequeues.LaneQueues` changes them under its lock and keeps their
invariant (see its module notes); what leaves a lane is handed to the node pipeline
(:mod:`cachepipe.node`) as the ``_Planned`` of its step. Data only, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .broker import Failed
from .delivered import _Held
from .plan import Cursor, Step

__all__: list[str] = []  # the node's own bookkeeping: lanequeues and node use them


class _MovedAway(Exception):
    """Raised by :meth:`LaneQueues.wait` when another consumer of the lane moved it away from
    the position waited for (two consumers read one lane)."""

    def __init__(self, floor: Cursor) -> None:
        super().__init__(floor)
        self.floor = floor


@dataclass(slots=True, eq=False)
class _Planned:
    """A step of a lane, from planning until the lane consumes it.

    The step that downloads an item also keeps the record of that one copy of it (``got``,
    ``holders``), which later steps of the item share while it is held (see
    :class:`LaneQueues`). One object per step: the node may hold millions.
    """

    seq: int  # the download's turn; -1: the step shares the copy of ``source``
    lane: int
    generation: int
    step: Step
    tick: int
    kept: _Held  # what a hand-out needs of the item (not the Item: the collector stops tracking it)
    source: _Planned | None = None  # the step whose copy this one shares; None: its own download
    got: str | Failed | None = None  # the copy's: None while downloading; its path once on disk, or its failure
    holders: int = 1  # the copy's: steps planned and not consumed that hold it
    handed: bool = False

    @property
    def copy(self) -> _Planned:
        """The step that keeps this step's copy (itself, unless it shares one)."""
        return self if self.source is None else self.source

    @property
    def value(self) -> str | Failed | None:
        """The item's path once on disk, or its failure; None while it downloads."""
        return self.copy.got

    @property
    def key(self) -> Cursor:
        return Cursor(self.step.epoch, self.step.index)

    @property
    def name(self) -> str:
        return self.kept[0]

    @property
    def size(self) -> int:
        return self.kept[1]


@dataclass(slots=True)
class _LaneState:
    generation: int = 0
    floor: Cursor = field(default_factory=lambda: Cursor(0, 0))  # every step of the lane before it is consumed
    held: dict[Cursor, _Planned] = field(default_factory=dict)  # planned in this generation, not consumed
    waiting: int = 0
    asked: int = 0  # the node's count of lane restarts as of this lane's last move (see LaneQueues.give_back)
