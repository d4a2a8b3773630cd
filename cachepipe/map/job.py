"""One job of a ``cachepipe map`` run: a slot of the output space, and the items it runs there in turn.

For each item, :meth:`Job.process` makes attempts: (unpack and) run CMD or ``fn`` under the
watcher, upload the outputs and then the marker; a failed run is retried with the same input,
a failed upload without running CMD again. The item is recorded as done or failed in the tally;
the slot is emptied after every item.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import CachePipeError, UnsafeKeyError
from ..pipeline import CachedItem
from ..removal import in_use, rmtree, tree_bytes
from ..unpack import ArchiveError, ChecksumError, adopt_others, unpack_item
from .child import CommandRun, FunctionRun, Watch, Watcher
from .plan import MapConfig, MapItem, item_reserve, out_reserve
from .result import Tally
from .uploader import DestinationError, Uploader

__all__ = [
    "CommandError",
    "Job",
    "OutputTooLargeError",
    "Slot",
    "UnsafeArgumentError",
    "make_writable",
    "remove_slot",
    "script_arguments",
]

log = logging.getLogger("cachepipe.map")

_PLACEHOLDER = re.compile(r"\{out\}|\{name\}|\{\}")
"""The placeholders of a command's arguments: the output folder, the item's name, its path."""
_VARIABLE = {"{}": "CACHEPIPE_ITEM", "{out}": "CACHEPIPE_OUT", "{name}": "CACHEPIPE_NAME"}
"""The environment variable that holds each placeholder's value."""


_SCRIPT_FLAG = re.compile(r"-[A-Za-z]*[ce]|--command|--eval")
"""An argument after which comes code for an interpreter: ``sh -c``, ``bash -lc``, ``python -c``,
``perl -e``, ``sed -e``, ``node --eval``..."""
_SAFE_IN_SCRIPT = re.compile(r"[\w@%+=:,./-]+")
"""What a placeholder's value may hold where it is put into code: no quote, ``$``, backtick,
``;``, space (a word split off, ``/``), bracket or glob, whatever the language."""


def script_arguments(command: Sequence[str]) -> set[int]:
    """The positions in ``command`` of the arguments that are code for an interpreter (the one
    after :data:`_SCRIPT_FLAG`): a placeholder there is put into the code as text."""
    return {i + 1 for i, arg in enumerate(command[:-1]) if _SCRIPT_FLAG.fullmatch(arg)}


class UnsafeArgumentError(CachePipeError, ValueError):
    """A placeholder's value (from an object key) cannot be put into a command's script safely."""


class OutputTooLargeError(CachePipeError, OSError):
    """A job's outputs (with extracted files and what it added to its input) outgrew its reserve."""


class CommandError(CachePipeError, RuntimeError):
    """CMD (or ``fn``) exited non-zero or timed out; ``tail`` holds the end of its stderr."""

    def __init__(self, message: str, tail: str) -> None:
        super().__init__(message)
        self.tail = tail


SLOT_BUSY_SECONDS = 5.0
"""How long the removal of a slot is tried again while a file in it is still open on NFS."""


