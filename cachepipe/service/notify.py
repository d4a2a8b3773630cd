"""sd_notify(3): tell systemd that the daemon is ready, reloading, stopping, alive, and how it is.

A datagram of ``KEY=VALUE`` lines to the socket named by ``$NOTIFY_SOCKET`` (a path, or an
abstract name starting with ``@``). Without ``$NOTIFY_SOCKET`` (not started by systemd, or
``Type=simple``) every call is a no-op.

Written here rather than with the ``sdnotify`` package: that one swallows every error with a
bare ``except:``, leaves its socket unclosed when ``$NOTIFY_SOCKET`` is unset (a
``ResourceWarning``), and does not read ``$WATCHDOG_USEC``; the protocol is one ``send`` call.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

__all__ = ["SEND_TIMEOUT", "Notifier"]

log = logging.getLogger("cachepipe.service")

SEND_TIMEOUT = 1.0
"""Seconds a message waits for room in the notify socket's queue before it is dropped."""


class Notifier:
    """Send sd_notify messages; a context manager that closes its socket.

    Args:
        environ: where to read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``
            (default ``os.environ``).

    Attributes:
        watchdog_interval: seconds between ``WATCHDOG=1`` heartbeats (half of ``WatchdogSec``),
            or None when systemd does not watch this process.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._sock: socket.socket | None = None
        self._warned = False
        self.address = env.get("NOTIFY_SOCKET") or None
        self.watchdog_interval = _watchdog_interval(env)
        if self.address is None:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        if not target.startswith(("/", "\0")):
            log.warning("NOTIFY_SOCKET=%r: not a Unix socket path; not notifying systemd", self.address)
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(target)
        except OSError as exc:
            sock.close()
            log.warning("cannot connect to NOTIFY_SOCKET=%r: %s; not notifying systemd", self.address, exc)
            return
        sock.settimeout(SEND_TIMEOUT)  # never block the main loop for good on a reader that stopped reading
        self._sock = sock

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str) -> bool:
        """Send one message of ``KEY=VALUE`` lines; False if it could not be sent (logged once).

        Waits at most :data:`SEND_TIMEOUT` seconds for room in the socket's queue (a reader that
        does not read, such as a supervisor that set ``NOTIFY_SOCKET`` and forgot it): then the
        message is dropped, so that the main loop goes on (stop, reload, status)."""
        if self._sock is None:
            return False
        try:
            self._sock.send("\n".join(lines).encode())
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd at %r: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", "STATUS=" + _one_line(status))

    def status(self, status: str) -> bool:
        return self.send("STATUS=" + _one_line(status))

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading the configuration")

    def stopping(self) -> bool:
        return self.send("STOPPING=1", "STATUS=stopping")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half the watchdog timeout from ``WATCHDOG_USEC``, if it applies to this process."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2


def _one_line(text: str) -> str:
    return " ".join(text.split())
