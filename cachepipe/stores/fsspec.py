"""The fsspec backend: ``s3://`` (s3fs), ``file://``, plain paths, ``memory://``, ``gs://``...

All errors from fsspec, s3fs, botocore and aiohttp, and from the direct S3 requests of
:mod:`cachepipe.stores.s3direct` (GETs and listing pages, for plain s3fs options), are translated in
:func:`_translate`, the one seam of this backend (see :mod:`cachepipe.stores.base` for the contract).
"""

from __future__ import annotations

import builtins
import errno
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

import fsspec
import fsspec.asyn

from ..errors import StoreUnavailableError
from .base import ObjectInfo

__all__ = ["FsspecStore"]

_CHUNK = 8 * 1024 * 1024  # bytes per request when streaming a range
_UPLOAD_PART = 16 * 1024 * 1024  # multipart part size of uploads (s3fs: files from twice this size)


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore ClientError behind ``exc`` (s3fs chains it), if any."""
    for err in (exc, exc.__cause__, exc.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


def _translate(exc: Exception, where: str) -> BaseException:
    """Map an exception raised by fsspec or a backend SDK to the store error contract."""
    status = _http_status(exc)
    name = type(exc).__name__
    if isinstance(exc, (FileNotFoundError, PermissionError)) or status in (403, 404):
        if status == 403 or isinstance(exc, PermissionError):
            return PermissionError(errno.EACCES, f"access denied to {where}: {exc}")
        return FileNotFoundError(errno.ENOENT, f"not found: {where} ({exc})")
    if name in ("NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError"):
        return PermissionError(errno.EACCES, f"no usable credentials for {where}: {exc}")
    if status is not None and (status >= 500 or status in (408, 429)):
        return StoreUnavailableError(f"store unavailable (HTTP {status}) for {where}: {exc}")
    if isinstance(exc, OSError) and exc.errno == errno.EBUSY:  # s3fs: SlowDown, ServiceUnavailable
        return StoreUnavailableError(f"store throttled or unavailable for {where}: {exc}")
    if isinstance(exc, TimeoutError) or "Timeout" in name:
        return TimeoutError(f"timed out on {where}: {exc}")
    if isinstance(exc, ConnectionError) or name in (
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ClientOSError",
        "HTTPClientError",
        "ProxyConnectionError",
        "IncompleteRead",
        "ResponseStreamingError",
    ):
        return ConnectionError(f"connection failed for {where}: {name}: {exc}")
    if isinstance(exc, OSError):
        return exc
    return OSError(errno.EIO, f"{where}: {name}: {exc}")


@contextmanager
def _errors(where: str) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        translated = _translate(exc, where)
        if translated is exc:
            raise
        raise translated from exc


class FsspecStore:
    """A :class:`~cachepipe.stores.base.Store` over any fsspec filesystem.

    Args:
        url: the root prefix, e.g. ``s3://bucket/video/`` or ``/data/video``.
        storage_options: keyword arguments for the fsspec filesystem (for s3fs:
            ``endpoint_url``, ``key``, ``secret``, ``anon``, ``client_kwargs``...).
        chunk_size: bytes requested per GET when streaming a range (default 8 MiB).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, chunk_size: int = _CHUNK) -> None:
        self.url = url
        with _errors(url):
            self.fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.chunk_size = chunk_size
        self._direct: Any = None  # a DirectGet for plain s3fs options (botocore only imported then)
        if getattr(self.fs, "protocol", None) in (("s3", "s3a"), "s3"):
            from .s3direct import DirectGet

            self._bucket, prefix, _ = self.fs.split_path(self.root)  # keys are relative to the root
            self._key_prefix = f"{prefix}/" if prefix else ""
            if self._bucket and DirectGet.usable(self.fs, storage_options or {}):
                self._direct = DirectGet(self.fs)

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    list_page_size: int = 1000
    """Keys per listing request to S3 (S3's maximum and default is 1,000)."""

    def list(self) -> Iterator[ObjectInfo]:
        """Yield every object under the root in key order. On S3, one page at a time: each page
        is yielded before the next is requested (a plain fsspec ``find`` lists everything first)."""
        if getattr(self.fs, "protocol", None) in (("s3", "s3a"), "s3") and not getattr(self.fs, "version_aware", False):
            yield from self._list_s3()
            return
        with _errors(self.url):
            self.fs.invalidate_cache(self.root)  # a relisting must see the store as it is now
            entries = self.fs.find(self.root, detail=True, withdirs=False)
        prefix = f"{self.root}/" if self.root else ""
        for path in sorted(entries):
            info = entries[path]
            if info.get("type", "file") != "file" or not path.startswith(prefix):
                continue
            etag = info.get("ETag") or info.get("etag")
            yield ObjectInfo(path[len(prefix) :], int(info["size"]), etag.strip('"') if etag else None)

    def _list_s3(self) -> Iterator[ObjectInfo]:
        bucket, key, _ = self.fs.split_path(self.root)
        prefix = f"{key}/" if key else ""
        token = None
        while True:
            with _errors(self.url):
                entries, token = self._list_s3_page(bucket, prefix, token)
            for name, size, etag in entries:
                if name == prefix:
                    continue  # the root's own directory marker
                yield ObjectInfo(name[len(prefix) :], size, etag)
            if token is None:
                return

    def _list_s3_page(
        self, bucket: str, prefix: str, token: str | None
    ) -> tuple[builtins.list[tuple[str, int, str | None]], str | None]:  # `list` is also this class's method
        """One ListObjectsV2 page: ``([(key, size, etag), ...], next continuation token or None)``."""
        if self._direct is not None:
            page = self._direct.list_page(bucket, prefix, self.list_page_size, token)
            if page is not None:
                return page  # type: ignore[no-any-return]  # DirectGet, held as Any so botocore stays unimported
        request = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": self.list_page_size, **self.fs.req_kw}
        if token is not None:
            request["ContinuationToken"] = token
        page = fsspec.asyn.sync(self.fs.loop, self.fs._call_s3, "list_objects_v2", **request)  # noqa: SLF001 - s3fs has no public call for one raw page
        entries = []
        for entry in page.get("Contents", ()):
            etag = entry.get("ETag")
            entries.append((entry["Key"], int(entry["Size"]), etag.strip('"') if etag else None))
        return entries, page["NextContinuationToken"] if page.get("IsTruncated") else None

    def get(self, key: str, out: BinaryIO, start: int, end: int) -> int:
        path = self._path(key)
        if self._direct is not None:
            with _errors(f"{self.url.rstrip('/')}/{key}"):
                got = self._direct.get(self._bucket, self._key_prefix + key, out, start, end)
            if got is not None:
                return got  # type: ignore[no-any-return]  # as above
        written = 0
        pos = start
        while pos < end:
            want = min(self.chunk_size, end - pos)
            with _errors(f"{self.url.rstrip('/')}/{key}"):
                data = self.fs.cat_file(path, start=pos, end=pos + want)
            if not data:
                break
            out.write(data)
            written += len(data)
            pos += len(data)
            if len(data) < want:
                break  # short body: the caller's size check decides
        return written

    def close(self) -> None:
        """Close the direct GET connections (fsspec shares filesystem instances and their pools)."""
        if self._direct is not None:
            self._direct.close()

    # ---- writing (optional primitives, see WritableStore) ----------------------------
    upload_part_size: int = _UPLOAD_PART
    """Part size of multipart uploads to S3 (s3fs uploads files of at least twice this size
    in parts, several in flight; at least 5 MiB). Set it on the instance to change it."""

    def put(self, local_path: str | os.PathLike[str], key: str) -> None:
        """Upload ``local_path`` as ``key``: s3fs streams it, multipart from ``2 * upload_part_size``;
        on a local filesystem it is copied to a temporary name beside the target and renamed."""
        local = os.fspath(local_path)
        path = self._path(key)
        with _errors(f"{self.url.rstrip('/')}/{key}"):
            protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else tuple(self.fs.protocol)
            if "file" in protocols or "local" in protocols:
                self.fs.makedirs(self.fs._parent(path), exist_ok=True)  # noqa: SLF001 - fsspec's own parent rule for this filesystem
                temp = f"{path}.cachepipe-{uuid.uuid4().hex[:12]}.tmp"
                try:
                    self.fs.put_file(local, temp)
                    os.replace(temp, path)
                except BaseException:
                    if os.path.lexists(temp):
                        os.unlink(temp)
                    raise
            elif "s3" in protocols or "s3a" in protocols:
                self.fs.put_file(local, path, chunksize=self.upload_part_size)
            else:
                self.fs.put_file(local, path)

    def exists(self, key: str) -> bool:
        """True if ``key`` exists. Asks the store (no cached listing); a missing object is False,
        any other failure raises (fsspec's own ``exists`` would return False for those too)."""
        path = self._path(key)
        with _errors(f"{self.url.rstrip('/')}/{key}"):
            self.fs.invalidate_cache(path)
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                return False
        return bool(info.get("type", "file") == "file")
