"""What an archive's member may be (pure: no I/O): its name, its link's target, and the budget
of members and bytes an item's extraction may not pass.

A name is refused (:class:`~cachepipe.errors.UnsafeMemberError`) when it is absolute, has a
``..`` segment or a NUL or control character; a link when its target is empty, absolute, or
leaves the item. :class:`_Budget` refuses a member (:class:`~cachepipe.errors.ArchiveTooLargeError`)
that would pass ``max_members`` or ``limit_bytes``, before it is written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .blocks import link_charge
from .errors import ArchiveTooLargeError, UnsafeMemberError


class _Budget:
    """Members and bytes an extraction has written, against its limits. With ``block`` (bytes,
    above 0), bytes are counted as the cache's ledger counts an item
    (:func:`~cachepipe.blocks.footprint`): each file rounded up to whole blocks, a block for
    each folder the extraction makes (its own, ``out_dir``, counted from the start), a block for
    a symbolic link whose target is too long to be kept in its inode
    (:func:`~cachepipe.blocks.link_charge`), hard links as the file they link to; else the
    bytes of the files alone."""

    def __init__(self, limit_bytes: int, max_members: int, advice: str | None = None, block: int = 0) -> None:
        self.limit_bytes = limit_bytes
        self.max_members = max_members
        self.advice = advice  # what to raise, appended to a refusal for bytes
        self.block = block
        self.folders: set[str] = set()  # made so far (relative paths), with ``block`` only
        self.bytes = block  # the extraction's own folder
        self.members = 0

    def copy(self, max_members: int) -> _Budget:
        """A budget of the same limit and advice from what this one holds, of ``max_members``."""
        planned = _Budget(self.limit_bytes, max_members, self.advice, self.block)
        planned.bytes, planned.folders = self.bytes, set(self.folders)
        return planned

    def charge(self, rel: str, size: int, is_dir: bool = False, link: int = 0) -> int:
        """The bytes member ``rel`` (a folder if ``is_dir``; a symbolic link whose target is
        ``link`` bytes, if above 0) of ``size`` bytes adds: ``size``, or with :attr:`block`, in
        whole blocks, a block per folder it makes (its parents not made before, and itself if a
        folder), and the link's block if it takes one."""
        block = self.block
        if not block:
            return size
        return -(-size // block) * block + len(self.new_folders(rel, is_dir)) * block + link_charge(link, block)

    def new_folders(self, rel: str, is_dir: bool) -> list[str]:
        new: list[str] = []
        cut = len(rel) if is_dir else rel.rfind("/")
        while cut > 0:
            folder = rel[:cut]
            if folder in self.folders:
                break  # its parents were made with it
            new.append(folder)
            cut = folder.rfind("/")
        return new

    def total(self, members: Iterable[tuple[str, int, bool]]) -> int:
        """What the item would hold with ``members`` (``(rel, size, is_dir)`` each) added, counted
        as :meth:`charge` counts (nothing is recorded)."""
        tally = self.copy(self.max_members)
        for rel, size, is_dir in members:
            tally.bytes += tally.charge(rel, size, is_dir)
            if tally.block:
                tally.folders.update(tally.new_folders(rel, is_dir))
        return tally.bytes

    def over(
        self, archive: str, member: str, size: int, total: int | None = None, rel: str | None = None, link: int = 0
    ) -> ArchiveTooLargeError:
        """The refusal of ``member`` (``size`` bytes, its path ``rel``; a symbolic link whose
        target is ``link`` bytes, if above 0); ``total``: the archive's whole extracted size,
        when known."""
        whole = f" (its files total {total} bytes)" if total is not None else ""
        charge = self.charge(member if rel is None else rel, size, link=link)
        taken = link_charge(link, self.block)  # a link's block: said as such
        blocks = (
            f" ({charge} in whole blocks of {self.block} bytes, with the folders it makes)" if charge not in (size, taken) else ""
        )
        counted = " (in whole blocks, with its folders)" if self.block else ""
        what = f"its symbolic link (a target of {link} bytes: a block of {taken} bytes)" if taken else f"its {size} bytes"
        return ArchiveTooLargeError(
            archive,
            member,
            f"extracting {what}{blocks} would bring the item to {self.bytes + charge} bytes{counted}{whole}, over "
            f"the limit of {self.limit_bytes} bytes" + (f"; {self.advice}" if self.advice else ""),
        )

    def fits(self, size: int, rel: str = "", is_dir: bool = False, link: int = 0) -> bool:
        """Whether member ``rel`` of ``size`` more bytes stays within ``limit_bytes`` (:meth:`charge`)."""
        return self.bytes + self.charge(rel, size, is_dir, link) <= self.limit_bytes

    def add(self, archive: str, member: str, size: int, rel: str | None = None, is_dir: bool = False, link: int = 0) -> None:
        """Count member ``member`` (its checked path ``rel``; default ``member``) of ``size``
        bytes (a symbolic link whose target is ``link`` bytes, if above 0), or refuse it
        (:class:`ArchiveTooLargeError`)."""
        if self.members + 1 > self.max_members:
            raise ArchiveTooLargeError(archive, member, f"more than {self.max_members} members")
        rel = member if rel is None else rel
        if not self.fits(size, rel, is_dir, link):
            raise self.over(archive, member, size, rel=rel, link=link)
        self.bytes += self.charge(rel, size, is_dir, link)
        if self.block:
            self.folders.update(self.new_folders(rel, is_dir))
        self.members += 1


def _check_name(archive: str, name: str) -> str:
    """The member's relative path (``/``-separated, no ``./``), or raise :class:`UnsafeMemberError`."""
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UnsafeMemberError(archive, name, "NUL or a control character in the name")
    if name.startswith("/") or re.match(r"^[A-Za-z]:[/\\]", name):
        raise UnsafeMemberError(archive, name, "absolute path")
    segments = [s for s in name.split("/") if s not in ("", ".")]
    if ".." in segments:
        raise UnsafeMemberError(archive, name, "'..' path segment (would write outside the item)")
    return "/".join(segments)


def _check_link(archive: str, name: str, rel: str, target: str, hard: bool) -> str:
    """The link target relative to the item root, or raise if it is absolute or leaves the item."""
    if not target:
        raise UnsafeMemberError(archive, name, "link with an empty target")
    if target.startswith("/"):
        raise UnsafeMemberError(archive, name, f"link to the absolute path {target!r}")
    base = [] if hard else rel.split("/")[:-1]
    parts: list[str] = list(base)
    for seg in target.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not parts:
                raise UnsafeMemberError(archive, name, f"link to {target!r}, outside the item")
            parts.pop()
        else:
            parts.append(seg)
    return "/".join(parts)
