"""CachePipeDataset.set_epoch (one pass per epoch), both modes: the regressions its review found
(a copy of the dataset, a worker saved before it yielded, a state taken after a pass), and the
start methods. The review's probes (about 100 cases, most of which held) are in commit 8857f09
and those after it, as tests/test_review_epochs.py."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
import json
import mmap
import multiprocessing
import os
import pickle
import random
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from cachepipe.plan import Plan  # noqa: E402
from cachepipe.torch import CachePipeDataset  # noqa: E402


def read(path):
    return path.name, hashlib.md5((path / "f").read_bytes()).hexdigest()


def names_of(samples):
    return [s[0] for s in samples]


def plan_names(names, epoch, *, worker=0, num_workers=1, rank=0, world_size=1, **plan):
    p = Plan([500] * len(names), rank=rank, world_size=world_size, worker=worker, num_workers=num_workers, **plan)
    return [names[s.item] for s in p if s.epoch == epoch]


def per_worker_expected(names, epoch, num_workers, **plan):
    """What a DataLoader of num_workers yields for one epoch (workers round-robin, batch_size=None)."""
    return [plan_names(names, epoch, worker=w, num_workers=num_workers, **plan) for w in range(num_workers)]


def split_by_worker(got, shares):
    """Assign each yielded name to its worker by membership (the shares are disjoint)."""
    owner = {n: w for w, share in enumerate(shares) for n in share}
    out = [[] for _ in shares]
    for n in got:
        out[owner[n]].append(n) if n in owner else out[0].append(("stray", n))
    return out


PLAN = {"shuffle": True, "seed": 11}


pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def opts(s3_source, **more):
    return {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1, **PLAN, **more}


def passes_follow_set_epoch(dataset, names, context):
    """Three passes of 2 persistent workers started by ``context``, each after set_epoch: each
    worker reads its plan share of that epoch."""
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=context
    )
    for epoch in range(3):
        dataset.set_epoch(epoch)
        got = names_of(loader)
        shares = per_worker_expected(names, epoch, 2, epochs=3, **PLAN)
        assert split_by_worker(got, shares) == shares, epoch


def test_set_epoch_reaches_persistent_workers_started_by_spawn(s3_source, tmp_path):
    names = sorted(s3_source.folders(9, {"f": 500}))
    passes_follow_set_epoch(CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", epochs=3, **opts(s3_source)), names, "spawn")


@pytest.mark.parametrize("copier", ["deepcopy", "pickle"])
def test_set_epoch_on_a_copy_reaches_its_persistent_workers(s3_source, tmp_path, copier):
    """Review: a copy's value was private memory, which forked persistent workers only inherit."""
    names = sorted(s3_source.folders(9, {"f": 500}))
    original = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", epochs=3, **opts(s3_source))
    dataset = copy.deepcopy(original) if copier == "deepcopy" else pickle.loads(pickle.dumps(original))  # noqa: S301 - our own bytes
    passes_follow_set_epoch(dataset, names, "fork")
    # and the copy is independent of the original
    assert int(original._epoch.item()) == -1


def flat(batches, batch_size):
    out = []
    for b in batches:
        if batch_size is None:
            out.append(b[0])
        else:
            out.extend(b[0])
    return out


def stateful_loader(s3_source, cache, epoch, num_workers, batch_size, drop_last):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    dataset = CachePipeDataset(s3_source.url, cache, "1MiB", epochs=4, **opts(s3_source))
    if epoch is not None:
        dataset.set_epoch(epoch)
    kw = {"batch_size": batch_size, "num_workers": num_workers}
    if batch_size is not None:
        kw["drop_last"] = drop_last
    return dataset, stateful.StatefulDataLoader(dataset, **kw)


@pytest.mark.parametrize(("num_workers", "batch_size", "drop_last"), [(3, None, False), (0, 2, True)])
def test_a_mid_pass_checkpoint_resumes_the_rest_of_the_epoch(s3_source, tmp_path, num_workers, batch_size, drop_last):
    """Review: with 3 workers, one had not yielded when the loader was saved; its state was {},
    and resumed without set_epoch it read every epoch of the plan."""
    s3_source.folders(7, {"f": 500})
    args = (num_workers, batch_size, drop_last)
    _, ref_loader = stateful_loader(s3_source, tmp_path / "ref", 1, *args)
    ref = flat(list(ref_loader), batch_size)
    _, loader = stateful_loader(s3_source, tmp_path / "a", 1, *args)
    got, state = [], None
    for n, batch in enumerate(loader, 1):
        got.append(batch)
        if n == 2:
            state = loader.state_dict()
    assert flat(got, batch_size) == ref
    head = flat(got[:2], batch_size)
    _, resumed = stateful_loader(s3_source, tmp_path / "b", None, *args)  # set_epoch not called again
    resumed.load_state_dict(state)
    rest = flat(list(resumed), batch_size)
    assert head + rest == ref


