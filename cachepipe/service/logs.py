"""Logging for the daemon: stderr, no timestamps (journald adds them), syslog priorities.

When stderr is connected to the journal (``$JOURNAL_STREAM`` names it, as systemd sets it for
``StandardError=journal``), every line starts with ``<N>``, the syslog priority journald reads
(``SyslogLevelPrefix=yes``, the default). Otherwise lines start with the level name.

What is logged while the config file loads (the settings the environment makes, a small
capacity) is held (:class:`HeldRecords`) until the file's ``log_level`` is known, then written at
that level: ``log_level: warning`` leaves out the info lines of the loading too.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

__all__ = ["HeldRecords", "JournalFormatter", "set_level", "setup_logging", "stream_is_journal"]

_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def _priority(levelno: int) -> int:
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


class JournalFormatter(logging.Formatter):
    """``<6>cachepipe.service: message`` (``journal=True``) or ``INFO cachepipe.service: message``.

    With ``journal=True`` each line of a multi-line record (a traceback) carries the prefix, so
    that journald files all of them at the record's priority.
    """

    def __init__(self, journal: bool) -> None:
        super().__init__("%(name)s: %(message)s")
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not self.journal:
            return f"{record.levelname} {text}"
        prefix = f"<{_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in text.splitlines() or [""])


def stream_is_journal(stream: TextIO, environ: dict[str, str] | None = None) -> bool:
    """True when ``stream`` is the journal stream named by ``$JOURNAL_STREAM`` ("dev:inode")."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(part) for part in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup_logging(level: str, stream: TextIO | None = None) -> logging.Handler:
    """Send the ``cachepipe`` loggers to ``stream`` (default stderr) at ``level``; returns the handler."""
    stream = sys.stderr if stream is None else stream
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter(journal=stream_is_journal(stream)))
    logger = logging.getLogger("cachepipe")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    return handler


def set_level(level: str) -> None:
    """Change the level of the ``cachepipe`` loggers (on reload)."""
    logging.getLogger("cachepipe").setLevel(level.upper())


class HeldRecords(logging.Handler):
    """Keeps the records of the ``cachepipe`` loggers, every level, while it is attached (as a
    context manager), to be written once the level to write them at is known (:meth:`replay`).

    For the daemon's start, before its handler is set up and before any other thread logs: while
    attached, the loggers' level is ``DEBUG`` and their records go no further (to no handler of
    the root logger: :meth:`replay` sends them there, once). A reload logs as it goes, at the
    running level."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._level = logging.NOTSET
        self._propagate = True

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> HeldRecords:
        logger = logging.getLogger("cachepipe")
        self._level, self._propagate = logger.level, logger.propagate
        logger.addHandler(self)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # held: not written now by the root logger's handlers, at any level
        return self

    def __exit__(self, *exc_info: object) -> None:
        logger = logging.getLogger("cachepipe")
        logger.removeHandler(self)
        logger.setLevel(self._level)
        logger.propagate = self._propagate

    def replay(self, level: str) -> None:
        """Log again, through the ``cachepipe`` loggers' handlers, each record at ``level`` or above."""
        threshold = logging.getLevelName(level.upper())
        logger = logging.getLogger("cachepipe")
        for record in self.records:
            if record.levelno >= threshold:
                logger.handle(record)
        self.records.clear()
