"""CachePipeDataset under torchrun, as a distributed-training engineer meets it over a week:
elastic restarts (a rank SIGKILLed, its DataLoader workers orphaned), two DataLoaders over one
dataset, resumes. Real DataLoader worker processes; ranks as processes, as torchrun starts them."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from cachepipe.torch import CachePipeDataset  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def _folders(tmp_path: Path, count: int) -> Path:
    """A local source of ``count`` items ``i0``, ``i1``... (folders of one 100-byte file)."""
    src = tmp_path / "src"
    for n in range(count):
        (src / f"i{n}").mkdir(parents=True)
        (src / f"i{n}" / "f").write_bytes(b"x" * 100)
    return src


def name(path):
    return path.name


@pytest.mark.parametrize("second", ["another-loader", "same-loader"])
def test_two_dataloaders_of_one_dataset_read_at_once_are_refused_within_seconds_saying_what_to_do(tmp_path, monkeypatch, second):
    """A second DataLoader made from the training loader's dataset (or the same loader iterated
    twice at once, ``zip(loader, loader)``): its workers' folders are the first one's. Before, its
    workers waited SIBLING_WAIT (60 s) for a worker of their own dataset to stop, then were
    refused with advice for two datasets. Now the holder's note says it waits for its DataLoader
    (a loader reading at the same time, not a pass that stops): refused after IDLE_WAIT (1 s),
    saying to read one loader of a dataset at a time or make the second dataset with its own
    cache_dir. SIBLING_WAIT set to an hour (forked workers inherit it): the DataLoader's timeout
    (30 s) bounds the old wait, a timeout there, not this refusal."""
    import cachepipe.torchlocal

    monkeypatch.setattr(cachepipe.torchlocal, "SIBLING_WAIT", 3600.0)
    dataset = CachePipeDataset(str(_folders(tmp_path, 20)), tmp_path / "c", "1MiB", transform=name, rank=0, world_size=1)
    train = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=30)
    other = train if second == "same-loader" else torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=30)
    first = iter(train)
    assert next(first) == "i0"
    # a CacheLockedError, which a DataLoader re-raises from its worker as a RuntimeError
    with pytest.raises(RuntimeError, match=r"this dataset of this process.*one DataLoader of a dataset at a time"):
        next(iter(other))
    del first
