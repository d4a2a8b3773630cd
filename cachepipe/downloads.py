"""Download worker processes: the ranged GETs of a pipeline run outside its process.

A pipeline's download threads spend most of their CPU in the request path (HTTP, signing, TLS,
copying bodies), under the one interpreter lock of their process. A node daemon that serves
every rank and worker of a node is then bound to one core. With ``download_processes=N`` the
fetcher keeps its threads (they plan, reserve, publish: bookkeeping), but each GET is made by one
of ``N`` worker processes, each running its share of ``max_concurrency`` threads over its own
store: the parent sends ``(key, local path, start, end)`` and waits for the number of bytes
written. Files are written by the worker straight into the staging path, so no body crosses the
pipe.

Errors cross the pipe as the store raised them (already translated at the store's seam:
``FileNotFoundError``, ``PermissionError``, transient ``ConnectionError``...), so the fetcher's
retry policy sees the same exceptions as in one process. A local write that failed (a full disk)
comes back as :class:`LocalWriteError`, which the fetcher tells apart from a store error. A worker
that dies fails its requests in flight with a transient :class:`WorkerLostError` (the fetcher
retries them) and is replaced at the next request.

Each worker is a fresh interpreter (``python -m cachepipe.downloads FD``), not a fork (the
parent runs threads: a fork would copy held locks) nor multiprocessing's spawn (which imports
the caller's ``__main__`` again). :meth:`DownloadWorkers.close` stops them; none outlives it, and
a worker exits by itself when its parent dies (its end of the pipe closes): it drops the requests
it had queued and aborts those under way, since a killed pipeline's staging paths may be the next
owner's by then (it would open them by name and write into them).
:meth:`DownloadWorkers.abort` (a closing pipeline) has each worker abort its store: its requests
in flight fail at once as the store's ``abort`` cuts them, so that the close after it is prompt.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .errors import CachePipeError
from .fscalls import RELEASING, FileCalls
from .hedging import Racer

__all__ = ["DownloadWorkers", "LocalWriteError", "StagingFile", "WorkerLostError", "get_part"]

log = logging.getLogger("cachepipe.downloads")

_STOP_SECONDS = 10.0  # how long close() waits for a worker to finish its requests before killing it


# The worker's main. The folder this cachepipe was imported from is appended to its sys.path (not
# put first, which could shadow the standard library), so that a cachepipe found only there,
# however this process found it, is found by the worker too.
_MAIN = "import sys; sys.path.append(sys.argv[2]); from cachepipe.downloads import serve_fd; serve_fd(int(sys.argv[1]))"
_HOME = str(Path(__file__).resolve().parents[1])


class LocalWriteError(CachePipeError, OSError):
    """A part could not be written into its staging file (errno as the local write's)."""


class WorkerLostError(CachePipeError, ConnectionError):
    """A download worker process died with the request in flight (transient: retried)."""


class _Worker:
    """The parent's end of one worker process: its pipe, a reader thread, requests in flight."""

    def __init__(self, slot: int, url: str, storage_options: dict[str, Any], threads: int) -> None:
        self.name = f"cachepipe-download-{slot}"
        parent, child = socket.socketpair()
        try:
            # a fresh interpreter running this module, not multiprocessing's spawn: that would
            # import the caller's __main__ again (a script without a main guard would run twice)
            self.process = subprocess.Popen(  # noqa: S603 - this interpreter, our own module, an fd number
                [sys.executable, "-c", _MAIN, str(child.fileno()), _HOME], pass_fds=(child.fileno(),)
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.conn.send((url, storage_options, threads))
        self.pending: dict[int, Future[int]] = {}
        self.lock = threading.Lock()  # sends, and pending
        self.alive = True
        self.reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self.reader.start()

    def send(self, request_id: int, request: tuple[str, str, int, int, bool, str | None]) -> Future[int]:
        future: Future[int] = Future()
        with self.lock:
            if not self.alive:
                raise WorkerLostError(f"download worker {self.name} exited")
            self.pending[request_id] = future
            try:
                self.conn.send((request_id, *request))
            except (OSError, ValueError) as exc:  # the worker is gone: its pipe is closed
                del self.pending[request_id]
                self.alive = False
                raise WorkerLostError(f"download worker {self.name} exited ({exc})") from exc
        return future

    def _read(self) -> None:
        """Complete each request's future with the worker's reply, until the pipe closes."""
        while True:
            try:
                request_id, status, payload = self.conn.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                future = self.pending.pop(request_id, None)
            if future is None:
                continue
            if status == "ok":
                future.set_result(payload)
            else:
                future.set_exception(_exception(payload))
        with self.lock:
            self.alive = False
            lost, self.pending = list(self.pending.values()), {}
        for future in lost:
            future.set_exception(WorkerLostError(f"download worker {self.name} exited (exit code {self.process.poll()})"))

    def abort(self) -> None:
        """Ask the worker to abort its store's requests (it goes on serving: :meth:`stop` ends it)."""
        with self.lock:
            try:
                if self.alive:
                    self.conn.send("abort")
            except (OSError, ValueError):
                pass  # its pipe is closed: the worker is gone already

    def stop(self, timeout: float) -> None:
        """Ask the worker to finish its requests and exit; kill it after ``timeout`` seconds."""
        with self.lock:
            try:
                if self.alive:
                    self.conn.send(None)
            except (OSError, ValueError):
                pass  # its pipe is closed: the worker is gone already (waited for below)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("download worker %s did not stop within %.0f s: killing it", self.name, timeout)
            self.process.kill()
            self.process.wait()
        self.conn.close()
        self.reader.join()


class DownloadWorkers:
    """``processes`` worker processes, each with ``threads`` download threads over its own store.

    Args:
        url: the source URL (each worker opens its store with :func:`cachepipe.stores.open_store`).
        storage_options: the store's options (picklable).
        processes: worker processes (at least 1).
        threads: requests each worker runs at once (at least 1).
    """

    def __init__(self, url: str, storage_options: dict[str, Any], processes: int, threads: int) -> None:
        self._args = (url, storage_options, threads)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker] = []
        try:
            for slot in range(processes):
                self._workers.append(_Worker(slot, *self._args))
        except BaseException:
            self.close()
            raise

    def get(self, key: str, path: str, start: int, end: int, create: bool, etag: str | None = None) -> int:
        """Write bytes ``[start, end)`` of object ``key`` into the file at ``path`` at offset
        ``start`` (``create``: create or truncate it first; else it exists), by a request
        conditional on ``etag`` if given. Blocks until done; returns the bytes written (short if
        the store sent a short body).

        Raises:
            LocalWriteError: the local file could not be written.
            WorkerLostError: the worker died meanwhile (transient).
            RuntimeError: :meth:`close` was called.
            Exception: what the store raised for this request.
        """
        worker = self._pick()
        return worker.send(next(self._ids), (key, path, start, end, create, etag)).result()

    def _pick(self) -> _Worker:
        """The worker with the fewest requests in flight; a dead one is replaced first."""
        with self._lock:
            if self._closed:
                raise RuntimeError("download workers are closed")
            for slot, worker in enumerate(self._workers):
                if not worker.alive:
                    log.warning("download worker %s exited (exit code %s): starting another", worker.name, worker.process.poll())
                    worker.stop(0)
                    self._workers[slot] = _Worker(slot, *self._args)
            return min(self._workers, key=lambda w: len(w.pending))

    def abort(self) -> None:
        """Have every worker abort its store (see :func:`cachepipe.stores.base.abort_store`): their
        requests in flight fail at once, and later ones are refused. Before :meth:`close`."""
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.abort()

    def close(self) -> None:
        """Stop every worker (each finishes its requests in flight first). Idempotent."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop(_STOP_SECONDS)


def _exception(payload: bytes | tuple[str, str]) -> BaseException:
    """The exception a worker sent: unpickled, or (if it would not pickle) described."""
    if isinstance(payload, tuple):
        kind, message = payload
        return RuntimeError(f"{kind} in a download worker: {message}")
    exc = pickle.loads(payload)  # noqa: S301 - from our own child process, over a private pipe
    return exc if isinstance(exc, BaseException) else RuntimeError(f"download worker sent {exc!r}")


# ---- the worker process ----------------------------------------------------------------
def _serve(conn: Connection) -> None:
    """A worker's main: read ``(url, storage_options, threads)``, then serve requests from
    ``conn`` with ``threads`` threads until told to stop (``None``) or the parent's end closes;
    ``"abort"`` aborts the store's requests (:meth:`DownloadWorkers.abort`)."""
    url, storage_options, threads = conn.recv()
    from .stores import open_store
    from .stores.base import abort_store

    store = open_store(url, storage_options)
    send_lock = threading.Lock()

    def handle(request_id: int, key: str, path: str, start: int, end: int, create: bool, etag: str | None) -> None:
        try:
            reply: tuple[str, Any] = ("ok", get_part(store, key, path, start, end, create, etag=etag))
        except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it for this request
            try:
                reply = ("error", pickle.dumps(exc))
            except Exception:  # noqa: BLE001 - an exception that does not pickle is described instead
                reply = ("error", (type(exc).__name__, str(exc)))
        with send_lock:
            try:
                conn.send((request_id, *reply))
            except OSError:
                pass  # the parent is gone

    pool = ThreadPoolExecutor(threads, thread_name_prefix="cachepipe-get")
    orphaned = False
    try:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                orphaned = True  # the parent is gone (killed): what it asked for is wanted no more
                break
            if request is None:
                break
            if request == "abort":
                abort_store(store)
                continue
            pool.submit(handle, *request)
    finally:
        if orphaned:
            # Its staging paths may be the next owner's by now: a queued request would open one
            # by name and write into it. Those queued are dropped, those under way aborted.
            abort_store(store)
        pool.shutdown(wait=True, cancel_futures=orphaned)
        store.close()
        conn.close()


class StagingFile:
    """The staging file a part is written into, from ``offset`` on (each write one call of
    ``pwrite``, unbuffered: :func:`os.pwrite`, or a :class:`~cachepipe.fscalls.FileCalls`'s).
    Remembers a local write failure (disk full, I/O error), whatever a store backend makes of the
    exception on its way up."""

    def __init__(self, fd: int, offset: int = 0, pwrite: Callable[[int, bytes | memoryview, int], int] = os.pwrite) -> None:
        self._fd = fd
        self._pwrite = pwrite
        self._start = self._offset = offset
        self.error: OSError | None = None

    @property
    def written(self) -> int:
        """Bytes written so far, one run from the first offset on (counted here, not by the store)."""
        return self._offset - self._start

    def write(self, data: bytes | memoryview) -> int:
        view = data if type(data) is bytes else memoryview(data).cast("B")  # bytes as they are: no view, no copy
        size = len(view)
        done = 0
        try:
            while done < size:
                wrote = self._pwrite(self._fd, view[done:] if done else view, self._offset + done)
                if wrote == 0:
                    raise OSError(errno.ENOSPC, "a staging write made no progress")
                done += wrote
        except OSError as exc:
            self.error = exc
            raise
        finally:
            self._offset += done
        return size


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def get_part(
    store: Any,
    key: str,
    path: str,
    start: int,
    end: int,
    create: bool,
    calls: FileCalls = RELEASING,
    etag: str | None = None,
    racer: Racer | None = None,
) -> int:
    """Bytes ``[start, end)`` of ``key`` into the staging file ``path`` at the same offsets
    (``create``: the part is the whole file, created here), by a request conditional on ``etag``
    if given (the caller passes one only to a store whose ``get`` takes it); returns the bytes written, as
    counted by the file, whatever the store says it wrote: so when each part of a file wrote its
    whole range, the file holds exactly the listed size and needs no ``stat`` to prove it. An
    error opening or closing the file is raised as it is (the fetcher sorts it), a failed write
    as :class:`LocalWriteError` whatever the store made of it. Three system calls for a small
    file (open, write, close): no buffering layer, no seek; made by ``calls`` (the cache's
    :attr:`~cachepipe.cache.Cache.file_calls`; a download worker process uses :mod:`os`'s, the
    default). ``racer``: the part is raced by a second request (:mod:`cachepipe.hedging`): each
    write is made only while the other has not won, else :class:`~cachepipe.hedging.Superseded`
    ends this request."""
    fd = calls.open(path, _CREATE if create else os.O_WRONLY | os.O_CLOEXEC, 0o666)
    out = StagingFile(fd, start, calls.pwrite if racer is None else racer.guard(calls.pwrite))
    if racer is not None:
        racer.watch(out, fd)
    try:
        if etag is None:
            store.get(key, out, start, end)
        else:
            store.get(key, out, start, end, etag=etag)
        return out.written
    except BaseException:
        if out.error is not None:
            raise LocalWriteError(out.error.errno or errno.EIO, f"{path}: {out.error.strerror or out.error}") from None
        raise
    finally:
        if racer is None:
            calls.close(fd)
        else:
            racer.close(calls.close)


def serve_fd(fd: int) -> None:
    """The entry point of a worker process: serve the parent over the socket ``fd``."""
    _serve(Connection(fd))