KIB = 1024


def node_transform(item):
    info = torch.utils.data.get_worker_info()
    return [0 if info is None else info.id, item.cursor.epoch, item.name]


def node_share(names, epoch, worker, num_workers, rank=0, world_size=1, **plan):
    plan = {**PLAN, **{k: v for k, v in plan.items() if k != "retain"}, "epochs": epoch + 1}
    p = Plan([2 * KIB] * len(names), rank=rank, world_size=world_size, worker=worker, num_workers=num_workers, **plan)
    return [names[s.item] for s in p if s.epoch == epoch]


def test_set_epoch_during_a_pass_does_not_change_it(s3_source, tmp_path):
    data = s3_source.folders(6, {"f": 500})
    names = sorted(data)
    dataset = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", epochs=3, **opts(s3_source))
    dataset.set_epoch(0)
    it = iter(dataset)
    head = [next(it)[0] for _ in range(2)]
    dataset.set_epoch(2)
    assert head + names_of(it) == plan_names(names, 0, epochs=3, **PLAN)
    assert names_of(dataset) == plan_names(names, 2, epochs=3, **PLAN)


@pytest.mark.parametrize("mode", ["local", "node"])
def test_a_state_taken_after_a_pass_in_the_main_process_follows_the_next_set_epoch(s3_source, tmp_path, short_dir, mode):
    """state_dict() after a pass ended (main process, no StatefulDataLoader): "the next pass's
    start". A run resumed from it that calls set_epoch(2) should read epoch 2."""
    import contextlib

    from test_node_torch import write_config

    from cachepipe.service.testing import DaemonProcess

    data = s3_source.folders(6, {"f": 2 * KIB})
    names = sorted(data)
    sock = short_dir / "api.sock"
    if mode == "node":
        daemon = DaemonProcess(write_config(tmp_path, sock, s3_source.url, s3_source.options, capacity=64 * KIB))
        options = {"node": str(sock), "job": "train", "rank": 0, "world_size": 1, "epochs": None, **PLAN}

        def make(name):
            return CachePipeDataset(s3_source.url, transform=node_transform, **options)

        def read_names(ds):
            return [n for _, _, n in ds]
    else:
        daemon = contextlib.nullcontext()

        def make(name):
            return CachePipeDataset(s3_source.url, tmp_path / name, "1MiB", epochs=None, **opts(s3_source))

        def read_names(ds):
            return names_of(ds)

    with daemon:
        first = make("a")
        first.set_epoch(1)
        assert read_names(first) == node_share(names, 1, 0, 1)
        state = first.state_dict()
        resumed = make("b")
        resumed.load_state_dict(state)
        resumed.set_epoch(2)
        assert read_names(resumed) == node_share(names, 2, 0, 1), state


REPLAY = r"""
import json, logging, sys, torch
from cachepipe.torch import CachePipeDataset
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
cfg = json.loads(sys.argv[1])
dataset = CachePipeDataset(cfg["url"], cfg["cache"], "1MiB", transform=lambda path: path.name, storage_options=cfg["options"],
                           rank=0, world_size=1, shuffle=True)
loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
print(json.dumps([sorted(loader), sorted(loader)]))
"""


def test_a_replayed_pass_is_logged_by_new_worker_processes_too(s3_source, tmp_path):
    """Review: the replay was logged only by the process that ran the last pass, so never with
    the DataLoader's default (non-persistent) workers, each pass's being new processes."""
    names = sorted(s3_source.folders(4, {"f": 100}))
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "c"), "options": s3_source.options}
    command = [sys.executable, "-c", REPLAY, json.dumps(cfg)]
    run = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [names, names]
    logged = [line for line in run.stderr.splitlines() if "call set_epoch(epoch) before each pass" in line]
    assert 1 <= len(logged) <= 2, run.stderr  # once, or by both workers if they start at the same moment
    assert logged[0].startswith("WARNING")


