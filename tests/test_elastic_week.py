"""CachePipeDataset under torchrun, as a distributed-training engineer meets it over a week:
elastic restarts (a rank SIGKILLed, its DataLoader workers orphaned), two DataLoaders over one
dataset, resumes. Real DataLoader worker processes; ranks as processes, as torchrun starts them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until
from zygote import Zygote

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from test_torch_mistakes import _folders  # noqa: E402

from cachepipe.torch import CachePipeDataset  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture(scope="module")
def ranks() -> Iterator[Zygote]:
    """A fork server of ranks (tests/torch_rank_child.py): torch and the adapter imported once."""
    with Zygote("torch_rank_child") as zygote:
        yield zygote


def _running(pid: int) -> bool:
    """True if process ``pid`` runs (not gone, not a zombie left unreaped by a container's init)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


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


def test_a_killed_rank_s_dataloader_workers_exit_with_it_and_free_its_cache_folders_for_the_restart(ranks, tmp_path):
    """torchrun --max-restarts, a rank SIGKILLed (OOM, a node's watchdog) while its DataLoader
    workers make samples: the workers are not killed with it. Before, each went on with the
    batch in hand (torch's own check that its parent lives comes between batches: here a
    transform that waits, as a slow decode or download does), holding its cache folder,
    cache_dir/rank<r>-worker<k>, and the restarted rank's workers, not their siblings, were
    refused it at once ("in use by pid N; close it first"): every restart failed while they lived
    (seen under torchrun: 4 restarts used up in 80 s, a batch of 2 samples of 40 s each). Now a
    worker whose parent is gone kills itself within half a second."""
    src = _folders(tmp_path, 8)
    hold = tmp_path / "hold"
    hold.touch()
    cfg = {"kind": "orphans", "src": str(src), "cache": str(tmp_path / "c"), "hold": str(hold), "env": {}}
    rank = ranks.spawn(cfg)
    try:
        assert rank.stdout is not None
        workers = json.loads(rank.stdout.readline())
        wait_until(lambda: all(Path(f"{hold}-{pid}").exists() for pid in workers), what="both workers in a sample that waits")
        rank.kill()
        rank.wait(30)
        wait_until(lambda: not any(_running(pid) for pid in workers), timeout=30, what="the killed rank's workers gone")
    finally:
        hold.unlink()
        rank.kill()
        rank.wait(30)
        for pipe in (rank.stdin, rank.stdout, rank.stderr):
            if pipe is not None:
                pipe.close()
    again = ranks.spawn({**cfg, "all": True})  # the restart, same rank and cache_dir
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert sorted(json.loads(out)) == sorted(p.name for p in src.iterdir())
