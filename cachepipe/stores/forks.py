"""Store objects used in a process forked from the one that made them.

A DataLoader worker forked from the training process (Linux's default before Python 3.14) gets
a copy of the dataset's ``store=`` object, and with it the parent's pooled connections, locks and
clients. Two processes sending requests on one connection read each other's responses (a GET
returned another object's bytes, or failed reading a body as its status line); a lock that a
thread of the parent held at the fork stays held in the child for ever (the thread is not there
to let go of it); s3fs's instance refuses to run in the child (fsspec's "This class is not
fork-safe").

A store that pools registers here (:func:`renew_after_fork`); in a child forked from this
process its ``_forked()`` is called, before anything else runs there (``os.register_at_fork``,
in the forking thread, the only one in the child). It gives the store empty pools and new locks,
and forgets what belongs to the parent's clients; what must be made anew (an s3fs instance, its
event loop and session) is made lazily, at the store's first use in the child: ``_forked`` sends
nothing, starts no thread and makes no client (a child made by ``subprocess`` with a
``preexec_fn`` runs it too, just before it runs another program).

What the parent's clients hold is never closed in the child, only let go of and kept alive
(:func:`keep_parents`): freed there, s3fs's finalizer would close the parent's aiohttp session
through the parent's event loop, whose transports leave an epoll instance that the two
processes share (read in the code of s3fs 2026.9.0 and asyncio, not seen happen: moto pools no
connection).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

__all__ = ["keep_parents", "renew_after_fork"]


class _Forkable(Protocol):
    def _forked(self) -> None: ...


_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()
"""Every object alive in this process (weakly) whose ``_forked`` a forked child calls."""

_PARENTS: list[Any] = []
"""The parents' clients that stores let go of in this process (:func:`keep_parents`), never freed."""


def renew_after_fork(obj: _Forkable) -> None:
    """Call ``obj._forked()`` in each process forked from this one while ``obj`` lives (held
    weakly). ``_forked`` must send nothing, start no thread and make no client (see the module's
    docstring)."""
    _REGISTERED.add(obj)


def keep_parents(*clients: Any) -> None:
    """Keep ``clients`` (the parent's, let go of by a store in a forked child) alive in this
    process for good: freed, a client closes its connections (the parent's) here. Called from
    ``_forked``."""
    _PARENTS.extend(client for client in clients if client is not None)


def _after_fork_in_child() -> None:
    """Each registered object's ``_forked()``; one that raises does not keep the others shared
    (the first error is raised at the end, and printed by Python as an at-fork handler's)."""
    failed: BaseException | None = None
    for obj in list(_REGISTERED):
        try:
            obj._forked()  # noqa: SLF001 - the registered objects' own method
        except Exception as exc:  # noqa: BLE001 - raised below, after the others
            failed = failed or exc
    if failed is not None:
        raise failed


os.register_at_fork(after_in_child=_after_fork_in_child)
