"""The exceptions cachepipe raises.

Every error is a builtin subclass as well, so callers that catch ``ValueError`` or
``FileNotFoundError`` keep working::

    CachePipeError
     +-- ConfigError            (ValueError)        a bad setting; names the value and the accepted forms
     +-- UnsafeKeyError         (ValueError)        an object key that would escape or collide in the cache
     +-- OversizeError          (ValueError)        an item larger than the capacity
     +-- EmptySourceError       (FileNotFoundError) the listing found nothing under the URL
     +-- CacheLockedError       (RuntimeError)      another live process owns the cache directory
     +-- CacheRemovedError      (FileNotFoundError) the cache directory was removed or replaced under the open pipeline
     +-- LaneConflictError      (RuntimeError)      node mode: another consumer moved the lane while this one waited
     +-- NothingToRepeatError   (RuntimeError)      equal_steps: every item of a worker's pass was skipped
     +-- UnknownItemError       (KeyError)          ack/release of a path that is not handed out
     +-- ItemFailedError                            an item could not be fetched; ``__cause__`` says why
     +-- PrepareOverflowError   (OSError)           the prepare hook wrote more than its reserve
     +-- StoreUnavailableError  (ConnectionError)   5xx, throttling, a store that answered before and now does not: retried
     +-- StoreUnreachableError  (ConnectionError)   the endpoint never answered (host does not resolve, refused): not retried
     +-- VerificationError      (OSError)           downloaded bytes do not match the listing: retried
     |    +-- ChecksumError                         an archive volume does not match its MD5 file
     +-- ObjectChangedError     (OSError)           the object was rewritten since it was listed: not retried
     +-- StoreClosedError       (OSError)           a request cut short or refused because its store was aborted: not retried
     +-- LocalFileError         (OSError)           a local file given to a store's upload could not be opened or read
     +-- ArchiveError           (ValueError)        an item that cannot be unpacked (no archive, corrupt, gaps)
          +-- UnsafeMemberError                     a member that would leave the item, or a device file
          +-- ArchiveTooLargeError                  extraction past its byte or member limit (a bomb)

Store backends translate their own errors at one seam (``stores/*.py``) into builtins:
``FileNotFoundError`` (no such key or bucket), ``PermissionError`` (denied, bad credentials),
``TimeoutError`` / ``ConnectionError`` / :class:`StoreUnavailableError` (transient, retried),
:class:`StoreUnreachableError` and :class:`ConfigError` (an unknown storage option or URL
scheme; permanent), chained to the original with ``raise ... from``. Each names the URL and the
endpoint, and carries the store's own error code (``InvalidAccessKeyId``, ``NoSuchBucket``...)
in its message and as the attribute ``code`` (None when the store sent none), the endpoint as
``endpoint`` (see :func:`store_code`). An upload's own local file that cannot be opened or read is
not the store's error: it is a :class:`LocalFileError` naming the file.

Only transient errors are retried (:func:`is_transient`): timeouts, resets, 5xx, throttling,
short or corrupt bodies, a refused connection once the endpoint has answered. A bad setting, a
host that does not resolve, an endpoint that refuses the very first request, rejected
credentials and a missing bucket fail at once.
"""

from __future__ import annotations

__all__ = [
    "ArchiveError",
    "ArchiveTooLargeError",
    "CacheLockedError",
    "CachePipeError",
    "CacheRemovedError",
    "ChecksumError",
    "ConfigError",
    "EmptySourceError",
    "ItemFailedError",
    "LaneConflictError",
    "LocalFileError",
    "NothingToRepeatError",
    "ObjectChangedError",
    "OversizeError",
    "PrepareOverflowError",
    "StoreClosedError",
    "StoreUnavailableError",
    "StoreUnreachableError",
    "UnknownItemError",
    "UnsafeKeyError",
    "UnsafeMemberError",
    "VerificationError",
    "closest",
    "is_transient",
    "store_code",
]

import difflib
import errno
from collections.abc import Iterable
from typing import Final, TypeVar

_E = TypeVar("_E", bound=BaseException)