def remove_slot(path: Path) -> None:
    """Delete a slot (or what a killed run left in the work folder): :func:`~cachepipe.removal.rmtree`
    (an entry removed meanwhile, NFS's ``.nfsXXXX`` at its last close, is no error), and if
    that is refused, again once every folder under ``path`` is writable by its owner. A command
    may leave a folder it cannot write among its outputs (``chmod 555``; ``cp -r`` or ``tar x``
    of a read-only tree), whose files no one but root could then delete. Links are never
    followed: only real folders under ``path`` are changed.

    On NFS a file removed while a process holds it open stays in its folder (``.nfsXXXX``, its
    removal refused with ``EBUSY``) until it is closed, and a command's process that map has
    just killed holds its files for a moment more: a removal that meets that (``ENOTEMPTY``,
    ``EBUSY``) is tried again, for up to :data:`SLOT_BUSY_SECONDS`."""
    deadline = time.monotonic() + SLOT_BUSY_SECONDS
    while True:
        try:
            try:
                rmtree(path)
            except PermissionError:
                make_writable(path)
                rmtree(path)
            return
        except OSError as exc:
            if not in_use(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def make_writable(path: Path) -> None:
    """Give the owner back write (and list) permission on ``path`` and every real folder under
    it that lacks it, so that its files can be deleted; links are never followed.

    The walk goes by file descriptor: each folder is opened relative to its parent's descriptor
    without following a link, then changed and listed through its own (:func:`_writable_folder`),
    so that a folder swapped for a link meanwhile (by a command's process still running) is
    neither changed nor entered. It holds one descriptor per level of the tree."""
    root = _writable_folder(os.fspath(path), None, os.fspath(path))
    if root is None:
        return
    stack = [(root, _subfolders_or_close(root), os.fspath(path))]
    try:
        while stack:
            fd, names, shown = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                os.close(fd)
            elif (child := _writable_folder(name, fd, os.path.join(shown, name))) is not None:
                stack.append((child, _subfolders_or_close(child), os.path.join(shown, name)))
    finally:
        for fd, _names, _shown in stack:
            os.close(fd)


def _subfolders_or_close(fd: int) -> Iterator[str]:
    """:func:`_subfolders` of ``fd``, which is closed if they cannot be listed (EMFILE, EIO):
    it is not on the walk's stack yet."""
    try:
        return _subfolders(fd)
    except BaseException:
        os.close(fd)
        raise


_FOLDER = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""Open a real folder only: a link or a file in its place fails (ELOOP, ENOTDIR)."""


def _writable_folder(name: str, parent: int | None, shown: str) -> int | None:
    """A descriptor open for reading on the folder ``name`` (relative to the folder open as
    ``parent``, if given), made ``rwx`` for its owner if it lacked that; None if ``name`` is gone
    (a command may delete its input) or not a real folder (a link, a file). ``shown``: its path,
    which an error names."""
    try:
        try:
            fd = os.open(name, os.O_RDONLY | _FOLDER, dir_fd=parent)
        except PermissionError:  # its owner may not read it
            return _readable_again(name, parent)
        try:
            mode = os.fstat(fd).st_mode
            if mode & stat.S_IRWXU != stat.S_IRWXU:
                os.fchmod(fd, mode | stat.S_IRWXU)
        except BaseException:
            os.close(fd)
            raise
        return fd
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        exc.filename = shown  # not the name relative to its parent, nor /proc/self/fd/N
        raise


def _readable_again(name: str, parent: int | None) -> int | None:
    """:func:`_writable_folder` for a folder its owner may not read, which cannot be opened for
    reading: opened as a path (``O_PATH``, Linux), changed through ``/proc/self/fd`` (which is
    that folder itself, not a name looked up again; ``fchmod`` refuses an ``O_PATH``
    descriptor), then opened for reading through it. Without ``O_PATH`` or ``/proc``: checked
    by name (not a link) relative to ``parent`` and changed by name at once, which a swap
    between the two calls would still mislead."""
    if not hasattr(os, "O_PATH") or not os.path.isdir("/proc/self/fd"):
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        if not stat.S_ISDIR(mode):
            return None
        os.chmod(name, mode | stat.S_IRWXU, dir_fd=parent)
        return os.open(name, os.O_RDONLY | _FOLDER, dir_fd=parent)
    path_fd = os.open(name, os.O_PATH | _FOLDER, dir_fd=parent)
    try:
        os.chmod(f"/proc/self/fd/{path_fd}", os.fstat(path_fd).st_mode | stat.S_IRWXU)
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=path_fd)
    finally:
        os.close(path_fd)


def _subfolders(fd: int) -> Iterator[str]:
    """The names of the real folders in the folder open as ``fd`` (listed at once)."""
    with os.scandir(fd) as entries:
        return iter([entry.name for entry in entries if entry.is_dir(follow_symlinks=False)])


class Slot:
    """One job's work folder under ``cache_dir/.cachepipe-map/<n>/``: ``in`` (extracted files),
    ``out`` (outputs), ``cwd`` (working directory for single-file items); ``size`` is the bytes set
    aside for it (the largest item's reserve plus the margin), ``block`` the cache's block, in
    whose whole blocks (and a block per folder) what it holds is measured, as the cache counts
    its files (0: the files' bytes alone)."""

    def __init__(self, root: Path, size: int, block: int = 0) -> None:
        self.root = root
        self.size = size
        self.block = block
        self.inp = root / "in"
        self.out = root / "out"
        self.cwd = root / "cwd"

    def reset(self) -> None:
        if self.root.exists():
            remove_slot(self.root)
        for path in (self.inp, self.out, self.cwd):
            path.mkdir(parents=True)


class Job:
    """Runs items one at a time in its slot; shares the watcher, uploader, stop event and tally of the run."""

    def __init__(
        self,
        cfg: MapConfig,
        fn: Callable[[str, str], Any] | None,
        slot: Slot,
        *,
        watcher: Watcher,
        uploader: Uploader,
        stop: threading.Event,
        tally: Tally,
    ) -> None:
        self.cfg = cfg
        self.slot = slot
        self._fn = fn
        self._watcher = watcher
        self._uploader = uploader
        self._stop = stop
        self._tally = tally

    def process(self, cached: CachedItem, mi: MapItem) -> None:
        """Make the item's attempts; record it as done or failed (nothing is recorded once stopped)."""
        cfg, slot = self.cfg, self.slot
        produced: Path | None = None
        manifest: dict[str, int] | None = None
        error: BaseException | None = None
        tail = ""
        attempt = 0
        for attempt in range(1, cfg.retries + 2):
            if self._stop.is_set():
                return
            if attempt > 1:
                self._tally.retried()
                log.warning("retrying %s (attempt %d of %d) after: %s", mi.name, attempt, cfg.retries + 1, error)
            try:
                if produced is None:
                    slot.reset()
                    produced = self._produce(cached, mi)
                if manifest is None:
                    log.info("uploading %s", mi.name)
                    manifest = self._uploader.upload_item(mi.name, produced, marker_dir=slot.root, version=mi.version)
                    if self._stop.is_set():
                        return
            except (OutputTooLargeError, ArchiveError, ChecksumError, UnsafeKeyError, UnsafeArgumentError) as exc:
                error, tail = exc, ""
                break  # the same input would fail the same way
            except CommandError as exc:
                error, tail, produced = exc, exc.tail, None
            except DestinationError:
                raise  # the run stops (see Run._worker)
            except Exception as exc:  # noqa: BLE001 - an upload or local I/O error: the item is retried, then reported
                if self._stop.is_set():
                    return
                error, tail = exc, ""
                if produced is not None and not produced.exists():
                    produced = None
            else:
                slot.reset()
                self._tally.succeed(mi.name, manifest)
                return
        if self._stop.is_set():
            return
        slot.reset()
        self._tally.fail(mi.name, f"{type(error).__name__}: {error}", tail, attempt)

    def _produce(self, cached: CachedItem, mi: MapItem) -> Path:
        """Unpack and/or run CMD on the item; return the folder whose files are the results.

        The slot's limit, counted as the slot is measured (in whole blocks, a block per folder,
        the slot's own folders among them): with ``unpack``, the extracted files (measured) plus
        the outputs' reserve for that input; else the outputs' reserve for the item."""
        cfg, slot = self.cfg, self.slot
        block = slot.block
        runs = cfg.command is not None or self._fn is not None
        reserve = item_reserve(cfg, mi, runs, block)
        item_path = cached.path
        source = item_path
        limit, extracted = reserve.folders + reserve.out, 0
        if cfg.unpack:
            advice = (
                f"unpack_ratio (--unpack-ratio) {cfg.unpack_ratio:g} reserves {reserve.unpack} bytes for this item of "
                f"{mi.size} bytes: raise it to the archive's compression ratio"
            )
            # the extraction counts its folder (``in``, a block, one of the slot's own) and its
            # members in whole blocks with the folders they make: the members get reserve.unpack
            result = unpack_item(
                item_path,
                slot.inp,
                limit_bytes=reserve.unpack + block,
                max_members=cfg.max_members,
                advice=advice,
                name=mi.name,
                block=block,
            )
            adopt_others(item_path, slot.inp, result.other, move=False)  # a folder item's captions beside its archive
            source = slot.inp
            if not runs:
                return slot.inp
            extracted = tree_bytes(slot.inp, block=block)
            limit = reserve.folders + extracted + out_reserve(cfg, extracted, block=block)
        cwd = source if source.is_dir() else slot.cwd
        # what the input holds before the command runs in it: measured before it starts, or what
        # it writes there at once (under load, before this walk) would count as the input's own
        grown = item_path if source == item_path and item_path.is_dir() else None
        base = tree_bytes(grown, block=block) if grown is not None else 0
        values = {"{}": str(source), "{out}": str(slot.out), "{name}": mi.name}
        env = {_VARIABLE[placeholder]: value for placeholder, value in values.items()}
        if self._fn is not None:
            run: Any = FunctionRun(self._fn, source, slot.out, cwd, env)
        elif cfg.command is not None:
            _check_script_values(cfg.command, values, mi.name)
            argv = [_PLACEHOLDER.sub(lambda m: values[m.group()], a) for a in cfg.command]  # once: not in what replaced them
            try:
                run = CommandRun(argv, cwd, {**os.environ, **env})
            except OSError as exc:
                raise CommandError(f"cannot start {argv[0]!r}: {exc}", "") from exc
        else:  # map_items refuses a run with neither, unless it only unpacks (returned above)
            raise RuntimeError(f"item {mi.name!r}: no fn and no command to run on it")
        watch = Watch(run, slot.root, grown, base, limit, block, reserve.folders)
        self._watcher.add(watch)
        try:
            code, tail, timed_out = run.wait(cfg.timeout, cfg.kill_grace)
        except BaseException:
            run.kill()  # a wait that failed must not leave the command running beside the item's next attempt
            raise
        finally:
            self._watcher.remove(watch)
        if watch.grown is not None:  # CMD ran in its input: what it made read-only there (chmod -R a-w .) is
            make_writable(item_path)  # made deletable again, or the cache could not remove the item after it
        used = watch.measure()
        self._tally.measured(watch.peak)
        if watch.over or used > limit:
            peak = max(used, watch.peak)
            own = reserve.folders  # the slot's own folders: in what is measured and in the limit, shown in neither
            share = f" ({extracted} extracted + {limit - own - extracted} for outputs)" if cfg.unpack else ""
            counted = (
                f", counted in the filesystem's blocks of {block} bytes (files in whole blocks, a block per folder)"
                if block
                else ""
            )
            message = (
                f"item {mi.name!r}: outputs reached {peak - own} bytes, over its reserve of {limit - own} bytes"
                f"{share}{counted} (the command was stopped); raise out_reserve/out_ratio (--out-reserve/--out-ratio)"
            )
            if peak > slot.size:
                message += (
                    f"; they also passed the job's slot of {slot.size} bytes (reserve + margin + the slot's own folders), "
                    f"so the cache may have held up to {peak - slot.size} bytes more than its capacity: the command wrote "
                    f"more than the margin between two of the watcher's measurements (every {cfg.watch_interval:g} s); "
                    "raise out_margin (--out-margin)"
                )
            raise OutputTooLargeError(message)
        if self._stop.is_set():
            raise InterruptedError("stopped")
        what = "fn" if self._fn is not None else f"command {cfg.command[0]!r}"  # type: ignore[index]
        if timed_out:
            raise CommandError(f"{what} timed out after {cfg.timeout} s", tail)
        if code != 0:
            status = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            raise CommandError(f"{what} {status}", tail)
        return slot.out


def _check_script_values(command: Sequence[str], values: dict[str, str], name: str) -> None:
    """Refuse an item whose placeholder value would go into a command's script (``sh -c '... {}'``)
    with characters that code can read as code: a key such as ``x$(rm -rf ~)y`` would run."""
    for i in script_arguments(command):
        for placeholder in sorted(set(_PLACEHOLDER.findall(command[i]))):
            value = values[placeholder]
            if not _SAFE_IN_SCRIPT.fullmatch(value):
                bad = sorted({c for c in value if not _SAFE_IN_SCRIPT.fullmatch(c)})
                variable = _VARIABLE[placeholder]
                raise UnsafeArgumentError(
                    f"item {name!r}: {placeholder} is {value!r}, which has characters that the script after "
                    f"{command[i - 1]!r} could run as code or split ({', '.join(map(repr, bad))}); {placeholder} is put into "
                    f'a script as text: read "${variable}" in the script instead (the item is not run)'
                )
