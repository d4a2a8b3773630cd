"""Errors the daemon raises and the API translates into HTTP statuses.

Both :mod:`.daemon` (which raises them) and :mod:`.api` (which maps them) import them from
here, so that neither imports the other::

    LookupError
     +-- UnknownPipelineError   no pipeline of that name          HTTP 404
    RuntimeError
     +-- UnavailableError       pipeline down                      HTTP 503 "unavailable"
          +-- StoppingError     the daemon is stopping             HTTP 503 "stopping"
"""

from __future__ import annotations

__all__ = ["StoppingError", "UnavailableError", "UnknownPipelineError"]


class UnknownPipelineError(LookupError):
    """No pipeline of that name (HTTP 404)."""


class UnavailableError(RuntimeError):
    """The daemon is stopping, or the pipeline failed to open (HTTP 503)."""


class StoppingError(UnavailableError):
    """The daemon is stopping (or not yet serving): ask again once it is back (HTTP 503 ``stopping``)."""
