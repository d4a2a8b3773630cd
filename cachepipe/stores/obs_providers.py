"""The OBS SDK's credential providers as a store without keys asks them (:func:`remembering`):
the environment at every request, the others (ECS instance metadata, OIDC) with their "found
none" remembered for a while (:func:`quiet_after`: none after the first, then from half a second
doubling to :data:`ASK_AGAIN_AFTER`).

Why: with no keys given, the SDK asks its providers before each request
(``security_provider_policy='OBS_DEFAULT'``: ``ENV``, then ``ECS``, then ``OIDC``, in
``obs/loadtoken.py``). ``ECS`` keeps the credentials it found (until 10 minutes before they
expire), but not that it found none: off an ECS it asks ``http://169.254.169.254`` again for
each request (the address, and a timeout of 5 s, are fixed in the SDK), three attempts 0.1 and
0.2 s apart, holding a lock of the SDK that every thread's lookup waits on. A read of a public
bucket without keys made about 3 requests a second where that address answers at once (0.3 s
a lookup), and each lookup could wait three 5 s timeouts where its packets are dropped.

Now each provider but the environment that found none is asked again only after a quiet time
that grows with the lookups that found none in a row (:func:`quiet_after`): at once after the
first (a lookup that failed once on an ECS, a blip or a metadata service that limits the rate
as many workers start, costs no more than it did), then 0.5 s, doubling up to
:data:`ASK_AGAIN_AFTER` (off an ECS, about ten lookups in the first two minutes, then one a
minute). The requests meanwhile go as the SDK sends them when no provider has credentials
(unsigned). When it is due, one request asks it while the others go on with its last answer. A
provider that found credentials once is asked at every request from then on, as the SDK asks it
(it keeps them itself, and fetches new ones before they expire): the host has them, and a lookup
that fails later (the metadata service down as they expired, OIDC's identity service failing as
they are renewed) is an outage there, not "none here", whose next request looks again. Keys set
in the ``OBS_*`` environment later are used from the next request on.

Forks (a DataLoader worker, forked by default on Linux): a lookup holds a lock of ours (one at a
time per provider) and one of the SDK's (``ECS.lock``, a class attribute shared by every client;
OIDC's ``OIDC._lock`` and its provider's own, held across its requests to IAM). A process forked
while a thread of its parent was inside a lookup inherited them held, by a thread that does not
exist in it: its first lookup waited for ever, through a store of its own as through the
parent's. In the child each is replaced by a new lock (:func:`_new_locks_in_child`), and that
lookup is forgotten there: the child makes its own when one is due.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ASK_AGAIN_AFTER", "FIRST_QUIET", "ask_again", "quiet_after", "remembering"]

ASK_AGAIN_AFTER = 60.0
"""The longest a provider that found no credentials (ECS metadata, OIDC) is not asked again, in
seconds: what a store without keys waits at most for credentials that appear later there (a
metadata service that starts answering, an OIDC token file written later). Off an ECS, one
lookup a minute of 0.3 s (up to three 5 s timeouts where the address drops packets) instead of
one per request."""

FIRST_QUIET = 0.5
"""The quiet time after the second lookup in a row that found none, in seconds (doubled after
each further one, up to :data:`ASK_AGAIN_AFTER`)."""

_ASKED_AT_EACH_REQUEST = ("ENV",)
"""The providers that are cheap to ask (the environment, read at each request), by name."""


def quiet_after(nones: int, most: float = ASK_AGAIN_AFTER) -> float:
    """Seconds a provider is not asked after ``nones`` lookups in a row that found no
    credentials: 0 after none or one, then :data:`FIRST_QUIET` doubling, at most ``most``."""
    if nones <= 1:
        return 0.0
    return min(most, FIRST_QUIET * 2.0 ** min(nones - 2, 64))


def ask_again(found_none_at: float | None, nones: int, now: float, most: float = ASK_AGAIN_AFTER) -> bool:
    """Whether a provider whose last ``nones`` lookups in a row found no credentials, the last at
    ``found_none_at`` (a clock's seconds; None: it never found none), is to be asked at ``now``."""
    return found_none_at is None or now - found_none_at >= quiet_after(nones, most)


class _Remembered:
    """One of the SDK's providers (a class with a static ``search``) whose "found none" is
    remembered for :func:`quiet_after` (at most ``wait``) seconds. The SDK takes it for a
    provider: it has the ``__name__`` the SDK finds a provider by, and a ``search`` that is a
    function, not a method (the SDK checks ``inspect.isfunction(provider.search)``, and refuses
    every provider otherwise)."""

    def __init__(self, provider: Any, wait: float = ASK_AGAIN_AFTER, clock: Callable[[], float] = time.monotonic) -> None:
        self.__name__: str = provider.__name__
        self._provider = provider
        self._wait = wait
        self._clock = clock
        self._lock = threading.Lock()  # one lookup at a time
        self._found_none_at: float | None = None  # when it last found none; None: it never did
        self._nones = 0  # the lookups in a row that found none
        self._asked = False
        self._found = False  # it found credentials once: asked at every request from then on
        self.search: Callable[[], Any] = self._searcher()
        _LIVE.add(self)  # its lock replaced in a forked child (_new_locks_in_child)

    def _searcher(self) -> Callable[[], Any]:
        def search() -> Any:
            return self._search()

        return search

    def _search(self) -> Any:
        if self._found:
            # it found some once: asked each time, as the SDK asks it (it keeps them); a failure
            # later is not remembered (an outage of the host's provider, looked at again next time)
            return self._provider.search()
        if not ask_again(self._found_none_at, self._nones, self._clock(), self._wait):
            raise self._none()
        # the first lookup waits for one in flight; a later one goes on with the last answer
        if not self._lock.acquire(blocking=not self._asked):
            raise self._none()
        try:
            if self._asked and not ask_again(self._found_none_at, self._nones, self._clock(), self._wait):
                raise self._none()  # asked by the thread this one waited for
            return self._ask()
        finally:
            self._lock.release()

    def _ask(self) -> Any:
        try:
            found = self._provider.search()
        except Exception:
            self._found_none_at = self._clock()
            self._nones += 1
            raise
        finally:
            self._asked = True
        self._found = True
        return found

    def _none(self) -> Exception:
        from obs.loadtoken import NoneTokenException  # what the SDK's providers raise for "none"

        quiet = quiet_after(self._nones, self._wait)
        none: Exception = NoneTokenException(
            f"{self.__name__}: found no credentials in {self._nones} lookups in a row; asked again {quiet:g} s after the last"
        )
        return none


_LIVE: weakref.WeakSet[_Remembered] = weakref.WeakSet()
"""Every :class:`_Remembered` alive in this process (weakly: a store's go with it)."""


def _new_locks_in_child() -> None:
    """In a process just forked (``os.register_at_fork``), where the only thread is the one that
    forked: a new lock for each provider of ours, and for the SDK's providers, whose locks a
    thread of the parent may have held in a lookup (see the module's docstring, "Forks").

    Safe: no thread of the child holds or waits on the locks replaced (the forking thread is
    running this, not a lookup), and the SDK takes them from where they are replaced at each
    lookup (``ECS.lock.acquire()``, ``OIDC._lock.acquire()``, ``with self._lock`` in its OIDC
    provider's ``get_credentials``). Nothing else a lookup in flight changes is kept before it
    ends (ours: ``_asked`` and the rest are set once it has returned; the SDK's: its cached
    credentials, and OIDC's provider, are set once they are found), so the child finds the state
    before that lookup, and makes its own."""
    for provider in list(_LIVE):
        provider._lock = threading.Lock()  # noqa: SLF001 - this module's own class
    loadtoken = sys.modules.get("obs.loadtoken")  # not imported: no lookup of the SDK's ran
    if loadtoken is None:
        return
    ecs, oidc = getattr(loadtoken, "ECS", None), getattr(loadtoken, "OIDC", None)
    if ecs is not None and hasattr(ecs, "lock"):
        ecs.lock = threading.Lock()
    if oidc is not None and hasattr(oidc, "_lock"):
        oidc._lock = threading.Lock()  # noqa: SLF001 - the SDK's, see above
        instance = getattr(oidc, "_provider_instance", None)
        if instance is not None and hasattr(instance, "_lock"):
            instance._lock = threading.Lock()  # noqa: SLF001 - the SDK's, see above


os.register_at_fork(after_in_child=_new_locks_in_child)


def remembering(providers: Sequence[Any], wait: float = ASK_AGAIN_AFTER) -> list[Any]:
    """``providers`` (the SDK's default chain) with each one but the environment's wrapped to
    remember for a while (:func:`quiet_after`, at most ``wait`` seconds) that it found no
    credentials."""
    return [p if getattr(p, "__name__", None) in _ASKED_AT_EACH_REQUEST else _Remembered(p, wait) for p in providers]
