"""How one ``cachepipe map`` run (:mod:`cachepipe.map.run`) splits its capacity: the jobs'
output slots (a reserve and a margin each), the downloads' pipeline beside the run's state, and
the items too large for what that leaves, refused before anything is downloaded (by the run and
by ``dry_run`` alike, so that a dry run predicts the refusals). Pure: sizes in, sizes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .plan import MapItem

__all__: list[str] = []  # the run's own bookkeeping: map_items and its dry run use it


@dataclass(frozen=True)
class _Sizing:
    capacity: int
    reserve: int
    margin: int
    jobs: int
    state: int  # what the downloads' pipeline reserves for its journal, inside the downloads' share

    @property
    def downloads(self) -> int:
        """The capacity of the downloads' pipeline: what the jobs' slots leave."""
        return self.capacity - self.jobs * (self.reserve + self.margin)

    @property
    def largest(self) -> int:
        """The largest item the downloads' pipeline can hold beside its state."""
        return self.downloads - self.state

    def least_for(self, size: int) -> int:
        """The least capacity whose :attr:`largest` holds an item of ``size`` bytes, all else kept
        (the jobs' reserves and margins and the state do not grow with the capacity)."""
        return self.capacity + size - self.largest


def _refusals(todo: Sequence[MapItem], sizing: _Sizing) -> list[tuple[str, str]]:
    """The items a run of this sizing refuses before downloading them, each with the reason
    (shared by the run and ``dry_run``, so that a dry run predicts the refusals)."""
    return [
        (
            mi.name,
            (
                f"item is {mi.size} bytes, more than the {sizing.largest} bytes the capacity leaves for "
                f"downloads beside the jobs' reserves and the run's state ({sizing.state} bytes); give capacity "
                f"(--capacity) at least {sizing.least_for(mi.size)} bytes, or lower jobs/out_reserve"
            ),
        )
        for mi in todo
        if mi.size > sizing.largest
    ]
