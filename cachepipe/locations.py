"""Where data is: the checks of a source's and a destination's own URL or path, before anything
is opened (pure but for a look at the local filesystem and at fsspec's known protocols).

A URL a slash short (``s3:/bucket/``), a prefix written without its scheme (``bucket/video/``),
a relative local path for a daemon whose working directory is not its user's, and a path that is
not UTF-8 are each refused at once, naming the value and what to write instead: as local paths,
the first two would be read or written, without a word, under folders of those names.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .errors import ConfigError

__all__ = [
    "SCHEMES",
    "cache_in_source",
    "check_absolute_source",
    "check_destination",
    "check_source",
    "inside_prefix",
    "spelled",
    "utf8_location",
]

SCHEMES = "s3://, obs://, gs://, az://, file://, memory://, http(s):// or any other fsspec protocol"


_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]+"
"""A URL scheme's name, as a regular expression (before its ``:``)."""


def utf8_location(value: Any) -> Any:
    """A source's or destination's own path or URL, as text (a path-like as its string), refused
    if it is not UTF-8: the names *below* it may be any bytes (held with ``surrogateescape``),
    but it is itself a setting, saved and compared as text. For a pydantic ``BeforeValidator``.
    """
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(value, str) or value.isascii():
        return value
    odd = [part for part in value.split("/") if any(0xD800 <= ord(c) <= 0xDFFF for c in part)]  # surrogates: not UTF-8
    if odd:
        raw = bytes(ord(c) - 0xDC00 for c in odd[0] if 0xDC80 <= ord(c) <= 0xDCFF)  # surrogateescape's bytes
        held = f"the byte{'s' if len(raw) > 1 else ''} {', '.join(f'0x{b:02X}' for b in raw)}" if raw else "a lone surrogate"
        raise ValueError(
            f"its part {odd[0]!r} holds {held}, which is not UTF-8 "
            "(a Latin-1 name?); the names below a source may be any bytes, but the source's own path, and a "
            "destination's, are read as text: link to it from a UTF-8 path (ln -s) or rename it"
        )
    return value


def check_source(source: str) -> None:
    """Refuse a source with no scheme that is not an existing local path: ``bucket/video/`` is
    an S3 prefix written without ``s3://`` far more often than a local folder yet to be made,
    and as a local path it would end, after the cache is taken, in "no items".

    Raises:
        ConfigError: naming the value and the known schemes.
    """
    if "://" in source or os.path.exists(source):
        return
    meant = _short_of_slashes(source)
    what = "a scheme without its '//'" if meant else "no scheme"
    meant = meant or f"s3://{source.lstrip('/')}"
    raise ConfigError(
        f"source {source!r}: no such local path, and {what}; expected a URL like {meant!r} "
        f"(schemes: {SCHEMES}), or an existing local path (or 'file://' + an absolute path)"
    )


def check_destination(dest: str, field: str, folder: bool = False) -> None:
    """Refuse a destination written as a URL a slash short (``s3:/bucket/out/``, ``s3:bucket/``)
    that is not an existing local path: as a local path it would be written, without a word, to
    a folder named ``s3:`` under the current directory. With ``folder`` (a folder of results,
    made if missing), also a relative path without a scheme whose parent folder does not exist:
    ``bucket/out/`` is an S3 prefix written without ``s3://`` far more often than local folders
    yet to be made (an absolute path, or one in an existing folder: ``out``, ``./data/out``, is
    taken as local).

    Raises:
        ConfigError: naming ``field``, the value and the URL meant.
    """
    if "://" in dest or os.path.exists(dest):
        return
    meant = _short_of_slashes(dest)
    if meant:
        raise ConfigError(
            f"{field} {dest!r}: a scheme without its '//'; expected a URL like {meant!r} "
            f"(schemes: {SCHEMES}), or a local path (or 'file://' + an absolute path)"
        )
    parent = os.path.dirname(dest.rstrip("/"))
    if folder and not os.path.isabs(dest) and parent and not os.path.isdir(parent):
        raise ConfigError(
            f"{field} {dest!r}: no scheme, and no local folder {parent!r} to make it in; expected a URL like "
            f"'s3://{dest}' (schemes: {SCHEMES}), or a local path in an existing folder (or 'file://' + an absolute path)"
        )


