"""A DataLoader worker of :class:`~cachepipe.torch.CachePipeDataset` ends once its parent process
(the rank, or your process) is gone: killed (SIGKILL, the OOM killer, a restart by ``torchrun``).

Nothing kills a process's children with it, and torch's own check that the parent lives
(``ManagerWatchdog``) comes between the batches a worker makes: a worker in the middle of a
batch (a slow ``transform``, a download, a wait for the node's daemon) went on with it for as
long as that took, orphaned, holding what a restarted rank's worker needs at once: its cache
folder (per-process mode: the restart's worker was refused it, ``CacheLockedError``, and the
restart failed) or its lane's position (node mode). What it makes can reach no one.

Invariant: only a DataLoader worker watches (the watch is started by the dataset, in the worker,
once per process); the worker kills itself (SIGKILL, as a rank killed with its workers would be),
within :data:`POLL` seconds of its parent's end. A cache survives a killed process.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["POLL", "exit_with_parent"]

#: seconds between a worker's looks at whether its parent process is still its parent
POLL = 0.5

_watching: set[int] = set()  # the pid of the process whose watch runs (a process forked from it is not in it)


def exit_with_parent() -> None:
    """In a DataLoader worker: start, once per process, a daemon thread that kills this process
    once its parent process is gone (it is then the child of another: ``os.getppid()`` changes,
    as torch's ``ManagerWatchdog`` checks)."""
    if os.getpid() in _watching:
        return
    _watching.clear()
    _watching.add(os.getpid())
    parent = os.getppid()
    threading.Thread(target=_watch, args=(parent,), name="cachepipe-parent-watch", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL)
    os.kill(os.getpid(), signal.SIGKILL)
