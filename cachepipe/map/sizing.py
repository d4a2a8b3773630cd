"""How one ``cachepipe map`` run (:mod:`cachepipe.map.run`) splits its capacity: the jobs'
output slots (a reserve and a margin each), the downloads' pipeline beside the run's state, and
the items too large for what that leaves, refused before anything is downloaded (by the run and
by ``dry_run`` alike, so that a dry run predicts the refusals). Pure: sizes in, sizes out.

Every size here is counted as the downloads' cache counts it (:mod:`cachepipe.blocks`): files
in whole blocks of its filesystem, a block per folder; the items by their charge, the state by
what its folder, files and the journal's budget take. So the least capacity a refusal tells is
one the cache accepts.
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
    state: int  # what the downloads' pipeline reserves for its state and the work folder, inside the downloads' share
    block: int  # the cache's block (what its filesystem gives a file at least)
    charges: dict[str, int]  # what each item to do takes in the downloads' cache, by name

    @property
    def downloads(self) -> int:
        """The capacity of the downloads' pipeline: what the jobs' slots leave."""
        return self.capacity - self.jobs * (self.reserve + self.margin)

    @property
    def largest(self) -> int:
        """The largest item the downloads' pipeline can hold beside its state."""
        return self.downloads - self.state

    def least_for(self, charge: int) -> int:
        """The least capacity whose :attr:`largest` holds an item that takes ``charge`` bytes,
        all else kept (the jobs' reserves and margins and the state do not grow with the capacity)."""
        return self.capacity + charge - self.largest


def _refusals(todo: Sequence[MapItem], sizing: _Sizing) -> list[tuple[str, str]]:
    """The items a run of this sizing refuses before downloading them, each with the reason
    (shared by the run and ``dry_run``, so that a dry run predicts the refusals)."""
    refused = []
    for mi in todo:
        charge = sizing.charges[mi.name]
        if charge <= sizing.largest:
            continue
        size = f"{mi.size} bytes listed, {charge} bytes in the filesystem's blocks of {sizing.block} bytes"
        why = (
            f"item is {size}, more than the {sizing.largest} bytes the capacity leaves for downloads beside the jobs' "
            f"reserves and the run's state ({sizing.state} bytes); give capacity (--capacity) at least "
            f"{sizing.least_for(charge)} bytes, or lower jobs/out_reserve"
        )
        refused.append((mi.name, why))
    return refused
