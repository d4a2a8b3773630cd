"""``JobClient``: one lane of a job, read from a node's ``cachepipe serve`` daemon.

A training process (a rank, or one DataLoader worker of a rank) registers the job's spec with
the node daemon and then reads its own share by position::

    lane = JobClient("train-42", spec, rank=3, worker=1)
    cursor = (0, 0)                      # or the position saved in a checkpoint
    while (item := lane.take(cursor)) is not None:
        sample = read(item.path)
        cursor = item.next
        lane.consume(cursor)             # done with it: the daemon frees its space now

Every request names the lane's position, and asking for a position acknowledges everything
before it (see :mod:`cachepipe.node`), so every request is safe to send again: a daemon that
restarts meanwhile is waited for (``outage_timeout``, 5 minutes, once the job is registered:
a training job had better wait for systemd to restart the daemon than die) and the job is
registered again.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any
from urllib.parse import quote

from .client import DEFAULT_OUTAGE_TIMEOUT, DEFAULT_STARTUP_TIMEOUT, Client, ServiceError
from .daemonconn import _code, _info, _Outage
from .errors import LaneConflictError
from .items import PathItem
from .plan import Cursor

__all__ = ["JobClient", "LaneItem", "LaneSkip"]

_SLICE = 60.0  # longest single wait per request (the daemon caps it by max_wait too)
_MARGIN = 30.0


class LaneItem(PathItem):
    """An item of a lane: usable as a path until the lane consumes it.

    Attributes:
        path: local path (a folder, or a file for single-object items).
        name: the item's name (relative to the source prefix).
        size: total bytes.
        files: relative paths of its files.
        cursor: its position in the lane's share, ``(epoch, index)``.
        next: the position after it (what to ask for next, and to save in a checkpoint).
    """

    __slots__ = ("cursor", "files", "name", "next", "size")

    def __init__(self, data: dict[str, Any]) -> None:
        super().__init__(data["path"])
        self.name = str(data["name"])
        self.size = int(data["size"])
        self.files = tuple(data["files"])
        self.cursor = Cursor(int(data["epoch"]), int(data["index"]))
        self.next = Cursor(*(int(x) for x in data["next"]))

    def __repr__(self) -> str:
        return f"LaneItem({self._local!r}, cursor={tuple(self.cursor)})"


class LaneSkip:
    """A step of a lane whose item the daemon skipped (``on_error``/``on_oversize="skip"``),
    as :meth:`JobClient.take` returns it with ``report_skips=True``.

    Attributes:
        name: the item's name.
        reason: why it was skipped (the error, as text).
        cursor: its position in the lane's share, ``(epoch, index)``.
        next: the position after it.
    """

    __slots__ = ("cursor", "name", "next", "reason")

    def __init__(self, data: dict[str, Any]) -> None:
        self.name, self.reason = str(data["name"]), str(data["reason"])
        self.cursor = Cursor(int(data["epoch"]), int(data["index"]))
        self.next = Cursor(*(int(x) for x in data["next"]))

    def __repr__(self) -> str:
        return f"LaneSkip({self.name!r}, cursor={tuple(self.cursor)})"


def _lane_step(data: dict[str, Any]) -> LaneItem | LaneSkip:
    return LaneSkip(data) if data.get("skipped") else LaneItem(data)


MAX_REGISTRATIONS = 8
"""Registrations of the job again within one :class:`JobClient` request, each after a 404 from
another connection than the last registration's (a daemon that restarted, once per restart)."""


