"""Errors the daemon raises and the API translates into HTTP statuses.

Both :mod:`.daemon` (which raises them) and :mod:`.api` (which maps them) import them from
here, so that neither imports the other::

    LookupError
     +-- UnknownPipelineError   no pipeline of that name          HTTP 404
    ConnectionError
     +-- ClientGone             the client's own connection failed (none: nothing more is written)
    RuntimeError
     +-- UnavailableError       pipeline down                      HTTP 503 "unavailable"
          +-- StoppingError     the daemon is stopping             HTTP 503 "stopping"
"""

from __future__ import annotations

__all__ = ["ClientGone", "StoppingError", "UnavailableError", "UnknownPipelineError"]


class UnknownPipelineError(LookupError):
    """No pipeline of that name (HTTP 404)."""


class UnavailableError(RuntimeError):
    """The daemon is stopping, or the pipeline failed to open (HTTP 503)."""


class StoppingError(UnavailableError):
    """The daemon is stopping (or not yet serving): ask again once it is back (HTTP 503 ``stopping``)."""


class ClientGone(ConnectionError):
    """The client of a request went away: its connection ended or failed under a read of the
    request or a write of its answer. Its connection ends, with nothing more written on it.

    Raised only for the client's own socket: a ``BrokenPipeError`` or ``ConnectionResetError``
    from the work of a request (a pipe, a store's connection) is that request's failure,
    answered and logged as any other."""
