"""The manifest a dataset sends to DataLoader workers started by spawn or forkserver
(:mod:`cachepipe.torchshare`), without a DataLoader: pickled, and unpickled as a worker does."""

from __future__ import annotations

import pickle
import tracemalloc

import pytest

from cachepipe.catalog import Catalog
from cachepipe.manifest import Manifest, held_identity, hold
from cachepipe.stores.base import ObjectInfo

pytest.importorskip("torch", reason="PyTorch is not installed")

from cachepipe.torchshare import SharedManifest


def test_a_worker_copies_the_shared_catalog_once_into_its_memory():
    """Unpickled, the manifest is copied out of shared memory into the worker's catalog: once.
    It was copied twice (into a bytearray, which Catalog.from_columns copied again), so that a
    worker held two catalogs at its start (a second 130 MB for ImageNet's, per worker). Python's
    allocations are traced: the copy's peak stays under 1.5 catalogs (it was over 2)."""
    catalog = Catalog.from_listing(ObjectInfo(f"s{i:07d}/f", 1) for i in range(40_000))
    manifest = Manifest("/nowhere/m.gz", "s3://b/p/", "folders", "2026-01-01T00:00:00Z", catalog.digest(), catalog)
    identity = (0, id(catalog), 0, 0, 0, b"torchshare")  # no file's: held for this test alone
    assert hold(identity, lambda: manifest) is manifest and held_identity(manifest) == identity
    shared = SharedManifest.of(manifest)
    assert shared is not None
    rebuild, args = shared.__reduce__()
    fields, _identity, state, lengths, blob = args
    other = (*identity[:-1], b"torchshare, a worker")  # held by no one: the worker copies it
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        copy = rebuild(fields, other, state, lengths, blob)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert copy.catalog is not catalog and list(copy.catalog) == list(catalog) and copy.digest == manifest.digest
    assert peak < 1.5 * catalog.nbytes, (peak, catalog.nbytes)
    again = pickle.loads(pickle.dumps(shared))  # noqa: S301 - bytes made here; in this process: the held read
    assert again is manifest
