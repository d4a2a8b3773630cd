"""What a ``cachepipe map`` run did: :class:`MapResult`, kept up to date by :class:`Tally`.

Every job records into one :class:`Tally` (under its lock), which also drives the progress bar;
:func:`format_plan` and :func:`format_summary` are the text the command line prints.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ..sizes import format_size
from .uploader import DONE_MARKER, marker_key

__all__ = ["MapFailure", "MapResult", "Tally", "format_deletes", "format_plan", "format_share", "format_summary"]

log = logging.getLogger("cachepipe.map")


@dataclass(frozen=True)
class MapFailure:
    """A failed item: its name, the error, CMD's stderr tail (may be empty), attempts made."""

    name: str
    error: str
    stderr_tail: str
    attempts: int


@dataclass
class MapResult:
    """What a map run did. Sizes in bytes.

    Attributes:
        items_listed: items under ``SRC`` (all of them, over every rank).
        items_skipped: items of this share already complete in ``DST`` (marker found, for the same
            input and command): not run.
        items_done: items completed by this run.
        items_failed: items recorded as failed (see :attr:`failed`).
        items_retried: attempts beyond the first, over all items.
        planned: names of the items to do (with ``dry_run``: what would run).
        command_changed: names of the items whose marker records another command (or another
            ``unpack``; see :func:`~cachepipe.map.plan.command_digest`), in plan order: done
            before, run again (their outputs replaced, those it does not write again deleted); with
            ``dry_run``, would be.
        held: what ``DST`` held under each item to run whose marker was there (done before by
            another command, or from another version of its input): its keys, relative to
            ``DST``, markers included, in plan order. The run deletes those that the item's
            attempt does not write again (see :mod:`~cachepipe.map.uploader`); with ``dry_run``,
            the most a run could delete (which of them it writes again, only the command can tell).
        refused: with ``dry_run``, the items the run would refuse before downloading them, with
            the reason (the run records them in :attr:`failed`).
        bytes_in: bytes downloaded.
        bytes_out: bytes of outputs uploaded (markers excluded).
        files_out: output files uploaded.
        seconds: wall time of the run.
        capacity: the cap on bytes under the cache dir.
        download_capacity: the part of it given to downloads.
        reserve: bytes set aside per job for outputs and, with ``unpack``, the extracted files
            (without the margin).
        margin: extra bytes per job that absorb a burst between two watcher measurements.
        peak_job_bytes: the largest job slot measured (outputs + extracted + added to inputs).
        failed: the failures, in the order they happened.
        rank: this process's rank among ``world_size`` (see :mod:`cachepipe.map.share`).
        world_size: the number of processes sharing the listing.
        rank_source: where ``rank`` and ``world_size`` came from (``"RANK=1, WORLD_SIZE=3"``...).
        share_items: the items of this rank's share (all listed items with one process).
        share_bytes: their bytes.
    """

    items_listed: int = 0
    items_skipped: int = 0
    items_done: int = 0
    items_failed: int = 0
    items_retried: int = 0
    planned: list[str] = field(default_factory=list)
    command_changed: list[str] = field(default_factory=list)
    held: dict[str, list[str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    files_out: int = 0
    seconds: float = 0.0
    capacity: int = 0
    download_capacity: int = 0
    reserve: int = 0
    margin: int = 0
    peak_job_bytes: int = 0
    failed: list[MapFailure] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    rank_source: str = ""
    share_items: int = 0
    share_bytes: int = 0

    @property
    def ok(self) -> bool:
        """True when no item failed."""
        return not self.failed


class Tally:
    """The jobs' shared record of a run: counters of ``result`` under one lock, and the progress bar."""

    def __init__(self, result: MapResult) -> None:
        self.result = result
        self._lock = threading.Lock()
        self._bar: Any = None
        self._bytes_out: Callable[[], int] = lambda: 0
        self._bytes_taken = 0

    def open_bar(self, total: int, bytes_out: Callable[[], int]) -> None:
        """Show a progress bar of ``total`` items; ``bytes_out`` reads the bytes uploaded so far."""
        from tqdm.auto import tqdm

        self._bytes_out = bytes_out
        self._bar = tqdm(total=total, unit="item", desc="cachepipe map", dynamic_ncols=True)

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def taken(self, size: int) -> None:
        """A job took an item of ``size`` bytes from the cache."""
        with self._lock:
            self._bytes_taken += size

    def retried(self) -> None:
        with self._lock:
            self.result.items_retried += 1

    def measured(self, peak: int) -> None:
        """A job's slot reached ``peak`` bytes."""
        with self._lock:
            self.result.peak_job_bytes = max(self.result.peak_job_bytes, peak)

    def succeed(self, name: str, manifest: dict[str, int] | None) -> None:
        with self._lock:
            self.result.items_done += 1
        log.info("done %s: %d files, %d bytes", name, len(manifest or {}), sum((manifest or {}).values()))
        self._tick()

    def fail(self, name: str, error: str, tail: str, attempts: int) -> None:
        with self._lock:
            self.result.items_failed += 1
            self.result.failed.append(MapFailure(name, error, tail, attempts))
        log.error("item %s failed after %d attempt(s): %s", name, attempts, error)
        self._tick()

    def _tick(self) -> None:
        if self._bar is None:
            return
        with self._lock:
            r = self.result
            self._bar.update(1)
            self._bar.set_postfix(
                ordered_dict={
                    "done": r.items_done,
                    "failed": r.items_failed,
                    "in": f"{self._bytes_taken / 1e6:.1f}MB",
                    "out": f"{self._bytes_out() / 1e6:.1f}MB",
                },
                refresh=False,
            )


def format_share(result: MapResult) -> str:
    """Which share of the listing this process takes: rank, world size, items, bytes."""
    return (
        f"rank {result.rank} of {result.world_size} ({result.rank_source}): {result.share_items} of "
        f"{result.items_listed} items, {result.share_bytes} bytes"
    )


def format_plan(result: MapResult, dest: str) -> str:
    """The ``--dry-run`` listing: each item that would run (marking those done before, whose
    outputs would be replaced), each that would be refused, the counts, and what the run could
    delete in ``dest`` (:func:`format_deletes`)."""
    root = dest.rstrip("/")
    lines = [format_share(result)] if result.world_size > 1 else []
    changed, first = set(result.command_changed), result.command_changed[:1]
    replaced = " its outputs would be replaced, those not written again deleted)"
    again = dict.fromkeys(changed, f" (done before by another command:{replaced}")
    again |= {name: f" (done before from another version of its input:{replaced}" for name in result.held if name not in changed}
    lines += [f"would run: {name} -> {root}/{name}/{again.get(name, '')}" for name in result.planned]
    lines += [f"would refuse: {name}: {why}" for name, why in result.refused.items()]
    refused = f", {len(result.refused)} would be refused" if result.refused else ""
    lines.append(
        f"{len(result.planned)} items to run"
        + (f" ({len(changed)} done before by another command, first: {first[0]})" if first else "")
        + f"{refused}, {result.items_skipped} already done, of "
        + (f"{result.share_items} in this share" if result.world_size > 1 else f"{result.items_listed} listed")
    )
    deletes = format_deletes(result, dest)
    if deletes:
        lines.append(deletes)
    if result.planned or result.refused:
        lines.append(
            f"capacity {result.capacity} bytes: {result.download_capacity} for downloads, "
            f"{result.reserve} + {result.margin} margin per job for outputs (and extracted files)"
        )
    return "\n".join(lines)


_SHOWN = 3
"""How many of the keys a run could delete :func:`format_deletes` names."""


def format_deletes(result: MapResult, dest: str) -> str:
    """What a run may delete in ``dest`` (:attr:`MapResult.held`): how many items would have
    earlier outputs replaced, how many objects at most (each of them is deleted unless the
    item's attempt writes it again), and the first few keys (outputs before markers, which are
    always replaced); empty when it deletes nothing."""
    if not result.held:
        return ""
    root = dest.rstrip("/")
    count = sum(map(len, result.held.values()))
    keys = list(islice((key for keys in result.held.values() for key in keys if not key.endswith(f"/{DONE_MARKER}")), _SHOWN))
    shown = (keys + [marker_key(name) for name in result.held])[:_SHOWN]  # outputs in listing order, then markers
    more = ", ..." if count > _SHOWN else ""
    return (
        f"{len(result.held)} items would have earlier outputs replaced: up to {count} objects in DST "
        f"deleted (their markers included), those the run does not write again (first: "
        f"{', '.join(f'{root}/{key}' for key in shown)}{more})"
    )


def format_summary(result: MapResult) -> str:
    """The closing summary: counts (and how many items were run again because another command
    had done them, naming the first), sizes (format_size), failed items with their stderr tails."""
    changed = result.command_changed
    again = f"{len(changed)} run again, done before by another command (first: {changed[0]}); " if changed else ""
    lines = [
        (
            f"cachepipe map: {result.items_done} done, {result.items_failed} failed, {result.items_skipped} already done; "
            f"{again}{format_size(result.bytes_in)} in, {format_size(result.bytes_out)} out ({result.files_out} files) "
            f"in {result.seconds:.1f} s; peak job {result.peak_job_bytes} of {result.reserve} bytes reserved"
        )
    ]
    if result.world_size > 1:
        lines.append(f"cachepipe map: {format_share(result)}")
    if result.failed:
        lines.append("failed items (run the same command again to retry them):")
        for failure in result.failed:
            lines.append(f"  {failure.name}: {failure.error} (after {failure.attempts} attempt(s))")
            lines.extend(f"    | {line}" for line in failure.stderr_tail.strip().splitlines()[-10:])
    return "\n".join(lines)
