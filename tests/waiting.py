"""Waiting for a condition in tests: check, then wait briefly on an event that never fires."""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "the condition") -> object:
    """Return ``predicate()``'s first true value; raise AssertionError after ``timeout`` seconds."""
    idle = threading.Event()
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        idle.wait(0.005)
    return value


def in_a_fork(run: Callable[[], object], wait: float = 30.0) -> int:
    """The exit status of a process forked from this one (threads and all, as a DataLoader
    worker is forked) that calls ``run`` and exits, 0 if it returned; one still running after
    ``wait`` seconds is killed (AssertionError)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: "this process is multi-threaded"
        pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            faulthandler.dump_traceback_later(max(wait - 2, 1))  # where it waits, if it does
            run()
            code = 0
        except BaseException:  # noqa: BLE001 - any: printed, and the exit status says so
            traceback.print_exc()
        finally:
            os._exit(code)
    ended: list[int] = []

    def exited() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ended.append(os.waitstatus_to_exitcode(status))
        return bool(done)

    try:
        wait_until(exited, timeout=wait, what="the forked process's end")
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    return ended[0]
