"""The on-disk cache: one owner's size-capped cache directory.

The parts, each owning one invariant (see their module docstrings):

- :mod:`.ledger`: bytes by owner under the capacity (pure);
- :mod:`.record`: what is published, acknowledged and consumed, journaled before it is believed;
- :mod:`.staging`: staging areas and the checks before the atomic publish;
- :mod:`.eviction`: the only code that deletes items (moved aside first, then deleted);
- :mod:`.lock`: one owner per directory;
- :mod:`.recovery`: what of an earlier owner's items is reused (policy, no writes);
- :mod:`.core`: :class:`Cache`, the facade the fetcher and the pipeline use: its lifecycle (open,
  recovery, close), over base classes that each add one concern under its lock:
  :mod:`.reservation` (room and claims), :mod:`.publishing` (staging and the atomic publish)
  and :mod:`.acks` (acks, drops, retention's hooks).
"""

from ..removal import tree_bytes
from .core import STATE_DIR, Cache, journal_budget_of
from .eviction import REAP_MIN_BYTES

__all__ = ["REAP_MIN_BYTES", "STATE_DIR", "Cache", "journal_budget_of", "tree_bytes"]
