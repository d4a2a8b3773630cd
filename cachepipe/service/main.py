"""``cachepipe serve``: run the daemon in the foreground under systemd (or a terminal).

The main thread owns the signals and the conversation with systemd:

- READY=1 once every cache is open (or waits for room on a full disk: :mod:`.roomwait`) and the
  socket listens; STATUS= lines (items ready, leased, bytes cached) every ``status_interval``
  seconds when they change;
- WATCHDOG=1 every half ``WatchdogSec`` (``$WATCHDOG_USEC``) while the API thread is alive,
  during a reload too (a thread of its own);
- SIGTERM / SIGINT: STOPPING=1, stop fetching, close the pipelines (published items stay for the
  next start with ``keep_on_close``), exit 0. During start-up or a reload the signal interrupts it (either
  can list a bucket for minutes; systemd's ``TimeoutStopSec`` is 30 s in our units).
- SIGHUP: RELOADING=1, read and validate the config file again; invalid: log why and keep the
  running configuration; valid: apply it (:meth:`Daemon.reload`); then READY=1. One that comes
  while the daemon loads its configuration or starts is a reload once it runs (its default action
  would end the process).

Signal handlers only queue an event (``queue.SimpleQueue.put`` is safe in a signal handler);
the loop blocks on that queue with a timeout that is the next heartbeat or status update.

Exit status: 0 after SIGTERM/SIGINT, 1 when the daemon cannot start or its API thread dies,
78 (EX_CONFIG) when the configuration is invalid or this host cannot run it (see
:mod:`.preflight`: a ``socket_group`` that does not exist, a directory it cannot create or
write), a pipeline with ``on_error: raise`` meets a key that cannot be stored in its first
listing page (:class:`~cachepipe.UnsafeKeyError`: the same listing would refuse every restart),
one with ``on_oversize: raise`` an item larger than its capacity (:class:`~cachepipe.OversizeError`),
or the ``service`` extra is not installed (the unit's ``RestartPreventExitStatus=78``:
restarting would not help).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import CachePipeError, ConfigError, OversizeError, UnsafeKeyError
from .config import ServiceConfig, load_config
from .daemon import Daemon
from .jobsroot import held_by
from .logs import HeldRecords, setup_logging
from .notify import Notifier
from .preflight import host_problems

__all__ = ["EX_CONFIG", "check", "serve"]

log = logging.getLogger("cachepipe.service")

EX_CONFIG = 78


class _Interrupted(BaseException):
    """SIGTERM/SIGINT while starting or reloading: unwinds the start or the reload like
    KeyboardInterrupt would (either can list a bucket for minutes)."""


def _user() -> str:
    """This process's user, ``name (uid N)``: whose rights ``--check`` checked."""
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:  # no entry (a container's arbitrary uid)
        return f"uid {uid}"
    return f"{name} (uid {uid})"


def check(config_path: str | os.PathLike[str]) -> int:
    """Validate the config file, and it against this host, as ``serve`` would before opening
    anything; print a summary (``cachepipe serve --check``), with a line naming the daemon that holds
    ``jobs.root`` if one does (not a failure: a restart of that daemon is what a check is run before)."""
    config, handler = _load(config_path)
    logging.getLogger("cachepipe").removeHandler(handler)
    if config is None:
        return EX_CONFIG
    names = ", ".join(f"{n} ({c.source} -> {c.cache_dir})" for n, c in config.pipelines.items()) or "none"
    jobs = "" if config.jobs is None else f"; jobs under {config.jobs.root}, capacity {config.jobs.capacity}"
    print(
        f"checked on this host, as {_user()}: the socket's folder and each cache_dir take a new folder and file "
        "(made and removed at once; run --check as the service's User= to check its rights); not checked: the "
        "sources (nothing is listed or sent)"
    )
    if config.jobs is not None and (holder := held_by(config.jobs.root)) is not None:
        print(
            f"jobs.root {str(config.jobs.root)!r} is held by a running cachepipe daemon ({holder}): a restart or reload "
            "of that daemon is fine; a second daemon on this jobs.root would exit 1 while that one runs (one daemon "
            "per jobs.root)"
        )
    print(f"{config_path}: valid; socket {config.socket}; pipelines: {names}{jobs}")  # last: what scripts read
    return 0


def serve(config_path: str | os.PathLike[str]) -> int:
    """Run the daemon until SIGTERM/SIGINT; returns the exit status."""
    events: queue.SimpleQueue[str] = queue.SimpleQueue()
    # a SIGHUP while the configuration loads and is checked (its default action ends the process):
    # a reload once the daemon runs, as one while it starts
    early = _install(lambda _signum, _frame: events.put("reload"), (signal.SIGHUP,))
    try:
        config, handler = _load(config_path)
        try:
            if config is None:
                return EX_CONFIG
            with Notifier() as notifier:
                return _run(Path(config_path).absolute(), config, notifier, events)  # reloads read the same file
        finally:
            logging.getLogger("cachepipe").removeHandler(handler)
    finally:
        _restore(early)


def _load(config_path: str | os.PathLike[str]) -> tuple[ServiceConfig | None, logging.Handler]:
    """The valid configuration, or None after printing every problem (the file's, then the
    host's); and the handler that writes the ``cachepipe`` loggers to stderr at the file's
    ``log_level`` (at info when the file is invalid), which has written what loading logged (the
    settings made by the environment, a small capacity) at that level."""
    problems = None
    held = HeldRecords()
    try:
        with held:
            try:
                config: ServiceConfig | None = load_config(config_path)
            except ConfigError as exc:
                config, problems = None, str(exc)
            if config is not None and (host := host_problems(config)):
                lines = "\n  ".join(host)
                config, problems = None, f"configuration {str(config_path)!r} cannot run on this host:\n  {lines}"
    except BaseException:  # a check that failed itself: what loading logged is written before its traceback
        handler = setup_logging("info")
        held.replay("info")
        logging.getLogger("cachepipe").removeHandler(handler)
        raise
    level = "info" if config is None else config.log_level
    handler = setup_logging(level)
    held.replay(level)
    if problems is not None:
        print(problems, file=sys.stderr)
    return config, handler


