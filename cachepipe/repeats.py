"""A worker's steps kept whole when items are skipped: which sample repeats in a skipped
item's place (pure bookkeeping; the PyTorch adapter does the reading and the yielding).

Under DDP every rank runs the same number of steps, or a collective hangs at the epoch's end;
``equal_steps`` plans as many items for every rank (and for each DataLoader worker, the same
counts on every rank). An item skipped at run time (``on_error="skip"``, ``on_oversize="skip"``)
would still be a step fewer on its rank. :class:`Repeats` sees every step of one worker's pass
in plan order, the good ones and the skipped ones, and says how many times to yield each
sample so that the worker yields exactly one sample per planned step:

- a skipped step, after a sample: that (previous) sample again, in the skipped item's place;
- skipped steps before the first sample (of the pass, or since a resume): the next sample, once
  more for each, right after it;
- skipped steps and no sample at all to the end of the pass: :class:`NothingToRepeatError`
  (naming the items), not a short pass.

So the counts hold per epoch too when one pass reads several epochs (each repeat takes the
place of its skipped step, except at a pass's start, where the first sample's repeats follow
it). A checkpoint is taken at the last sample read; a pass resumed from it reads that sample
again, with ``weight`` (the yields its step is due) and ``delivered`` (the yields made from it
on before the checkpoint, not made again: see :meth:`Repeats.deliver`), so it has a sample to
repeat for skipped items right after the checkpoint. Each substitution is logged as a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import NothingToRepeatError

__all__ = ["Repeats"]

log = logging.getLogger("cachepipe")

_NAMED = 5  # the most skipped items a message names


class Repeats:
    """The substitutions of one worker's pass (see the module notes).

    Args:
        where: the worker, for messages (``"rank 1 worker 0"``).
        weight: the yields due for the pass's first step (1; more for a resumed pass whose first
            step's sample was also yielded for skipped steps before it).
        delivered: the yields a resumed pass made before, from its first step on (not made
            again, see :meth:`deliver`): a pass resumes at its last sample's step, which it
            reads again, so that it has a sample to repeat for the skipped steps after it.
    """

    def __init__(self, where: str, weight: int = 1, delivered: int = 0) -> None:
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            raise ValueError(f"repeat {weight!r} in the state: expected an integer >= 1 (the yields due at its position)")
        if isinstance(delivered, bool) or not isinstance(delivered, int) or delivered < 0:
            raise ValueError(f"yielded {delivered!r} in the state: expected an integer >= 0")
        self.where = where
        self._suppress = delivered  # yields made before the resume: counted, not made again
        self.due = weight  # the yields the current sample's step is due (its own and skipped steps' before it)
        self.since = 0  # the yields made (or made before the resume) from the current sample's step on
        self._weight = weight  # the yields the next step is due (more than 1 only for a resumed pass's first)
        self.previous: Any = None  # the last sample yielded
        self.previous_name: str | None = None  # its item's name (None: no sample yet)
        self._owed: list[tuple[str, str]] = []  # (name, reason) of skipped steps before the first sample
        self._owed_count = 0  # yields owed for them (a resumed first step may owe several)

    def _take_weight(self) -> int:
        weight, self._weight = self._weight, 1
        return weight

    def skipped(self, name: str, reason: str) -> int:
        """A skipped step: how many times to yield :attr:`previous` now (0: owed to the next sample)."""
        weight = self._take_weight()
        if self.previous_name is None:
            self._owed.append((name, reason))
            self._owed_count += weight
            return 0
        log.warning(
            "%s: item %r was skipped (%s); its sample, item %r, is yielded again in its place (equal_steps: every rank "
            "the same number of steps)",
            self.where,
            name,
            reason,
            self.previous_name,
        )
        return weight

    def sample(self, name: str, sample: Any) -> int:
        """A step read: ``sample``, of item ``name``; how many times to yield it (1, and once more
        for each step owed before it)."""
        times = self._take_weight() + self._owed_count
        if self._owed:
            log.warning(
                "%s: %s %s skipped before any sample of this pass (%s); item %r is yielded %d times, in their place "
                "(equal_steps: every rank the same number of steps)",
                self.where,
                _names(self._owed),
                "was" if len(self._owed) == 1 else "were",
                self._owed[0][1],
                name,
                times,
            )
        self._owed, self._owed_count = [], 0
        self.previous, self.previous_name = sample, name
        self.due, self.since = times, 0
        return times

    def deliver(self) -> bool:
        """Count one yield of :attr:`previous` (of its own step, or a skipped step's); False: it
        was made before the resume (``delivered``), so it is not made again."""
        self.since += 1
        if self._suppress:
            self._suppress -= 1
            return False
        return True

    def end(self) -> None:
        """The pass ended.

        Raises:
            NothingToRepeatError: steps were skipped and no sample came to repeat in their place.
        """
        if self._owed:
            raise NothingToRepeatError(
                f"{self.where}: every step of this pass (from its start, or from the state it resumed from) was "
                f"skipped ({_names(self._owed)}; the first: "
                f"{self._owed[0][1]}), so there is no sample to repeat in their place, and a pass of fewer steps would "
                "leave this rank behind the others (a DDP collective hangs): fix or remove these items, or make the "
                "capacity hold them"
            )


def _names(owed: list[tuple[str, str]]) -> str:
    """``item 'a'``, ``items 'a', 'b'``, or the first few of many and their count."""
    names = [repr(name) for name, _ in owed[:_NAMED]]
    more = f" and {len(owed) - _NAMED} more" if len(owed) > _NAMED else ""
    return f"item{'s' if len(owed) > 1 else ''} {', '.join(names)}{more}"
