"""A manifest that a :class:`~cachepipe.torch.CachePipeDataset` holds, sent to the DataLoader
workers that spawn or forkserver start, through shared memory: each plans from it rather than
reading the whole file (its gzip, JSON and keys' check: seconds per worker for a million items).

The dataset reads a local manifest once (:func:`cachepipe.manifest.read_manifest`, which holds
the read, by the file's identity). A worker started by fork inherits the held read; one started
by spawn or forkserver gets a pickled copy of the dataset, in which :class:`SharedManifest`
stands for the manifest: its fields, the identity of the file it was read from, and its
catalog's columns in one ``torch`` tensor in shared memory (made once per manifest, in the
dataset's process; pickled for a worker as a file descriptor, as torch sends any shared tensor:
not through the pipe that carries the pickle, which the parent writes while the worker imports
its modules, so every worker would wait for the one started before it). Unpickled, it is the
manifest, held in the worker under that identity: the worker's pipeline reads the manifest with
:func:`~cachepipe.manifest.read_manifest`, which checks the file's identity as for a read of its
own process (its inode, size, times and gzip trailer) and returns the held copy only while the
file is the one read, else reads the file. The copy's catalog digest is checked against the
manifest's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .catalog import Catalog, ColumnsState
from .manifest import Manifest, held_identity, hold

__all__: list[str] = []


class SharedManifest:
    """``manifest``, held in this process as the read of the file of ``identity`` (see
    :meth:`of`), to pickle for a process started by spawn or forkserver; unpickled, the
    manifest, held there."""

    __slots__ = ("_blob", "_identity", "_lengths", "_state", "manifest")

    @classmethod
    def of(cls, manifest: Manifest) -> SharedManifest | None:
        """``manifest`` in shared memory, or None if it is not a read held in this process
        (:func:`~cachepipe.manifest.read_manifest` holds a local one while it is referenced):
        then a worker reads the file."""
        identity = held_identity(manifest)
        return None if identity is None else cls(manifest, identity)

    def __init__(self, manifest: Manifest, identity: tuple[int | bytes, ...]) -> None:
        state, columns = manifest.catalog.columns()
        raw = [memoryview(column).cast("B") for column in columns]
        blob = torch.empty(sum(len(r) for r in raw), dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call, unused-ignore]
        at = 0
        for r in raw:
            if len(r):
                blob[at : at + len(r)] = torch.frombuffer(r, dtype=torch.uint8)
            at += len(r)
        self.manifest, self._identity, self._state = manifest, identity, state
        self._lengths, self._blob = [len(r) for r in raw], blob

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        fields = replace(self.manifest, catalog=Catalog(mode=self.manifest.catalog.mode))  # the catalog goes as its columns
        return _rebuild, (fields, self._identity, self._state, self._lengths, self._blob)


def _rebuild(
    fields: Manifest, identity: tuple[int | bytes, ...], state: ColumnsState, lengths: list[int], blob: torch.Tensor
) -> Manifest:
    """The manifest :class:`SharedManifest` stood for, held in this process (the one held
    already, if any: this process's own read of that file)."""

    def copy() -> Manifest:
        raw = blob.numpy().data  # a view of the shared memory itself: from_columns makes the one copy
        columns, at = [], 0
        for n in lengths:
            columns.append(raw[at : at + n])
            at += n
        catalog = Catalog.from_columns(state, columns)
        if catalog.digest() != fields.digest:
            raise RuntimeError(f"manifest {fields.location!r}: its copy from the dataset's process has another digest")
        return replace(fields, catalog=catalog)

    return hold(identity, copy)
