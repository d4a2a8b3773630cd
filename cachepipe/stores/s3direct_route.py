"""A bucket's route for the direct path (:mod:`cachepipe.stores.s3direct`): how s3fs's client
sends a GetObject there, as a probe found it (:class:`_Route`: the URL's origin and prefix, the
Host header, the signing region, the signer and the client's credentials object), and what the
probe's ``before-sign`` hook carries out of botocore when it stops it (:class:`_Probed`). Data
only: ``DirectGet._probe`` probes, and :class:`~cachepipe.stores.s3direct.DirectGet` keeps the
routes and takes them again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from botocore.auth import S3SigV4Auth

__all__: list[str] = []  # the direct path's own: s3direct uses them

_SIGV4 = ("s3v4", "v4")  # botocore's names of plain SigV4 header signing
_PROBE_EVENT = "before-sign.s3.GetObject"
_DEFAULT_PORTS = {"http": 80, "https": 443}


class _Probed(Exception):
    """Raised in the probe's ``before-sign`` hook: stops botocore before it signs or sends."""

    def __init__(self, url: str, signature_version: Any, signing_name: str, region: str, own_identity: bool) -> None:
        super().__init__(url)
        self.url, self.signature_version = url, signature_version
        self.signing_name, self.region, self.own_identity = signing_name, region, own_identity


@dataclasses.dataclass(frozen=True)
class _Route:
    """How s3fs's client sends a GetObject to one bucket, as probed at one time."""

    scheme: str
    netloc: str
    host: str  # the Host header: netloc without a default port, as botocore signs it
    prefix: str  # URL path before the quoted key: "/bucket/" (path style) or "/" (virtual host)
    region: str  # the signing region
    signer: S3SigV4Auth | None  # None: the client sends unsigned requests (anon)
    refresh_needed: Callable[[], bool] | None  # the credentials' own check, if refreshable
    credentials: Any  # the client's botocore credentials object (None when unsigned)
    taken: float  # time.monotonic() of the probe, seconds

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.netloc}"