#: The ``error`` codes the daemon answers a store's failure with (``cachepipe.service.routes``),
#: for which its Python clients raise ``StoreError``: one set for both sides of the socket.
DAEMON_STORE_CODES: Final = frozenset({"store_unavailable", "store_error", "empty_source", "source_not_found"})


class CachePipeError(Exception):
    """Base class of every error cachepipe raises itself."""


class ConfigError(CachePipeError, ValueError):
    """A configuration value is malformed or out of range."""


class UnsafeKeyError(CachePipeError, ValueError):
    """An object key cannot be mapped safely into the cache directory; ``advice``, if given, is
    added to the message (what to do about it)."""

    def __init__(self, key: str, reason: str, advice: str = "") -> None:
        super().__init__(f"unsafe object key {key!r}: {reason}" + (f"; {advice}" if advice else ""))
        self.key = key
        self.reason = reason
        self.advice = advice

    def __reduce__(self) -> tuple[type[UnsafeKeyError], tuple[str, str, str]]:
        return type(self), (self.key, self.reason, self.advice)  # a catalog's, to a worker started by spawn


class OversizeError(CachePipeError, ValueError):
    """An item is larger than the whole cache capacity."""

    def __init__(
        self,
        item: str,
        size: int,
        capacity: int,
        occupied: int = 0,
        of: str = "the cache capacity",
        taken: int | None = None,
        block: int = 0,
    ) -> None:
        room = f" less {occupied} bytes taken by other files and cachepipe's state" if occupied else ""
        # what the capacity counts: its files in whole blocks of the filesystem, and its folders
        blocks = (
            f" listed, {taken} bytes in the filesystem's blocks of {block} bytes (each file rounded up to whole "
            "blocks, a block per folder),"
            if taken is not None and taken != size
            else ","
        )
        self.reason = f"{size} bytes{blocks} larger than {of} of {capacity} bytes{room}"
        """Why the item does not fit, without the advice: what a skipped item is logged with."""
        super().__init__(f"item {item!r} is {self.reason}; raise capacity or pass on_oversize='skip'")
        self.item = item
        self.size = size
        """Its listed size: the sum of its files' sizes."""
        self.capacity = capacity
        self.occupied = occupied
        self.taken = size if taken is None else taken
        """What it takes under the capacity: its files in whole blocks, and its folders."""
        self.block = block


class EmptySourceError(CachePipeError, FileNotFoundError):
    """The source URL lists no items."""


class CacheLockedError(CachePipeError, RuntimeError):
    """The cache directory is owned by another live pipeline."""

    def __init__(self, cache_dir: str, owner: str) -> None:
        super().__init__(f"cache directory {cache_dir!r} is in use by {owner}; close it first or use another cache_dir")
        self.cache_dir = cache_dir
        self.owner = owner


class CacheRemovedError(CachePipeError, FileNotFoundError):
    """The cache directory, or the state directory in it (``.cachepipe``: journal, lock,
    staging), was removed or replaced while the pipeline was open. The items, the journal and the
    lock in it are gone, so the pipeline stops: every later ``get`` raises this error. Open a
    pipeline again to start over in a fresh directory."""


class LaneConflictError(CachePipeError, RuntimeError):
    """Node mode: another consumer of the lane (the same rank and DataLoader worker of the job)
    moved it while this one waited for its item. A lane has one consumer at a time: its
    position acknowledges every earlier item, so two consumers would consume each other's items."""


class NothingToRepeatError(CachePipeError, RuntimeError):
    """``equal_steps`` over several ranks: every step of a DataLoader worker's pass (from its
    start, or from the state it resumed from) was skipped, so there is no sample to repeat in
    their place, and a shorter pass would leave its rank a step short (a DDP collective hangs)."""


