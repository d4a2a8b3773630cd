"""The child process of one attempt of ``cachepipe map``, and the watcher that stops it.

:class:`CommandRun` runs CMD, :class:`FunctionRun` runs ``fn`` in a spawned process; each child
leads a session of its own (so that a signal reaches everything it started) and dies with the
map process (Linux). ``wait`` keeps the tail of its stderr and enforces the timeout (TERM the
group, ``grace`` seconds later KILL it). When the child exits, whatever it left running in its
group is killed, before the child is reaped: nothing it started writes into the cache after it
(a process that left the group with its own ``setsid`` escapes this, unless it still holds the
command's stderr: then it is found by its ``CACHEPIPE_OUT`` and killed, ``STDERR_DRAIN`` seconds
after the exit, so that it cannot hold up the job). :class:`Watcher` measures every running
job's slot and kills a child whose outputs outgrew the item's reserve.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cache import tree_bytes

__all__ = ["TAIL_BYTES", "CommandRun", "FunctionRun", "Watch", "Watcher", "kill_leftovers"]

log = logging.getLogger("cachepipe.map")

TAIL_BYTES = 4096
"""How much of the end of a child's stderr (or traceback) is kept for the failure report."""

STDERR_DRAIN = 1.0
"""Seconds a command's stderr may stay open after the command exited and its group was killed:
what still holds it then left the group (``setsid``, ``start_new_session=True``, a daemon)."""

LONGEST_WAIT = 86400.0
"""Seconds one wait for a child blocks at most before it looks at the deadline again: a wait of
the kernel takes no more than 24.8 days (``epoll``'s milliseconds in an int), a timeout may."""

_PR_SET_PDEATHSIG = 1
_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _prctl = _libc.prctl
    except (OSError, AttributeError):
        _libc = None


def _die_with_parent() -> None:
    """In a child: be killed when the map process dies (kill -9 included), so no orphan keeps
    writing into the cache. Linux only; elsewhere a no-op."""
    if _libc is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own session: this reaches everything it started
    except ProcessLookupError:
        try:
            os.kill(pid, sig)  # not yet a group leader (a function child before its setsid)
        except ProcessLookupError:
            pass  # already gone


def kill_leftovers(work: Path, wait: float = 5.0) -> list[int]:
    """Kill every process whose ``CACHEPIPE_OUT`` names a slot under ``work``: what the commands of
    an earlier run on this cache started and left running when that run was killed (SIGKILL
    reaches only a command's own process, through its parent-death signal; what it started
    lives on, writing into the slots). Call with the run's lock held, before the slots are
    cleared. Waits up to ``wait`` seconds for them to die; returns their pids. Linux (reads
    ``/proc``); elsewhere nothing is found. Only processes in this mount namespace count (in
    another, the same path may be another folder, with a live run of its own). Processes of
    other users are not readable, so not found: they could not write into this user's cache
    anyway, unless it is shared."""
    marker = os.fsencode(f"CACHEPIPE_OUT={work}{os.sep}")
    me = os.getpid()
    killed = []
    try:
        entries = os.listdir("/proc")
        here = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/mnt").st_ino != here:
                continue  # another mount namespace (a container, PrivateTmp): the same path is another folder
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:  # gone, or another user's
            continue
        if any(var.startswith(marker) for var in environ.split(b"\0")):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait
    while killed and time.monotonic() < deadline and any(_running(pid) for pid in killed):
        time.sleep(0.01)
    return killed


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed orphan stays one until init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _exit_fd(pid: int) -> int | None:
    """A descriptor that becomes readable when child ``pid`` exits, before it is reaped (a pidfd,
    Linux 5.3+); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # ENOSYS: an older kernel
        return None


class _Child:
    """What both kinds of child share: the kill, and the end of the group at the child's exit."""

    pid: int

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended = False  # exited and its group killed: no signal may name its pid any more

    def kill(self) -> None:
        with self._lock:
            if not self._ended:
                _signal_group(self.pid, signal.SIGKILL)

    def _end(self) -> None:
        """The child exited and is not reaped yet (so its pid names no other process): kill what it
        left running in its group; from now on :meth:`kill` does nothing."""
        with self._lock:
            self._ended = True
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # not a group leader (a function child that died before its setsid)


