"""Waiting for a condition in tests: check, then wait briefly on an event that never fires."""

from __future__ import annotations

import threading
import time
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
