"""The retry schedule: how long to wait before each retry of a transient failure.

One rule for every retry of cachepipe (a part's request and an item's restart in the fetcher,
a listing, a pass's catalog, and ``cachepipe map``'s jobs and uploads): exponential backoff with
equal jitter. Pure: the random source is a parameter.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["backoff_delay"]


def backoff_delay(attempt: int, base: float, cap: float, rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based), with "equal jitter": between half
    and all of ``min(cap, base * 2**attempt)``, so that retries spread out but the budget of a
    given number of retries still covers a predictable outage."""
    delay = min(cap, base * 2.0**attempt)
    return delay / 2 + rand() * delay / 2
