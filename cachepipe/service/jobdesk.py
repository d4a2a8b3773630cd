"""The daemon's jobs (:mod:`cachepipe.service.jobs`), as the socket API asks for them: register
and delete a job, take and consume a lane's steps, and the manifests jobs plan from.

Invariant: every job operation fails with ``StoppingError`` (503 ``stopping``: the lane asks
the next daemon) once the daemon is not serving, and with ``UnknownPipelineError`` when it has
no ``jobs`` section; a lane's wait is capped by ``max_wait``; a registration that meets a full
disk (``ENOSPC``, ``EDQUOT``) fails with an ``OSError`` of that errno naming the job (507
``insufficient_storage``), not 500. :class:`_JobDesk` is a base class of
:class:`~cachepipe.service.daemon.Daemon`, not used alone.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import CachePipeError
from ..plan import Cursor
from .errors import StoppingError, UnknownPipelineError
from .jobs import Jobs
from .served import _RUNNING, _DaemonState

if TYPE_CHECKING:
    from ..node import SkippedStep, Taken

__all__: list[str] = []


class _JobDesk(_DaemonState):
    """The daemon's job operations (see the module notes)."""

    def _job_registry(self) -> Jobs:
        if self._state != _RUNNING:
            raise StoppingError(f"{self!r} is not serving")
        if self._jobs is None:
            raise UnknownPipelineError("this daemon takes no jobs: its configuration has no jobs section")
        return self._jobs

    def register_job(self, name: str, spec: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Register job ``name`` (see :meth:`.jobs.Jobs.register`); ``(created, description)``."""
        registry = self._job_registry()
        try:
            return registry.register(name, spec)
        except RuntimeError as exc:  # its pipeline closed while it opened: the daemon stops
            raise self._stopped_under(exc, f"register job {name!r}") from exc
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # another writer filled the disk: not the daemon's failure (500), and room may come back (507)
            if exc.filename is None and exc.strerror and exc.strerror.startswith("cache_dir "):  # the cache's open: said all
                why = exc.strerror
            else:
                why = f"{exc}: the disk is full (or the quota reached)"
            root = registry.config.root
            message = f"job {name!r} cannot open its cache under {root}: {why}; register again once there is room"
            raise OSError(exc.errno, message) from exc

    def delete_job(self, name: str) -> None:
        """End job ``name`` and delete its items (see :meth:`.jobs.Jobs.delete`)."""
        self._job_registry().delete(name)

    def take_lane(
        self,
        name: str,
        rank: int,
        worker: int,
        cursor: Cursor,
        timeout: float | None,
        count: int = 1,
        max_bytes: int | None = None,
        report_skips: bool = False,
    ) -> list[Taken] | list[SkippedStep]:
        """The item at ``cursor`` of lane ``(rank, worker)`` of job ``name`` and up to ``count - 1``
        more already on disk (see :meth:`cachepipe.node.NodePipeline.take_many`, and its
        ``report_skips``); blocks up to ``timeout`` seconds for the first, capped by
        ``max_wait``. Empty: the lane's share ended."""
        limit = self.config.max_wait if timeout is None else min(timeout, self.config.max_wait)
        key = f"job/{name}"
        self._count_waiting(key, +1)
        try:
            return self._job_registry().take(name, rank, worker, cursor, limit, count, max_bytes, report_skips)
        except RuntimeError as exc:
            raise self._stopped_under(exc, f"take from lane {rank}.{worker} of job {name!r}") from exc
        finally:
            self._count_waiting(key, -1)

    def consume_lane(self, name: str, rank: int, worker: int, cursor: Cursor) -> None:
        """Lane ``(rank, worker)`` of job ``name`` is done with every step before ``cursor``."""
        try:
            self._job_registry().consume(name, rank, worker, cursor)
        except RuntimeError as exc:
            raise self._stopped_under(exc, f"consume on lane {rank}.{worker} of job {name!r}") from exc

    def _stopped_under(self, exc: RuntimeError, what: str) -> Exception:
        """``exc`` from a job's node pipeline, or, if it closed under the request because the
        daemon stops (not a cachepipe error of its own), a StoppingError (503 ``stopping``: the
        lane asks the next daemon; before, 500 ``internal``, and the lane gave up)."""
        with self._cond:
            stopping = self._state != _RUNNING
        if stopping and not isinstance(exc, CachePipeError):
            return StoppingError(f"cannot {what}: the daemon is shutting down (the lane asks again after it restarts)")
        return exc

    def manifest_limit(self) -> int:
        """The largest manifest a job may upload, in bytes (``jobs.max_manifest``)."""
        return self._job_registry().config.max_manifest

    def upload_manifest(self, body: BinaryIO, length: int) -> dict[str, Any]:
        """Keep an uploaded manifest for jobs to plan from (see :meth:`.jobs.Jobs.upload_manifest`)."""
        return self._job_registry().upload_manifest(body, length)

    def index_source(self, source: str, items: str) -> dict[str, Any]:
        """List ``source`` into a manifest for jobs (see :meth:`.jobs.Jobs.index_source`)."""
        return self._job_registry().index_source(source, items)

    def manifest_bytes(self, digest: str) -> bytes:
        """The bytes of the manifest ``digest`` (uploaded or listed here)."""
        return self._job_registry().manifest_bytes(digest)
