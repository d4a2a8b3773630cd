"""What the daemon shows of itself: ``GET /v1/status``, ``GET /v1/health``, the metrics'
snapshots, systemd's status line, and each pass's progress (:func:`pass_progress`); and the
check that takes down a pipeline whose cache directory was removed (:meth:`_Views.check_caches`).

Invariant: a pipeline whose cache directory is gone is taken down once (marked down, closed in
the background), and is reported down (health 503) until a reload reopens it.
:class:`_Views` is a base class of :class:`~cachepipe.service.daemon.Daemon` (under
:class:`~cachepipe.service.pipelinedesk._PipelineDesk`), not used alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from .. import __version__
from ..config import format_size
from ..errors import CacheRemovedError
from ..pipeline import Pipeline, Stats
from .errors import UnavailableError
from .metrics import Snapshot, leased
from .served import _RUNNING, _DaemonState, _Served

__all__ = ["pass_progress"]

log = logging.getLogger("cachepipe.service")


class _Views(_DaemonState):
    """The daemon's views and its check of the caches (see the module notes)."""

    def _snapshots(self) -> list[Snapshot]:
        return [
            Snapshot(e.name, _serving(e), e.pipeline.stats() if e.pipeline else None, self._waiting.get(e.name, 0))
            for e in self._entries()
        ] + [Snapshot(name, True, pipe.stats(), self._waiting.get(name, 0)) for name, pipe, _ in self._job_entries()]

    def status(self) -> dict[str, Any]:
        """Everything ``cachepipe status`` shows (the ``GET /v1/status`` body)."""
        pipelines = {}
        for e in self._entries():
            # a reload's rebuild: the pipeline shown is the closed one, whose counters the new one does not
            # go on from (it starts at zero): none shown until it is open
            live = None if e.reloading else e.pipeline
            stats: Stats | None = live.stats() if live is not None else None
            pipelines[e.name] = {
                "state": _state(e),
                "error": e.waiting or e.error or None,
                "source": e.config.source,
                "cache_dir": str(e.root),
                "items": e.config.items,
                "lease_timeout": e.config.lease_timeout,
                "leased": leased(stats) if stats else 0,
                "waiting": self._waiting.get(e.name, 0),
                "stats": dataclasses.asdict(stats) if stats else None,
                "pass": pass_progress(live) if live is not None else None,
            }
        return {
            "version": __version__,
            "pid": os.getpid(),
            "state": self._state,
            "uptime_seconds": round(time.monotonic() - self._started, 3),
            "config": self.config_path,
            "socket": str(self.config.socket),
            "pipelines": pipelines,
            "jobs": {
                name: {
                    **info,
                    "lanes_done": pipe.lanes_done(),
                    "waiting": self._waiting.get(name, 0),
                    "stats": dataclasses.asdict(pipe.stats()),
                }
                for name, pipe, info in self._job_entries()
            },
        }

    def check_caches(self) -> None:
        """Take down each pipeline whose cache directory was removed or replaced (see
        :meth:`cachepipe.Pipeline.check_cache`), and drop each such job (see
        :meth:`~cachepipe.service.jobs.Jobs.take`): called by :meth:`health` and every
        ``status_interval`` seconds, besides each ``next`` and each lane's request."""
        for served in self._entries():
            pipe = served.pipeline
            if pipe is None:
                continue
            try:
                pipe.check_cache()
            except CacheRemovedError as exc:
                self._take_down(served, pipe, exc)
            except RuntimeError:
                pass  # closed meanwhile (a reload, or the daemon stopping)
        if self._jobs is not None:
            self._jobs.check_caches()

    def _take_down(self, served: _Served, pipe: Pipeline, exc: CacheRemovedError) -> UnavailableError:
        """The cache directory of ``served`` (running ``pipe``) is gone: close the pipeline and
        mark it down (health 503, and 503 to its consumers) until a reload reopens it, which
        starts over in a fresh directory. Returns the error to answer its consumers with."""
        with self._cond:
            # once: the first thread to find it closes it (served.error is empty while it runs)
            current = self._served.get(served.name) is served and served.pipeline is pipe and not served.error
            if current:
                served.error = f"{type(exc).__name__}: {exc}"
        if current:
            log.error("pipeline %s is down until a reload reopens it: %s", served.name, exc)
            if self._markers is not None:
                self._markers.unwatch(served.name)
            self._handouts.forget_under(served.root)
            with self._cond:
                served.pipeline = None
                self._cond.notify_all()
            # Closed in the background: closing waits for the downloads in flight, as long as a
            # store that stopped answering takes, and the caller answers a request (or sends
            # systemd's heartbeats).
            self._closer.close(served.name, pipe)
        return UnavailableError(f"pipeline {served.name!r} is down: {served.error}")

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, body of ``GET /v1/health``): healthy when running and every pipeline is open
        (one waiting for room on its disk is not: ``"waiting for room: <why>"``)."""
        self.check_caches()
        entries = self._entries()
        down = {
            e.name: "reloading" if e.reloading else f"waiting for room: {e.waiting}" if e.waiting else f"down: {e.error}"
            for e in entries
            if not _serving(e)
        }
        ok = self._state == _RUNNING and not down
        status = "ok" if ok else ("degraded" if self._state == _RUNNING else self._state)
        return ok, {
            "status": status,
            "pipelines": {e.name: down.get(e.name, "open") for e in entries},
        }

    def status_line(self) -> str:
        """One line for systemd's STATUS=: items ready, leased and bytes cached per pipeline."""
        parts = []
        for e in self._entries():
            if e.reloading or e.pipeline is None:
                parts.append(f"{e.name}: {'waiting for room on its disk' if e.waiting else _state(e)}")
                continue
            s = e.pipeline.stats()
            progress = pass_progress(e.pipeline)
            if progress is not None and progress["complete"]:
                parts.append(f"{e.name}: pass complete, {_acknowledged(progress)}")
                continue
            parts.append(
                f"{e.name}: {s.items_ready} ready, {leased(s)} leased, {s.items_acked} acked, {format_size(s.bytes_in_cache)} of {format_size(s.capacity)} cached"  # noqa: E501 - kept whole
            )
        return "; ".join(parts)


