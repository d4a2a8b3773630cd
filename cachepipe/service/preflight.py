"""What this host must offer a valid configuration before ``cachepipe serve`` opens anything.

:func:`load_config` checks the file on its own terms (types, ranges, absolute paths, caches not
nested in each other, capacities parseable); :func:`host_problems` checks it against this host
and this user, leaving nothing behind: the ``socket_group`` exists (and this user may give
the socket to it), the socket's directory, every ``cache_dir`` and ``jobs.root`` exist as writable directories
or can be created, on a filesystem that stores files (not ``/proc`` or ``/sys``, where
``access(2)`` lets root pass): a folder holding a file is created there, the file locked (a
filesystem that cannot lock files, NFS without its lock service, is refused), and removed at once,
nothing that is not a socket sits at the socket path, ``tcp_host`` (with a
``tcp_port``) is an address of this machine, a backend serves each pipeline's ``source``
scheme and is installed, and the ``source`` and its ``storage_options`` pass the checks that
opening the pipeline makes before it sends anything (a source written without ``s3://``, a
storage option its backend does not take), as do ``jobs.options.storage_options`` against each
of ``jobs.sources``. ``serve --check`` reports these problems with the
file's; ``serve`` refuses to start on them (exit 78), and a reload (SIGHUP) keeps the running
configuration, each named with its field, its value and what would do.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path

from ..cache.lock import EXPECTED_LOCKS
from ..config import PipelineConfig, check_source
from ..errors import ConfigError
from ..filesystems import filesystem_at
from ..stores import check_store, preload
from ..wholefiles import NO_LOCKS
from .config import ServiceConfig
from .jobspec import JobsConfig

__all__ = ["host_problems"]

log = logging.getLogger("cachepipe.service")


def host_problems(config: ServiceConfig) -> list[str]:
    """One line per problem, ``<field> <value>: <what is wrong and what would do>``; [] when none."""
    problems = []
    if config.socket_group is not None:
        problems += _group_problems(config.socket_group)
    problems += _dir_problems(f"socket {str(config.socket)!r}: its directory", config.socket.parent)
    problems += _socket_path_problems(config.socket)
    if config.tcp_port is not None:
        problems += _tcp_host_problems(config.tcp_host)
    for name, cfg in config.pipelines.items():
        problems += _dir_problems(f"pipelines.{name}.cache_dir {str(cfg.cache_dir)!r}", Path(cfg.cache_dir))
        problems += _source_problems(name, cfg)
    if config.jobs is not None:
        problems += _jobs_problems(config.jobs)
    return problems


def _jobs_problems(jobs: JobsConfig) -> list[str]:
    """``jobs.root`` is a writable directory or can be created (as a pipeline's ``cache_dir``:
    on a read-only filesystem, such as a path outside a systemd unit's ``ReadWritePaths``, every
    job's registration would fail), and ``jobs.options.storage_options`` pass the checks of :func:`~cachepipe.stores.check_store`
    for each of ``jobs.sources``, as a job's pipeline will check them against its source when it
    registers. With no ``sources`` (any source may register) no backend is known to check them
    against: a job's registration does (HTTP 400)."""
    options = jobs.options.get("storage_options")
    problems = _dir_problems(f"jobs.root {str(jobs.root)!r}", jobs.root)  # every job's cache goes under it
    for prefix in jobs.sources if options else []:
        try:
            check_store(prefix, options)
        except (ConfigError, ImportError) as exc:
            problems.append(f"jobs.options.storage_options, for jobs.sources {prefix!r}: {exc}")
    return problems


def _tcp_host_problems(host: str) -> list[str]:
    """``host`` is an address of this machine that a listener can bind (tried on port 0, so that
    no port is taken), as the daemon's TCP listener will at start."""
    expected = "expected an address of this machine, such as '127.0.0.1'"
    version = 6 if ":" in host else 4  # as the listener chooses (service/api.py, ApiServer.bind)
    try:
        infos = socket.getaddrinfo(
            host, 0, socket.AF_INET6 if version == 6 else socket.AF_INET, socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return [f"tcp_host {host!r}: cannot resolve it as an IPv{version} address ({exc.strerror}); {expected}"]
    except (UnicodeError, ValueError) as exc:  # e.g. '127.0.0..1': an empty label
        return [f"tcp_host {host!r}: not a host name or address ({exc}); {expected}"]
    family, kind, proto, _name, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as exc:
        return [f"tcp_host {host!r}: cannot listen there ({exc.strerror}); {expected}"]
    return []


def _source_problems(name: str, cfg: PipelineConfig) -> list[str]:
    """A backend serves the ``source``'s scheme and is installed (imported now, as the daemon
    does when it opens the pipeline), and the source and its ``storage_options`` pass the checks
    that ``Pipeline(...)`` and its :func:`~cachepipe.stores.open_store` make before they send
    anything (:func:`~cachepipe.config.check_source`, :func:`~cachepipe.stores.check_store`),
    with their messages. Nothing is sent to the store."""
    try:
        preload(cfg.source)
    except (ConfigError, ImportError) as exc:
        return [f"pipelines.{name}.source {cfg.source!r}: {exc}"]
    try:
        check_source(cfg.source)
        check_store(cfg.source, cfg.storage_options)
    except (ConfigError, ImportError) as exc:
        return [f"pipelines.{name}: {exc}"]
    return []


def _group_problems(group: str) -> list[str]:
    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        return [
            (
                f"socket_group {group!r}: no such group on this system; expected an existing group name or number "
                f"(create it: groupadd --system {group}; or leave socket_group out: the socket is then this user's alone)"
            )
        ]
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        why = f"this user (uid {os.geteuid()}) is not a member of it, so it cannot give the socket to it"
        return [f"socket_group {group!r}: {why}; expected one of this user's groups (or run the daemon as root)"]
    return []


def _dir_problems(label: str, path: Path) -> list[str]:
    """``path`` is a writable directory, or the nearest existing folder above it is one (it can be
    created). A folder on a read-only filesystem is said to be so: no user may write there, so
    "not writable by this user" and "create it beforehand" would be the wrong advice."""
    uid = os.geteuid()
    existing = path
    while True:
        try:
            st = os.stat(existing)
            break
        except (FileNotFoundError, NotADirectoryError):  # not there, or a file above it: look further up
            existing = existing.parent
        except OSError as exc:
            return [f"{label}: cannot look at {str(existing)!r}: {exc.strerror}"]
        except ValueError as exc:  # a NUL byte in the path
            return [f"{label}: {exc}; expected a path without NUL bytes"]
    if not stat.S_ISDIR(st.st_mode):
        where = f"{str(existing)!r} is" if existing == path else f"{str(existing)!r} on its path is"
        return [f"{label}: {where} not a directory; expected a directory this daemon can write to"]
    fstype = filesystem_at(str(existing))
    if fstype in PSEUDO_FILESYSTEMS:  # before the rights: what is said of them would not help there
        where = "" if existing == path else f"cannot be created: {str(existing)!r} "
        return [f"{label}: {where}is on a {fstype} filesystem, which holds the kernel's own files; {_STORES_FILES}"]
    if os.statvfs(existing).f_flag & os.ST_RDONLY:  # no user may write there: not a matter of this user's rights
        why = "on" if existing == path else f"cannot be created: {str(existing)!r} is on"
        return [f"{label}: {why} a read-only filesystem; expected a directory on a writable filesystem"]
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == path:
            return [f"{label}: not writable by this user (uid {uid}); expected a directory it can write to"]
        why = f"cannot be created: {str(existing)!r} is not writable by this user (uid {uid})"
        return [f"{label}: {why}; create it beforehand or choose a path this user can create"]
    return _probe_problems(label, existing, existing == path)


#: filesystems of the kernel's own files: access(2) lets root "write" there, yet they store nothing
PSEUDO_FILESYSTEMS = frozenset(
    {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs", "securityfs", "configfs", "bpf", "pstore"}
)
_STORES_FILES = "expected a directory on a filesystem that stores files"
PROBE_PREFIX = ".cachepipe-check-"  # the folder the probe makes, and removes at once


def _probe_problems(label: str, folder: Path, itself: bool) -> list[str]:
    """``folder`` (the directory, or the nearest one above it that exists) takes a new folder
    holding a new file that can be locked (``flock``), as a cache does: both are created, the
    file locked, then removed at once (nothing stays).
    Permission bits and ``access(2)`` do not tell: for root they pass in ``/proc`` and ``/sys``,
    whose filesystems store nothing, and a full or failing filesystem answers only when written."""
    where = "" if itself else f"cannot be created: {str(folder)!r} "
    expected = _STORES_FILES
    try:
        probe = tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=folder)
    except OSError as exc:
        if exc.errno in FULL_ERRNOS:
            return _full(label, folder, exc)
        return [f"{label}: {where}refuses a new folder (tried to create one: {exc.strerror}); {expected}"]
    file = os.path.join(probe, "probe")
    try:
        try:
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                return _full(label, folder, exc)
            return [f"{label}: {where}refuses a new file (tried to create one: {exc.strerror}); {expected}"]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the cache's owner lock (cache/lock.py)
        except OSError as exc:
            if exc.errno in NO_LOCKS:  # as the open would say it (cache.lock.unusable_dir)
                tried = f"tried an flock in {str(folder)!r}: {exc.strerror}: NFS without its lock service?"
                return [f"{label}: its filesystem cannot lock files ({tried}); {EXPECTED_LOCKS}"]
        finally:
            os.close(fd)
            os.unlink(file)
    except OSError as exc:
        return [f"{label}: {where}keeps what is made there (cannot remove {file!r}: {exc.strerror}); {expected}"]
    finally:
        try:
            os.rmdir(probe)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("%s: cannot remove the probe folder %r: %s; remove it by hand", label, probe, exc.strerror)
    return []


FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""Errors of a filesystem that stores files but is full now (or the user's quota): no problem of
the configuration. The pipeline waits for the room (``min_free``) and goes on, so ``serve``
starts (a refusal, exit 78, is never restarted by systemd) and a reload is applied."""


def _full(label: str, folder: Path, exc: OSError) -> list[str]:
    """The probe found ``folder``'s filesystem full: a warning, not a problem (see :data:`FULL_ERRNOS`)."""
    log.warning("%s: %r is full now (%s): its pipeline waits for room before it downloads", label, str(folder), exc.strerror)
    return []


def _socket_path_problems(path: Path) -> list[str]:
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        return [f"socket {str(path)!r}: cannot look at it: {exc.strerror}"]
    except ValueError as exc:  # a NUL byte in the path
        return [f"socket {str(path)!r}: {exc}; expected a path without NUL bytes"]
    if not stat.S_ISSOCK(st.st_mode):
        return [f"socket {str(path)!r}: exists and is not a socket; expected a free path (remove it or choose another)"]
    return []  # a socket: a live daemon's (serve refuses it then) or a stale one (serve replaces it)
