"""The OBS SDK's credential providers as a store without keys asks them (:func:`remembering`):
the environment at every request, the others (ECS instance metadata, OIDC) with their "found
none" remembered for :data:`ASK_AGAIN_AFTER` seconds.

Why: with no keys given, the SDK asks its providers before each request
(``security_provider_policy='OBS_DEFAULT'``: ``ENV``, then ``ECS``, then ``OIDC``, in
``obs/loadtoken.py``). ``ECS`` keeps the credentials it found (until 10 minutes before they
expire), but not that it found none: off an ECS it asks ``http://169.254.169.254`` again for
each request (the address, and a timeout of 5 s, are fixed in the SDK), three attempts 0.1 and
0.2 s apart, holding a lock of the SDK that every thread's lookup waits on. A read of a public
bucket without keys made about 3 requests a second where that address answers at once (0.3 s
a lookup), and each lookup could wait three 5 s timeouts where its packets are dropped.

Now each provider but the environment is asked again only :data:`ASK_AGAIN_AFTER` seconds after
it found none; the requests meanwhile go as the SDK sends them when no provider has credentials
(unsigned). When it is due, one request asks it while the others go on with its last answer. A
provider that found credentials once is asked at every request from then on, as the SDK asks it
(it keeps them itself, and fetches new ones before they expire): the host has them, and a lookup
that fails later (the metadata service down as they expired, OIDC's identity service failing as
they are renewed) is an outage there, not "none here", whose next request looks again. Keys set
in the ``OBS_*`` environment later are used from the next request on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ASK_AGAIN_AFTER", "ask_again", "remembering"]

ASK_AGAIN_AFTER = 60.0
"""Seconds a provider that found no credentials (ECS metadata, OIDC) is not asked again: what a
store without keys waits at most for credentials that appear later there (a metadata service
that starts answering, an OIDC token file written later). Off an ECS, one lookup a minute of
0.3 s (up to three 5 s timeouts where the address drops packets) instead of one per request."""

_ASKED_AT_EACH_REQUEST = ("ENV",)
"""The providers that are cheap to ask (the environment, read at each request), by name."""


def ask_again(found_none_at: float | None, now: float, wait: float = ASK_AGAIN_AFTER) -> bool:
    """Whether a provider that last found no credentials at ``found_none_at`` (a clock's
    seconds; None: it did not, or was never asked) is to be asked again at ``now``."""
    return found_none_at is None or now - found_none_at >= wait


class _Remembered:
    """One of the SDK's providers (a class with a static ``search``) whose "found none" is
    remembered for ``wait`` seconds. The SDK takes it for a provider: it has the ``__name__``
    the SDK finds a provider by, and a ``search`` that is a function, not a method (the SDK
    checks ``inspect.isfunction(provider.search)``, and refuses every provider otherwise)."""

    def __init__(self, provider: Any, wait: float = ASK_AGAIN_AFTER, clock: Callable[[], float] = time.monotonic) -> None:
        self.__name__: str = provider.__name__
        self._provider = provider
        self._wait = wait
        self._clock = clock
        self._lock = threading.Lock()  # one lookup at a time
        self._found_none_at: float | None = None  # when it last found none; None: it never did
        self._asked = False
        self._found = False  # it found credentials once: asked at every request from then on
        self.search: Callable[[], Any] = self._searcher()

    def _searcher(self) -> Callable[[], Any]:
        def search() -> Any:
            return self._search()

        return search

    def _search(self) -> Any:
        if self._found:
            # it found some once: asked each time, as the SDK asks it (it keeps them); a failure
            # later is not remembered (an outage of the host's provider, looked at again next time)
            return self._provider.search()
        if not ask_again(self._found_none_at, self._clock(), self._wait):
            raise self._none()
        # the first lookup waits for one in flight; a later one goes on with the last answer
        if not self._lock.acquire(blocking=not self._asked):
            raise self._none()
        try:
            if self._asked and not ask_again(self._found_none_at, self._clock(), self._wait):
                raise self._none()  # asked by the thread this one waited for
            return self._ask()
        finally:
            self._lock.release()

    def _ask(self) -> Any:
        try:
            found = self._provider.search()
        except Exception:
            self._found_none_at = self._clock()
            raise
        finally:
            self._asked = True
        self._found = True
        return found

    def _none(self) -> Exception:
        from obs.loadtoken import NoneTokenException  # what the SDK's providers raise for "none"

        none: Exception = NoneTokenException(f"{self.__name__}: found no credentials; asked again {self._wait:g} s after")
        return none


def remembering(providers: Sequence[Any], wait: float = ASK_AGAIN_AFTER) -> list[Any]:
    """``providers`` (the SDK's default chain) with each one but the environment's wrapped to
    remember for ``wait`` seconds that it found no credentials."""
    return [p if getattr(p, "__name__", None) in _ASKED_AT_EACH_REQUEST else _Remembered(p, wait) for p in providers]