def _short_of_slashes(location: str) -> str | None:
    """The URL meant by ``location`` when it is one with a known scheme short of its ``//``
    (``s3:/bucket/`` or ``s3:bucket/``: ``s3://bucket/``), else None (a colon in a name)."""
    import fsspec

    scheme = re.match(rf"({_SCHEME}):/?(?!/)", location)
    if scheme is None or scheme.group(1).lower() not in {"obs", *fsspec.available_protocols()}:
        return None
    return f"{scheme.group(1).lower()}://{location[scheme.end() :]}"


def check_absolute_source(source: str, field: str = "source") -> None:
    """Refuse a local source (no scheme, ``file://`` or ``local://``) written as a relative path,
    for a long-running process whose working directory is not its user's: the daemon's is ``/``
    under systemd, so ``data/train/`` that ``serve --check`` finds in its user's shell would be
    ``/data/train/`` in the service. ``Pipeline(...)`` keeps relative paths, against its process's
    working directory, as a library does.

    Raises:
        ConfigError: naming ``field``, the value, and the absolute path or URL to write instead.
    """
    scheme, sep, path = source.partition("://")
    if sep and scheme.lower() not in ("file", "local"):
        return
    local = path if sep else source
    if os.path.isabs(local) or (not sep and re.match(f"{_SCHEME}:", source)):
        return  # absolute, or a scheme short of its '//' (s3:/bucket/), which check_source names
    if local.startswith("~"):  # nothing expands it: the shell does, not a config file
        meant = f"the path written out (such as {os.path.expanduser(local)}): '~' is not expanded"
    elif sep:
        meant = f"an absolute path after {scheme}:// (three slashes, such as {scheme}:///srv/{path.lstrip('./')})"
    else:
        rest = source.lstrip("./")
        meant = f"an absolute path (such as /srv/{rest}), or a URL if an object store was meant (s3://{rest})"
    raise ConfigError(
        f"{field} {source!r}: a relative local path; the daemon would read it from its own working directory "
        f"('/' under systemd), not from the folder of its config file or of the shell that checks it: "
        f"expected {meant}"
    )


def spelled(url: str, resolve: bool = False) -> str:
    """``url`` spelled one way, ending in ``/``: a local path (no scheme, or ``file://``) made
    absolute and normalised (``data``, ``./data/`` and ``file:///home/me/data`` are one place;
    symbolic links resolved only if ``resolve``), any other URL as it is."""
    path = url.removeprefix("file://") if url.startswith("file://") else None if "://" in url else url
    if path is None:
        return url.rstrip("/") + "/"
    path = os.path.expanduser(path)
    return "file://" + (os.path.realpath(path) if resolve else os.path.abspath(path)).rstrip("/") + "/"


def inside_prefix(source: str, dest: str) -> str | None:
    """``dest`` relative to ``source`` when it lies under it (``s3://b/d/`` and ``s3://b/d/out/`` -> ``out/``;
    ``data`` and ``./data/out`` -> ``out/``: local paths are compared as absolute paths, then,
    if that finds neither under the other, with their links resolved: a link to a folder is
    that folder).

    Raises:
        ConfigError: ``dest`` is ``source`` itself, as spelled or through a link (its listing
            would be the dataset's, whose files a run would delete as left by an earlier attempt).
    """
    spellings = [(spelled(source, resolve), spelled(dest, resolve)) for resolve in (False, True)]
    for resolved, (src, dst) in enumerate(spellings):
        if dst == src:
            how = f" through a link ({src.removeprefix('file://')})" if resolved else ""
            raise ConfigError(f"dest {dest!r} is the source itself ({source!r}){how}; give a folder beside it or under it")
    for src, dst in spellings:
        if dst.startswith(src):
            return dst[len(src) :]
    return None


def cache_in_source(source: str, cache_dir: str | os.PathLike[str]) -> bool:
    """Whether the folder ``cache_dir`` is a local ``source`` (no scheme, or ``file://``) or lies
    under it, as spelled or with links resolved (:func:`spelled`): the source's listing would
    then hold the cache's own files. False for any other source."""
    if "://" in source and not source.startswith("file://"):
        return False
    return any(spelled(os.fspath(cache_dir), resolve).startswith(spelled(source, resolve)) for resolve in (False, True))