class CommandRun(_Child):
    """CMD in a child process of its own session, stdin from /dev/null, stderr read by :meth:`wait`."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        super().__init__()
        # preexec_fn runs in the forked child before exec; _die_with_parent only makes one prctl
        # call through a function looked up at import, touching no lock another thread could hold.
        self.proc = subprocess.Popen(  # noqa: S603 - CMD is the user's own command: running it is what map does
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent if _libc is not None else None,  # noqa: PLW1509 - one prctl call, no lock (comment above)
        )
        self.pid = self.proc.pid
        self._out = env.get("CACHEPIPE_OUT")

    def wait(self, timeout: float | None, grace: float) -> tuple[int, str, bool]:
        """Block until CMD exits, keeping the tail of its stderr; past ``timeout`` TERM its group,
        ``grace`` seconds later KILL it; at its exit, kill what it left in its group (with a pidfd;
        without one, leftovers run on), and :data:`STDERR_DRAIN` seconds later what still holds
        its stderr outside the group (:meth:`_kill_escaped`). Returns (exit status, stderr tail,
        timed out)."""
        stderr = self.proc.stderr
        if stderr is None:
            raise RuntimeError(f"{self.proc.args!r}: started without its stderr pipe")
        fd = stderr.fileno()
        exit_fd = _exit_fd(self.pid)
        tail = bytearray()
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._grace = grace
        self._stage = 0  # 0 running, 1 sent TERM, 2 sent KILL
        drain: float | None = None  # once CMD exited: when to stop waiting for its stderr's EOF
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if exit_fd is not None:
                    sel.register(exit_fd, selectors.EVENT_READ)
                while sel.get_map():  # stderr until EOF, and CMD's exit (a KILL that brought neither in a second: stop waiting)
                    remaining = self._remaining()
                    if drain is not None:  # CMD is gone, its group killed: only an escaped process holds stderr
                        if drain <= time.monotonic():
                            self._kill_escaped()
                            sel.unregister(fd)
                            break
                        remaining = drain - time.monotonic()
                    elif remaining is not None and remaining <= 0:
                        if not self._escalate():
                            break
                        continue
                    for key, _events in sel.select(None if remaining is None else min(remaining, LONGEST_WAIT)):
                        if key.fd == exit_fd:
                            sel.unregister(exit_fd)
                            self._end()  # a leftover in its group holding stderr dies too: the EOF comes
                            drain = time.monotonic() + STDERR_DRAIN
                            continue
                        data = os.read(fd, 65536)
                        if data:
                            tail += data
                            del tail[:-TAIL_BYTES]
                        else:
                            sel.unregister(fd)
        finally:
            if exit_fd is not None:
                os.close(exit_fd)
        while True:  # CMD may have closed its stderr and run on (without a pidfd, its exit is seen here)
            remaining = self._remaining()
            try:
                code = self.proc.wait(None if remaining is None else min(max(remaining, 0), LONGEST_WAIT))
                break
            except subprocess.TimeoutExpired:
                if (left := self._remaining()) is not None and left <= 0:  # not a wait cut at LONGEST_WAIT
                    self._escalate()
        with self._lock:
            self._ended = True  # reaped: its pid may now name another process
        stderr.close()
        return code, tail.decode("utf-8", "replace"), self._stage > 0

    def _remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _kill_escaped(self) -> None:
        """CMD exited and its group was killed, yet its stderr is still open: held by a process it
        started in a session of its own. Kill every process whose ``CACHEPIPE_OUT`` is this job's
        (what a later run on the cache would kill anyway); stop reading stderr either way."""
        slot = os.path.dirname(self._out) if self._out else None
        killed = kill_leftovers(Path(slot)) if slot else []
        log.warning(
            "command %r exited, but processes it started outside its process group still held its stderr %s s later: "
            "%s; a command must not leave processes running",
            self.proc.args[0] if isinstance(self.proc.args, list) else self.proc.args,
            STDERR_DRAIN,
            f"killed pids {', '.join(map(str, killed))}" if killed else "none of them has this job's CACHEPIPE_OUT, left running",
        )

    def _escalate(self) -> bool:
        """The deadline passed: TERM, then KILL the group; False once KILL was sent and its second passed."""
        if self._stage == 2:
            self._deadline = None  # SIGKILL cannot be ignored: the exit comes
            return False
        self._stage += 1
        _signal_group(self.pid, signal.SIGTERM if self._stage == 1 else signal.SIGKILL)
        self._deadline = time.monotonic() + (self._grace if self._stage == 1 else 1.0)
        return True


def _call_in_child(fn: Callable[[str, str], Any], item: str, out: str, cwd: str, env: dict[str, str], conn: Any) -> None:
    """Body of a function child (spawned): own session, dies with the parent, reports a traceback."""
    os.setsid()
    _die_with_parent()
    os.chdir(cwd)
    os.environ.update(env)
    try:
        fn(item, out)
    except BaseException:  # noqa: BLE001 - whatever fn raised is the item's failure, reported to the parent
        conn.send(traceback.format_exc()[-TAIL_BYTES:])
        conn.close()
        sys.exit(1)
    conn.close()


class FunctionRun(_Child):
    """``fn(item, out)`` in a spawned child process; a traceback it raises comes back as the tail."""

    def __init__(self, fn: Callable[[str, str], Any], item: Path, out: Path, cwd: Path, env: dict[str, str]) -> None:
        super().__init__()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_call_in_child, args=(fn, str(item), str(out), str(cwd), env, child), name="cachepipe-map-fn", daemon=True
        )
        self.proc.start()
        child.close()
        pid = self.proc.pid
        if pid is None:  # start() returned: the child exists
            raise RuntimeError(f"{self.proc!r}: started without a pid")
        self.pid = pid

    def wait(self, timeout: float | None, grace: float) -> tuple[int, str, bool]:
        """As :meth:`CommandRun.wait`; the tail is the traceback ``fn`` raised, if any."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (exited := multiprocessing.connection.wait([self.proc.sentinel], _left(deadline))):
            if deadline is not None and deadline <= time.monotonic():
                break
        timed_out = not exited
        if timed_out:
            _signal_group(self.pid, signal.SIGTERM)
            if not multiprocessing.connection.wait([self.proc.sentinel], grace):
                _signal_group(self.pid, signal.SIGKILL)
        multiprocessing.connection.wait([self.proc.sentinel])  # exited (the KILL cannot be ignored)
        self._end()
        self.proc.join()
        tail = ""
        if self._conn.poll():
            try:
                tail = self._conn.recv()
            except EOFError:
                pass  # the child closed the pipe without a traceback: it succeeded, or was killed
        code = self.proc.exitcode if self.proc.exitcode is not None else -1
        self._conn.close()
        self.proc.close()
        return code, tail, timed_out


