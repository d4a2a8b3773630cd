"""The node mode of :class:`~cachepipe.torch.CachePipeDataset` (``node=SOCKET``): the job it
registers with the node's daemon (its spec and name), the manifest listed once for every node
under ``torch.distributed``, and a pass that reads this worker's lane by position.

Invariant: the position (:class:`~cachepipe.plan.Cursor`) after the last sample yielded is the
dataset's state; a batch of items is consumed only once every item of it is read.
:class:`_NodeMode` is a base class of ``CachePipeDataset`` over
:class:`~cachepipe.torchstate._DatasetState`, not used alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

from .client import DEFAULT_OUTAGE_TIMEOUT, DEFAULT_STARTUP_TIMEOUT
from .config import Share
from .jobclient import JobClient, LaneItem, LaneSkip
from .plan import STATE_VERSION, Cursor
from .torchdist import _distributed, _from_rank0, local_ranks
from .torchstate import _DatasetState, _repeats

__all__ = ["NODE_BATCH", "NODE_BATCH_BYTES"]

NODE_BATCH = 16  #: node mode: most items a worker takes per request (the next ones already on disk)
NODE_BATCH_BYTES = 64 * 2**20  #: node mode: most bytes a worker takes per request (the first item always)

# the fields of a registered job's spec that decide, with its catalog, which item each position of a lane names
_LANE_PLAN = ("world_size", "num_workers", "shuffle", "seed", "balance", "partition", "equal_steps")

# the options of a job's spec (the rest of a node's settings is the daemon's jobs section)
_JOB_OPTIONS = frozenset(
    {
        "items",
        "manifest",
        "catalog",
        "epochs",
        "shuffle",
        "seed",
        "balance",
        "partition",
        "equal_steps",
        "retain",
        "on_error",
        "on_oversize",
    }
)


class _NodeMode(_DatasetState):
    """The dataset in node mode (see the module notes)."""

    def _node_catalog(self) -> str | None:
        """Node mode under an initialised ``torch.distributed`` of several ranks: rank 0's node
        daemon lists the source once; rank 0 broadcasts the manifest's bytes; the first rank of
        every other node uploads them to its daemon, which checks their digest; all ranks then
        register the job with that catalog (so every node plans from one listing). Returns the
        digest, or None (not distributed: the node daemon lists)."""
        dist = _distributed()
        if dist is None:
            return None
        items = self._items()
        with JobClient("manifests", {}, dist.get_rank(), 0, self.node) as daemon:

            def listed() -> tuple[str, bytes]:
                digest = daemon.index(self.source, items)
                return digest, daemon.manifest_bytes(digest)

            rank, (digest, data) = _from_rank0(listed, self.source)
            ranks = self.node_ranks if self.node_ranks is not None else local_ranks(rank)
            if rank != 0 and rank == min(ranks) and 0 not in ranks:
                got = daemon.upload_manifest(data)
                if got != digest:
                    raise RuntimeError(f"the manifest rank 0 listed has digest {digest}, this node's daemon read {got}")
        dist.barrier()  # every node has the manifest before any rank registers the job
        return str(digest)

    def job_spec(self, num_workers: int) -> dict[str, Any]:
        """Node mode: the spec this dataset registers (the same in every rank of the node)."""
        rank, world = self._rank_world()
        ranks = self.node_ranks if self.node_ranks is not None else local_ranks(rank)
        spec: dict[str, Any] = {
            "source": self.source,
            # equal_steps=None as the spec of a job registered before the option existed (same name)
            **{k: v for k, v in self.options.items() if k in _JOB_OPTIONS and not (k == "equal_steps" and v is None)},
            "world_size": world,
            "ranks": sorted(ranks),
            "num_workers": num_workers,
        }
        if isinstance(self.capacity, int):
            spec["capacity"] = self.capacity
        elif isinstance(self.capacity, Share):
            spec["capacity"] = f"{self.capacity.fraction * 100:g}%"
        return spec

    def job_name(self, spec: dict[str, Any]) -> str:
        """Node mode: the job's name (``job``, or one derived from ``spec``)."""
        if self.job is not None:
            return self.job
        digest = hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=6).hexdigest()
        return f"torch-{digest}"

    def _open_lane(self, start: dict[str, Any] | None) -> tuple[JobClient, Cursor]:
        """Node mode: this process's lane, registered, and the position its pass starts at."""
        worker, num_workers = self._worker()
        rank, _ = self._rank_world()
        spec = self.job_spec(num_workers)
        name = self.job_name(spec)
        cursor, self._end = Cursor(0, 0), None  # no state: the plan from its start (a set_epoch pass has one)
        digest = None
        if start:  # {}: the start
            if (version := start.get("version", STATE_VERSION)) != STATE_VERSION:  # none: an earlier version's state
                raise ValueError(
                    f"state of lane {start.get('rank')}.{start.get('worker')} was saved by another cachepipe (state "
                    f"version {version!r}; this one reads {STATE_VERSION}): resume with that version, or start the run over"
                )
            if "job" in start and not {"end_epoch", "plan"} & start.keys() and spec.get("equal_steps") is not None:
                # a lane's state of a cachepipe before equal_steps (2026-11-29; its states name no end_epoch either):
                # its job planned without it, and a padded plan deals other items to the lane
                raise ValueError(
                    f"state of lane {start.get('rank')}.{start.get('worker')} was saved by a cachepipe before equal_steps, "
                    f"which planned job {start.get('job')!r} without it; this dataset plans with "
                    f"equal_steps={spec['equal_steps']!r} (the default over several ranks since): its position would "
                    "name other items (some read twice, some never); pass equal_steps=None to resume it, or start the run over"
                )
            if (start.get("job"), start.get("rank"), start.get("worker")) not in ((name, rank, worker), (None, None, None)):
                raise ValueError(
                    f"state of job {start.get('job')!r} lane {start.get('rank')}.{start.get('worker')}: this is job "
                    f"{name!r} lane {rank}.{worker} (same settings, world size and DataLoader workers to resume)"
                )
            cursor, digest = Cursor(int(start["epoch"]), int(start["index"])), start.get("catalog_digest")
            self._end = start.get("end_epoch")  # the pass it was saved in: its end
        # registered in an earlier pass of this process: the daemon was here, a restart is waited out
        patience = DEFAULT_OUTAGE_TIMEOUT if self._lane_info is not None else DEFAULT_STARTUP_TIMEOUT
        lane = JobClient(name, spec, rank, worker, self.node, startup_timeout=patience)
        try:
            info = lane.register()
            if digest is not None and digest != info.get("catalog_digest"):
                raise ValueError(
                    f"state was saved with catalog_digest={digest!r}, job {name!r} has "
                    f"catalog_digest={info.get('catalog_digest')!r}: cannot resume over other data"
                )
            plan = {key: info.get("spec", {}).get(key) for key in _LANE_PLAN}  # None: a daemon that does not say
            saved = (start or {}).get("plan") or {}  # a state of a version before it names none
            differ = [k for k in _LANE_PLAN if k in saved and saved[k] != plan[k]]  # not a field of a later version
            if differ:
                key = differ[0]
                raise ValueError(
                    f"state of lane {rank}.{worker} was saved with {key}={saved.get(key)!r}, job {name!r} plans with "
                    f"{key}={plan[key]!r}: its position would name other items (some read twice, some never); "
                    f"resume with the {', '.join(_LANE_PLAN)} it was saved with, or start the run over"
                )
        except BaseException:
            lane.close()
            raise
        self._lane_info = (name, rank, worker, info.get("catalog_digest"), plan)
        return lane, cursor

    def _iter_node(self, start: dict[str, Any] | None, token: object) -> Iterator[Any]:
        try:
            lane, cursor = self._open_lane(start)
        except BaseException:
            self._not_started(start, token)
            raise
        with lane:
            if self._pass is token:
                self._cursor = cursor
            end = self._end
            if self.transform is None:
                while not _past(cursor, end) and (item := lane.take(cursor)) is not None and not _past(item.cursor, end):
                    cursor = item.next
                    if self._pass is token:
                        self._cursor = cursor
                    yield item  # released when the loop asks for the next
            elif self._equal:
                yield from self._equal_node(lane, cursor, start, token)
            else:
                transform = self.transform
                while not _past(cursor, end) and (batch := lane.take_many(cursor, NODE_BATCH, NODE_BATCH_BYTES)):
                    # several small items per request; a batch's items are consumed together once read
                    batch = [item for item in batch if not _past(item.cursor, end)]  # the next epoch's: the next pass's
                    if not batch:
                        break
                    samples = [transform(item) for item in batch]
                    cursor = batch[-1].next
                    lane.consume(cursor)  # read: their space is free while the samples travel on
                    for sample, item in zip(samples, batch, strict=True):
                        if self._pass is token:
                            self._cursor = item.next
                        yield sample
        self._ended(token)

    def _equal_node(self, lane: JobClient, cursor: Cursor, start: dict[str, Any] | None, token: object) -> Iterator[Any]:
        """Node mode, ``equal_steps`` over several ranks: as :meth:`_equal_local`, the daemon
        reporting each skipped step in its turn (``report_skips``)."""
        transform, end = self.transform, self._end
        if transform is None:
            raise ValueError("equal steps with transform=None: refused when the dataset is made")
        repeats = _repeats(self._where(), start)
        at = cursor
        while not _past(cursor, end) and (batch := lane.take_many(cursor, NODE_BATCH, NODE_BATCH_BYTES, report_skips=True)):
            batch = [step for step in batch if not _past(step.cursor, end)]  # the next epoch's: the next pass's
            if not batch:
                break
            samples = [transform(step) if isinstance(step, LaneItem) else None for step in batch]
            cursor = batch[-1].next
            lane.consume(cursor)  # read: their space is free while the samples travel on
            for read, step in zip(samples, batch, strict=True):
                if isinstance(step, LaneSkip):
                    times = repeats.skipped(step.name, step.reason)
                else:
                    times, at = repeats.sample(step.name, read), step.cursor
                for _ in range(times):
                    if repeats.deliver():
                        if self._pass is token:
                            self._cursor, self._owed = step.next, (at, repeats.due, repeats.since)
                        yield repeats.previous
        repeats.end()


def _past(cursor: Cursor, end: int | None) -> bool:
    """True if ``cursor`` is at or after the start of epoch ``end`` (None: never)."""
    return end is not None and cursor.epoch >= end