def _serving(served: _Served) -> bool:
    """``served`` is open and serving: not down, not waiting for room, not closed by a reload
    that opens its new settings (which lists its source: minutes for a large bucket)."""
    return served.pipeline is not None and not served.reloading


def _state(served: _Served) -> str:
    """The state ``cachepipe status`` shows for ``served``."""
    if served.reloading:
        return "reloading"
    return "open" if served.pipeline is not None else ("waiting for room" if served.waiting else "down")


def pass_progress(pipe: Pipeline) -> dict[str, Any] | None:
    """Where the pass of ``pipe`` stands, as its journal records it (so across restarts): the
    position of its first step not yet acknowledged (``epoch``, ``index``), ``epochs`` (None: no
    end), ``start_epoch`` (the pass reads epochs ``start_epoch`` to ``epochs - 1``), ``items``
    per epoch (None while a streamed listing goes on), ``acknowledged``: the steps acknowledged
    in the whole pass from ``start_epoch`` on (None where a share of several ranks or workers
    makes an epoch shorter than ``items``), and ``complete``: nothing is left to hand out. None
    if it has no position (it is closing)."""
    try:
        state = pipe.state_dict()
    except RuntimeError:
        return None
    epoch, index, epochs, items = state["epoch"], state["index"], state.get("epochs"), state.get("n_items")
    whole = state.get("world_size", 1) * state.get("num_workers", 1) == 1
    start = min(pipe.config.start_epoch, epoch)  # the pass reads epochs start_epoch to epochs - 1
    return {
        "epoch": epoch,
        "index": index,
        "epochs": epochs,
        "start_epoch": start,
        "items": items,
        "acknowledged": (epoch - start) * items + index if whole and items is not None else None,
        "complete": epochs is not None and epoch >= epochs,
    }


def _acknowledged(progress: dict[str, Any]) -> str:
    """``"N of M items acknowledged"`` (or the epochs, where the items cannot be counted)."""
    done, items, epochs = progress["acknowledged"], progress["items"], progress["epochs"]
    if done is None or items is None:
        return f"{progress['epoch']} of {epochs} epochs"
    return f"{done} of {items * (epochs - progress['start_epoch'])} items acknowledged"
