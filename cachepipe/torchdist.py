"""One listing for every rank under ``torch.distributed``: rank 0 lists (or has its node's
daemon list) and broadcasts the result, so every rank plans over one catalog; and the ranks of
this node, from torchrun's environment.

Invariant: if rank 0 fails to list, every rank learns it (none waits for ever for a broadcast
that never comes).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch.distributed

from .blocks import round_up
from .manifest import index
from .removal import taken
from .state import atomic_write

__all__ = ["local_ranks", "manifests_taken"]

T = TypeVar("T")


def _distributed() -> Any:
    """``torch.distributed`` if its process group is initialised with several ranks, else None."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _from_rank0(make: Callable[[], T], source: str) -> tuple[int, T]:
    """``(this rank, what rank 0's make() returned)``, broadcast to every rank. If rank 0's
    ``make`` raises, every rank learns it: rank 0 raises its error, the others a RuntimeError
    naming it (none waits forever for a broadcast that never comes)."""
    dist = torch.distributed
    rank = dist.get_rank()
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = ("ok", make())
        except Exception as exc:
            payload[0] = ("error", f"{type(exc).__name__}: {exc}")
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind != "ok":
        raise RuntimeError(f"rank 0 could not list {source!r} for this job: {value}")
    return rank, value


def _save_manifest(cache_dir: Path, rank: int, data: bytes, source: str, items: str) -> str:
    """Write manifest ``data`` (of ``source`` listed as ``items``) as rank ``rank``'s under
    ``cache_dir``; its path. The name holds a digest of the source and items mode, so that
    datasets of other sources over one ``cache_dir`` (training and validation) keep theirs."""
    of = hashlib.blake2b(f"{items} {source}".encode(), digest_size=4).hexdigest()
    path = cache_dir / f"manifest-rank{rank}-{of}.json.gz"
    cache_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
    return str(path)


def manifests_taken(cache_dir: Path, rank: int, block: int) -> int:
    """Bytes that rank ``rank``'s manifests under ``cache_dir`` (:func:`_save_manifest`'s, of
    every source listed there) take on the disk: each file's size in whole ``block`` s, or the
    blocks it was given where more. Per-process mode reserves them from the rank's capacity
    before it deals its workers' shares, so that they and the workers' folders stay under it;
    0 where there are none (or ``cache_dir`` is not there yet)."""
    prefix, total = f"manifest-rank{rank}-", 0
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(cache_dir):
            if entry.name.startswith(prefix) and entry.name.endswith(".json.gz"):
                with contextlib.suppress(FileNotFoundError):  # replaced meanwhile: counted at the next pipeline
                    st = entry.stat(follow_symlinks=False)
                    total += max(taken(st, block), round_up(st.st_size, block))
    return total


def _manifest_bytes(source: str, items: Literal["folders", "files"], options: dict[str, Any]) -> bytes:
    """List ``source`` as ``items`` (with the dataset's ``storage_options``) into manifest bytes."""
    with tempfile.TemporaryDirectory(prefix="cachepipe-list-") as tmp:
        path = Path(tmp) / "manifest.json.gz"
        index(source, path, items, options.get("storage_options"))
        return path.read_bytes()


def local_ranks(rank: int, environ: Mapping[str, str] | None = None) -> list[int]:
    """The ranks on this node: from torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (ranks
    ``rank - LOCAL_RANK`` onwards, contiguous, as torchrun assigns them), else ``[rank]``.

    Raises:
        ValueError: a malformed or inconsistent value, named.
    """
    env = os.environ if environ is None else environ
    if "LOCAL_RANK" not in env or "LOCAL_WORLD_SIZE" not in env:
        return [rank]
    try:
        local, size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except ValueError:
        raise ValueError(
            f"LOCAL_RANK={env['LOCAL_RANK']!r}, LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']!r}: expected integers"
        ) from None
    if not 0 <= local < size or local > rank:
        raise ValueError(f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={size} with rank {rank}: expected 0 <= LOCAL_RANK < size")
    first = rank - local
    return list(range(first, first + size))
