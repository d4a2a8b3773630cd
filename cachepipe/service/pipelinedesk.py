"""The daemon's named pipelines, as the socket API and the markers ask for them: take items
(leased, recorded as hand-outs and watched for a ``.done`` before the consumer learns their
paths), and acknowledge, release or renew them by path, routed to the pipeline whose cache holds
the path, one at a time or several of one pipeline at once.

Invariant: a hand-out is recorded before its paths are answered, and forgotten (no longer
watched) once it ends; a marker acknowledges only the hand-out it was made for. An operation
that finds its pipeline closed says why: the daemon is stopping (503 ``stopping``), the
pipeline is down (503), or a reload rebuilt it and ended its leases (409). :class:`_PipelineDesk`
is a base class of :class:`~cachepipe.service.daemon.Daemon` over
:class:`~cachepipe.service.views._Views` (a request that finds its cache directory gone takes
the pipeline down there), not used alone.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..errors import CacheRemovedError, UnknownItemError
from ..pipeline import CachedItem, Pipeline
from .errors import StoppingError, UnavailableError, UnknownPipelineError
from .served import _RUNNING, _UNOPENED, _Served
from .views import _Views

__all__: list[str] = []

log = logging.getLogger("cachepipe.service")


class _PipelineDesk(_Views):
    """The daemon's operations on its named pipelines (see the module notes)."""

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
            served, pipe = self._pipeline(name, deadline)
            self._count_waiting(name, +1)
            try:
                try:
                    items = pipe.get_many(count, timeout=max(deadline - time.monotonic(), 0.0))
                except CacheRemovedError as exc:
                    raise self._take_down(served, pipe, exc) from None
                except TimeoutError as exc:  # said with the request's wait, not what was left of it at this try
                    if hasattr(exc, "endpoint"):  # a store's (a listing that timed out): answered as its failure
                        raise
                    raise TimeoutError(f"no item became ready within {limit:g} s") from None
                watcher = self._markers  # None: no marker watch (markers: false)
                judged = watcher is not None and markers  # else no marker to judge: none looked up at hand-out
                # recorded (and watched) before the consumer learns the paths: by the path an ack
                # names them by (absolute and normal, see _checked), the cache's prefix and the name
                paths = [served.prefix + item.name for item in items]
                # a marker at hand-out is looked up only where one can be: not in an item on its first
                # hand-out since its download (nobody has had its path; one lstat saved per item), unless
                # the pipeline made its files (unpack, prepare): an archive may hold a .done of its own
                made = pipe.config.prepares
                replaced = self._handouts.record(
                    [
                        (path, item.lease, item.files, judged and (made or not item._first), markers)  # noqa: SLF001
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
            if served.waiting:
                raise UnavailableError(f"pipeline {served.name!r} waits for room on its disk: {served.waiting}")
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

    def _pipeline(self, name: str, deadline: float) -> tuple[_Served, Pipeline]:
        """The served pipeline ``name`` and its live :class:`Pipeline`; one waiting for room on
        its disk is waited for until ``deadline`` (``time.monotonic()``), as items are.

        Raises:
            StoppingError, UnknownPipelineError, UnavailableError; TimeoutError: it still waits
            for room at ``deadline``.
        """
        with self._cond:
            while True:
                if self._state != _RUNNING:
                    raise StoppingError("the daemon is shutting down" if self._state != _UNOPENED else "the daemon is starting")
                served = self._served.get(name)
                if served is None or not served.waiting:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"pipeline {name!r} waits for room on its disk: {served.waiting}")
                self._cond.wait(remaining)
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