@pytest.mark.parametrize("persistent", [False, True], ids=["new-workers", "persistent"])
def test_set_epoch_passes_with_retention_download_a_share_that_fits_once(s3_source, fault_proxy, tmp_path, persistent):
    """retain="auto" with partition="fixed" and a cache that holds the share: the first epoch
    downloads each item once and later ones nothing, in a loop of one pass per epoch too (each
    pass was a pipeline of its own epoch, which kept nothing for the next and downloaded it
    all again). The last epoch's pass leaves the cache empty."""
    proxy, endpoint = fault_proxy
    data = s3_source.folders(8, {"f": 500})
    names = sorted(data)
    plan = {**PLAN, "partition": "fixed"}
    options = {**s3_source.options, "endpoint_url": endpoint}
    cache = tmp_path / "c"
    dataset = CachePipeDataset(
        s3_source.url, cache, "1MiB", epochs=3, retain="auto", **{**opts(s3_source, **plan), "storage_options": options}
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=persistent)
    for epoch in range(3):
        dataset.set_epoch(epoch)
        shares = per_worker_expected(names, epoch, 2, epochs=3, **plan)
        assert split_by_worker(names_of(loader), shares) == shares, epoch
    gets = [head for head in proxy.requests if head.startswith("GET") and "/item" in head.split()[1]]
    assert sorted(head.split()[1].split("/")[-2] for head in gets) == names  # each item once, in all
    del loader  # persistent workers stop
    assert sorted(p.name for p in cache.glob("rank0-worker*/*") if p.name != ".cachepipe") == []


def test_a_set_epoch_pass_with_retention_whose_last_item_fails_stops_at_its_epoch(s3_source, tmp_path):
    """The item got after the epoch's last one was skipped is the next epoch's: given back, for
    the next pass, not yielded in this one."""
    from conftest import listed

    data = s3_source.folders(6, {"f": 500})
    names = sorted(data)
    manifest = listed(s3_source, tmp_path)
    last = plan_names(names, 0, epochs=2, **PLAN)[-1]
    s3_source.delete(f"{last}/f")  # listed, then gone: its download fails
    dataset = CachePipeDataset(
        s3_source.url, tmp_path / "c", "1MiB", epochs=2, retain="auto", on_error="skip", manifest=manifest, **opts(s3_source)
    )
    for epoch in range(2):
        dataset.set_epoch(epoch)
        assert names_of(dataset) == [n for n in plan_names(names, epoch, epochs=2, **PLAN) if n != last], epoch


def test_set_epoch_passes_list_the_source_once_for_every_pass_and_worker(s3_source, fault_proxy, tmp_path):
    """Per-process mode without torch.distributed: each DataLoader worker of each pass listed
    the source (6 listings for 3 passes of 2 workers); the first set_epoch lists it once, into
    a manifest every pass plans from."""
    from test_torch import listings

    proxy, endpoint = fault_proxy
    names = sorted(s3_source.folders(6, {"f": 500}))
    options = {**s3_source.options, "endpoint_url": endpoint}
    dataset = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", epochs=3, **{**opts(s3_source), "storage_options": options})
    assert listings(proxy) == 0  # not at construction
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
    for epoch in range(3):
        dataset.set_epoch(epoch)
        shares = per_worker_expected(names, epoch, 2, epochs=3, **PLAN)
        assert split_by_worker(names_of(loader), shares) == shares, epoch
    assert listings(proxy) == 1