class UnknownItemError(CachePipeError, KeyError):
    """``ack``/``release`` named a path that is not currently handed out."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0])


class ItemFailedError(CachePipeError):
    """An item could not be delivered; ``__cause__`` is the last underlying error."""

    def __init__(self, item: str, key: str, cause: BaseException) -> None:
        super().__init__(f"item {item!r} failed at {key}: {type(cause).__name__}: {cause}")
        self.item = item
        self.key = key


class PrepareOverflowError(CachePipeError, OSError):
    """The ``prepare`` hook made an item larger than the space reserved for it."""


class StoreUnavailableError(CachePipeError, ConnectionError):
    """The store answered 5xx, throttled us, or stopped answering after it had. Retried with backoff."""


class StoreUnreachableError(CachePipeError, ConnectionError):
    """The endpoint never answered: its host does not resolve, or it refused the first request.

    A misconfigured endpoint, not an outage: not retried.
    """


class VerificationError(CachePipeError, OSError):
    """Downloaded bytes do not match the listing (size or checksum). Retried."""


class ObjectChangedError(CachePipeError, OSError):
    """The object is no longer the one listed: the store refused a request conditional on the
    listed ETag (HTTP 412, ``If-Match``), so it was rewritten or deleted and written again since.
    Not retried: the plan holds the listed size, and the bytes the store now has are another
    object's. List again (a new pass) to fetch the new content."""


class StoreClosedError(CachePipeError, OSError):
    """A store request cut short, or refused before it was sent, because the store was aborted
    (``abort()``: its owner is closing). Not retried: every later request of the store is refused
    too. A closing pipeline reports no item failure for it."""


class LocalFileError(CachePipeError, OSError):
    """The local file that a store was given to upload could not be opened or read (``chmod 000``,
    gone, a failing disk): this machine's error, not the store's, whatever the store would have
    said. Keeps the local error's ``errno`` (so :func:`is_transient` judges it as that error) and
    names the file as ``filename``; not a :class:`PermissionError` even for ``EACCES``, which in
    an upload's error means that the store refused it."""


class ArchiveError(CachePipeError, ValueError):
    """An item that cannot be unpacked: no archive in it, a corrupt or unsupported archive."""


class UnsafeMemberError(ArchiveError):
    """An archive member that would write outside the item, or a kind of file that is refused."""

    def __init__(self, archive: str, member: str, reason: str) -> None:
        super().__init__(f"unsafe member {member!r} in archive {archive!r}: {reason}")
        self.archive = archive
        self.member = member
        self.reason = reason


class ArchiveTooLargeError(ArchiveError):
    """The extracted size or member count would exceed the limit (a tar or zip bomb)."""

    def __init__(self, archive: str, member: str, reason: str) -> None:
        super().__init__(f"archive {archive!r} refused at member {member!r}: {reason}")
        self.archive = archive
        self.member = member


class ChecksumError(VerificationError):
    """A volume's MD5 differs from its ``.md5`` sidecar or ``md5sums`` entry."""


_TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT}


def closest(name: str, accepted: Iterable[str]) -> str | None:
    """The one of ``accepted`` that ``name`` most resembles, if one is close enough to be what
    was meant (``max_concurency``: ``max_concurrency``), else None: the "did you mean" of every
    message that refuses an unknown name (an option, a storage option, a config key)."""
    close = difflib.get_close_matches(name, sorted(accepted), n=1)
    return close[0] if close else None


def store_code(exc: _E, code: str | None, endpoint: str | None) -> _E:
    """``exc`` with the store's error code and endpoint set as its attributes ``code`` and ``endpoint``.

    Used by the store backends at their error seam, so that a ``PermissionError`` keeps S3's
    ``InvalidAccessKeyId`` (say) for callers that tell causes apart.
    """
    setattr(exc, "code", code)  # noqa: B010 - builtins do not declare the attribute
    setattr(exc, "endpoint", endpoint)  # noqa: B010 - as above
    return exc


def is_transient(exc: BaseException) -> bool:
    """True when retrying ``exc`` after a backoff may succeed.

    Connection problems once the store has answered, timeouts, 5xx/throttling, a short or corrupt
    download and a full or failing local disk are transient. An endpoint that never answered,
    missing keys, denied access, bad settings and everything else are not.
    """
    if isinstance(exc, (StoreUnreachableError, ObjectChangedError, StoreClosedError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, VerificationError)):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS
