"""What a :class:`~cachepipe.client.Client` takes from a ``cachepipe serve`` daemon and gives
back: :class:`ServedItem`, and the requests below the client's public methods that take items
(``next``: a long wait asked for in slices, the pipeline's name found when none was given, a
daemon that answers "stopping" asked again once its successor serves, the acks it carries sent
once) and finish them (``ack``, ``release``, ``renew``; of many items in one request, and those
of a loop as it moves on or ends, one by one where one of them is refused).

:class:`_ItemRequests` is the base class of :class:`~cachepipe.client.Client` (not used alone),
over its connection (:class:`~cachepipe.daemonconn._Connection`); its attributes are set by
``Client.__init__``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .batching import MAX_BATCH
from .daemonconn import _code, _Connection, _Outage
from .errors import UnknownItemError
from .items import PathItem

__all__ = ["ServedItem"]

log = logging.getLogger("cachepipe.client")

_SLICE = 60.0  # longest single wait per request; longer waits are several requests
_MARGIN = 30.0  # socket timeout beyond the wait the daemon was asked for


def _ack_bodies(items: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """The ``{"path", "lease"}`` objects acknowledging ``items`` (leases of :class:`ServedItem` s)."""
    if len(items) > MAX_BATCH:
        raise ValueError(f"{len(items)} items to acknowledge at once: at most {MAX_BATCH} per request")
    return [
        {"path": os.path.abspath(os.fspath(item)), "lease": item.lease if isinstance(item, ServedItem) else None}
        for item in items
    ]


class ServedItem(PathItem):
    """An item handed out by the daemon: usable wherever a path is, like :class:`~cachepipe.CachedItem`.

    Attributes:
        path: local path (a folder, or a file for single-object items).
        name: the item's name (relative to the source prefix and to the cache dir).
        size: total bytes.
        files: relative paths of its files.
        lease: the lease id; ack/release send it, so a late ack of an expired lease is refused.
        pipeline: the name of the pipeline it came from.
    """

    __slots__ = ("files", "lease", "name", "pipeline", "size")

    def __init__(
        self, path: str | os.PathLike[str], name: str, lease: str, size: int = 0, files: tuple[str, ...] = (), pipeline: str = ""
    ) -> None:
        super().__init__(path)
        self.name = name
        self.lease = lease
        self.size = size
        self.files = tuple(files)
        self.pipeline = pipeline

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServedItem:
        return cls(
            data["path"], data["name"], data["lease"], data.get("size", 0), tuple(data.get("files", ())), data.get("pipeline", "")
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "name": self.name,
            "path": self._local,
            "lease": self.lease,
            "size": self.size,
            "files": list(self.files),
        }

    def __repr__(self) -> str:
        return f"ServedItem({self._local!r}, lease={self.lease!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ServedItem):
            return self.path == other.path and self.lease == other.lease
        if isinstance(other, (str, os.PathLike)):
            return self.path == Path(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.path)


class _ItemRequests(_Connection):
    """The item requests of a :class:`~cachepipe.client.Client` (see the module notes): its base."""

    # set by Client.__init__, which says what each holds
    pipeline: str | None
    markers: bool
    request_timeout: float

    def _require_open(self) -> None:
        """Open the client if it is not yet, refuse it once closed (:meth:`cachepipe.client.Client._require_open`)."""
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """The daemon's status (:meth:`cachepipe.client.Client.status`)."""
        raise NotImplementedError

    def _ack_each(self, items: list[ServedItem], outage: _Outage) -> None:
        """Acknowledge ``items`` by one request; if one is refused, the others one by one, then
        raise the (first) refusal. ``outage``: the wait for a daemon these requests share."""
        if not items:
            return
        self._require_open()
        try:
            self._finish_many("ack", items, outage)
            return
        except UnknownItemError:
            if len(items) == 1:
                raise
        refused: UnknownItemError | None = None
        for item in items:
            try:
                self._finish("ack", item, None, outage)
            except UnknownItemError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused

    def _give_back(self, items: list[ServedItem], outage: _Outage) -> None:
        """Release ``items``, by one request; if one's lease expired meanwhile (it went back to
        the queue anyway), the others one by one. ``outage``: as :meth:`_ack_each`."""
        try:
            self._finish_many("release", items, outage)
        except UnknownItemError:
            for item in items:
                try:
                    self._finish("release", item, None, outage)
                except UnknownItemError:
                    log.info("%s went back to the queue before it was released (its lease expired)", item.path)

    def _take_many(
        self, count: int, timeout: float | None, ack: Sequence[str | os.PathLike[str]], markers: bool
    ) -> list[ServedItem]:
        """:meth:`get_many`; ``markers``: whether the daemon watches these items for a ``.done``."""
        acks = _ack_bodies(ack)
        reply = self._next(timeout, {"count": count, **({"acks": acks} if acks else {})}, markers)
        return [] if reply is None else [ServedItem.from_json(item) for item in reply["items"]]

    def _finish_many(self, verb: str, items: Sequence[str | os.PathLike[str]], outage: _Outage | None = None) -> None:
        """``POST /v1/ack`` or ``/v1/release`` of ``items`` in one request (raises as :meth:`ack_many`);
        ``outage``: the wait for a daemon it shares with other requests (default: its own)."""
        bodies = _ack_bodies(items)
        if not bodies:
            return
        status, data = self._request("POST", f"/v1/{verb}", {"items": bodies}, self.request_timeout, outage=outage)
        if status != 200:
            self._raise_for(status, data)

    def _take(self, timeout: float | None, ack: ServedItem | None) -> ServedItem | None:
        acks = None if ack is None else {"ack": {"path": str(ack), "lease": ack.lease}}
        reply = self._next(timeout, acks, self.markers)
        return None if reply is None else ServedItem.from_json(reply)

    def _next(self, timeout: float | None, extra: dict[str, Any] | None, markers: bool) -> dict[str, Any] | None:
        """``POST .../next`` with ``extra`` in the body, waiting up to ``timeout``; the reply, or
        None once every item was delivered. ``markers`` False: the daemon does not watch the
        items taken for a ``.done``."""
        self._require_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.pipeline is None:
            names = sorted(self.status()["pipelines"])
            if not names:
                raise ValueError(
                    f"the daemon at {self.address} serves no pipeline (jobs only): its jobs are read by "
                    "CachePipeDataset(node=SOCKET) (docs/multinode.md); to take items here, give it a pipelines section"
                )
            if len(names) != 1:
                raise ValueError(
                    f"the daemon at {self.address} serves the pipelines {', '.join(names)}: "
                    "name one (Client(pipeline=NAME); cachepipe next --pipeline NAME)"
                )
            self.pipeline = names[0]
        route = f"/v1/pipelines/{quote(str(self.pipeline), safe='')}/next"
        outage = _Outage(self.startup_timeout, self.address)
        acking = extra is not None and bool(extra.get("ack") or extra.get("acks"))
        stopped = False  # answered "stopping": asking the next daemon
        while True:
            wait = _SLICE if deadline is None else min(max(deadline - time.monotonic(), 0.0), _SLICE)
            body: dict[str, Any] = {"timeout": wait, **(extra or {}), **({} if markers else {"markers": False})}
            # A next carrying an ack is sent once: were it sent again, the ack could be refused
            # (or apply twice); without one, asking again changes nothing.
            try:
                status, data = self._request("POST", route, body, wait + _MARGIN, retry=not acking)
            except ConnectionError as exc:
                if stopped:  # not "is it running?": it was, and said it was stopping
                    raise ConnectionError(
                        f"the cachepipe daemon at {self.address} shut down while this next waited (HTTP 503 stopping), "
                        f"and none has answered since: {exc.__cause__ or exc} (tried for {self.startup_timeout:g} s; "
                        "`cachepipe wait` waits for a daemon to be ready)"
                    ) from exc
                if not (acking and isinstance(exc.__cause__, (ConnectionResetError, BrokenPipeError))):
                    raise
                # The daemon went away with the request (killed, crashed): its acks were journaled
                # or are lost (those items come again); ask its successor, without them.
                log.warning("the cachepipe daemon at %s went away during a next: asking again (%s)", self.address, exc)
                status, data = 0, b""
            if acking and extra is not None:
                extra = {k: v for k, v in extra.items() if k not in ("ack", "acks")}
                acking = False
            if status == 0:
                continue
            if status != 503:  # a daemon serves: a later stop is another outage, with a wait of its own
                outage.answered()
                stopped = False
            if status == 200:
                reply: dict[str, Any] = json.loads(data)
                return reply
            if status == 204:
                return None
            if status == 408 and (deadline is None or deadline - time.monotonic() > 0):
                continue  # the daemon capped this wait (max_wait); ours goes on
            if status == 503 and _code(data) == "stopping" and outage.pause():
                self._drop()
                stopped = True
                continue  # the daemon is going away (a restart?): ask its successor
            self._raise_for(status, data)

    def _finish(self, verb: str, item: str | os.PathLike[str], lease: str | None, outage: _Outage | None = None) -> None:
        self._require_open()
        if isinstance(item, ServedItem):
            lease = lease or item.lease
        body = {"path": os.path.abspath(os.fspath(item)), "lease": lease}
        status, data = self._request("POST", f"/v1/{verb}", body, self.request_timeout, outage=outage)
        if status != 200:
            self._raise_for(status, data)
