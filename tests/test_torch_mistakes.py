"""CachePipeDataset: the mistakes of a first hour with it, each said so rather than a silent
wrong result or a stall (found playing a training engineer's week against it, with real
DataLoader workers)."""

from __future__ import annotations

import hashlib

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from cachepipe.torch import CachePipeDataset  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def read(path):
    return path.name, hashlib.md5((path / "f").read_bytes()).hexdigest()


def first_call_warnings(caplog) -> list[str]:
    return [r.levelname for r in caplog.records if "its first call, came after a pass" in r.getMessage()]


@pytest.mark.parametrize("order", ["after-the-loop", "after-iter", "before"])
def test_set_epoch_first_called_after_a_pass_began_says_that_pass_read_every_epoch(s3_source, tmp_path, caplog, order):
    """Before, ``for epoch: for batch in loader: ...; set_epoch(epoch + 1)`` (or set_epoch after
    iter(loader), whose workers began their pass) made the first pass read every epoch of the
    plan, silently: here 3 epochs in the first "epoch"."""
    s3_source.folders(3, {"f": 100})
    dataset = CachePipeDataset(
        s3_source.url, tmp_path / "c", "1MiB", transform=read, storage_options=s3_source.options, epochs=3, shuffle=True
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    if order == "after-the-loop":
        first = list(loader)
        dataset.set_epoch(1)
    elif order == "after-iter":
        it = iter(loader)
        first = [next(it)]  # its workers' pass began
        dataset.set_epoch(0)
        first += list(it)
    else:
        dataset.set_epoch(0)
        first = list(loader)
    if order == "before":
        assert len(first) == 3 and not first_call_warnings(caplog)
    else:
        if order == "after-the-loop":
            assert len(first) == 9  # every epoch, as documented without set_epoch: now said so
        assert first_call_warnings(caplog) == ["WARNING"]  # (after iter: a worker not begun yet reads epoch 0)
