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

This module holds the lifecycle, reload and the operations on named pipelines. The state the
parts share is declared in :mod:`cachepipe.service.served`; the jobs' operations are the base
class ``_JobDesk`` (:mod:`cachepipe.service.jobdesk`), status, health, the metrics' snapshots
and the check of the caches the base class ``_Views`` (:mod:`cachepipe.service.views`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from .. import __version__
from ..cache.lock import unusable_dir
from ..config import PipelineConfig, with_unit
from ..errors import CachePipeError, CacheRemovedError, ConfigError, UnknownItemError
from ..pipeline import CachedItem, Pipeline
from ..stores import open_store
from .api import ApiServer, Deadlines
from .closing import Closer
from .config import ServiceConfig, pipeline_options
from .errors import StoppingError, UnavailableError, UnknownPipelineError
from .jobdesk import _JobDesk
from .jobs import Jobs
from .logs import set_level
from .markers import HandOuts, MarkerWatcher
from .metrics import Metrics
from .served import _CLOSED, _RUNNING, _STOPPING, _UNOPENED, _Served
from .views import _Views, pass_progress

# the errors live in .errors, pass_progress in .views; re-exported
__all__ = ["Daemon", "UnavailableError", "UnknownPipelineError", "pass_progress"]

log = logging.getLogger("cachepipe.service")


class Daemon(_JobDesk, _Views):
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
            OSError: the socket cannot be created (in use by a live daemon, permissions).
            CachePipeError: a pipeline cannot open (its error says why); nothing stays open.
        """
        if self._state != _UNOPENED:
            raise RuntimeError(f"{self!r} cannot be started again: create a new Daemon")
        self._state = _STOPPING  # until running, stop() cleans up whatever was started
        self._api = ApiServer(self, self.config)
        self._api.bind()
        if self.config.markers:
            self._markers = MarkerWatcher(self._marker_ack)
            self._markers.start()
        for name, cfg in self.config.pipelines.items():
            served = _Served(name, cfg)
            served.pipeline = self._open(served)  # raises: the caller stops us
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
        if self._markers is not None:
            self._markers.stop()
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

    def _open(self, served: _Served) -> Pipeline:
        pipe = Pipeline(**pipeline_options(served.config))
        if self._markers is not None:
            try:
                served.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # what the start's host check cannot foresee (a /proc path, a full disk)
                field = f"pipelines.{served.name}.cache_dir"
                error = unusable_dir(served.config.cache_dir, exc, field)
                raise (error or type(exc)(exc.errno, f"{field}: cannot create it: {exc}")) from exc
            try:
                self._markers.watch(served.name, served.root, served.config.items)
            except OSError as exc:  # e.g. fs.inotify.max_user_watches reached: serve without markers
                log.error("%s: marker acks are off for this pipeline: cannot watch %s: %s", served.name, served.root, exc)
        try:
            pipe.open()
        except BaseException:
            if self._markers is not None:
                self._markers.unwatch(served.name)
            raise
        return pipe

    def _close(self, served: _Served) -> None:
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
        open is reopened with its old settings; if that fails too it stays down (health 503)
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
            if new.jobs != old.jobs:  # its values unsaid: jobs.options may hold credentials
                log.warning(
                    "reload: the jobs section changed; this takes a restart (the jobs registered, and those to come, "
                    "keep the section the daemon started with)"
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
                if entry is not None and entry.config == cfg and entry.pipeline is not None:
                    continue
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
        if old is not None:
            self._close(old)
        self._closer.wait(name)  # one taken down: it finishes closing before its cache opens again
        fresh = _Served(name, cfg, rebuilt_at=None if old is None else time.monotonic())
        try:
            fresh.pipeline = self._open(fresh)
            verb = "added" if old is None else ("reopened" if old.pipeline is None else "rebuilt")
            result = f"{verb} {name}"
        except Exception as exc:  # noqa: BLE001 - any failure to open: report it and fall back, never crash the daemon
            log.error("reload: pipeline %s cannot open with the new settings: %s", name, exc)
            fresh.error = f"{type(exc).__name__}: {exc}"
            if old is not None and old.pipeline is not None:
                fallback = _Served(name, old.config, rebuilt_at=time.monotonic())
                try:
                    fallback.pipeline = self._open(fallback)
                    fresh = fallback
                    log.warning("reload: pipeline %s runs on with its old settings", name)
                except Exception as again:  # noqa: BLE001 - the old settings no longer open either: the pipeline is down
                    log.error("reload: pipeline %s cannot reopen with its old settings either: %s", name, again)
            result = f"failed {name}"
        with self._cond:
            self._served[name] = fresh
            self._cond.notify_all()
        return result

    # ---- operations (called from API handler threads) --------------------------------
    def take_many(
        self, name: str, timeout: float | None, count: int, acks: list[Any] | None = None, markers: bool = True
    ) -> list[CachedItem]:
        """Acknowledge ``acks`` (``{"path", "lease"}`` objects of items of pipeline ``name``, all or
        none: see :meth:`finish_many`), then lease up to ``count`` items of it (see
        :meth:`cachepipe.Pipeline.get_many`). Blocks up to ``timeout`` seconds for the first
        (capped by ``max_wait``); a pipeline rebuilt by a reload meanwhile is waited for. Empty:
        every item was delivered. ``markers=False``: the consumer acknowledges over the API (or
        by deleting the item), and a ``.done`` made in these items is not watched for.

        Raises:
            UnknownPipelineError, UnavailableError, UnknownItemError (an ack), TimeoutError,
            ItemFailedError; ValueError: a malformed ack, or one of another pipeline.
        """
        limit = self.config.max_wait if timeout is None else min(timeout, self.config.max_wait)
        deadline = time.monotonic() + limit
        if acks:
            self.finish_many("ack", acks, pipeline=name)
        while True:
            served, pipe = self._pipeline(name)
            self._count_waiting(name, +1)
            try:
                try:
                    items = pipe.get_many(count, timeout=max(deadline - time.monotonic(), 0.0))
                except CacheRemovedError as exc:
                    raise self._take_down(served, pipe, exc) from None
                watcher = self._markers  # None: no marker watch (markers: false)
                judged = watcher is not None and markers  # else no marker to judge: none looked up at hand-out
                # recorded (and watched) before the consumer learns the paths: by the path an ack
                # names them by (absolute and normal, see _checked), the cache's prefix and the name
                paths = [served.prefix + item.name for item in items]
                # a marker at hand-out is looked up only where one can be: not in an item on its first
                # hand-out since its download (nobody has had its path), one lstat saved per item
                replaced = self._handouts.record(
                    [
                        (path, item.lease, item.files, judged and not item._first, markers)  # noqa: SLF001
                        for path, item in zip(paths, items, strict=True)
                    ]
                )
                if watcher is not None:  # a deletion acknowledges an item either way
                    for path in replaced:  # handed out again after its lease expired: watched anew, as asked now
                        watcher.unfollow(path)
                    for path in paths:
                        watcher.follow(name, path, markers=markers)
                return items
            except UnavailableError:
                raise  # taken down (its cache directory is gone): not a pipeline closed by a reload
            except RuntimeError:
                if not self._wait_replaced(name, pipe, deadline):
                    raise TimeoutError(f"pipeline {name!r} was being reloaded for the whole wait of {limit:g} s") from None
            finally:
                self._count_waiting(name, -1)

    def finish_many(self, verb: str, items: list[Any], pipeline: str | None = None) -> tuple[str, list[str]]:
        """``ack`` (or ``release``, ``renew``) every ``{"path", "lease"}`` of ``items``, items of one
        pipeline (of ``pipeline``, if given), checked before any is acted on; an ack of several is
        journaled by one write, all or none (see :meth:`cachepipe.Pipeline.ack_many`). Returns
        (pipeline name, item names).

        Raises:
            ValueError: a malformed entry, items of more than one pipeline, or not of ``pipeline``.
            UnknownItemError: as :meth:`finish` (for an ack of several: none was acknowledged).
        """
        if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
            raise ValueError(f'{items!r}: expected a non-empty list of objects {{"path": ..., "lease": ...}}')
        checked = [self._checked(i.get("path"), i.get("lease")) for i in items]
        served = self._owner(checked[0][0])
        if all(path.startswith(served.prefix) for path, _lease in checked):
            owners = {served.name}
        else:  # named, or an error for a path outside every cache
            owners = {self._owner(path).name for path, _lease in checked}
        if pipeline is not None and owners != {pipeline}:
            others = ", ".join(repr(o) for o in sorted(owners - {pipeline}))
            raise ValueError(f"the acks sent with next of pipeline {pipeline!r} are items of pipeline {others}")
        if len(owners) > 1:
            raise ValueError(f"one request acknowledges items of one pipeline, not of {', '.join(sorted(owners))}")
        if verb != "ack" or len(items) == 1:
            done = [self.finish(verb, path, lease) for path, lease in checked]
            return done[0][0], [n for _p, n in done]
        pipe = self._live(served)
        try:
            pipe.ack_many([(path, lease) if lease else path for path, lease in checked])
        except RuntimeError:
            raise self._closed_error("ack", "these items", served) from None
        except UnknownItemError as exc:
            raise self._explained(exc, served) from None
        self._ended([(path, lease or None) for path, lease in checked])
        return served.name, [served.name_of(path) for path, _lease in checked]

    def _ended(self, ended: list[tuple[str, str | None]]) -> None:
        """The hand-outs of ``ended``, ``(absolute path, lease or None)`` each, ended: forget
        them, stop watching them."""
        gone = self._handouts.forget(ended)
        markers = self._markers
        if markers is not None:
            for path in gone:
                markers.unfollow(path)

    def finish(self, verb: str, path: Any, lease: Any = None) -> tuple[str, str]:
        """``ack``, ``release`` or ``renew`` the item at ``path``; returns (pipeline name, item name).

        Raises:
            ValueError: ``path``/``lease`` are not strings.
            UnknownItemError: not handed out (or outside every cache), or ``lease`` is not the
                live lease (it expired and the item went back to the queue or to another consumer).
        """
        item_path, lease = self._checked(path, lease)
        served = self._owner(item_path)
        pipe = self._live(served)
        action = {"ack": pipe.ack, "release": pipe.release, "renew": pipe.renew}.get(verb)
        if action is None:
            raise ValueError(f"unknown action {verb!r}")
        try:
            action(item_path, lease or None)
        except RuntimeError:
            raise self._closed_error(verb, repr(path), served) from None
        except UnknownItemError as exc:
            raise self._explained(exc, served) from None
        if verb != "renew":
            self._ended([(item_path, lease or None)])
        return served.name, served.name_of(item_path)

    @staticmethod
    def _checked(path: Any, lease: Any) -> tuple[str, str | None]:
        """``(absolute path, lease)`` of an item a consumer names; ValueError if malformed."""
        if not isinstance(path, str) or not path:
            raise ValueError("'path': expected the item's local path as a string")
        if lease is not None and not isinstance(lease, str):
            raise ValueError(f"'lease' {lease!r}: expected the lease id string returned by next")
        return os.path.abspath(path), lease

    @staticmethod
    def _live(served: _Served) -> Pipeline:
        if served.pipeline is None:
            raise UnavailableError(f"pipeline {served.name!r} is down: {served.error}")
        return served.pipeline

    def _closed_error(self, verb: str, what: str, served: _Served) -> Exception:
        """Why ``verb`` of ``what`` found the pipeline of ``served`` closed: the daemon is stopping
        (503 ``stopping``: nothing was done, the next start delivers an item not acknowledged
        again), the pipeline was taken down (503), or a reload is rebuilding it (409: its leases
        ended)."""
        with self._cond:
            state, error = self._state, served.error
        if state != _RUNNING:
            return StoppingError(
                f"cannot {verb} {what}: the daemon is shutting down (an item not acknowledged is delivered again "
                "after it restarts)"
            )
        if error:
            return UnavailableError(f"cannot {verb} {what}: pipeline {served.name!r} is down: {error}")
        return self._rebuilt_error(verb, what, served)

    @staticmethod
    def _rebuilt_error(verb: str, what: str, served: _Served) -> UnknownItemError:
        return UnknownItemError(
            f"cannot {verb} {what}: pipeline {served.name!r} is being rebuilt by a reload, which ends the leases "
            "handed out before it; the item will be delivered again"
        )

    @staticmethod
    def _explained(exc: UnknownItemError, served: _Served) -> UnknownItemError:
        """``exc``, noting a reload that ended the leases, if there was one."""
        if served.rebuilt_at is None:
            return exc
        ago = time.monotonic() - served.rebuilt_at
        return UnknownItemError(
            f"{exc}; note: pipeline {served.name!r} was rebuilt by a reload {ago:.0f} s ago, which ended every lease "
            "handed out before it (those items are delivered again)"
        )

    def _marker_ack(self, name: str, item: str, how: str, looked: bool = False) -> None:
        with self._cond:
            served = self._served.get(name)
        if served is None or served.pipeline is None:
            return
        # Judged by provenance, not by what is true now: only the hand-out the marker was made for.
        lease, why, held = self._handouts.lease_for(item, how)
        if held is not None:
            self.metrics.markers_refused.labels(name).inc()
            log.warning(
                "%s: the .done in %s holds %r, not the lease the item is handed out under now (a lease from before a "
                "restart or a reload, or one that expired): it acknowledges nothing and is left in place",
                name,
                item,
                held[:80],
            )
            return
        try:
            if lease is None:
                raise UnknownItemError(why)
            served.pipeline.ack(item, lease)
        except UnknownItemError as exc:
            # Our own evictions show up as deletions too; a marker on an item not handed out is ignored.
            # a look (no event) finds an item's own or an earlier .done at each hand-out held that long
            (log.info if how == "marker" and not looked else log.debug)("%s: %s of %s ignored: %s", name, how, item, why or exc)
            return
        except CacheRemovedError as exc:
            # the downloads found the cache directory gone: nothing is deleted, and the pipeline is
            # taken down by the next check (each request, and every status_interval), not from here
            log.info("%s: %s of %s ignored: %s", name, how, item, exc)
            return
        except RuntimeError:
            return  # the pipeline closed meanwhile (reload or stop)
        self._ended([(item, lease)])
        self.metrics.marker_acks.labels(name, how).inc()
        log.debug("%s: acknowledged %s (%s)", name, item, how)

    def _pipeline(self, name: str) -> tuple[_Served, Pipeline]:
        """The served pipeline ``name`` and its live :class:`Pipeline`.

        Raises:
            StoppingError, UnknownPipelineError, UnavailableError.
        """
        with self._cond:
            if self._state != _RUNNING:
                raise StoppingError("the daemon is shutting down" if self._state != _UNOPENED else "the daemon is starting")
            served = self._served.get(name)
        if served is None:
            raise UnknownPipelineError(f"no pipeline named {name!r}; this daemon serves: {', '.join(sorted(self._served))}")
        if served.pipeline is None:
            raise UnavailableError(f"pipeline {name!r} is down: {served.error}")
        return served, served.pipeline

    def _wait_replaced(self, name: str, pipe: Pipeline, deadline: float) -> bool:
        """After ``pipe`` closed under a waiting request: wait until a reload replaced it."""
        with self._cond:
            while True:
                if self._state != _RUNNING:
                    raise StoppingError("the daemon is shutting down")
                served = self._served.get(name)
                if served is None or served.pipeline is not pipe:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)

    def _owner(self, path: str) -> _Served:
        """The pipeline whose cache holds ``path`` (absolute and normal, see :meth:`_checked`)."""
        with self._cond:
            for served in self._served.values():
                if path.startswith(served.prefix):
                    return served
        raise UnknownItemError(f"cannot act on {path!r}: not in the cache directory of any pipeline of this daemon")


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
