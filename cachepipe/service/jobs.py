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

Listed once per job. A job of several nodes has a daemon per node, and each would list the
source: at different moments, so possibly over different objects. Instead the job's rank 0
lists it once and every rank uploads that manifest to its node's daemon (``PUT
/v1/manifests``, kept under ``root/.manifests/DIGEST.json.gz``, its digest checked against its
content); the spec then names it by digest (``"catalog": DIGEST``), and every node plans from
the same catalog. Each is written to a temporary name there (``.upload-*``, ``.index-*``) and
renamed once checked; those of a daemon killed meanwhile are removed by the next write there
when no other is under way, also of another daemon on the same root (:meth:`Jobs._manifests`,
:class:`.jobsroot.ManifestsLock`; not on a mount without locks: left there). The manifests no job names are removed
once older than ``jobs.manifest_grace`` (when a job is deleted, and at the daemon's start), and
a second daemon on the same root is refused: :mod:`.jobsroot`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from pydantic import ValidationError

from ..cache.lock import STATE_DIR
from ..cache.room import room_at
from ..config import PipelineConfig, Share, check_absolute_source, in_our_words, with_unit
from ..errors import CachePipeError, CacheRemovedError, ConfigError
from ..manifest import index, read_manifest
from ..plan import Cursor
from ..removal import rmtree
from ..state import atomic_write
from ..wholefiles import naming
from .closing import Closer
from .errors import ClientGone, StoppingError, UnknownPipelineError
from .jobspec import _JOB_FIELDS, JobsConfig, JobSpec
from .jobsroot import MANIFEST_NAME, MANIFESTS_LOCK, ManifestsLock, RootLock, unneeded

if TYPE_CHECKING:
    from ..node import NodePipeline, SkippedStep, Taken

__all__ = ["JobConflictError", "JobSpec", "Jobs", "JobsConfig"]

log = logging.getLogger("cachepipe.service")

_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_RETRY_OPTIONS = ("retries", "retry_backoff", "retry_backoff_max")  # jobs.options a manifest's listing takes too


class JobConflictError(ValueError):
    """A job of that name exists with another spec, or there is no room for another job (HTTP 409)."""


def _under(value: str, prefix: str) -> bool:
    """Whether the URL ``value`` is ``prefix`` or under it, by whole path segments: under
    ``s3://b/data`` are ``s3://b/data`` and ``s3://b/data/x``, not ``s3://b/data-private/``."""
    if prefix.endswith("/"):
        return value.startswith(prefix) or value == prefix[:-1]
    return value == prefix or value.startswith(prefix + "/")


class _Job:
    def __init__(self, name: str, spec: JobSpec, pipeline: NodePipeline) -> None:
        self.name, self.spec, self.pipeline = name, spec, pipeline


_DELETE = "`cachepipe delete-job NAME`, or DELETE /v1/jobs/NAME"


def _remove_emptied(cache_dir: Path) -> None:
    """After a deleted job's pipeline closed (its items deleted): remove what is left of its cache
    directory, its state (``.cachepipe``: the lock, the journal, the note of what it held) and
    then the folder, if nothing else is left in it. Each job name run and deleted left its folder
    and state behind (three files, about 4 KiB with the journal), under ``root`` for good. Anything
    else left there keeps both: an item the close could not delete (its journal line is what lets
    the next owner delete it, not take it for foreign), a foreign file. Not called where the
    folder was removed or replaced since the job opened it (another owner's now, maybe: its
    close touched nothing there either). A failure is logged, not raised: the job is deleted
    either way."""
    try:
        with os.scandir(cache_dir) as entries:
            if any(entry.name != STATE_DIR for entry in entries):
                return
        rmtree(cache_dir / STATE_DIR)
        cache_dir.rmdir()
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            log.warning("job folder %s: not removed after its job was deleted: %s", cache_dir, exc)


class Jobs:
    """The registered jobs of a daemon (thread-safe).

    Args:
        config: the daemon's ``jobs`` section.
        closer: closes the pipeline of a job dropped because its cache directory was removed,
            in the background (default: one of its own).
    """

    def __init__(self, config: JobsConfig, closer: Closer | None = None) -> None:
        self.config = config
        self._closer = closer or Closer()
        self._lock = threading.Lock()  # guards _jobs, _closed, _opening and _deleting; never held while a pipeline opens
        self._deleted = threading.Condition(self._lock)  # a delete's close ended (_deleting)
        self._registering = threading.Lock()  # one registration at a time, held while its pipeline opens (lists)
        self._deleting: set[str] = set()  # the jobs whose delete closes their pipeline now
        self._jobs: dict[str, _Job] = {}
        self._closed = False
        self._opening: NodePipeline | None = None  # the pipeline register() opens: close() closes it, aborting its listing
        self._pinned: str | None = None  # the manifest (digest) register() opens a job over: named (see _named)
        self._root_lock: RootLock | None = None

    def start(self, socket_path: str) -> None:
        """At the daemon's start: lock ``jobs.root`` for this daemon, then remove the manifests
        no job folder names (see :mod:`.jobsroot`). A root that cannot be made or locked
        (permissions, no locks there) is said in a warning: its jobs' registrations say why they fail.

        Raises:
            OSError: ``EADDRINUSE``, another live daemon serves the root (its pid named).
        """
        lock = RootLock(self.config.root, socket_path)
        try:
            lock.acquire()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise
            log.warning(
                "jobs.root %s: cannot be locked for this daemon (%s): a second daemon on it would not be refused, "
                "and its jobs cannot register",
                self.config.root,
                exc,
            )
            return
        self._root_lock = lock
        self._sweep("no job folder under jobs.root names it (the daemon's start)")

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
        try:
            spec = JobSpec.model_validate(body)
        except ValidationError as exc:  # its message is the 400's: without pydantic's link
            raise in_our_words(exc) from None
        self._check_sources(spec)
        self._closer.wait(f"job/{name}")  # a job of this name dropped: its close ends before it opens again
        with self._registration(name):
            if self._closed:
                raise StoppingError("the daemon is stopping")
            job = self._jobs.get(name)
            if job is not None:
                self._check_same(job, spec)
                return False, self._describe(job)
            if len(self._jobs) >= self.config.max_jobs:
                raise JobConflictError(
                    f"job {name!r}: {len(self._jobs)} jobs are registered, jobs.max_jobs is {self.config.max_jobs}; "
                    f"delete one that ended (`cachepipe delete-job NAME`, or DELETE /v1/jobs/NAME; jobs: "
                    f"{', '.join(sorted(self._jobs))})"
                )
            self._pinned = spec.catalog  # not removed while the job opens over it (one registration at a time)
            try:
                return self._create(name, spec)
            finally:
                self._pinned = None

    def _create(self, name: str, spec: JobSpec) -> tuple[bool, dict[str, Any]]:
        """Open job ``name`` of ``spec`` (see :meth:`register`; called holding the registration
        and the jobs' lock, which it lets go while the job's pipeline opens)."""
        uploaded = None if spec.catalog is None else str(self._uploaded(spec.catalog))
        capacity = self._capacity(name, spec)
        options = {
            **self.config.options,
            "keep_on_close": True,
            **spec.model_dump(include={*_JOB_FIELDS, "on_error", "on_oversize"} - {"source"}),
        }
        if uploaded is not None:
            options["manifest"] = uploaded
        from ..node import NodePipeline  # imported by the first job, not by every daemon's start

        pipeline = NodePipeline(
            spec.source,
            self.config.root / name,
            with_unit(capacity),
            ranks=spec.ranks,
            world_size=spec.world_size,
            num_workers=spec.num_workers,
            **options,
        )
        self._opening = pipeline
        self._lock.release()  # the listing may take minutes: lanes, status and close() go on meanwhile
        try:
            pipeline.open()  # raises RuntimeError if close() closed it meanwhile
        finally:
            self._lock.acquire()
            self._opening = None
        if self._stopped():  # close() came after the open: its jobs did not include this one
            pipeline.close()
            raise StoppingError("the daemon is stopping")
        job = _Job(name, spec, pipeline)
        self._jobs[name] = job
        self._note(name, spec.catalog)
        log.info("job %s registered: %s, ranks %s of %d", name, spec.source, spec.ranks, spec.world_size)
        return True, self._describe(job)

    @contextlib.contextmanager
    def _registration(self, name: str) -> Iterator[None]:
        """Hold the one registration at a time and the jobs' lock, once no delete of job ``name``
        closes its pipeline (it lets the cache directory go before the job opens again). That
        delete is waited for holding neither: its close deletes every item of the job's cache
        (minutes for a large one), and the registrations of other jobs go on meanwhile."""
        while True:
            with self._lock:
                self._deleted.wait_for(lambda: name not in self._deleting)
            self._registering.acquire()
            self._lock.acquire()
            if name not in self._deleting:  # else deleted again while this one waited for the registration lock
                break
            self._lock.release()
            self._registering.release()
        try:
            yield
        finally:
            self._lock.release()
            self._registering.release()

    def _stopped(self) -> bool:
        """Whether close() was called (read again after the lock was let go, see register())."""
        return self._closed

    def _uploaded(self, digest: str) -> Path:
        path = self.config.root / ".manifests" / f"{digest}.json.gz"
        if not path.is_file():
            raise JobConflictError(
                f"catalog {digest!r}: no manifest of that digest was uploaded (PUT /v1/manifests first; one no job "
                f"names is removed {self.config.manifest_grace:g} s after it was written, jobs.manifest_grace)"
            )
        return path

    def _note(self, name: str, digest: str | None) -> None:
        """Note that job ``name`` plans from manifest ``digest`` (None: from none, an empty note),
        in ``root/.manifests/jobs/NAME``: kept while its job folder is (see :mod:`.jobsroot`). A
        failure is logged: its folder then has no note, and keeps every manifest (:meth:`_unnoted`)."""
        path = self.config.root / ".manifests" / "jobs" / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, b"" if digest is None else f"{digest}\n".encode())
        except OSError as exc:
            log.warning("job %s: could not note in %s that it plans from manifest %s: %s", name, path, digest, exc)

    def _named(self, now: float) -> set[str]:
        """The digests of the manifests a job names (called holding the jobs' lock): the
        registered jobs' catalogs, the one a registration opens over, and those the notes of job
        folders under ``root`` name. A note whose folder is gone is removed once older than the grace."""
        named = {job.spec.catalog for job in self._jobs.values() if job.spec.catalog is not None}
        if self._pinned is not None:
            named.add(self._pinned)
        notes = self.config.root / ".manifests" / "jobs"
        try:
            entries = list(os.scandir(notes))
        except FileNotFoundError:
            return named
        for entry in entries:
            name = entry.name
            if not _JOB_NAME.match(name):  # an atomic_write's temporary file
                continue
            try:
                digest, written = Path(entry.path).read_text().strip(), entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            live = name in self._jobs or name in self._deleting or (self.config.root / name).is_dir()
            if live or now - written < self.config.manifest_grace:
                named.add(digest)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            if digest:  # an empty note named none
                log.info("job %s: its folder is gone, so its manifest %s is no longer kept for it", name, digest)
        return named

    def _unnoted(self) -> list[str]:
        """The job folders under ``root`` without a note (called holding the jobs' lock), but a
        registered job's (its catalog is named) and the one a registration opens: left by a
        cachepipe before the notes (2026-12-01), or whose note could not be written. The manifest
        each plans from is not known, so none is removed while there is one (:meth:`_sweep`)."""
        notes = self.config.root / ".manifests" / "jobs"
        opening = None if self._opening is None else Path(self._opening.config.cache_dir).name
        return sorted(
            entry.name
            for entry in os.scandir(self.config.root)
            if _JOB_NAME.match(entry.name)
            and entry.name not in self._jobs
            and entry.name != opening
            and entry.is_dir(follow_symlinks=False)
            and not (notes / entry.name).exists()
        )

    def _sweep(self, why: str, deleted: _Job | None = None) -> None:
        """Remove the manifests no job names (:meth:`_named`) written ``jobs.manifest_grace``
        seconds ago or more (:func:`.jobsroot.unneeded`), each logged at INFO with ``why`` (or,
        for the catalog of the job ``deleted``, that it was its last). Holds the folder's lock
        exclusively (:class:`.jobsroot.ManifestsLock`), so no upload or listing (of this daemon, or
        of another on the root where it was not refused) writes meanwhile: its ``os.replace`` of
        the same digest, a moment before the removal, would be undone. Skipped while one is under
        way (the next delete or start removes them), and where the lock cannot be taken (a mount
        without locks): said in the log. Holds the jobs' lock too: no registration takes a
        manifest meanwhile. A failure is logged, not raised."""
        folder = self.config.root / ".manifests"
        try:
            lock = ManifestsLock(folder)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("manifests in %s: none removed: %s", folder, exc)
            return
        try:
            alone = lock.alone()
            if not alone:
                if alone is None:
                    log.warning(
                        "manifests in %s: none removed: %s %s",
                        folder,
                        MANIFESTS_LOCK,
                        "cannot be locked (a mount without locks: nolock, ENOLCK)"
                        if lock.unopened is None
                        else f"cannot be opened ({lock.unopened.strerror})",
                    )
                else:
                    log.info(
                        "manifests in %s: none removed now: a manifest is being written there (the next delete removes them)",
                        folder,
                    )
                return
            with self._lock:
                now, grace = time.time(), self.config.manifest_grace
                written = {}
                for entry in os.scandir(folder):
                    if (found := MANIFEST_NAME.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False):
                        written[found[1]] = entry.stat(follow_symlinks=False).st_mtime
                named, unnoted = self._named(now), self._unnoted()
                if unnoted and written:
                    log.info(
                        "manifests in %s: none removed: the job folder%s %s name%s none (left by a cachepipe before "
                        "2026-12-01, or the note could not be written): the manifest a job there plans from is not "
                        "known, so all are kept until it registers again (or its folder is removed)",
                        folder,
                        "s" if len(unnoted) > 1 else "",
                        ", ".join(map(repr, unnoted)),
                        "" if len(unnoted) > 1 else "s",
                    )
                    return
                for digest in unneeded(written, named, now, grace):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(folder / f"{digest}.json.gz")
                    last = deleted is not None and deleted.spec.catalog == digest
                    log.info(
                        "manifest %s removed: %s (written %.0f s ago; jobs.manifest_grace is %g s)",
                        digest,
                        f"its last job, {deleted.name!r}, was deleted" if last and deleted is not None else why,
                        now - written[digest],
                        grace,
                    )
        except OSError as exc:
            log.warning("manifests in %s: not all removed: %s", folder, exc)
        finally:
            lock.close()

    def upload_manifest(self, body: BinaryIO, length: int) -> dict[str, Any]:
        """Read a manifest of ``length`` bytes from ``body``, check it (its digest against its
        content, its source against ``jobs.sources``) and keep it as ``root/.manifests/DIGEST.json.gz``.

        Returns:
            ``{"catalog": DIGEST, "source", "items", "count"}``.

        Raises:
            ValueError: not a manifest, or one of a source this daemon's jobs may not read.
            ClientGone: the client sent fewer than ``length`` bytes.
        """
        with self._manifests() as folder:
            return self._upload(folder, body, length)

    def _upload(self, folder: Path, body: BinaryIO, length: int) -> dict[str, Any]:
        fd, tmp = tempfile.mkstemp(prefix=".upload-", suffix=".json.gz", dir=folder)
        try:
            with naming(f"cannot keep the uploaded manifest in {str(folder)!r}"), os.fdopen(fd, "wb") as out:
                left = length
                while left:
                    chunk = body.read(min(left, 1 << 20))
                    if not chunk:
                        raise ClientGone(f"the client closed the connection after {length - left} of {length} bytes")
                    out.write(chunk)
                    left -= len(chunk)
            try:
                manifest = read_manifest(tmp)
            except ConfigError as exc:
                raise ValueError(f"upload of {length} bytes is not a manifest of `cachepipe index`: {exc}") from None
            if self.config.sources and not any(manifest.source.startswith(p) for p in self.config.sources):
                raise ValueError(
                    f"manifest of source {manifest.source!r}: this daemon's jobs may read only under {self.config.sources}"
                )
            os.replace(tmp, folder / f"{manifest.digest}.json.gz")  # same content, same name: a race is harmless
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        log.info("manifest %s uploaded: %s, %d items", manifest.digest, manifest.source, len(manifest.catalog))
        return {"catalog": manifest.digest, "source": manifest.source, "items": manifest.items, "count": len(manifest.catalog)}

    def index_source(self, source: str, items: str) -> dict[str, Any]:
        """List ``source`` (under ``jobs.sources``, with ``jobs.options``' storage options and
        retries, as a job's listing) once, into a manifest kept like an uploaded one.

        Raises:
            ValueError: a source this daemon's jobs may not read, or bad ``items``.
            CachePipeError, OSError: the listing failed.
        """
        if items not in ("folders", "files"):
            raise ValueError(f"items {items!r}: expected 'folders' or 'files'")
        self._check_sources(JobSpec(source=source, world_size=1, ranks=[0]))
        with self._manifests() as folder:
            fd, tmp = tempfile.mkstemp(prefix=".index-", suffix=".json.gz", dir=folder)
            os.close(fd)
            try:
                options = self.config.options
                retry = {k: options.get(k, PipelineConfig.model_fields[k].default) for k in _RETRY_OPTIONS}
                manifest = index(source, tmp, items, options.get("storage_options"), **retry)  # type: ignore[arg-type]
                os.replace(tmp, folder / f"{manifest.digest}.json.gz")
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        log.info("listed %s for jobs: manifest %s, %d items", source, manifest.digest, len(manifest.catalog))
        return {"catalog": manifest.digest, "source": manifest.source, "items": manifest.items, "count": len(manifest.catalog)}

    @contextlib.contextmanager
    def _manifests(self) -> Iterator[Path]:
        """``root/.manifests``, made if need be, to write a manifest into: its temporary files
        (``.upload-*``, ``.index-*``: every name there that begins with a dot, but the lock file) are
        this writer's while it holds the folder's lock (:class:`.jobsroot.ManifestsLock`, shared).
        Before it takes it, those of writers that are gone (a daemon killed during an upload or a
        listing) are removed, if no other writer, of this daemon or of another on the same root, is
        under way: that takes the lock exclusively, and is skipped while it cannot (a later write
        removes them), and where it cannot be taken (a mount without locks: a write then leaves them)."""
        folder = self.config.root / ".manifests"
        folder.mkdir(parents=True, exist_ok=True)
        with ManifestsLock(folder) as lock:
            if lock.alone():  # None: whether another writer is under way cannot be known, so nothing is removed
                for entry in os.scandir(folder):
                    if entry.name.startswith(".") and entry.name != MANIFESTS_LOCK and entry.is_file(follow_symlinks=False):
                        log.info("removing %s, left in %s by a daemon that was killed while writing it", entry.name, folder)
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
            lock.share()
            yield folder

    def manifest_bytes(self, digest: str) -> bytes:
        """The bytes of manifest ``digest``.

        Raises:
            UnknownPipelineError: no such manifest here (HTTP 404).
        """
        if not re.fullmatch(r"[0-9a-f]{32}", digest):
            raise UnknownPipelineError(f"manifest {digest!r}: expected a digest of 32 hex digits")
        try:
            return (self.config.root / ".manifests" / f"{digest}.json.gz").read_bytes()
        except FileNotFoundError:
            raise UnknownPipelineError(f"no manifest {digest!r} on this daemon") from None

    def _check_sources(self, spec: JobSpec) -> None:
        for field, value in (("source", spec.source), ("manifest", spec.manifest)):
            if value is not None:  # a lane's relative path is relative to its own directory, not the daemon's
                check_absolute_source(value, field)
        allowed = self.config.sources
        if not allowed:
            return
        for field, value in (("source", spec.source), ("manifest", spec.manifest)):
            if value is None:
                continue
            path = value.split("://", 1)[-1]
            if any(segment in (".", "..") for segment in path.split("/")):
                raise ValueError(f"{field} {value!r}: a '.' or '..' path segment; expected a URL under {allowed} without them")
            if not any(_under(value, prefix) for prefix in allowed):
                raise ValueError(f"{field} {value!r}: this daemon's jobs may read only under {allowed} (jobs.sources)")

    def _check_same(self, job: _Job, spec: JobSpec) -> None:
        mine, theirs = job.spec.model_dump(), spec.model_dump()
        for key, value in mine.items():
            if theirs[key] != value and not (key == "capacity" and theirs[key] is None):
                raise JobConflictError(
                    f"job {job.name!r} is registered with {key}={value!r}, this registration asks for "
                    f"{key}={theirs[key]!r}: every lane of a job must register the same spec (or delete the job first: "
                    f"`cachepipe delete-job {job.name}`)"
                )

    def _capacity(self, name: str, spec: JobSpec) -> int:
        """Bytes for a new job: what it asks for (default all of ``jobs.capacity``), if the
        registered jobs leave that much."""
        root = self.config.root
        root.mkdir(parents=True, exist_ok=True)
        room = self._room(name) if Share in (type(self.config.capacity), type(spec.capacity)) else 0
        total = self._bytes(self.config.capacity, room)
        taken = sum(job.pipeline.config.capacity for job in self._jobs.values() if isinstance(job.pipeline.config.capacity, int))
        want = total - taken if spec.capacity is None else self._bytes(spec.capacity, room)
        if want <= 0 or taken + want > total:
            free = max(total - taken, 0)
            if spec.capacity is None:
                asked = "the rest of jobs.capacity (its spec gives no capacity)"
            elif isinstance(spec.capacity, Share):
                asked = f"capacity {spec.capacity} of the disk space free or held by jobs ({want} bytes)"
            else:
                asked = f"capacity {want} bytes"
            size = (
                f"{self.config.capacity} of the disk space free or held by jobs, {total} bytes"
                if isinstance(self.config.capacity, Share)
                else f"{total} bytes"
            )
            held = ", ".join(f"{other!r} {job.pipeline.config.capacity}" for other, job in sorted(self._jobs.items()))
            fix = (
                f"give the job a capacity of at most {free} bytes, or delete a job that ended ({_DELETE})"
                if free
                else f"delete a job that ended ({_DELETE})"
            )
            raise JobConflictError(
                f"job {name!r} asks for {asked}, and {free} bytes are available: jobs.capacity is {size} and the "
                f"registered jobs hold {taken} ({held or 'none'}): {fix}"
            )
        return want

    def _room(self, name: str) -> int:
        """The bytes a share of the disk is of: the free space under root and what the registered
        jobs and job ``name`` hold in their folders. Their items are room of ``jobs.capacity``, not
        taken from it: a job registered again after a restart finds the size it had, though its
        items (kept for it) have taken their part of the free space. The folders of other jobs not
        registered now stay taken."""
        root = self.config.root
        return room_at(root, [root / job for job in {*self._jobs, name}])

    @staticmethod
    def _bytes(capacity: int | Share, room: int) -> int:
        if isinstance(capacity, Share):
            return int(room * capacity.fraction)
        return capacity

    def _job(self, name: str) -> _Job:
        with self._lock:
            job = self._jobs.get(name)
        if job is None:
            raise UnknownPipelineError(f"no job {name!r}: register it with PUT /v1/jobs/{name}")
        return job

    def take(
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
        """:meth:`NodePipeline.take_many` of job ``name``.

        Raises:
            UnknownPipelineError: the job's cache directory was removed: the job is dropped, and
                a new registration opens it again in a fresh directory (a lane's
                :class:`~cachepipe.jobclient.JobClient` registers again and goes on); or the job
                was deleted while the take waited (as a take after the delete: see :meth:`_deleted_under`).
        """
        job = self._job(name)
        try:
            return job.pipeline.take_many(rank, worker, cursor, count, max_bytes, timeout, report_skips)
        except CacheRemovedError as exc:
            raise self._drop(job, exc) from None
        except (RuntimeError, KeyError) as exc:
            raise self._deleted_under(job, exc) from exc

    def _deleted_under(self, job: _Job, exc: Exception) -> Exception:
        """``exc`` from ``job``'s pipeline, or, where :meth:`delete` (or a drop) closed it under the request
        (its pipeline closed, or its items deleted while the request moved the lane), the 404 that
        makes a lane register the job again (before: 500 ``internal``, and the lane gave up).
        One closed by the daemon's stop is left to the caller (503 ``stopping``)."""
        with self._lock:
            deleted = not self._closed and self._jobs.get(job.name) is not job
        if not deleted or isinstance(exc, CachePipeError):
            return exc
        return UnknownPipelineError(
            f"job {job.name!r} was deleted (or dropped, its cache directory removed) while this request was served; "
            f"register it again (PUT /v1/jobs/{job.name}) to start over"
        )

    def check_caches(self) -> None:
        """Drop every job whose cache directory was removed (see :meth:`take`)."""
        for job in self._jobs_now():
            try:
                job.pipeline.check_cache()
            except CacheRemovedError as exc:
                self._drop(job, exc)
            except RuntimeError:
                pass  # closed meanwhile (deleted, or the daemon stopping)

    def _drop(self, job: _Job, exc: CacheRemovedError) -> UnknownPipelineError:
        """Forget ``job`` (its cache directory is gone) and close it; the error for its lanes."""
        with self._lock:
            mine = self._jobs.get(job.name) is job
            if mine:
                del self._jobs[job.name]
        if mine:
            log.error("job %s dropped: %s", job.name, exc)
            with contextlib.suppress(OSError):  # its lanes register it again at once: its manifest is kept the grace
                os.utime(self.config.root / ".manifests" / "jobs" / job.name)
            self._closer.close(f"job/{job.name}", job.pipeline)  # in the background: its downloads in flight end first
        return UnknownPipelineError(f"job {job.name!r} was dropped: {exc}; register it again to start over")

    def _jobs_now(self) -> list[_Job]:
        with self._lock:
            return list(self._jobs.values())

    def consume(self, name: str, rank: int, worker: int, cursor: Cursor) -> None:
        """:meth:`NodePipeline.consume` of job ``name``."""
        job = self._job(name)
        try:
            job.pipeline.consume(rank, worker, cursor)
        except (RuntimeError, KeyError) as exc:
            raise self._deleted_under(job, exc) from exc

    def delete(self, name: str) -> None:
        """End job ``name``: stop its downloads and delete its cached items. A lane still reading
        registers the job again at once (its next request is answered 404), and the new pipeline
        opens the cache directory once this one has let it go (before, it was refused as "in use"
        by the daemon's own pid, 500 ``internal``). Only a registration of this name waits for the
        delete, holding no lock meanwhile (see :meth:`_registration`); the delete waits for no
        registration (another job's may list for minutes).

        Raises:
            UnknownPipelineError: no such job.
        """
        with self._lock:
            job = self._jobs.pop(name, None)
            known = sorted(self._jobs)
            if job is not None:
                self._deleting.add(name)
        if job is None:
            registered = f"the jobs registered are {', '.join(map(repr, known))}" if known else "no job is registered"
            raise UnknownPipelineError(f"no job {name!r} on this daemon: {registered}")
        try:
            pipe = job.pipeline
            try:
                pipe.check_cache()
                mine = True
            except (CacheRemovedError, RuntimeError):  # removed or replaced: its close touches nothing there, nor this
                mine = False
            pipe.config = pipe.config.model_copy(update={"keep_on_close": False})
            pipe.close()
            if mine:
                _remove_emptied(Path(pipe.config.cache_dir))
            if (self.config.root / name).is_dir():  # kept (a file not of the cache in it): noted as planning from none
                self._note(name, None)
            else:
                with contextlib.suppress(OSError):
                    (self.config.root / ".manifests" / "jobs" / name).unlink()
        finally:
            with self._lock:
                self._deleting.discard(name)
                self._deleted.notify_all()
        log.info("job %s deleted", name)
        self._sweep("no job names it", job)

    def close(self) -> None:
        """Close every job, keeping its items for a later registration. Idempotent."""
        with self._lock:
            self._closed, opening = True, self._opening
            jobs, self._jobs = list(self._jobs.values()), {}
        if opening is not None:
            opening.close()  # its open() raises: register() answers 503 stopping
        for job in jobs:
            job.pipeline.close()
        self._closer.wait_all()
        if self._root_lock is not None:
            self._root_lock.release()  # after every job let its folder go: the next daemon may take them

    def entries(self) -> list[tuple[str, NodePipeline, dict[str, Any]]]:
        """``(name, pipeline, description)`` of every registered job."""
        return [(job.name, job.pipeline, self._describe(job)) for job in self._jobs_now()]

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
