"""Logging for the daemon: stderr, no timestamps (journald adds them), syslog priorities.

When stderr is connected to the journal (``$JOURNAL_STREAM`` names it, as systemd sets it for
``StandardError=journal``), every line starts with ``<N>``, the syslog priority journald reads
(``SyslogLevelPrefix=yes``, the default). Otherwise lines start with the level name.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

__all__ = ["JournalFormatter", "setup_logging", "stream_is_journal"]

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
