"""The on-disk cache: one owner's size-capped cache directory.

The parts, each owning one invariant (see their module docstrings):

- :mod:`.ledger`: bytes by owner under the capacity (pure);
- :mod:`.record`: what is published, acknowledged and consumed, journaled before it is believed;
- :mod:`.staging`: staging areas and the checks before the atomic publish;
- :mod:`.eviction`: the only code that deletes items (moved aside first, then deleted);
- :mod:`.lock`: one owner per directory;
- :mod:`.core`: :class:`Cache`, the facade the fetcher and the pipeline use.
"""

from ..removal import tree_bytes
from .core import STATE_DIR, Cache, journal_budget_of
from .eviction import REAP_MIN_BYTES

__all__ = ["REAP_MIN_BYTES", "STATE_DIR", "Cache", "journal_budget_of", "tree_bytes"]
