"""The OBS backend's error seam: each SDK request's raised network error or returned error
result translated into the builtins of :mod:`cachepipe.stores.base`, chained to the SDK's
exception or to an :class:`ObsServiceError` (the table is in :mod:`cachepipe.stores.obs`).

:class:`_ObsSeam` is the base class of :class:`~cachepipe.stores.obs.ObsStore` (not used
alone): it declares the store's attributes it reads. Messages never show a secret (the secret
key, the security token, a proxy password; one under 6 characters only where it stands alone:
:func:`~cachepipe.stores.obs_settings.redact`); once the store is aborted, every error is its
:class:`~cachepipe.errors.StoreClosedError`.
"""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable
from http.client import HTTPException
from typing import Any, TypeVar

from cachepipe.errors import ObjectChangedError, StoreClosedError, StoreUnavailableError, StoreUnreachableError, store_code
from cachepipe.stores.base import CHANGED, CREDENTIAL_CODES, DROPPED, NO_REPLY, THROTTLE_CODES, not_the_api
from cachepipe.stores.obs_settings import _ENV_ENDPOINT, _Settings, redact

__all__ = ["ObsServiceError"]

_DOING = {"list": "listing", "get": "reading", "head": "checking"}

_T = TypeVar("_T")


def _in_connect(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while connecting (in :func:`socket.create_connection`, which the
    SDK's connections call): the SDK has one ``timeout`` for connects and reads, and raises the
    socket's own error, so where it was raised tells a connect that timed out (no answer at all:
    packets dropped) from a response that did not come in time (a silent server)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return any(frame.name == "create_connection" and frame.filename.endswith("socket.py") for frame in frames)


class ObsServiceError(Exception):
    """An error result returned (not raised) by the OBS SDK; the ``__cause__`` of translated errors.

    Attributes:
        status: the HTTP status, or None when the SDK returned no response.
        code: the OBS error code (``NoSuchKey``, ``AccessDenied``...), or None (e.g. on HEAD).
        message: the server's message, or None.
        request_id: the OBS request id for support tickets, or None.
    """

    def __init__(self, status: int | None, code: str | None, message: str | None, request_id: str | None) -> None:
        text = f"HTTP {status} {code or '(no error code)'}: {message or '(no message)'}"
        super().__init__(f"{text} (request id {request_id})" if request_id else text)
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id


class _ObsSeam:
    """Translates the OBS SDK's errors for :class:`~cachepipe.stores.obs.ObsStore`, its subclass."""

    url: str
    bucket: str
    prefix: str
    _settings: _Settings
    _secrets: tuple[str, ...]
    _timeout: Any
    _answered: bool  # OBS answered a request: a refused connection is then an outage, retried
    _aborted: bool  # abort(): requests in flight cut, later ones refused

    def _aborted_error(self) -> StoreClosedError:
        return StoreClosedError(f"request to {self.url} at {self.endpoint} aborted: the store was closed")

    @property
    def endpoint(self) -> str:
        """The resolved endpoint, ``scheme://host[:port]``."""
        return self._settings.endpoint

    @property
    def credential_source(self) -> str:
        """``"explicit"``, ``"env"`` or ``"provider"``: where the credentials came from."""
        return self._settings.credential_source

    def _object_url(self, key: str | None) -> str:
        return self.url if key is None else f"obs://{self.bucket}/{self.prefix}{key}"

    def _call(self, what: str, key: str | None, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run one SDK request; translate a raised network error or a returned error result."""
        try:
            resp = fn(*args, **kwargs)
        except (OSError, HTTPException) as exc:
            raise self._unreachable(exc, what, key) from exc
        if isinstance(getattr(resp, "status", None), int):
            self._answered = True
        self._check(resp, what, key)
        return resp

    def _redact(self, text: str) -> str:
        return redact(text, self._secrets)

    def _check(self, resp: Any, what: str, key: str | None) -> None:
        """Raise the builtin error for an SDK result whose status is not 2xx; return if it is.

        ``what`` is ``"list"``, ``"get"`` or ``"head"``; ``key`` is relative to the root, or
        None for the listing. The raised error is chained to an :class:`ObsServiceError`.
        """
        status = getattr(resp, "status", None)
        if isinstance(status, int) and status < 300:
            return
        if self._aborted:  # the SDK turned the cut connection into an error result
            raise self._aborted_error()
        code = getattr(resp, "errorCode", None) or None
        message = getattr(resp, "errorMessage", None)
        message = self._redact(message) if message else None
        cause = ObsServiceError(status, code, message, getattr(resp, "requestId", None))
        target = self._object_url(key)
        hint = ""
        if code is None and what != "head" and isinstance(status, int) and status < 500 and status not in (408, 429):
            hint = f"; {not_the_api(self.endpoint, 'OBS')}"  # OBS's error bodies name their code; a HEAD's has no body
        detail = f"({code + ', ' if code else ''}HTTP {status}{': ' + message if message else ''}{hint})"
        raise store_code(self._error_for(status, code, what, detail, target), code, self.endpoint) from cause

    def _error_for(self, status: int | None, code: str | None, what: str, detail: str, target: str) -> OSError:
        """The builtin error for an error result (chained by the caller)."""
        doing = _DOING.get(what, what)
        if status == 404 and code is None and what != "head":  # OBS names what is missing: another server answered
            return FileNotFoundError(f"{doing} {target}: nothing there {detail}")
        if status == 404 and (code == "NoSuchBucket" or what == "list"):
            return FileNotFoundError(f"OBS bucket {self.bucket!r} does not exist at {self.endpoint} {detail}, {doing} {target}")
        if status == 404:
            hint = "" if code == "NoSuchKey" else " (or no such bucket)"
            return FileNotFoundError(f"no such object {target}{hint} {detail}")
        if status == 412:  # only a conditional GET (If-Match: the listed ETag) is answered so
            return ObjectChangedError(f"{target} at {self.endpoint} {CHANGED} {detail}")
        if status == 401 or code in CREDENTIAL_CODES:  # some (ExpiredToken, InvalidToken) come as 400
            return PermissionError(
                f"OBS at {self.endpoint} rejected the credentials {detail} {doing} {target}; "
                f"check the access key pair and token (credentials from: {self._credential_hint()})"
            )
        if status == 403 and self.credential_source == "provider":  # the SDK sends unsigned when no provider has any
            return PermissionError(
                f"access denied to {target} {detail}: no keys were given, and the credentials of the SDK's providers "
                "(ECS metadata, OIDC) lack permission for this bucket or object, or they found none and the request "
                "went unsigned; off ModelArts, pass access_key_id and secret_access_key in storage_options or set "
                "OBS_ACCESS_KEY_ID and OBS_SECRET_ACCESS_KEY"
            )
        if status == 403:
            return PermissionError(
                f"access denied to {target} {detail}: the credentials (from: {self._credential_hint()}) were "
                "accepted but lack permission for this bucket or object"
            )
        if status == 429 or code in THROTTLE_CODES or (isinstance(status, int) and status >= 500):
            return StoreUnavailableError(f"OBS at {self.endpoint} is unavailable or throttling {detail}, {doing} {target}")
        if status is None:
            return StoreUnavailableError(f"cannot reach OBS endpoint {self.endpoint}: no response, {doing} {target}")
        if status in (301, 307) or code in ("PermanentRedirect", "TemporaryRedirect"):  # a Location the SDK follows
            return OSError(
                f"OBS at {self.endpoint} redirected {doing} {target} {detail} without saying where: the bucket "
                f"{self.bucket!r} is most likely in another region; set storage_options['server'] or {_ENV_ENDPOINT} "
                "to the endpoint of the bucket's region"
            )
        return OSError(f"OBS at {self.endpoint} refused {doing} {target} {detail}")

    def _credential_hint(self) -> str:
        return {
            "explicit": "storage_options",
            "env": "OBS_ACCESS_KEY_ID/OBS_SECRET_ACCESS_KEY",
            "provider": "the SDK providers (environment, ECS metadata, OIDC), none given explicitly",
        }[self.credential_source]

    def _unreachable(self, exc: BaseException, what: str, key: str | None) -> OSError:
        """The builtin error for a network exception raised by the SDK or the body read."""
        if isinstance(exc, StoreClosedError):
            return exc
        if self._aborted:  # a socket that abort shut down
            return self._aborted_error()
        doing = _DOING.get(what, what)
        target = self._object_url(key)
        check = f"check storage_options['server'] or {_ENV_ENDPOINT}"
        error: OSError
        # a connect, or the first request's reply, that timed out: unreachable at a first contact (a
        # listing, a check); a GET or an upload comes after one, or from a worker process whose
        # store saw no answer: retried
        if isinstance(exc, TimeoutError) and not self._answered and what in ("list", "head"):
            if _in_connect(exc):
                reason = f"no answer within {self._timeout} s before it ever answered ({DROPPED})"
            else:
                reason = f"{NO_REPLY} ({self._timeout} s)"
            error = StoreUnreachableError(f"cannot reach OBS endpoint {self.endpoint}: {reason}; {check} ({doing} {target})")
        elif isinstance(exc, TimeoutError):
            error = TimeoutError(f"timed out after {self._timeout} s talking to OBS endpoint {self.endpoint}, {doing} {target}")
        elif isinstance(exc, socket.gaierror):
            reason = f"its host name does not resolve ({exc.strerror}); {check}"
            error = StoreUnreachableError(f"cannot reach OBS endpoint {self.endpoint}: {reason} ({doing} {target})")
        elif isinstance(exc, ConnectionRefusedError) and not self._answered:
            reason = f"connection refused before it ever answered; {check}"
            error = StoreUnreachableError(f"cannot reach OBS endpoint {self.endpoint}: {reason} ({doing} {target})")
        else:
            reason = self._redact(f"{type(exc).__name__}: {exc}")
            error = StoreUnavailableError(f"cannot reach OBS endpoint {self.endpoint}: {reason} ({doing} {target})")
        return store_code(error, None, self.endpoint)
