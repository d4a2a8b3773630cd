"""PyTorch adapter: an ``IterableDataset`` over a cachepipe source (extra ``torch``).

Each DataLoader worker runs its own :class:`~cachepipe.Pipeline` over its share of every epoch
(worker ``k`` of ``n`` within this rank's share), with ``capacity / n`` and its own cache folder
``cache_dir/rank<r>-worker<k>``. Why not one daemon for all workers: a per-worker pipeline needs
no service, keeps each worker's downloads next to the process that reads them, and splits the
plan exactly (disjoint and covering, by the same pure plan as ranks); the price is that the
capacity is split too. To share one cache among several jobs, use ``cachepipe serve`` and
:class:`cachepipe.Client` instead.

Items are read inside the worker: pass ``transform(path)`` (decode the video, read the text...)
and the worker yields what it returns; the item is evicted when the worker moves to the next.
A bare path cannot leave a worker process safely (it would be evicted before the main process
read it), so ``transform`` is required when ``num_workers > 0``.

The same lifetime holds in the main process (``num_workers=0``, no ``transform``): a yielded
:class:`~cachepipe.CachedItem` is deleted when the loop asks for the next sample, so a batch of
several paths (``batch_size > 1`` with the default collate) holds deleted paths but the last:
read items in ``transform``, or use ``batch_size=1``/``None``. Using an acknowledged
``CachedItem`` as a path raises ``FileNotFoundError``; a ``str`` of it cannot be tracked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.utils.data

from .config import Share, parse_capacity
from .pipeline import CachedItem, Pipeline
from .plan import default_rank_world

__all__ = ["CachePipeDataset"]


class CachePipeDataset(torch.utils.data.IterableDataset):  # type: ignore[misc, type-arg, unused-ignore]  # torch: an optional extra (Any when absent)
    """Stream a source through a size-capped cache into a DataLoader.

    Args:
        source: dataset URL (see :class:`~cachepipe.Pipeline`).
        cache_dir: a folder under which each (rank, worker) gets its own cache.
        capacity: the total for this rank; each worker gets ``capacity / num_workers``.
        transform: ``fn(path) -> sample``, run in the worker while the item is on disk.
            Required with ``num_workers > 0``. None: yield the :class:`CachedItem` itself
            (only with ``num_workers=0``).
        **options: :class:`~cachepipe.config.PipelineConfig` options (``epochs``, ``shuffle``,
            ``seed``, ``rank``/``world_size``, ``storage_options``...). ``worker`` and
            ``num_workers`` are set from the DataLoader.
    """

    def __init__(
        self,
        source: str,
        cache_dir: str | os.PathLike[str],
        capacity: int | str,
        transform: Callable[[CachedItem], Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self._state: dict[str, Any] | None = None  # where the next iteration starts (load_state_dict)
        self._pipe: Pipeline | None = None  # the pipeline iterating in this process, if any
        for key in ("worker", "num_workers"):
            if key in options:
                raise ValueError(f"{key}={options[key]!r}: set by the DataLoader, not by the dataset")
        self.source, self.cache_dir, self.transform, self.options = source, Path(cache_dir), transform, options
        self.capacity = parse_capacity(capacity)

    def pipeline(self) -> Pipeline:
        """The pipeline this process (a DataLoader worker, or the main process) iterates."""
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None and self.transform is None:
            raise ValueError(
                f"transform=None with DataLoader num_workers={num_workers}: a path yielded by a worker process would be "
                "evicted before the main process reads it; pass transform=fn(path) to read items in the worker"
            )
        rank, world = self.options.get("rank"), self.options.get("world_size")
        if rank is None and world is None:
            rank, world = default_rank_world()
        capacity = self.capacity
        share = Share(capacity.fraction / num_workers) if isinstance(capacity, Share) else capacity // num_workers
        options = {**self.options, "rank": rank, "world_size": world, "worker": worker, "num_workers": num_workers}
        return Pipeline(self.source, self.cache_dir / f"rank{rank}-worker{worker}", share, **options)

    def __iter__(self) -> Iterator[Any]:
        pipe = self.pipeline()
        if self._state is not None:
            pipe.load_state_dict(self._state)
        self._pipe = pipe
        with pipe:
            for path in pipe:
                yield path if self.transform is None else self.transform(path)

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: epoch and position of the iteration in this process (``num_workers=0``).

        With DataLoader workers each worker's pipeline lives in its own process; resume those with
        ``resume=True`` (each worker's cache folder keeps its own journal) instead.

        Raises:
            RuntimeError: nothing has iterated in this process yet.
        """
        if self._pipe is None:
            raise RuntimeError("state_dict(): iterate the dataset in this process first (num_workers=0)")
        return self._pipe.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next iteration at ``state`` (from :meth:`state_dict`, same settings and data)."""
        self._state = dict(state)
