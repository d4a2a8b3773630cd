"""Recovery at open: what an earlier owner left, and what of it this owner may keep.

Policy, no writes: :func:`check_resume` decides from the journal alone whether a pass can be
resumed; :func:`sort_leftovers` reads the disk and decides which items are reused and which
are removed (the cache deletes those, through its eviction).

Invariant: an item is reused only if the journal names it as published (or being published),
the journal's recorded plan is of the same source and items mode (when it records them), its
files match the catalog exactly, and the version the journal recorded for it is the catalog's
(none for an item without ETags); other items the journal names are ours to remove; files it
does not name are never touched (foreign). With an unreadable journal, only items matching the
catalog exactly and without a version are reused; those with one are removed, and nothing else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import state
from ..catalog import Catalog
from ..errors import ConfigError
from .staging import in_folders, matches_sizes

__all__ = ["check_resume", "of_same_data", "plan_differences", "sort_leftovers"]


def check_resume(replay: state.Replay, resume: bool, plan: str, where: str) -> None:
    """Raise ConfigError if ``resume`` cannot continue the pass that ``replay`` describes.

    Args:
        plan: this pass's plan configuration (JSON), or "" if not known yet.
        where: the cache directory, for the message.
    """
    if resume and not replay.plan and replay.cursor != (0, 0):
        raise ConfigError(
            f"resume=True, but the pass in {where!r} streamed its listing and stopped at step "
            f"{replay.cursor[1]} before the listing ended, so its plan was never recorded and that position "
            "cannot be checked against the data; use resume=False to start a new pass"
        )
    if resume and replay.plan and plan and (differ := plan_differences(replay.plan, plan)):
        raise ConfigError(
            f"resume=True, but {where!r} holds a pass of another plan: {differ}. The source, the items mode, "
            "the data (n_items, sizes_digest) or the epochs/shuffle/seed/rank settings differ; "
            "use the same ones, or resume=False to start a new pass"
        )


LATER_KEYS = ("source", "items")
"""Keys of a recorded plan that earlier versions did not record: compared only when both have them."""


def _as_dicts(saved: str, new: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Two recorded plans (JSON) as dicts, or None if either is not a JSON object."""
    try:
        before, now = json.loads(saved), json.loads(new)
    except ValueError:
        return None
    return (before, now) if isinstance(before, dict) and isinstance(now, dict) else None


def plan_differences(saved: str, new: str) -> str:
    """How the recorded plan ``saved`` and this pass's plan ``new`` (both JSON) differ, one
    ``key: saved there, new here`` per key, or "" if they are the same pass. A key of
    :data:`LATER_KEYS` that ``saved`` lacks is not compared (a pass recorded before it was)."""
    plans = _as_dicts(saved, new)
    if plans is None:
        return "" if saved == new else f"{saved} there, {new} here"
    before, now = plans
    now = {k: v for k, v in now.items() if k in before or k not in LATER_KEYS}
    keys = sorted(before.keys() | now.keys())
    return "; ".join(f"{k} {before.get(k)!r} there, {now.get(k)!r} here" for k in keys if before.get(k) != now.get(k))


def of_same_data(saved: str, new: str) -> bool:
    """False if the recorded plan ``saved`` and this pass's plan ``new`` (both JSON, or "":
    unknown) name another source or items mode: an item of the same name and sizes there is
    another object. True when either is unknown or does not record them (an earlier version's)."""
    plans = _as_dicts(saved, new)
    if plans is None:
        return True
    before, now = plans
    return all(before.get(k) == now.get(k) for k in LATER_KEYS if k in before and k in now)


def sort_leftovers(
    root: Path, replay: state.Replay, rebuilt: bool, items: Catalog, reusable: bool = True, *, block: int
) -> tuple[dict[str, int], list[str]]:
    """The items on disk under ``root`` to reuse (name -> what it takes in ``block`` -byte blocks,
    :meth:`.core.Cache.charge`, in name order; ``block`` is the cache's, no default: a charge in
    any other block would not be what the ledger releases for the item) and the names to
    remove, from the journal's ``replay`` (or, if it was unreadable, ``rebuilt``) and the catalog;
    ``reusable`` False: none is reused, and those of ours are removed (another source, see
    :func:`of_same_data`, or an owner that transforms items before hand-out). An item is reused when its
    files match the catalog's sizes and the journal recorded the version the catalog names
    (:attr:`cachepipe.catalog.Item.version`): an object rewritten since, even at the same size,
    is downloaded again. An item whose version the journal does not hold (an unreadable journal,
    or one written before versions were recorded) is reused only if the catalog gives none;
    after an unreadable journal, a name on disk whose files do not match is left alone (it may
    not be ours). A nested name whose folders in ``root`` are not all real folders (a symbolic
    link in place of one: :func:`.staging.in_folders`) is neither: what its path leads to is not
    in the cache directory, and is never looked into or deleted."""
    named = replay.published | replay.publishing
    live = named
    ours = named | {name for _epoch, name in replay.acked}
    if rebuilt:
        unsafe = {items.name(i) for i in items.unsafe}  # never written: such a name is no path of ours
        ours = live = {name for name in items.names if name not in unsafe and os.path.lexists(root / name)}
    reuse: dict[str, int] = {}
    stale: list[str] = []
    base = f"{root}/"
    names = sorted(ours)
    looked_up = [name for name in names if name in live]  # published: looked up in one sweep (no index of it all)
    positions = dict(zip(looked_up, items.find_many(looked_up), strict=True))
    files_mode, sizes, unsafe_at = items.mode == "files", items.sizes, items.unsafe
    for name in names:
        path = f"{base}{name}"
        if "/" in name and not in_folders(os.fspath(root), name):
            continue
        if name in live:  # published: its files matched
            # From the catalog's columns, no Item made: what items[found] gives as its size,
            # unsafe, files' sizes and version (Catalog.file_sizes, Catalog.version).
            found = positions[name]
            if (
                found >= 0
                and found not in unsafe_at
                and matches_sizes(path, sizes[found] if files_mode else items.file_sizes(found))
            ):
                if reusable and replay.versions.get(name) == items.version(found):
                    reuse[name] = items.charge(found, block)
                else:  # ours (journaled, or matching the listing), not to reuse, or of another version or one not known
                    stale.append(name)
                continue
        if not rebuilt and os.path.lexists(path):
            stale.append(name)
    return reuse, stale