def _left(deadline: float | None) -> float:
    """Seconds to wait for a child whose deadline is ``deadline`` (None: none), at most :data:`LONGEST_WAIT`."""
    return LONGEST_WAIT if deadline is None else min(max(deadline - time.monotonic(), 0), LONGEST_WAIT)


@dataclass(eq=False)
class Watch:
    """One running child and the space its outputs may take."""

    run: Any
    slot: Path
    grown: Path | None  # the input folder when CMD runs in it: what it adds there counts too
    base: int  # what the input holds, measured as it is below
    limit: int
    block: int = 0  # files in whole blocks of it, a block per folder (the slot's own among them), as the cache counts
    folders: int = 0  # what the slot's own folders take: in what is measured and in the limit, not in what is said
    over: bool = False
    peak: int = 0

    def measure(self) -> int:
        block = self.block
        used = block + tree_bytes(self.slot, block=block)
        if self.grown is not None:
            used += max(0, tree_bytes(self.grown, block=block) - self.base)
        self.peak = max(self.peak, used)
        return used


class Watcher:
    """Measures the running jobs' slots every ``interval`` and kills a job that outgrew its reserve.

    Sizes have no change event to wait on, so this thread polls, and only while a job runs
    (it waits on a condition otherwise). Stop is immediate. After :meth:`kill_all` (the run is
    stopping) a child added is killed at once: a job may start one just as the stop comes.
    """

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._watches: set[Watch] = set()
        self._killing = False
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cachepipe-map-watcher", daemon=True)
        self._thread.start()

    def add(self, watch: Watch) -> None:
        with self._cond:
            self._watches.add(watch)
            if self._killing:
                watch.run.kill()
            self._cond.notify_all()

    def remove(self, watch: Watch) -> None:
        with self._cond:
            self._watches.discard(watch)

    def kill_all(self) -> None:
        """Kill every running child, and each one added from now on."""
        with self._cond:
            self._killing = True
            for watch in self._watches:
                watch.run.kill()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._watches and not self._stop.is_set():
                    self._cond.wait()
                watches = list(self._watches)
            for watch in watches:
                if not watch.over and watch.measure() > watch.limit:
                    watch.over = True
                    watch.run.kill()
                    log.warning(
                        "outputs of the job in %s passed its reserve of %d bytes: command killed",
                        watch.slot,
                        watch.limit - watch.folders,
                    )
            self._stop.wait(self._interval)
