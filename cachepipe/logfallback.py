"""What a user who configured no logging sees: warnings on stderr, a storm of them cut to a few lines.

Invariant: :class:`FallbackHandler` writes a record only when no other handler would see it
(none on the record's logger or on any ancestor it propagates to, the root included), and
then at most ``burst`` records of one kind (logger and message template) per ``period``.
When any handler is configured it writes nothing: the user's handlers decide.

Why a handler on ``cachepipe`` and not the library-customary ``NullHandler`` plus Python's
``logging.lastResort``: ``lastResort`` would print warnings to a user who configured nothing,
as intended, but all of them (a store outage is a retry line per request, thousands), and a
filter against that must sit on every module's logger, since logger filters do not see the
records of child loggers; a handler on ``cachepipe`` sees every record of the library. The
``NullHandler`` also hid the warnings completely (a handler was found, so ``lastResort``
never ran).

And what any handler gets: :func:`printable_records` makes each record of the library
writable in UTF-8 (a name of undecodable bytes escaped) as it is made, before any handler,
the user's on a module's logger too, sees it; and, should a record factory installed later
not call it, a handler first on ``cachepipe`` (:class:`_Unprinted`) still does before the
handlers of ``cachepipe`` and of its ancestors (the root's) see the record.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["FallbackHandler", "RateLimit", "printable", "printable_records"]


_DONE = "cachepipe_printable"
"""The attribute the record factory of :func:`printable_records` sets on each record it made
:func:`printable`: :class:`_Unprinted` leaves such a record as it is."""

_TEMPLATE = "cachepipe_template"
"""The attribute in which :func:`printable` keeps a record's message template (``record.msg``)
when it writes the message out escaped in its place: what kind of line the record is."""


class RateLimit:
    """Admit at most ``burst`` events of one kind per ``period`` seconds (pure bookkeeping).

    :meth:`admit` returns None (drop the event) or a suffix for the admitted message: empty,
    ``" (similar messages are held back for 30 s)"`` on the last of a burst, or
    ``" (12 similar messages held back)"`` on the first of a new period after some were dropped.
    """

    MAX_KINDS = 1024  # the kinds are static message templates; a bound against a dynamic one

    def __init__(self, burst: int = 3, period: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.period, self._clock = burst, period, clock
        self._kinds: dict[object, list[float]] = {}  # kind -> [period start, admitted, dropped]
        self._lock = threading.Lock()

    def admit(self, kind: object) -> str | None:
        now = self._clock()
        with self._lock:
            state = self._kinds.get(kind)
            suffix = ""
            if state is None or now - state[0] >= self.period:
                if state is not None and state[2]:
                    suffix = f" ({int(state[2])} similar messages held back)"
                if state is None and len(self._kinds) >= self.MAX_KINDS:
                    self._kinds.clear()
                state = self._kinds[kind] = [now, 0, 0]
            state[1] += 1
            if state[1] > self.burst:
                state[2] += 1
                return None
            if state[1] == self.burst:
                suffix += f" (similar messages are held back for {self.period:g} s)"
            return suffix


class FallbackHandler(logging.Handler):
    """Write WARNING and above to ``sys.stderr`` (looked up at each record, as ``lastResort``
    does) when no other handler would, rate-limited by ``limit``."""

    def __init__(self, limit: RateLimit | None = None) -> None:
        super().__init__(logging.WARNING)
        self.limit = limit or RateLimit()
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))

    def handle(self, record: logging.LogRecord) -> bool:
        if self._others(record.name):
            return False
        return super().handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        kind = getattr(record, _TEMPLATE, record.msg)  # the template, also of a record printable() rewrote
        suffix = self.limit.admit((record.name, record.levelno, str(kind)))
        if suffix is None:
            return
        try:
            sys.stderr.write(self.format(record) + suffix + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - as logging.StreamHandler.emit does
            self.handleError(record)  # logging's own policy: report on stderr, never raise into the caller

    def _others(self, name: str) -> bool:
        """True when a handler other than this one (and one that writes) is on the way ``name``'s records propagate."""
        logger: logging.Logger | None = logging.getLogger(name)
        while logger is not None:
            if any(h is not self and not isinstance(h, _Unprinted) for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


def printable(record: logging.LogRecord) -> None:
    """Make ``record`` writable by any UTF-8 handler: a message (or an exception's text) that
    holds surrogates, as a name of undecodable bytes does (the Latin-1 byte E9 is the character
    U+DCE9), is rewritten in place with each escaped as text (the six characters ``\\udce9``, as
    Python's stderr writes it; its template kept in the record's ``cachepipe_template``, the kind
    :class:`FallbackHandler` counts it as); any other record is left as it is."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a bad format string: the handler that writes it reports it
        return
    if not _encodes(message):
        setattr(record, _TEMPLATE, record.msg)  # its kind, for FallbackHandler's rate limit
        record.msg, record.args = _escaped(message), None
    if record.exc_info and not record.exc_text:
        text = logging.Formatter().formatException(record.exc_info)
        if not _encodes(text):
            record.exc_text = _escaped(text)  # formatters use it as it is, once set


def printable_records(prefix: str) -> None:
    """Make every record of the logger ``prefix`` and of its children :func:`printable` as it is
    made, before any handler sees it: a record factory (:func:`logging.setLogRecordFactory`)
    wrapping the one in place, which it calls first; the records of other loggers are left as
    they are. Once per ``prefix``: a second call (a module imported again) adds nothing.

    Not a handler on ``prefix``'s logger, which it was: a logger's handlers see a record before
    its ancestors' do, so one the user put on a child logger (``cachepipe.map``) got it first,
    and a strict one (``logging.FileHandler(path, encoding="utf-8")``) failed such a line
    ("--- Logging error ---" on stderr) and lost it. A logger's filter would see the record
    first, but only on the logger that made it (one per module), not on its ancestors.

    The factory is the process's: a user's installed after it that does not call the one it
    replaces (``logging.setLogRecordFactory(MyRecord)``) ends it. So :class:`_Unprinted`, first
    on ``prefix``'s logger, makes printable a record that the factory did not: the handlers of
    ``prefix`` and of its ancestors (the root's) get it escaped, as before the factory (a
    handler on a child logger does not, then).
    """
    logger = logging.getLogger(prefix)
    if not any(isinstance(h, _Unprinted) for h in logger.handlers):
        logger.handlers.insert(0, _Unprinted())  # first: before a handler a user put there before this import
    previous = logging.getLogRecordFactory()
    if getattr(previous, _PREFIX, None) == prefix:
        return
    child = prefix + "."

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if record.name == prefix or record.name.startswith(child):
            printable(record)
            record.__dict__[_DONE] = True
        return record

    setattr(factory, _PREFIX, prefix)
    logging.setLogRecordFactory(factory)


class _Unprinted(logging.Handler):
    """Makes :func:`printable` a record that the record factory of :func:`printable_records`
    did not make (one installed after it replaced it); writes nothing. First on the library's
    logger, so that its other handlers and its ancestors' see the record escaped."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)

    def handle(self, record: logging.LogRecord) -> bool:
        if not record.__dict__.get(_DONE):
            printable(record)
        return False

    def emit(self, record: logging.LogRecord) -> None:  # pragma: no cover - handle() writes nothing
        pass


_PREFIX = "cachepipe_prefix"
"""The attribute of the record factory of :func:`printable_records` that names its loggers."""


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