class JobClient:
    """Lane ``(rank, worker)`` of job ``job`` on the node daemon at ``socket``.

    Args:
        job: the job's name (letters, digits, ``.``, ``_``, ``-``; at most 64).
        spec: the job's spec (:class:`cachepipe.service.jobspec.JobSpec` fields: ``source``,
            ``world_size``, ``ranks``, ``num_workers``, ``epochs``, ``shuffle``, ``seed``...);
            every lane of the job sends the same.
        rank: this lane's rank.
        worker: this lane's DataLoader worker (0 without workers).
        socket: the daemon's Unix socket or ``http://HOST:PORT`` (default as for :class:`Client`).
        request_timeout: seconds to wait for an answer other than an item or a registration.
        register_timeout: seconds to wait for a registration (the daemon lists the source
            then, unless the spec names a manifest or catalog) or an upload (default 600).
        startup_timeout: seconds to keep trying while the daemon is not there, until the job
            is registered (default 10: a wrong socket fails fast).
        outage_timeout: seconds to keep trying while the daemon is not there, once the job is
            registered (default 300: a crash, systemd's ``RestartSec=5s``, then opening the
            caches), per outage: a request that a restarted daemon served has it all again when
            that daemon goes away in turn; each such wait is logged as it begins.

    Raises:
        ValueError: ``outage_timeout`` not a number of seconds >= 0.
    """

    def __init__(
        self,
        job: str,
        spec: dict[str, Any],
        rank: int,
        worker: int = 0,
        socket: str | os.PathLike[str] | None = None,
        *,
        request_timeout: float = 30.0,
        register_timeout: float = 600.0,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        outage_timeout: float = DEFAULT_OUTAGE_TIMEOUT,
    ) -> None:
        if isinstance(outage_timeout, bool) or not isinstance(outage_timeout, (int, float)) or not outage_timeout >= 0:
            raise ValueError(f"outage_timeout {outage_timeout!r}: expected a number of seconds >= 0")
        self.register_timeout, self.outage_timeout = register_timeout, float(outage_timeout)
        self.job, self.spec, self.rank, self.worker = job, dict(spec), rank, worker
        self._client = Client(socket=socket, request_timeout=request_timeout, startup_timeout=startup_timeout).open()
        self._route = f"/v1/jobs/{quote(job, safe='')}"
        self.info: dict[str, Any] | None = None  # the daemon's description, once registered

    def __repr__(self) -> str:
        return f"JobClient({self.job!r}, rank={self.rank}, worker={self.worker}, socket={self._client.address!r})"

    def close(self) -> None:
        """Close the connection (the daemon keeps the lane's position: the next take names it). Idempotent."""
        self._client.close()

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def register(self) -> dict[str, Any]:
        """Register the job (or check that the registered one has this spec); returns the
        daemon's description of it (``lanes``, ``items``, ``catalog_digest``, ``cache_dir``...).

        Raises:
            ServiceError: a bad spec (400), another spec under this name or no room (409), the
                daemon takes no jobs (404).
            StoreError: the job's source cannot be listed (:class:`~cachepipe.client.StoreError`,
                a ServiceError; its ``code``: ``store_unavailable`` 503, ``store_error`` 502,
                ``empty_source`` or ``source_not_found`` 422).
            ConnectionError: the daemon cannot be reached.
            RuntimeError: registered again (the daemon restarted and forgot the job), the job
                now plans from another catalog than this lane's positions refer to (its source
                was listed again and changed): continuing would skip and repeat items.
        """
        _, data = self._request("PUT", self._route, self.spec, self.register_timeout)
        info: dict[str, Any] = json.loads(data)
        before = None if self.info is None else self.info.get("catalog_digest")
        if before is not None and info.get("catalog_digest") != before:
            raise RuntimeError(
                f"job {self.job!r} was registered again (the daemon restarted) and now plans from another catalog "
                f"({info.get('catalog_digest')!r}, was {before!r}): its source changed since it was listed, so this "
                "lane's position would skip and repeat items. Restart the run, or pin the job to a manifest "
                "(a spec's 'catalog', see JobClient.index) so that a restart plans from the same items"
            )
        self.info = info
        client = self._client
        client.startup_timeout = max(client.startup_timeout, self.outage_timeout)  # the daemon was here: wait for it
        return info

    def upload_manifest(self, data: bytes) -> str:
        """Give the daemon a manifest (the bytes of ``cachepipe index``) to plan from; returns its
        digest, which a spec names as ``"catalog"``. Uploading one the daemon has is cheap.

        Raises:
            ServiceError: not a manifest, or of a source the daemon's jobs may not read (400),
                too large (413), the daemon takes no jobs (404).
            ConnectionError: the daemon cannot be reached.
        """
        _, answer = self._request("PUT", "/v1/manifests", {}, self.register_timeout, raw=data)
        return str(json.loads(answer)["catalog"])

    def index(self, source: str, items: str = "folders") -> str:
        """Have the daemon list ``source`` once into a manifest (with its own credentials);
        returns the manifest's digest (a spec's ``"catalog"``).

        Raises:
            ServiceError: a source the daemon's jobs may not read (400).
            StoreError: the listing failed (as :meth:`register`).
            ConnectionError: the daemon cannot be reached.
        """
        _, answer = self._request("POST", "/v1/manifests", {"source": source, "items": items}, self.register_timeout)
        return str(json.loads(answer)["catalog"])

    def manifest_bytes(self, digest: str) -> bytes:
        """The bytes of manifest ``digest`` held by the daemon (to hand to the other nodes)."""
        _, data = self._request("GET", f"/v1/manifests/{quote(digest, safe='')}", {}, self.register_timeout)
        return data

    def take(
        self, cursor: Cursor | tuple[int, int] = (0, 0), timeout: float | None = None, report_skips: bool = False
    ) -> LaneItem | LaneSkip | None:
        """The item at ``cursor`` of this lane (every earlier step is consumed); None when the
        lane's share ends before it. Registers the job first if the daemon does not know it.
        ``report_skips``: an item the daemon skipped in its turn is returned as a
        :class:`LaneSkip` (ask for its ``next`` then), not passed over.

        Raises:
            TimeoutError: nothing ready within ``timeout`` seconds (None: no limit).
            ServiceError: the item failed (502), a bad position (400).
            LaneConflictError: another consumer of this lane moved it while this one waited.
            ConnectionError: the daemon cannot be reached.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.info is None:
            self.register()
        while True:
            wait = _SLICE if deadline is None else min(max(deadline - time.monotonic(), 0.0), _SLICE)
            body = self._lane(cursor) | {"timeout": wait} | ({"report_skips": True} if report_skips else {})
            status, data = self._request("POST", self._route + "/take", body, wait + _MARGIN, may_wait=True)
            if status == 200:
                return _lane_step(json.loads(data))
            if status == 204:
                return None
            if deadline is not None and deadline - time.monotonic() <= 0:
                raise TimeoutError(f"{self!r}: no item at {tuple(cursor)} became ready within {timeout} s")

    def take_many(
        self,
        cursor: Cursor | tuple[int, int] = (0, 0),
        count: int = 16,
        max_bytes: int | None = 64 * 2**20,
        timeout: float | None = None,
        report_skips: bool = False,
    ) -> list[LaneItem | LaneSkip]:
        """The item at ``cursor`` and the lane's next ones that are on disk already, up to
        ``count`` items and ``max_bytes`` bytes (the first always): one request for several small
        items. Empty when the lane's share ends before ``cursor``. ``report_skips``: a skipped
        item at ``cursor`` comes alone, as a :class:`LaneSkip` (see :meth:`take`). Raises like
        :meth:`take`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.info is None:
            self.register()
        while True:
            wait = _SLICE if deadline is None else min(max(deadline - time.monotonic(), 0.0), _SLICE)
            body = self._lane(cursor) | {"timeout": wait, "count": count, "max_bytes": max_bytes}
            if report_skips:
                body["report_skips"] = True
            status, data = self._request("POST", self._route + "/take", body, wait + _MARGIN, may_wait=True)
            if status == 200:
                return [_lane_step(x) for x in json.loads(data)["items"]]
            if status == 204:
                return []
            if deadline is not None and deadline - time.monotonic() <= 0:
                raise TimeoutError(f"{self!r}: no item at {tuple(cursor)} became ready within {timeout} s")

    def consume(self, cursor: Cursor | tuple[int, int]) -> None:
        """This lane is done with every step before ``cursor``: the daemon deletes those items now.

        Raises:
            ServiceError: a bad position (400).
            ConnectionError: the daemon cannot be reached.
        """
        self._request("POST", self._route + "/consume", self._lane(cursor), self._client.request_timeout)

    def _lane(self, cursor: Cursor | tuple[int, int]) -> dict[str, Any]:
        epoch, index = cursor
        return {"rank": self.rank, "worker": self.worker, "epoch": epoch, "index": index}

    def _request(
        self, method: str, route: str, body: dict[str, Any], timeout: float, *, may_wait: bool = False, raw: bytes | None = None
    ) -> tuple[int, bytes]:
        """Send (again while the daemon restarts: every request here is idempotent); 408 is
        returned to a caller that waits (``may_wait``); a job the daemon does not know (it
        restarted) is registered again, with each daemon that answers so: the 404 is raised only
        when it comes from the daemon that registered the job in this call, over the connection
        that carried that registration's answer (a connection never spans two daemons). A daemon
        killed and back before the next attempt shows no outage, only a new connection; at most
        :data:`MAX_REGISTRATIONS` times in one call (a server that closes every connection and
        forgets the job at once, such as a proxy before a daemon that drops it, is not asked
        forever: its 404 is raised). One wait
        for an absent or stopping daemon per outage (an :class:`_Outage`, ended by any answer but
        a 503), so a request served by a restarted daemon waits in full again when that one stops
        too."""
        client = self._client
        outage = _Outage(client.startup_timeout, client.address)
        registered_on: object = None  # the connection that carried this call's last registration's answer (None: none kept)
        registrations = 0
        while True:
            status, data = client._request(method, route, body, timeout, retry=True, raw=raw, outage=outage)  # noqa: SLF001 - the same daemon connection
            if status in (200, 204) or (status == 408 and may_wait):
                return status, data
            code = _code(data)
            if (
                status == 404
                and method == "POST"
                and (registered_on is None or client._conn is not registered_on)  # noqa: SLF001 - which daemon answered
                and registrations < MAX_REGISTRATIONS
            ):
                self.register()  # the daemon restarted and forgot the job
                registrations += 1
                registered_on = client._conn  # noqa: SLF001 - as above
                outage.limit = client.startup_timeout  # registered: outage_timeout from now on
                continue
            if status == 503 and code == "stopping" and outage.pause():
                client._drop()  # noqa: SLF001 - ask the daemon's successor
                continue
            if status == 409 and code == "lane_conflict":  # another consumer moved the lane while this one waited
                raise LaneConflictError(str(_info(data).get("message", "")))
            if status == 409:  # a job registered under this name with another spec, or no room
                raise ServiceError(status, code, str(_info(data).get("message", "")))
            client._raise_for(status, data)  # noqa: SLF001 - one translation of error answers