def _run(config_path: Path, config: Any, notifier: Notifier, events: queue.SimpleQueue[str]) -> int:
    phase = ["starting"]

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            events.put("reload")
        elif phase[0] in ("starting", "reloading"):
            phase[0] = "stopping"
            raise _Interrupted
        else:
            events.put("stop")

    previous = _install(on_signal)
    daemon = Daemon(config, config_path)
    try:
        try:
            daemon.start()
        except _Interrupted:
            log.info("interrupted while starting")
            daemon.stop()
            return 0
        except ConfigError as exc:
            log.error("cannot start: %s", exc)
            daemon.stop()
            return EX_CONFIG
        except (CachePipeError, OSError, ValueError) as exc:
            log.error("cannot start: %s: %s", type(exc).__name__, exc)
            daemon.stop()
            # the data as listed, refused ("raise"): a restart would list it again
            return EX_CONFIG if isinstance(exc, (UnsafeKeyError, OversizeError)) else 1
        phase[0] = "running"
        notifier.ready(daemon.status_line())
        if notifier.watchdog_interval:
            log.info("systemd watchdog: heartbeat every %.1f s", notifier.watchdog_interval)
        code = _loop(daemon, config_path, notifier, events, phase)
        notifier.stopping()
        daemon.stop()
        return code
    except BaseException:
        daemon.stop()
        raise
    finally:
        _restore(previous)


def _loop(daemon: Daemon, config_path: Path, notifier: Notifier, events: queue.SimpleQueue[str], phase: list[str]) -> int:
    beat = notifier.watchdog_interval
    now = time.monotonic()
    next_beat = now if beat else float("inf")
    next_status = now + daemon.config.status_interval
    last_status = ""
    while True:
        timeout = max(min(next_beat, next_status) - time.monotonic(), 0.0)
        try:
            event = events.get(timeout=timeout)
        except queue.Empty:
            event = None
        if event == "stop":
            log.info("stopping (signal)")
            return 0
        if event == "reload":
            try:
                with _beating(daemon, notifier):
                    phase[0] = "reloading"  # a SIGTERM now interrupts the reload (see on_signal)
                    _reload(daemon, config_path, notifier)
                    phase[0] = "running"
            except _Interrupted:
                log.info("stopping (signal): interrupted while reloading")
                return 0
            last_status = ""
        if not daemon.running:
            log.critical("the API thread stopped unexpectedly; exiting so that systemd restarts the service")
            return 1
        now = time.monotonic()
        if now >= next_beat:
            notifier.watchdog()
            next_beat = now + beat  # type: ignore[operator]
        if now >= next_status or event == "reload":
            daemon.check_caches()
            line = daemon.status_line()
            if line != last_status:
                notifier.status(line)
                last_status = line
            next_status = now + daemon.config.status_interval


@contextlib.contextmanager
def _beating(daemon: Daemon, notifier: Notifier) -> Iterator[None]:
    """``WATCHDOG=1`` every half ``WatchdogSec`` from a thread of its own (``cachepipe-beat``)
    while the body runs, as long as the API thread is alive: a reload opens the pipelines it adds
    or rebuilds, which lists their sources (minutes for a large bucket), while the API serves
    on; systemd does not pause a service's watchdog while it reloads."""
    beat = notifier.watchdog_interval
    if not beat:
        yield
        return
    done = threading.Event()

    def run() -> None:
        while not done.wait(beat):
            if daemon.running:
                notifier.watchdog()

    thread = threading.Thread(target=run, name="cachepipe-beat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _reload(daemon: Daemon, config_path: Path, notifier: Notifier) -> None:
    notifier.reloading()
    try:
        new = load_config(config_path)
        problems = host_problems(new)  # as at start: a restart with this file would stop there
        if problems:
            lines = "\n  ".join(problems)
            raise ConfigError(f"configuration {str(config_path)!r} cannot run on this host:\n  {lines}")
    except Exception as exc:  # noqa: BLE001 - ConfigError, or a check that failed itself: never end the daemon
        log.error("reload: keeping the running configuration: %s", exc if isinstance(exc, ConfigError) else repr(exc))
        daemon.metrics.reloads.labels("invalid").inc()
        notifier.send("READY=1", "STATUS=reload failed (invalid config, see the log); running on the previous configuration")
        return
    try:
        changes = daemon.reload(new)
    except Exception:  # a host failure while applying it (e.g. inotify's limits): serve on with what was applied
        log.exception("reload: applying %s failed part way; serving on with what was applied", config_path)
        changes = ["failed part way (see the log)"]
    failed = any(c.startswith("failed") for c in changes)
    daemon.metrics.reloads.labels("partial" if failed else "ok").inc()
    log.info("reloaded %s: %s", config_path, ", ".join(changes) or "nothing changed")
    said = "reload failed in part (see the log); " if failed else ""
    notifier.send("READY=1", "STATUS=" + said + " ".join(daemon.status_line().split()))


def _install(handler: Any, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)) -> dict[int, Any]:
    """Install ``handler`` for ``signals`` (default SIGTERM, SIGINT and SIGHUP; main thread
    only); return the old ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in signals}


def _restore(previous: dict[int, Any]) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)
