"""Where a plan's rank, world size and DataLoader worker come from when they are not given:
``torch.distributed`` or a DataLoader worker's info if torch is already imported (it is never
imported here), else torchrun's ``RANK`` and ``WORLD_SIZE``, else one process. A malformed or
inconsistent value is refused, named. :mod:`cachepipe.plan` re-exports the public names.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

__all__ = ["default_rank_world", "default_worker"]


def _env_int(environ: Mapping[str, str], name: str) -> int:
    text = environ[name]
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a non-negative integer") from None


def _check_rank(rank: int, world_size: int, source: str, names: tuple[str, str] = ("rank", "world_size")) -> tuple[int, int]:
    if world_size < 1:
        raise ValueError(f"{names[1]} {world_size} ({source}): expected an integer >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"{names[0]} {rank} ({source}): expected 0 <= {names[0]} < {names[1]} = {world_size}")
    return rank, world_size


def default_rank_world(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from ``torch.distributed`` if torch is already
    imported and the process group is initialised, else from the ``RANK`` and ``WORLD_SIZE``
    variables (torchrun), else ``(0, 1)``. Torch is never imported here.

    Raises:
        ValueError: a malformed or inconsistent value, named (``RANK='x'``, rank >= world size,
            only one of the two variables set).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return _check_rank(int(dist.get_rank()), int(dist.get_world_size()), "torch.distributed")
    env = os.environ if environ is None else environ
    has_rank, has_world = "RANK" in env, "WORLD_SIZE" in env
    if not has_rank and not has_world:
        return 0, 1
    if has_rank != has_world:
        missing, present = ("WORLD_SIZE", "RANK") if has_rank else ("RANK", "WORLD_SIZE")
        raise ValueError(f"{present}={env[present]!r} is set but {missing} is not: set both (torchrun does) or neither")
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    return _check_rank(rank, world, "from RANK and WORLD_SIZE", ("RANK", "WORLD_SIZE"))


def default_worker() -> tuple[int, int]:
    """``(worker, num_workers)`` inside a torch DataLoader worker (if torch is already
    imported), else ``(0, 1)``."""
    data = sys.modules.get("torch.utils.data")
    info = data.get_worker_info() if data is not None else None
    return (0, 1) if info is None else (int(info.id), int(info.num_workers))
