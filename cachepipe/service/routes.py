"""What a request to the daemon's API asks, and how its answers read: the routes (which
handler, its argument, the methods allowed), the body keys each route takes, the lane a job's
request names, and the JSON of items handed out and of errors (:func:`_error_for`: each
exception type's status and code). Pure: no socket, no daemon; the routes themselves are listed
in :mod:`cachepipe.service.api`, and served by :mod:`cachepipe.service.handler`.
"""

from __future__ import annotations

import errno
import re
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from ..errors import (
    EmptySourceError,
    ItemFailedError,
    LaneConflictError,
    StoreClosedError,
    StoreUnavailableError,
    StoreUnreachableError,
    UnknownItemError,
    is_transient,
)
from ..pipeline import CachedItem
from ..plan import Cursor
from .errors import StoppingError, UnavailableError, UnknownPipelineError
from .jobs import JobConflictError

if TYPE_CHECKING:
    from ..node import SkippedStep, Taken

__all__ = ["BadRequest", "item_json"]

_NEXT_RE = re.compile(r"^/v1/pipelines/([^/]+)/next$")
_JOB_RE = re.compile(r"^/v1/jobs/([^/]+)(/take|/consume)?$")


class BadRequest(ValueError):
    """A malformed request (HTTP 400, or ``status`` when given)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def item_json(pipeline: str, item: CachedItem) -> dict[str, Any]:
    """The body of a ``next`` answer."""
    return {
        "pipeline": pipeline,
        "name": item.name,
        "path": str(item),  # the path, as a string (no Path made)
        "lease": item.lease,
        "size": item.size,
        "files": list(item.files),
    }


def _store_answer(exc: BaseException) -> tuple[int, str] | None:
    """The status and code of a store's failure, classified as the stores' seam classified it
    (:func:`cachepipe.errors.is_transient`); None for any other exception. A store failure is an
    error the seam marked with its ``endpoint`` (:func:`cachepipe.errors.store_code`), or one of
    the store classes; a listing that found nothing is one too:

    - 503 ``store_unavailable``: transient (a timeout, a reset, 5xx, throttling), left after the
      daemon's own retries: the same request may succeed later;
    - 422 ``empty_source``: the source lists no item; ``source_not_found``: no such bucket or key
      (a source, or a spec's manifest): the request names nothing to read, so fix the request.
      Not 404, which says the route, pipeline or job is unknown (and makes a lane register again);
    - 502 ``store_error``: the store refused (denied, rejected credentials) or never answered (an
      endpoint that does not resolve or refuses): the daemon's settings or the store's, not
      retried by the daemon either.

    A request refused because the daemon's store was aborted (``StoreClosedError``, its owner
    closing) is not the store's failure: not classified here."""
    if isinstance(exc, EmptySourceError):
        return 422, "empty_source"
    if isinstance(exc, StoreClosedError):
        return None
    if not hasattr(exc, "endpoint") and not isinstance(exc, (StoreUnavailableError, StoreUnreachableError)):
        return None
    if is_transient(exc):
        return 503, "store_unavailable"
    if isinstance(exc, FileNotFoundError):
        return 422, "source_not_found"
    return 502, "store_error"


# The "error" of the answers a malformed request gets, by status: fixed here, not made from the
# standard library's reason phrases, which change between Python versions (413 is "Content Too
# Large" from 3.13, "Request Entity Too Large" before) and hold a '-' ("Request-URI Too Long").
_MALFORMED = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "request_entity_too_large",
    414: "request_uri_too_long",
    431: "request_header_fields_too_large",
    501: "not_implemented",
    505: "http_version_not_supported",
}


def malformed_code(status: int) -> str:
    """The ``error`` code of an answer to a malformed request of HTTP ``status``: the same on
    every Python version, letters and ``_`` only."""
    return _MALFORMED.get(status) or re.sub(r"[^a-z]+", "_", HTTPStatus(status).phrase.lower())


def _error_for(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, BadRequest):
        return exc.status, malformed_code(exc.status)
    store = _store_answer(exc)  # before TimeoutError: a store's timeout is not a wait that ran out (408)
    if store is not None:
        return store
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the daemon's disk is full: not its fault
        return 507, "insufficient_storage"
    for kind, status, code in (
        (UnknownPipelineError, 404, "not_found"),
        (UnknownItemError, 409, "lease_conflict"),
        (JobConflictError, 409, "conflict"),
        (LaneConflictError, 409, "lane_conflict"),
        (TimeoutError, 408, "timeout"),
        (ItemFailedError, 502, "item_failed"),
        (StoppingError, 503, "stopping"),
        (UnavailableError, 503, "unavailable"),
        (ValueError, 400, "bad_request"),
    ):
        if isinstance(exc, kind):
            return status, code
    return 500, "internal"


