"""The daemon's state, declared once for the parts of :class:`~cachepipe.service.daemon.Daemon`:
its named pipelines (:class:`_Served`: each one's config, its open ``Pipeline`` or why it is
down, its cache directory), its lifecycle state, the requests waiting per pipeline or job.

Invariant: ``_served`` changes only under the condition ``_cond``, which is notified whenever a
pipeline is replaced or taken down (requests waiting for it wake). :class:`_DaemonState` is the
lowest base class of ``Daemon`` (``daemon.Daemon`` <- ``jobdesk._JobDesk`` <-
``served._DaemonState``; ``daemon.Daemon`` <- ``pipelinedesk._PipelineDesk`` <- ``views._Views``
<- ``served._DaemonState``), not used alone; the attributes are set by
:meth:`~cachepipe.service.daemon.Daemon.__init__`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import PipelineConfig
from ..pipeline import Pipeline
from .closing import Closer
from .config import ServiceConfig
from .jobs import Jobs
from .markers import HandOuts, MarkerWatcher
from .metrics import Metrics

if TYPE_CHECKING:
    from ..node import NodePipeline
    from .api import ApiServer
    from .roomwait import RoomWait

__all__: list[str] = []


@dataclasses.dataclass
class _Served:
    name: str
    config: PipelineConfig
    pipeline: Pipeline | None = None  # None: it failed to open (see error), or waits for room (see waiting)
    error: str = ""
    waiting: str = ""  # why it waits for room to open (its cache's disk is full), while room waits
    room: RoomWait | None = None  # the wait for room, while one runs (stopped by the daemon's close of it)
    rebuilt_at: float | None = None  # monotonic time a reload rebuilt it, ending older leases
    reloading: bool = False  # a reload closed its pipeline and opens its new settings (a listing: minutes)
    root: Path = dataclasses.field(init=False)
    prefix: str = dataclasses.field(init=False)  # str(root) + "/": what every item path starts with

    def __post_init__(self) -> None:
        self.root = Path(os.path.abspath(self.config.cache_dir))
        self.prefix = str(self.root).rstrip("/") + "/"

    def name_of(self, path: str) -> str:
        """The item name of ``path``, an absolute path under :attr:`root` (see :meth:`Daemon._owner`)."""
        return path[len(self.prefix) :]


_UNOPENED, _RUNNING, _STOPPING, _CLOSED = "unopened", "running", "stopping", "closed"


class _DaemonState:
    """The daemon's state (see the module notes): :class:`~cachepipe.service.daemon.Daemon`'s base."""

    # set by Daemon.__init__, which says what each holds
    config: ServiceConfig
    config_path: str | None
    metrics: Metrics
    _state: str
    _closer: Closer
    _jobs: Jobs | None
    _cond: threading.Condition
    _served: dict[str, _Served]
    _waiting: dict[str, int]
    _reload_lock: threading.Lock
    _markers: MarkerWatcher | None
    _handouts: HandOuts
    _api: ApiServer | None
    _started: float

    def _entries(self) -> list[_Served]:
        with self._cond:
            return list(self._served.values())

    def _count_waiting(self, name: str, delta: int) -> None:
        with self._cond:
            self._waiting[name] = self._waiting.get(name, 0) + delta

    def _job_entries(self) -> list[tuple[str, NodePipeline, dict[str, Any]]]:
        return [(f"job/{name}", pipe, info) for name, pipe, info in self._jobs.entries()] if self._jobs else []
