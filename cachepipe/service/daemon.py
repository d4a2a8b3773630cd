"""``Daemon``: named pipelines behind one API; the operations the socket API and markers call.

The daemon is a front-end over :class:`cachepipe.Pipeline`: each named pipeline is one
``Pipeline`` built from its :class:`~cachepipe.PipelineConfig`; taking, acknowledging and
releasing items are that pipeline's ``get``/``ack``/``release``/``renew``. What the daemon adds:
names, routing an item path to its pipeline, reload (rebuild changed pipelines), and a view for
status, health and metrics.

Lifecycle: UNOPENED -> :meth:`Daemon.start` (bind the API socket under a temporary name, watch
for markers, open every pipeline, serve, then rename the socket into place) -> RUNNING ->
:meth:`Daemon.stop` (remove the socket, stop accepting, close the pipelines keeping published
items per ``keep_on_close``, end every connection) -> CLOSED.

This module holds the lifecycle and reload. The state the parts share is declared in
:mod:`cachepipe.service.served`; the operations on named pipelines (take, ack, release, renew,
markers' acks) are the base class ``_PipelineDesk`` (:mod:`cachepipe.service.pipelinedesk`), the
jobs' operations the base class ``_JobDesk`` (:mod:`cachepipe.service.jobdesk`), status,
health, the metrics' snapshots and the check of the caches the base class ``_Views``
(:mod:`cachepipe.service.views`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from .. import __version__
from ..cache.fulldisk import full_disk
from ..cache.lock import unusable_dir
from ..config import PipelineConfig, with_unit
from ..errors import CachePipeError, ConfigError
from ..pipeline import Pipeline
from ..stores import open_store
from .api import ApiServer, Deadlines
from .closing import Closer
from .config import ServiceConfig, pipeline_options
from .errors import UnavailableError, UnknownPipelineError
from .jobdesk import _JobDesk
from .jobs import Jobs
from .logs import set_level
from .markers import HandOuts, MarkerWatcher
from .metrics import Metrics
from .pipelinedesk import _PipelineDesk
from .roomwait import RETRY_AFTER, RoomWait, is_full_disk
from .served import _CLOSED, _RUNNING, _STOPPING, _UNOPENED, _Served
from .views import pass_progress

# the errors live in .errors, pass_progress in .views; re-exported
__all__ = ["Daemon", "UnavailableError", "UnknownPipelineError", "pass_progress"]

log = logging.getLogger("cachepipe.service")


class Daemon(_JobDesk, _PipelineDesk):
    """Serve the pipelines of ``config`` over the socket API.

    Args:
        config: the validated configuration.
        config_path: where it was read from (shown in status).
    """

    def __init__(self, config: ServiceConfig, config_path: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.config_path = None if config_path is None else str(config_path)
        self._state = _UNOPENED
        self._closer = Closer()  # closes what a removed cache directory took down, in the background
        self._jobs = None if config.jobs is None else Jobs(config.jobs, self._closer)
        self._cond = threading.Condition()  # guards _served; notified when a pipeline is replaced
        self._served: dict[str, _Served] = {}
        self._waiting: dict[str, int] = {}  # requests blocked in next, by pipeline name
        self.metrics = Metrics(self._snapshots)
        self._reload_lock = threading.Lock()
        self._markers: MarkerWatcher | None = None
        # which watcher is self._markers: a reload changes it while a wait for room opens a pipeline
        self._markers_lock = threading.Lock()
        self._handouts = HandOuts()  # what each hand-out was: a marker acknowledges only its own
        self._api: ApiServer | None = None
        self._started = time.monotonic()

    def __repr__(self) -> str:
        return f"Daemon({list(self.config.pipelines)}, socket={str(self.config.socket)!r}, state={self._state})"

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Bind the socket, open every pipeline, start the marker watcher and the API.

        Raises:
            RuntimeError: already started.
            OSError: the socket cannot be created (in use by a live daemon, permissions), or
                ``jobs.root`` is served by another live daemon (``EADDRINUSE``).
            CachePipeError: a pipeline cannot open (its error says why); nothing stays open.
        """
        if self._state != _UNOPENED:
            raise RuntimeError(f"{self!r} cannot be started again: create a new Daemon")
        self._state = _STOPPING  # until running, stop() cleans up whatever was started
        self._api = ApiServer(self, self.config)
        self._api.bind()
        if self._jobs is not None:  # one daemon per jobs.root; then the manifests no job folder names are removed
            self._jobs.start(str(self.config.socket))
        if self.config.markers:
            self._markers = MarkerWatcher(self._marker_ack)
            self._markers.start()
        for name, cfg in self.config.pipelines.items():
            served = _Served(name, cfg)
            self._open_or_wait(served)  # raises: the caller stops us
            with self._cond:
                self._served[name] = served
        self._api.serve()
        self._state = _RUNNING
        self._api.publish()  # the socket appears now, ready: a client never finds one that refuses it
        names = ", ".join(self._served) or "no pipeline (jobs only)"
        log.info("cachepipe %s serving %s on %s", __version__, names, self._api.address)

    def stop(self) -> None:
        """Stop serving; close the pipelines (published items stay with ``keep_on_close``). Idempotent."""
        with self._cond:
            if self._state == _CLOSED:
                return
            self._state = _STOPPING
            self._cond.notify_all()
        if self._api is not None:
            self._api.stop_accepting()
        with self._markers_lock:  # none from here: a wait for room that opens a pipeline meanwhile watches nothing
            markers, self._markers = self._markers, None
        if markers is not None:
            markers.stop()
        if self._jobs is not None:
            self._jobs.close()
        with self._cond:
            served = list(self._served.values())
        for entry in served:
            self._close(entry)
        self._closer.wait_all()  # pipelines taken down (their cache directory removed) still closing
        if self._api is not None:
            self._api.close()
        self._state = _CLOSED
        log.info("stopped")

    @property
    def running(self) -> bool:
        """True while serving and the API thread is alive (what the systemd watchdog checks)."""
        return self._state == _RUNNING and self._api is not None and self._api.alive

    def _open_or_wait(self, served: _Served) -> None:
        """Open the pipeline of ``served``; where its cache's disk is full, wait for room instead
        (in the background: :class:`~.roomwait.RoomWait`) and say so once. Raises any other error."""
        try:
            served.pipeline = self._open(served)
        except OSError as exc:
            if not is_full_disk(exc):
                raise
            served.waiting = exc.strerror or str(exc)
            log.warning("pipeline %s waits for room, and opens once there is: %s", served.name, served.waiting)
            served.room = RoomWait(
                served.name,
                served.root,
                lambda: Pipeline(**pipeline_options(served.config)),
                lambda pipe: self._open(served, pipe),
                lambda pipe: self._room_found(served, pipe),
                lambda error: self._room_failed(served, error),
                lambda error: self._room_retrying(served, error),
                lambda error: self._room_full(served, error),
            )
            served.room.start()

    def _room_found(self, served: _Served, pipe: Pipeline) -> bool:
        """The pipeline of ``served``, waiting for room, opened (in its wait's thread): watched
        by the marker watcher there is now, then served. A reload may have turned markers on
        while it opened (after its open looked, before a reload's watches, which take only the
        pipelines open then); its watch is added again here, before anything is handed out."""
        with self._markers_lock:
            if self._markers is not None:
                try:
                    self._watch(self._markers, served)  # its folder is there: the open made it
                except OSError as exc:  # removed since (the cache check takes it down): served, without markers
                    log.error("%s: marker acks are off for this pipeline: %s", served.name, exc)
            with self._cond:
                served.pipeline, served.waiting, served.error, served.room = pipe, "", "", None
                self._cond.notify_all()
        log.info("pipeline %s: its disk has room now: opened", served.name)
        return True

    def _room_failed(self, served: _Served, exc: BaseException) -> None:
        """The pipeline of ``served``, waiting for room, failed to open for another reason: down."""
        log.error("pipeline %s is down until a reload reopens it: %s: %s", served.name, type(exc).__name__, exc)
        with self._cond:
            served.waiting, served.error, served.room = "", f"{type(exc).__name__}: {exc}", None
            self._cond.notify_all()

    def _room_retrying(self, served: _Served, exc: BaseException) -> None:
        """The pipeline of ``served``, waiting for room, failed to open otherwise: down, with its
        error, until the wait's next try (:data:`~.roomwait.RETRY_AFTER`)."""
        with self._cond:
            served.waiting, served.error = "", f"{type(exc).__name__}: {exc} (tried again every {RETRY_AFTER:g} s)"
            self._cond.notify_all()

    def _room_full(self, served: _Served, exc: OSError) -> None:
        """A try of the wait of ``served`` found its disk full: it waits for room (said once
        more where it was down with another error meanwhile), with the try's reason."""
        with self._cond:
            again = not served.waiting
            served.waiting, served.error = exc.strerror or str(exc), ""
            self._cond.notify_all()
        if again:
            log.warning("pipeline %s waits for room again, and opens once there is: %s", served.name, served.waiting)

    def _open(self, served: _Served, pipe: Pipeline | None = None) -> Pipeline:
        """Watch the markers of ``served`` and open its pipeline (``pipe``, or a new one)."""
        pipe = pipe or Pipeline(**pipeline_options(served.config))
        with self._markers_lock:  # the watcher as it is now, kept running meanwhile (a wait's open runs beside a reload)
            markers = self._markers
            if markers is not None:
                self._watch(markers, served)
        try:
            pipe.open()
        except BaseException:
            if markers is not None:
                markers.unwatch(served.name)
            raise
        return pipe

    @staticmethod
    def _watch(markers: MarkerWatcher, served: _Served) -> None:
        """Make the cache directory of ``served`` and watch it with ``markers``."""
        try:
            served.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # what the start's host check cannot foresee (a /proc path, a full disk)
            field = f"pipelines.{served.name}.cache_dir"
            # a full disk said as the pipeline's open says it (the disk, what holds it): the wait's reason
            error = unusable_dir(served.config.cache_dir, exc, field) or full_disk(served.config.cache_dir, served.root, exc)
            raise (error or type(exc)(exc.errno, f"{field}: cannot create it: {exc}")) from exc
        try:
            markers.watch(served.name, served.root, served.config.items)
        except OSError as exc:  # e.g. fs.inotify.max_user_watches reached: serve without markers
            log.error("%s: marker acks are off for this pipeline: cannot watch %s: %s", served.name, served.root, exc)

    def _close(self, served: _Served) -> None:
        room = served.room
        if room is not None:  # its wait ends (a pipeline it opens is closed) before the rest
            room.stop()
            served.room = None
        if self._markers is not None:
            self._markers.unwatch(served.name)
        if served.pipeline is not None:
            served.pipeline.close()
        self._handouts.forget_under(served.root)

    # ---- reload ----------------------------------------------------------------------
    def reload(self, new: ServiceConfig) -> list[str]:
        """Apply a new configuration; returns what changed, for the log.

        Pipelines removed are closed, added ones opened, changed ones rebuilt (closed, keeping
        published items per ``keep_on_close``, then opened with the new settings: their leases
        end and unacknowledged items are delivered again). A rebuilt pipeline that fails to
        open is reopened with its old settings (one that waited for room waits again; one whose
        disk filled meanwhile waits for room); if that fails too it stays down (health 503)
        until the next reload. Socket path, TCP settings and the ``jobs`` section need a restart
        (a change is logged, and the running ones kept); socket permissions and every other
        daemon setting apply at once.
        """
        with self._reload_lock:
            if self._state != _RUNNING or self._api is None:
                raise RuntimeError(f"{self!r} is not running")
            old = self.config
            changes: list[str] = []
            fixed = {f: getattr(old, f) for f in ("socket", "tcp_port", "tcp_host") if getattr(old, f) != getattr(new, f)}
            for field in fixed:
                log.warning(
                    "reload: %s changed from %r to %r; this takes a restart", field, getattr(old, field), getattr(new, field)
                )
            if new.jobs != old.jobs:  # its keys named, their values unsaid: jobs.options may hold credentials
                before, after = (None if c.jobs is None else c.jobs.model_dump(mode="json") for c in (old, new))
                log.warning(
                    "reload: %s changed (values not shown): not applied, this takes a restart (the jobs registered, "
                    "and those to come, keep the section the daemon started with)",
                    " and ".join(_changed_keys(before, after, "jobs") or ["jobs"]),
                )
                fixed["jobs"] = old.jobs
            if fixed:
                new = new.model_copy(update=fixed)
            if (new.socket_mode, new.socket_group) != (old.socket_mode, old.socket_group):
                try:
                    self._api.set_permissions(new.socket_mode, new.socket_group)
                    changes.append("socket permissions")
                except (ConfigError, OSError) as exc:  # e.g. the socket file was removed: the daemon serves on
                    log.error("reload: socket permissions not applied: %s", exc)
                    changes.append(f"failed socket permissions ({exc})")
                    new = new.model_copy(update={"socket_mode": old.socket_mode, "socket_group": old.socket_group})
            if new.log_level != old.log_level:
                set_level(new.log_level)
                changes.append(f"log_level {new.log_level}")
            if new.markers != old.markers:
                changes.append(f"markers {'on' if new.markers else 'off'}")
            if new.max_clients != old.max_clients:
                self._api.set_max_clients(new.max_clients)
                changes.append(f"max_clients {new.max_clients}")
            if Deadlines.of(new) != Deadlines.of(old):
                self._api.set_deadlines(Deadlines.of(new))
                changes.append(f"request deadlines {Deadlines.of(new)}")
            with self._cond:
                current = dict(self._served)
            for name in current.keys() - new.pipelines.keys():
                self._close(current[name])
                with self._cond:
                    del self._served[name]
                    self._cond.notify_all()
                changes.append(f"removed {name}")
            self._set_markers(new.markers)
            for name, cfg in new.pipelines.items():
                entry = current.get(name)
                if entry is not None and entry.config == cfg and (entry.pipeline is not None or entry.room is not None):
                    continue  # running, or waiting for room as it was
                if (
                    entry is not None
                    and entry.pipeline is not None
                    and entry.config.model_copy(update={"capacity": cfg.capacity}) == cfg
                ):
                    try:  # only the capacity changed: applied live, leases and queue untouched
                        entry.pipeline.set_capacity(with_unit(cfg.capacity))
                        entry.config = cfg
                        changes.append(f"capacity of {name} {cfg.capacity}")
                        continue
                    except ValueError as exc:
                        log.error("reload: capacity of %s cannot change to %s: %s; kept", name, cfg.capacity, exc)
                        continue
                changes.append(self._rebuild(name, cfg, entry))
            self.config = new
            return changes

    def _set_markers(self, enabled: bool) -> None:
        with self._markers_lock:  # against a wait for room that opens a pipeline meanwhile (_room_found)
            self._switch_markers(enabled)

    def _switch_markers(self, enabled: bool) -> None:
        if enabled and self._markers is None:
            self._markers = MarkerWatcher(self._marker_ack)
            self._markers.start()
            for entry in self._entries():
                if entry.pipeline is not None:
                    self._markers.watch(entry.name, entry.root, entry.config.items)
                    for path, handout in self._handouts.under(entry.root).items():
                        self._markers.follow(entry.name, path, markers=handout.markers, at_once=True)
        elif not enabled and self._markers is not None:
            markers, self._markers = self._markers, None
            markers.stop()

    def _rebuild(self, name: str, cfg: PipelineConfig, old: _Served | None) -> str:
        was = None if old is None or old.pipeline is None else (old.config.source, old.config.storage_options)
        if was is not None and was != (cfg.source, cfg.storage_options):
            why = _lists_nothing(cfg)  # asked before the running pipeline closes: closing it ends its leases
            if why:
                log.error("reload: pipeline %s keeps running with its old settings: the new source %s", name, why)
                return f"failed {name}"
        # open, or waiting for room: what a failed open of the new settings takes again (read before the close
        # ends the wait; under the lock its opening takes to say so)
        with self._cond:
            kept = old is not None and (old.pipeline is not None or old.room is not None)
        if old is not None:
            with self._cond:  # not serving until its replacement is in place: status, health, metrics say so
                old.reloading = True
            self._close(old)
        self._closer.wait(name)  # one taken down: it finishes closing before its cache opens again
        fresh = _Served(name, cfg, rebuilt_at=None if old is None else time.monotonic())
        try:
            self._open_or_wait(fresh)
            verb = "added" if old is None else ("reopened" if old.pipeline is None else "rebuilt")
            result = f"{verb} {name}" + (" (waiting for room on its disk)" if fresh.waiting else "")
        except Exception as exc:  # noqa: BLE001 - any failure to open: report it and fall back, never crash the daemon
            log.error("reload: pipeline %s cannot open with the new settings: %s", name, exc)
            fresh.error = f"{type(exc).__name__}: {exc}"
            if old is not None and kept:
                fallback = _Served(name, old.config, rebuilt_at=time.monotonic())
                try:
                    self._open_or_wait(fallback)  # its disk filled meanwhile: it waits for room, as at a start
                    fresh = fallback
                    if fallback.waiting:
                        log.warning("reload: pipeline %s waits for room with its old settings", name)
                    else:
                        log.warning("reload: pipeline %s runs on with its old settings", name)
                except Exception as again:  # noqa: BLE001 - the old settings no longer open either: the pipeline is down
                    log.error("reload: pipeline %s cannot reopen with its old settings either: %s", name, again)
            result = f"failed {name}"
        with self._cond:
            self._served[name] = fresh
            self._cond.notify_all()
        return result


def _lists_nothing(cfg: PipelineConfig) -> str:
    """Why the ``source`` of ``cfg`` cannot feed a pipeline, asked of its store (the first object
    of its listing; nothing is downloaded): it lists no object (a wrong bucket or prefix), or the
    store refuses the listing (no such bucket, no permission, unreachable). "" when it lists one."""
    try:
        store = open_store(cfg.source, cfg.storage_options)
        try:
            first = next(iter(store.list()), None)
        finally:
            store.close()
    except (CachePipeError, OSError, ValueError, ImportError) as exc:
        return f"{cfg.source!r} cannot be listed: {type(exc).__name__}: {exc}"
    return "" if first is not None else f"{cfg.source!r} lists no objects; check the bucket and the prefix"


def _changed_keys(old: Any, new: Any, prefix: str) -> list[str]:
    """The dotted names of the keys that differ between ``old`` and ``new`` (nested dicts, such
    as a section's ``model_dump``), under ``prefix``; a key added or removed is named as it is,
    a section added or removed (None) as ``prefix``. Names only: no value (credentials)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [prefix]
    keys = sorted({*old, *new}, key=str)
    return [name for key in keys for name in _changed_keys(old.get(key), new.get(key), f"{prefix}.{key}")]
