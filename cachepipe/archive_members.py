"""What an archive's member may be (pure: no I/O): its name, its link's target, and the budget
of members and bytes an item's extraction may not pass.

A name is refused (:class:`~cachepipe.errors.UnsafeMemberError`) when it is absolute, has a
``..`` segment or a NUL or control character; a link when its target is empty, absolute, or
leaves the item. :class:`_Budget` refuses a member (:class:`~cachepipe.errors.ArchiveTooLargeError`)
that would pass ``max_members`` or ``limit_bytes``, before it is written.
"""

from __future__ import annotations

import re

from .errors import ArchiveTooLargeError, UnsafeMemberError


class _Budget:
    def __init__(self, limit_bytes: int, max_members: int, advice: str | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.max_members = max_members
        self.advice = advice  # what to raise, appended to a refusal for bytes
        self.bytes = 0
        self.members = 0

    def over(self, archive: str, member: str, size: int, total: int | None = None) -> ArchiveTooLargeError:
        """The refusal of ``member`` (``size`` bytes); ``total``: the archive's whole extracted size, when known."""
        whole = f" (its files total {total} bytes)" if total is not None else ""
        return ArchiveTooLargeError(
            archive,
            member,
            f"extracting its {size} bytes would bring the item to {self.bytes + size} bytes{whole}, over the limit of "
            f"{self.limit_bytes} bytes" + (f"; {self.advice}" if self.advice else ""),
        )

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes stay within ``limit_bytes``."""
        return self.bytes + size <= self.limit_bytes

    def add(self, archive: str, member: str, size: int) -> None:
        if self.members + 1 > self.max_members:
            raise ArchiveTooLargeError(archive, member, f"more than {self.max_members} members")
        if not self.fits(size):
            raise self.over(archive, member, size)
        self.members += 1
        self.bytes += size


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