@contextlib.contextmanager
def pages_read(path):
    """The pages of the file ``path`` read by any process while inside: its pages are dropped
    from the page cache on entry (``posix_fadvise(DONTNEED)``, after an ``fsync``); yields a
    function giving the numbers of those in it again (``mincore`` over a map of the file, which
    reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    size, page = os.fstat(fd).st_size, os.sysconf("SC_PAGE_SIZE")
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    try:
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        def resident():
            vec = (ctypes.c_ubyte * -(-size // page))()
            assert libc.mincore(address, size, vec) == 0, os.strerror(ctypes.get_errno())
            return [n for n, flags in enumerate(vec) if flags & 1]

        assert resident() == [], "the file's pages could not be dropped"
        yield resident
    finally:
        libc.munmap(address, size)
        os.close(fd)


def test_forked_workers_and_later_passes_plan_from_the_manifest_the_dataset_read(s3_source, tmp_path):
    """Every DataLoader worker of every set_epoch pass read the whole manifest (seconds each for
    a million items); forked from the dataset's process, they plan from the one it read, and so
    do its own passes (num_workers=0). Seen at the file: during the passes, nobody reads any
    page of it but its last (its gzip trailer: 8 bytes, which tell whether it changed)."""
    rng = random.Random(3)  # and 25 files of long random names: a manifest of several pages (items of 500 bytes)
    names = sorted(s3_source.folders(6, {"f": 100} | {rng.randbytes(100).hex(): 16 for _ in range(25)}))
    dataset = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", epochs=3, **opts(s3_source))
    dataset.set_epoch(0)  # lists the source into the manifest, read here once
    pages = -(-os.path.getsize(dataset.options["manifest"]) // os.sysconf("SC_PAGE_SIZE"))
    assert pages >= 2
    with pages_read(dataset.options["manifest"]) as resident:
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)  # forked: the default here
        for epoch in range(3):
            dataset.set_epoch(epoch)
            shares = per_worker_expected(names, epoch, 2, epochs=3, **PLAN)
            assert split_by_worker(names_of(loader), shares) == shares, epoch
            assert names_of(dataset) == plan_names(names, epoch, epochs=3, **PLAN), epoch  # in this process
        assert resident() == [pages - 1]
        with open(dataset.options["manifest"], "rb") as fh:  # a read is seen
            fh.read(1)
        assert resident()[0] == 0


def test_spawned_workers_plan_from_the_manifest_the_dataset_read_until_it_is_replaced(s3_source, tmp_path):
    """Workers started by spawn or forkserver (Python 3.14's default on Linux) each read the
    whole manifest at every pass; now they get the dataset's read through shared memory and
    plan from it: during a pass nobody reads any page of the file but its last (its gzip
    trailer, which tells whether it changed). A manifest written again at its path (another
    file) is read by the workers, though the dataset still holds the old one."""
    from cachepipe.manifest import index

    rng = random.Random(5)  # 25 files of long random names: a manifest of several pages
    files = {"f": 100} | {rng.randbytes(100).hex(): 16 for _ in range(25)}
    names = sorted(s3_source.folders(4, files))
    manifest = tmp_path / "m.gz"
    index(s3_source.url, manifest, storage_options=s3_source.options)
    dataset = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", epochs=3, manifest=str(manifest), **opts(s3_source))
    # forkserver: the shared-memory path of spawn's workers too (the dataset pickled to each), one
    # torch import in all (spawn: one per worker, tested by test_set_epoch_reaches_persistent_workers_started_by_spawn).
    # The server preloads only __main__, which under pytest imports none of them: each worker of
    # each pass imported torch, s3fs, cachepipe and this module itself (most of the test's 25 s)
    multiprocessing.set_forkserver_preload(["__main__", "torch", "cachepipe.torch", "s3fs", __name__])
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    pages = -(-os.path.getsize(manifest) // os.sysconf("SC_PAGE_SIZE"))
    assert pages >= 2
    with pages_read(manifest) as resident:
        for epoch in range(2):
            dataset.set_epoch(epoch)
            shares = per_worker_expected(names, epoch, 2, epochs=3, **PLAN)
            assert split_by_worker(names_of(loader), shares) == shares, epoch
        assert resident() == [pages - 1], pages  # before: every page, read by each worker
    more = sorted(s3_source.folders(6, files))
    index(s3_source.url, manifest, storage_options=s3_source.options)  # atomically: another file at the path
    dataset.set_epoch(2)
    shares = per_worker_expected(more, 2, 2, epochs=3, **PLAN)
    assert split_by_worker(names_of(loader), shares) == shares


def test_two_datasets_of_other_sources_over_one_cache_dir_keep_their_own_listings(s3_source, s3_client, tmp_path):
    """Training and validation over one cache_dir, in turns: each set_epoch loop plans from its
    own source's manifest (one name for both: the second overwrote the first's, which then
    refused to plan from a manifest of another source)."""
    train = sorted(s3_source.folders(4, {"f": 500}))
    for name in ("val0", "val1"):
        s3_client.put_object(Bucket="data", Key=f"other/{name}/f", Body=b"v" * 500)
    options = {**opts(s3_source), "epochs": 2}
    datasets = [CachePipeDataset(url, tmp_path / "c", "1MiB", **options) for url in (s3_source.url, "s3://data/other/")]
    for epoch in range(2):
        for dataset, names in zip(datasets, (train, ["val0", "val1"]), strict=True):
            dataset.set_epoch(epoch)
            assert sorted(names_of(dataset)) == names
