"""Jobs: a training job registers its node's share with the daemon and reads it by lane.

A job (``PUT /v1/jobs/NAME``) is one :class:`~cachepipe.node.NodePipeline`: the job names its
source and plan (epochs, shuffle, seed, world size, the ranks on this node, DataLoader workers per
rank); the daemon's ``jobs`` section decides everything that touches the node: where the cache
is (``root/NAME``, a name of letters, digits, ``.``, ``_`` and ``-``, so a job cannot write
outside ``root``), how much of the disk all jobs may take together (``capacity``), which sources
it may read (``sources``, URL prefixes; a manifest must be under one too), the credentials and
endpoint (``options.storage_options``) and the download settings. A second registration of
the same name must ask for the same thing (each lane of a job registers on start; the first
creates the job); a different one is refused (409) naming the first field that differs.

A job lives until ``DELETE /v1/jobs/NAME`` (its cached items are deleted) or until the daemon
stops (they are kept, and reused when the job registers again).
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ..config import Capacity, PipelineConfig, Share, check_manifest_location
from ..node import NodePipeline, Taken
from ..plan import Cursor
from .errors import StoppingError, UnknownPipelineError

__all__ = ["JobConflictError", "JobSpec", "Jobs", "JobsConfig"]

log = logging.getLogger("cachepipe.service")

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_JOB_FIELDS = ("source", "items", "manifest", "epochs", "shuffle", "seed", "balance", "partition", "retain")
_NODE_SETS = {"cache_dir", "capacity", "keep_on_close", "resume", "rank", "worker", "world_size", "num_workers"}


class JobConflictError(ValueError):
    """A job of that name exists with another spec, or there is no room for another job (HTTP 409)."""


class JobsConfig(BaseModel):
    """The ``jobs`` section of the daemon's configuration: what registered jobs may do.

    Attributes:
        root: absolute directory; job ``NAME`` caches under ``root/NAME``.
        capacity: the most all jobs together may hold (a size, or a share of the free space
            of ``root`` like ``"80%"`` resolved when a job registers).
        sources: URL prefixes a job's ``source`` and ``manifest`` must start with (empty: any).
        max_jobs: most jobs registered at once (default 4).
        options: :class:`~cachepipe.PipelineConfig` options for every job (``storage_options``,
            ``max_concurrency``, ``part_size``...); not the ones a job gives or the node decides.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    root: Path
    capacity: Capacity
    sources: list[str] = Field(default_factory=list)
    max_jobs: int = Field(default=4, ge=1, le=1024)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> JobsConfig:
        if not self.root.is_absolute():
            raise ValueError(f"jobs.root {str(self.root)!r}: expected an absolute path")
        for key in self.options:
            if key not in PipelineConfig.model_fields:
                raise ValueError(f"jobs.options.{key}: not a pipeline option (see cachepipe.PipelineConfig)")
            if key in _NODE_SETS or key in _JOB_FIELDS:
                raise ValueError(f"jobs.options.{key}: set by the job or by the daemon, not in jobs.options")
        return self


