"""S3's replies as the direct path reads them (:mod:`cachepipe.stores.s3direct`): a
ListObjectsV2 page's keys, sizes and ETags, and an error body's ``Code`` and ``Message``, parsed
with :mod:`xml.etree.ElementTree` (what botocore parses with) for those fields only; and
:class:`HTTPStatusError`, a failed request's status shaped like botocore's errors, so that the
fsspec backend's one seam (:mod:`cachepipe.stores.fsspec_errors`) maps both the same way.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote_plus
from xml.etree import ElementTree  # noqa: ICN001 - ElementTree spelled out

from .base import listed_etag

__all__ = ["HTTPStatusError"]

_Page = tuple[list[tuple[str, int, str | None]], str | None]  # (key, size, etag)s, continuation token


def _parse_listing(body: bytes) -> _Page:
    """Keys, sizes and ETags (unquoted) of a ListObjectsV2 result, and its continuation token."""
    root = ElementTree.fromstring(body)  # noqa: S314 - replies from the configured endpoint; expat does not fetch external entities
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    url_encoded = root.findtext(f"{ns}EncodingType") == "url"
    entries = []
    for entry in root.iterfind(f"{ns}Contents"):
        key, size, etag = (entry.findtext(f"{ns}{tag}") for tag in ("Key", "Size", "ETag"))
        if key is None or size is None:
            raise ValueError(f"a ListObjectsV2 entry without Key or Size: {ElementTree.tostring(entry)[:200]!r}")
        entries.append((unquote_plus(key) if url_encoded else key, int(size), listed_etag(etag)))
    truncated = root.findtext(f"{ns}IsTruncated") == "true"
    return entries, root.findtext(f"{ns}NextContinuationToken") if truncated else None


def _error_body(body: bytes) -> tuple[str | None, str | None]:
    """S3's error ``Code`` and ``Message`` from an error response body, (None, None) if it has none."""
    try:
        root = ElementTree.fromstring(body)  # noqa: S314 - as in _parse_listing
    except ElementTree.ParseError:
        return None, None
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    return root.findtext(f"{ns}Code") or None, root.findtext(f"{ns}Message") or None


class HTTPStatusError(OSError):
    """A non-success status of a direct request, shaped like botocore's errors (a ``response`` with
    ``ResponseMetadata.HTTPStatusCode`` and ``Error.Code``/``Error.Message`` from S3's error body)
    so that the backend's seam maps it the same way."""

    def __init__(self, status: int, reason: str, body: bytes = b"") -> None:
        code, message = _error_body(body) if body else (None, None)
        super().__init__(f"HTTP {status} {code or reason}: {message}" if message else f"HTTP {status} {code or reason}")
        self.response: dict[str, Any] = {"ResponseMetadata": {"HTTPStatusCode": status}}
        if code or message:
            self.response["Error"] = {"Code": code, "Message": message}