def _match(path: str) -> tuple[str | None, str, tuple[str, ...]]:
    """(route handler name, its argument, allowed methods) for a request path."""
    fixed = {
        "/v1/health": ("health", "", ("GET",)),
        "/v1/status": ("status", "", ("GET",)),
        "/metrics": ("metrics", "", ("GET",)),
        "/v1/metrics": ("metrics", "", ("GET",)),
        "/v1/ack": ("finish", "ack", ("POST",)),
        "/v1/release": ("finish", "release", ("POST",)),
        "/v1/renew": ("finish", "renew", ("POST",)),
    }
    if path in fixed:
        return fixed[path]
    match = _NEXT_RE.match(path)
    if match:
        return "next", match.group(1), ("POST",)
    if path == "/v1/manifests":
        return "manifest", "", ("PUT", "POST")
    if path.startswith("/v1/manifests/") and path.count("/") == 3:
        return "manifest", path.rsplit("/", 1)[1], ("GET",)
    match = _JOB_RE.match(path)
    if match:
        name = unquote(match.group(1))  # JobClient quotes it: a name with "/" arrives whole, and is refused
        if match.group(2) is None:
            return "job", name, ("PUT", "DELETE")
        return match.group(2)[1:], name, ("POST",)
    return None, "", ()


#: the keys each route's JSON body may have (a job's spec is checked by its model, .jobs.JobSpec)
_BODY_KEYS = {
    "next": frozenset({"timeout", "ack", "acks", "count", "markers"}),
    "finish": frozenset({"path", "lease", "items"}),
    "take": frozenset({"rank", "worker", "epoch", "index", "timeout", "count", "max_bytes", "report_skips"}),
    "consume": frozenset({"rank", "worker", "epoch", "index"}),
    "manifest": frozenset({"source", "items"}),
}


_ACK_KEYS = frozenset({"path", "lease"})


_ACKS_IN = {"next": ("ack", "acks"), "finish": ("items",)}  # the body keys holding ack objects (or lists of them)


def _check_keys(method: str, path: str, route: str, body: dict[str, Any]) -> None:
    """Refuse a body key the route does not know, and a key of an ack object other than
    ``path`` and ``lease`` (400, naming it and the keys taken): a misspelt option ("time_out",
    "leese": an ack without its lease applies to whoever holds the item) or one this daemon is
    too old for ("report_skips") would otherwise be ignored, silently. A GET or DELETE takes no
    body key (a job's ``DELETE`` with ``{"force": true}`` would do what a plain one does)."""
    known = frozenset() if method in ("GET", "DELETE") else _BODY_KEYS.get(route)
    if known is not None:
        _refuse_unknown(f"{method} {path}", body, known, "in the body")
    for key in _ACKS_IN.get(route, ()):
        value = body.get(key)
        for ack in value if isinstance(value, list) else [value]:
            if isinstance(ack, dict):  # other shapes are refused by the route, naming them
                _refuse_unknown(f"{method} {path}", ack, _ACK_KEYS, f"in an object of {key!r}")


def _refuse_unknown(request: str, given: dict[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        names, expected = ", ".join(repr(k[:40]) for k in unknown[:5]), ", ".join(repr(k) for k in sorted(known))
        taken = f"expected some of {expected}" if known else "it takes none"
        raise BadRequest(f"{request}: unknown key(s) {names} {where}: {taken}")


def _taken_json(job: str, taken: Taken | SkippedStep) -> dict[str, Any]:
    from ..node import SkippedStep  # loaded with the first job: not at the daemon's start

    if isinstance(taken, SkippedStep):  # asked for with report_skips: no path
        cursor = taken.cursor
        return {
            "job": job,
            "skipped": True,
            "name": taken.name,
            "reason": taken.reason,
            "epoch": cursor.epoch,
            "index": cursor.index,
            "next": list(taken.after),
        }
    item = taken.item
    return {
        "job": job,
        "name": item.name,
        "path": str(item),  # the path, as a string (no Path made)
        "size": item.size,
        "files": list(item.files),
        "epoch": taken.cursor.epoch,
        "index": taken.cursor.index,
        "next": list(taken.after),
    }


def _lane(body: dict[str, Any]) -> tuple[int, int, Cursor]:
    """``(rank, worker, cursor)`` of a lane request, checked."""
    values = []
    for key, default in (("rank", None), ("worker", 0), ("epoch", 0), ("index", 0)):
        value = body.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadRequest(f"{key!r} {value!r}: expected an integer >= 0" + (" (required)" if default is None else ""))
        values.append(value)
    rank, worker, epoch, index = values
    return rank, worker, Cursor(epoch, index)