class JobSpec(BaseModel):
    """What a job asks for when it registers (the body of ``PUT /v1/jobs/NAME``).

    Attributes:
        source: the dataset URL (under one of the daemon's ``jobs.sources``).
        items, manifest, epochs, shuffle, seed, balance, partition, retain, on_error,
            on_oversize: as for :class:`~cachepipe.Pipeline` (``manifest`` also under
            ``jobs.sources``).
        world_size: ranks in the whole job.
        ranks: the ranks on this node.
        num_workers: DataLoader workers per rank (1: none).
        capacity: this job's share of ``jobs.capacity`` (default: all of it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(min_length=1)
    items: Literal["folders", "files"] = "folders"
    manifest: Annotated[str | None, BeforeValidator(check_manifest_location)] = None
    epochs: int | None = Field(default=1, ge=1)
    shuffle: bool = False
    seed: int = 0
    balance: Literal["bytes", "count"] = "bytes"
    partition: Literal["epoch", "fixed"] = "epoch"
    retain: Literal["none", "auto"] = "none"
    on_error: Literal["raise", "skip"] = "raise"
    on_oversize: Literal["raise", "skip"] = "raise"
    world_size: int = Field(ge=1)
    ranks: list[int] = Field(min_length=1)
    num_workers: int = Field(default=1, ge=1, le=1024)
    capacity: Capacity | None = None


class _Job:
    def __init__(self, name: str, spec: JobSpec, pipeline: NodePipeline) -> None:
        self.name, self.spec, self.pipeline = name, spec, pipeline


class Jobs:
    """The registered jobs of a daemon (thread-safe).

    Args:
        config: the daemon's ``jobs`` section.
    """

    def __init__(self, config: JobsConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # guards _jobs; registration opens a pipeline under it
        self._jobs: dict[str, _Job] = {}
        self._closed = False

    def register(self, name: str, body: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Create job ``name`` from ``body`` (a :class:`JobSpec`), or check it against the
        existing one; returns ``(created, description)``.

        Raises:
            ValueError: a bad name or spec (pydantic's error names the field), a source or
                manifest outside ``jobs.sources``.
            JobConflictError: the job exists with another spec, or ``max_jobs`` or the capacity
                would be exceeded.
            CachePipeError: the job's pipeline cannot open (listing, manifest, capacity).
        """
        if not _JOB_NAME.match(name):
            raise ValueError(f"job name {name!r}: expected 1-64 letters, digits, '.', '_' or '-', not starting with '.'")
        spec = JobSpec.model_validate(body)
        self._check_sources(spec)
        with self._lock:
            if self._closed:
                raise StoppingError("the daemon is stopping")
            job = self._jobs.get(name)
            if job is not None:
                self._check_same(job, spec)
                return False, self._describe(job)
            if len(self._jobs) >= self.config.max_jobs:
                raise JobConflictError(
                    f"job {name!r}: {len(self._jobs)} jobs are registered, jobs.max_jobs is {self.config.max_jobs}; "
                    f"DELETE /v1/jobs/NAME of one that ended ({', '.join(sorted(self._jobs))})"
                )
            capacity = self._capacity(name, spec)
            pipeline = NodePipeline(
                spec.source,
                self.config.root / name,
                capacity,
                ranks=spec.ranks,
                world_size=spec.world_size,
                num_workers=spec.num_workers,
                **{**self.config.options, "keep_on_close": True},
                **spec.model_dump(include={*_JOB_FIELDS, "on_error", "on_oversize"} - {"source"}),
            )
            pipeline.open()
            job = _Job(name, spec, pipeline)
            self._jobs[name] = job
            log.info("job %s registered: %s, ranks %s of %d", name, spec.source, spec.ranks, spec.world_size)
            return True, self._describe(job)

    def _check_sources(self, spec: JobSpec) -> None:
        allowed = self.config.sources
        if not allowed:
            return
        for field, value in (("source", spec.source), ("manifest", spec.manifest)):
            if value is not None and not any(value.startswith(prefix) for prefix in allowed):
                raise ValueError(f"{field} {value!r}: this daemon's jobs may read only under {allowed} (jobs.sources)")

    def _check_same(self, job: _Job, spec: JobSpec) -> None:
        mine, theirs = job.spec.model_dump(), spec.model_dump()
        for key, value in mine.items():
            if theirs[key] != value and not (key == "capacity" and theirs[key] is None):
                raise JobConflictError(
                    f"job {job.name!r} is registered with {key}={value!r}, this registration asks for "
                    f"{key}={theirs[key]!r}: every lane of a job must register the same spec (or DELETE the job first)"
                )

    def _capacity(self, name: str, spec: JobSpec) -> int:
        """Bytes for a new job: what it asks for (default all of ``jobs.capacity``), if the
        registered jobs leave that much."""
        root = self.config.root
        root.mkdir(parents=True, exist_ok=True)
        total = self._bytes(self.config.capacity, root)
        taken = sum(job.pipeline.config.capacity for job in self._jobs.values() if isinstance(job.pipeline.config.capacity, int))
        want = total - taken if spec.capacity is None else self._bytes(spec.capacity, root)
        if want <= 0 or taken + want > total:
            raise JobConflictError(
                f"job {name!r} asks for {want} bytes; jobs.capacity is {total} bytes and registered jobs hold {taken}: "
                "DELETE a job that ended, or ask for less"
            )
        return want

    @staticmethod
    def _bytes(capacity: int | Share, root: Path) -> int:
        if isinstance(capacity, Share):
            return int(shutil.disk_usage(root).free * capacity.fraction)
        return capacity

    def _job(self, name: str) -> _Job:
        with self._lock:
            job = self._jobs.get(name)
        if job is None:
            raise UnknownPipelineError(f"no job {name!r}: register it with PUT /v1/jobs/{name}")
        return job

    def take(self, name: str, rank: int, worker: int, cursor: Cursor, timeout: float | None) -> Taken | None:
        """:meth:`NodePipeline.take` of job ``name``."""
        return self._job(name).pipeline.take(rank, worker, cursor, timeout)

    def consume(self, name: str, rank: int, worker: int, cursor: Cursor) -> None:
        """:meth:`NodePipeline.consume` of job ``name``."""
        self._job(name).pipeline.consume(rank, worker, cursor)

    def delete(self, name: str) -> None:
        """End job ``name``: stop its downloads and delete its cached items.

        Raises:
            UnknownPipelineError: no such job.
        """
        with self._lock:
            job = self._jobs.pop(name, None)
        if job is None:
            raise UnknownPipelineError(f"no job {name!r}")
        pipe = job.pipeline
        pipe.config = pipe.config.model_copy(update={"keep_on_close": False})
        pipe.close()
        log.info("job %s deleted", name)

    def close(self) -> None:
        """Close every job, keeping its items for a later registration. Idempotent."""
        with self._lock:
            self._closed = True
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            job.pipeline.close()

    def entries(self) -> list[tuple[str, NodePipeline, dict[str, Any]]]:
        """``(name, pipeline, description)`` of every registered job."""
        with self._lock:
            jobs = list(self._jobs.values())
        return [(job.name, job.pipeline, self._describe(job)) for job in jobs]

    @staticmethod
    def _describe(job: _Job) -> dict[str, Any]:
        pipe = job.pipeline
        return {
            "job": job.name,
            "spec": job.spec.model_dump(),
            "cache_dir": str(pipe.config.cache_dir),
            "capacity": pipe.config.capacity,
            "lanes": [list(lane) for lane in pipe.node_plan.lanes],
            "items": pipe.node_plan.n_items,
            "catalog_digest": pipe.catalog_digest,
        }
