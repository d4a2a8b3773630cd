"""The PyTorch adapter: DataLoader workers and ranks each take a disjoint share of every epoch."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sampling import Sampler, block_of
from zygote import Zygote

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (make test installs torch==2.13.0 where the CPU wheel is available)"
)

from cachepipe.blocks import footprint  # noqa: E402
from cachepipe.torch import CachePipeDataset  # noqa: E402


def read(path):
    return path.name, hashlib.md5((path / "f").read_bytes()).hexdigest()


def run_ranks(script: str, cfg: dict, env: dict[str, str]) -> list:
    """Run ``script`` as ranks 0 and 1 of 2 (RANK/WORLD_SIZE, as torchrun sets them) at once;
    each prints a JSON value: the list of them, by rank."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", **env},
        )
        for rank in range(2)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out))
    return outputs


@pytest.fixture(scope="module")
def ranks() -> Iterator[Zygote]:
    """A fork server of ranks (tests/torch_rank_child.py, ``kind="direct"``): torch, the adapter
    and s3fs imported once for the module, a rank forked per run (a fresh process, its DataLoader
    workers its own children), not a Python started that imports torch each time (about 3 s)."""
    with Zygote("torch_rank_child", "s3://data/video/") as zygote:
        yield zygote


def fork_ranks(ranks: Zygote, cfg: dict, env: dict[str, str]) -> list:
    """As :func:`run_ranks`, the ranks forked from ``ranks`` (the script's ``kind="direct"``,
    unless ``cfg`` names another)."""
    procs = [ranks.spawn({"kind": "direct", **cfg, "env": {"RANK": str(rank), "WORLD_SIZE": "2", **env}}) for rank in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outputs.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    return outputs


RANK_SCRIPT = """
import json, sys, hashlib, torch
from cachepipe.torch import CachePipeDataset
def read(path):
    return path.name, hashlib.md5((path / "f").read_bytes()).hexdigest()
cfg = json.loads(sys.argv[1])
ds = CachePipeDataset(cfg["url"], cfg["cache"], "1MiB", transform=read, storage_options=cfg["options"],
                      epochs=2, shuffle=True, seed=5, **cfg.get("extra", {}))
loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
print(json.dumps([list(x) for x in loader]))
"""


def test_two_ranks_by_two_workers_see_every_item_once_per_epoch(s3_source, tmp_path):
    data = s3_source.folders(13, {"f": 500})
    digests = {name: hashlib.md5(files["f"]).hexdigest() for name, files in data.items()}
    # equal_steps=None: the shares as the split gives them (the default "pad" reads an item twice here)
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "cache"), "options": s3_source.options, "extra": {"equal_steps": None}}
    outputs = run_ranks(RANK_SCRIPT, cfg, {})
    seen = [name for out in outputs for name, _ in out]
    assert sorted(seen) == sorted(list(digests) * 2)  # 2 epochs: each item exactly twice in all
    assert all(digests[name] == digest for out in outputs for name, digest in out)
    assert all(len(out) in (12, 14) for out in outputs)  # each rank about half of 13 per epoch


EQUAL_SCRIPT = """
import json, sys, torch
from cachepipe.torch import CachePipeDataset
def name(path):
    return path.name
cfg = json.loads(sys.argv[1])
ds = CachePipeDataset(cfg["url"], cfg["cache"], "1MiB", transform=name, storage_options=cfg["options"],
                      epochs=2, shuffle=True, seed=5, **cfg["extra"])
loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
print(json.dumps([list(batch) for batch in loader]))
"""


@pytest.mark.parametrize("extra", [{}, {"equal_steps": "drop"}], ids=["default-pad", "drop"])
def test_ranks_of_items_of_different_sizes_run_the_same_number_of_steps(s3_source, tmp_path, extra):
    # 25 items, one of them large: split by bytes, one rank would get far fewer items than the other
    # (a DDP job hangs in the collective of the steps only the other runs)
    from cachepipe.plan import permutation

    names = [f"item{i:03d}" for i in range(25)]
    for i, name in enumerate(names):
        s3_source.put(f"{name}/f", bytes([i]) * (40_000 if i == 3 else 100 + 37 * i))
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "cache"), "options": s3_source.options, "extra": extra}
    outputs = run_ranks(EQUAL_SCRIPT, cfg, {})
    per_rank = 13 if not extra else 12  # per epoch: 25 padded to 26, or cut to 24
    assert [sum(len(batch) for batch in out) for out in outputs] == [2 * per_rank] * 2
    assert len(outputs[0]) == len(outputs[1])  # and as many batches of 4 (each worker's batches)
    seen = sorted(name for out in outputs for batch in out for name in batch)
    orders = [[names[x] for x in permutation(25, 5, epoch)] for epoch in (0, 1)]
    if not extra:  # the first item of each epoch's permutation is read twice
        assert seen == sorted(names * 2 + [order[0] for order in orders])
    else:  # the last item of each epoch's permutation is left out of it
        assert seen == sorted([n for n in names if n != orders[0][-1]] + [n for n in names if n != orders[1][-1]])


def test_single_process_yields_cached_items(s3_source, tmp_path):
    s3_source.folders(3, {"f": 10})
    ds = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", storage_options=s3_source.options, rank=0, world_size=1)
    assert [p.name for p in torch.utils.data.DataLoader(ds, batch_size=None)] == ["item000", "item001", "item002"]


@pytest.mark.parametrize("num_workers", [1, 2])
def test_workers_need_a_transform(s3_source, tmp_path, num_workers):
    # One worker is a separate process too: its bare paths would be evicted before the main process reads them.
    s3_source.folders(2, {"f": 10})
    ds = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", storage_options=s3_source.options, rank=0, world_size=1)
    it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers))
    try:
        with pytest.raises(Exception, match="transform"):
            next(it)
    finally:
        it._shutdown_workers()  # the worker error leaves the loader's queue threads to its shutdown
    with pytest.raises(ValueError, match="num_workers"):
        CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", num_workers=2)


def test_dataset_state_dict_resumes_mid_epoch(s3_source, tmp_path):
    s3_source.folders(6, {"f": 10})
    opts = {"storage_options": s3_source.options, "rank": 0, "world_size": 1, "epochs": 2, "shuffle": True, "seed": 8}
    full = [p.name for p in CachePipeDataset(s3_source.url, tmp_path / "a", "1MiB", **opts)]
    ds = CachePipeDataset(s3_source.url, tmp_path / "b", "1MiB", **opts)
    it = iter(ds)
    first = [next(it).name for _ in range(5)]  # four acked, the fifth in hand
    state = ds.state_dict()
    it.close()
    resumed = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", **opts)
    resumed.load_state_dict(state)
    assert first[:4] + [p.name for p in resumed] == full
    # the state is for one iteration: the next pass (for epoch in ...: for x in loader) is whole,
    # where before it started from the state again, every pass losing the items before it
    assert [p.name for p in resumed] == full


def test_stateful_dataloader_with_workers_resumes_each_worker_after_its_last_sample(s3_source, tmp_path):
    """Per-process mode. Before, StatefulDataLoader with workers failed at its first batch: a
    worker's state_dict() raised "iterate the dataset in this process first (num_workers=0)".
    Now each worker's state is its pipeline's position after the last sample it yielded (the
    item is acknowledged once transform returns), so a resume gets exactly the rest."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    s3_source.folders(12, {"f": 500})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1}
    opts |= {"epochs": 2, "shuffle": True, "seed": 3}

    def loader(cache: str):
        dataset = CachePipeDataset(s3_source.url, tmp_path / cache, "1MiB", **opts)
        return stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=2)

    full = [tuple(x) for x in loader("a")]
    first, got = loader("b"), []
    for n, sample in enumerate(first, 1):
        got.append(tuple(sample))
        if n == 7:
            state = first.state_dict()
    resumed = loader("c")
    resumed.load_state_dict(state)
    rest = [tuple(x) for x in resumed]
    assert got == full and len(full) == 24
    assert got[:7] + rest == full  # nothing twice, nothing lost
    assert [tuple(x) for x in resumed] == full  # the loaded state is for one pass


def test_a_checkpoint_between_passes_or_early_in_a_pass_of_persistent_workers_resumes_exactly(s3_source, tmp_path):
    """Found in review: a pass's state stayed on the dataset after it ended. With persistent
    workers, a checkpoint early in the next pass saved a worker's previous end (its first state
    is taken before it yields): a resume lost that worker's items. A checkpoint after a whole pass
    resumed into an empty pass (num_workers=0). Now a state between passes is the next's start."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    s3_source.folders(12, {"f": 500})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1}

    def loader(cache: str, **kw):
        dataset = CachePipeDataset(s3_source.url, tmp_path / cache, "1MiB", **opts)
        return stateful.StatefulDataLoader(dataset, batch_size=None, **kw)

    persistent = loader("a", num_workers=2, persistent_workers=True)
    full = [tuple(x) for x in persistent]
    second = iter(persistent)
    head = [tuple(next(second))]
    state = persistent.state_dict()
    rest = [tuple(x) for x in second]
    assert head + rest == full and len(full) == 12
    resumed = loader("b", num_workers=2)
    resumed.load_state_dict(state)
    assert [tuple(x) for x in resumed] == rest  # before: worker 1's items were lost
    single = loader("c", num_workers=0)
    assert [tuple(x) for x in single] == full
    state = single.state_dict()  # after a whole pass
    again = loader("d", num_workers=0)
    again.load_state_dict(state)
    assert [tuple(x) for x in again] == full  # before: an empty pass


def listings(proxy) -> int:
    return sum(1 for head in proxy.requests if "list-type=2" in head.split("\r\n", 1)[0])


def test_ranks_under_torch_distributed_list_once_and_plan_from_one_catalog(s3_source, ranks, fault_proxy, tmp_path):
    """Rank 0 lists and broadcasts the manifest; the four pipelines of two ranks plan from it."""
    proxy, endpoint = fault_proxy
    data = s3_source.folders(13, {"f": 500})
    options = {**s3_source.options, "endpoint_url": endpoint}
    from cachepipe.manifest import index

    index(s3_source.url, tmp_path / "one.json.gz", storage_options=options)  # what one listing takes
    one = listings(proxy)
    assert one >= 1
    proxy.requests.clear()
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "cache"), "options": options, "dist": True}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outputs = fork_ranks(ranks, cfg, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert listings(proxy) == one  # one listing for two ranks and four DataLoader workers
    seen = [name for out in outputs for name, _ in out]
    # two ranks: equal_steps="pad" by default, so 13 items are 14 an epoch, the first of its permutation twice
    from cachepipe.plan import permutation

    firsts = [sorted(data)[permutation(13, 5, epoch)[0]] for epoch in (0, 1)]
    assert sorted(seen) == sorted(list(data) * 2 + firsts)
    assert [len(out) for out in outputs] == [14, 14]
    of = hashlib.blake2b(f"folders {s3_source.url}".encode(), digest_size=4).hexdigest()
    assert sorted((tmp_path / "cache").glob("manifest-rank*.json.gz")) == [
        tmp_path / "cache" / f"manifest-rank0-{of}.json.gz",
        tmp_path / "cache" / f"manifest-rank1-{of}.json.gz",
    ]


@pytest.mark.parametrize(
    ("sizes", "batch_size", "cut"),
    [
        ([1000] + [100] * 6, None, 3),  # worker 0's share is one item: it ends while worker 1 still has five
        ([100] * 7, 2, 4),  # worker 1's last batch is short: its share ended inside the batch
    ],
)
def test_a_checkpoint_after_one_worker_ended_its_share_resumes_without_repeating_it(s3_source, tmp_path, sizes, batch_size, cut):
    """Found in review: a DataLoader worker whose share ended before the loader's pass did (a
    short last batch, or a smaller share than the other workers') saved the start of the next
    pass as its state; StatefulDataLoader keeps that worker state with the loader's, and a
    resume from a checkpoint taken after it delivered that worker's whole share again."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    for i, size in enumerate(sizes):
        s3_source.put(f"item{i:03d}/f", bytes(size))
    opts = {"transform": lambda path: path.name, "storage_options": s3_source.options, "rank": 0, "world_size": 1}

    def loader(cache: str):
        dataset = CachePipeDataset(s3_source.url, tmp_path / cache, "1MiB", **opts)
        return stateful.StatefulDataLoader(dataset, batch_size=batch_size, num_workers=2)

    first, got = loader("a"), []
    for n, batch in enumerate(first, 1):
        got.append(batch)
        if n == cut:
            state = first.state_dict()
    resumed = loader("b")
    resumed.load_state_dict(state)
    rest = list(resumed)

    def names(batches: list) -> list[str]:
        return sorted(name for batch in batches for name in ([batch] if isinstance(batch, str) else batch))

    assert names(got) == [f"item{i:03d}" for i in range(len(sizes))]
    assert names(got[:cut] + rest) == names(got)  # before: the ended worker's share again
    assert list(resumed) == got  # and the pass after it is whole


def test_a_pass_that_cannot_open_its_cache_leaves_the_loaded_state_for_the_next(s3_source, tmp_path):
    """Found in review: a pass whose pipeline failed to open (here its cache folder is held by a
    live iterator of the same dataset, as in a notebook that kept one) left the unopened
    pipeline as the dataset's position: state_dict() raised AttributeError ('Pipeline' object
    has no attribute '_frontier'), and the loaded state was gone, so the next pass started
    from the beginning. Now the state is the loaded one until a pass starts from it."""
    from cachepipe.errors import CacheLockedError

    s3_source.folders(5, {"f": 10})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1}
    ds = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", **opts)
    full = list(ds)
    held = iter(ds)
    assert next(held) == full[0]
    state = ds.state_dict()  # after the first sample
    ds.load_state_dict(state)
    with pytest.raises(CacheLockedError, match="rank0-worker0"):
        next(iter(ds))  # the live iterator holds the folder
    assert ds.state_dict() == state  # before: AttributeError
    held.close()
    assert list(ds) == full[1:]  # before: the whole pass again
    assert list(ds) == full


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epoch": 2}, "epoch"),  # a typo of epochs
        ({"epochs": 0}, "epochs"),
        ({"partition": "fix"}, "partition"),
        ({"rank": 1}, "rank 1, world_size None"),
        ({"rank": 3, "world_size": 2}, "rank 3 with world_size 2"),
        ({"transform": "read"}, "transform='read'"),
        ({"source": "bucket/video/"}, "s3://bucket/video/"),  # a scheme forgotten
    ],
)
def test_a_bad_argument_is_refused_when_the_dataset_is_made(tmp_path, kwargs, match):
    """Found in review: per-process mode checked the pipeline's options only when each DataLoader
    worker opened its pipeline (after the workers started, once per worker, under torch's
    'Caught ... in DataLoader worker process N'), and a transform that is not a function failed
    with "'str' object is not callable". Now the dataset refuses them when it is made (node mode
    too for rank/world_size and transform; the daemon checks a job's plan options)."""
    source = kwargs.pop("source", str(tmp_path))
    with pytest.raises((ValueError, TypeError), match=match):
        CachePipeDataset(source, tmp_path / "c", "1MiB", **kwargs)
    if "rank" in kwargs or "transform" in kwargs:
        with pytest.raises((ValueError, TypeError), match=match):
            CachePipeDataset(source, node="/nowhere.sock", **kwargs)


def test_a_dataset_read_in_the_main_process_can_still_go_to_spawned_workers(s3_source, tmp_path):
    """Found in review: after a pass in the main process that did not run to its end (a peek
    with next(iter(ds)), a loop left with break), the dataset held its closed pipeline, and
    pickling it (what DataLoader workers started by spawn or forkserver do: macOS, Python 3.14's
    default on Linux) failed with "cannot pickle '_thread.lock' object". Now a copy keeps the
    position, not the pipeline."""
    import pickle

    s3_source.folders(4, {"f": 100})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1}
    ds = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", **opts)
    full = list(ds)
    peek = iter(ds)
    assert next(peek) == full[0]
    peek.close()
    copy = pickle.loads(pickle.dumps(ds))  # noqa: S301 - bytes made here; before: TypeError
    assert copy.state_dict() == ds.state_dict()
    assert list(copy) == full  # a new pass starts at the beginning, as in the original
    assert list(ds) == full


def test_a_store_object_passes_through_to_the_pipelines(tmp_path):
    """Pipeline(store=) is not a pipeline option: the dataset's check of its options when it is
    made (77f1ac4) must let it through, as the workers' pipelines take it."""
    from cachepipe.stores.fsspec import FsspecStore

    src = tmp_path / "src"
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        (src / name / "f").write_bytes(b"x")
    opts = {"store": FsspecStore(f"file://{src}"), "rank": 0, "world_size": 1, "transform": lambda path: path.name}
    assert list(CachePipeDataset("s3://read/through/the/store/", tmp_path / "c", "1MiB", **opts)) == ["a", "b"]


def test_an_s3_store_object_works_in_forked_dataloader_workers(s3_source, tmp_path):
    """DataLoader workers forked from this process, given the dataset's ``store=`` of s3://,
    failed at once: each worker's listing raised OSError "RuntimeError: This class is not
    fork-safe" (the store's s3fs filesystem, made here, which fsspec refuses to run in another
    process). Now the store makes its own in each worker."""
    from cachepipe.stores.fsspec import FsspecStore

    data = s3_source.folders(4, {"f": 100})
    store = FsspecStore(s3_source.url, {**s3_source.options, "skip_instance_cache": True})
    opts = {"store": store, "transform": read, "rank": 0, "world_size": 1}
    dataset = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", **opts)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="fork")
    try:
        expected = sorted((name, hashlib.md5(item["f"]).hexdigest()) for name, item in data.items())
        assert sorted(tuple(sample) for sample in loader) == expected
    finally:
        store.close()


@pytest.mark.parametrize("num_workers", [0, 2], ids=["main-process", "persistent-workers"])
def test_one_store_object_serves_every_pass_of_a_dataset(s3_source, tmp_path, num_workers):
    """The second pass over a dataset given ``store=`` failed every item with StoreClosedError:
    the first pass's pipeline aborted and closed the store given to it, in the main process
    (``num_workers=0``) or in each persistent worker. Now a pipeline leaves a store given to it
    open: each pass (here one per set_epoch) reads every item, and the store is still the
    owner's after them."""
    from cachepipe.stores.fsspec import FsspecStore

    data = s3_source.folders(4, {"f": 100})
    store = FsspecStore(s3_source.url, s3_source.options)
    opts = {"store": store, "transform": read, "rank": 0, "world_size": 1, "epochs": 2}
    dataset = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", **opts)
    kw = {"num_workers": num_workers, "persistent_workers": num_workers > 0}
    if num_workers:
        kw["multiprocessing_context"] = "fork"
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, **kw)
    expected = sorted((name, hashlib.md5(item["f"]).hexdigest()) for name, item in data.items())
    try:
        for epoch in range(2):
            dataset.set_epoch(epoch)
            assert sorted(tuple(sample) for sample in loader) == expected  # before: the second failed
        assert len(list(store.list())) == 4
    finally:
        del loader  # its persistent workers end
        store.close()


def test_a_store_object_sent_to_spawned_workers_is_refused_naming_what_to_do(tmp_path):
    """DataLoader workers started by spawn (or forkserver) get the dataset pickled, and a store
    object cannot be: the loader failed with pickle's bare "cannot pickle '_thread.lock' object".
    Now the error names the store, why, and what to do instead, before any worker starts."""
    from cachepipe.stores.fsspec import FsspecStore

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_bytes(b"x")
    store = FsspecStore(f"file://{src}")
    opts = {"store": store, "rank": 0, "world_size": 1, "transform": len}
    dataset = CachePipeDataset(f"file://{src}", tmp_path / "c", "1MiB", **opts)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(TypeError) as info, pytest.warns(UserWarning, match="pickle error"):  # torch's own, then ours
        iter(loader)
    message = str(info.value)
    assert "FsspecStore" in message and "spawn or forkserver" in message, message
    assert "storage_options" in message and "fork" in message, message


@pytest.mark.parametrize(("n_items", "drop_last", "run"), [(40, False, 0), (7, True, 0), (7, True, 1), (7, True, 2)])
def test_a_checkpoint_after_a_whole_pass_of_workers_resumes_into_the_next_pass(s3_source, tmp_path, n_items, drop_last, run):
    """Found in review: StatefulDataLoader resuming a checkpoint taken after a whole pass starts
    workers with the saved (finished) states, then, seeing the pass finished, another set for
    the next pass while the first set still runs. The first set ran whole passes (a worker's
    state after its pass was the next pass's start) and held their cache folders: the next
    pass's workers failed with CacheLockedError (3 runs in 3 before this review's fixes, 2 in 3
    after the first, where the first set ran empty passes). Now a pass loaded at the end of its
    share takes no cache. With drop_last (a race: 3 runs in 4 failed, hence 3 runs; found by
    the set_epoch review), a worker's state is before the item of its dropped batch, so it
    opens its folder to read it while the next pass's worker of that number opens it too: the
    latter now waits for its sibling to let go."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    s3_source.folders(n_items, {"f": 100})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1}

    def loader(cache: str):
        dataset = CachePipeDataset(s3_source.url, tmp_path / cache, "1MiB", **opts)
        return stateful.StatefulDataLoader(dataset, batch_size=2, num_workers=2, drop_last=drop_last)

    first = loader("a")
    full = [[tuple(x) for x in zip(*batch, strict=True)] for batch in first]
    state = first.state_dict()
    resumed = loader("b")
    resumed.load_state_dict(state)
    assert [[tuple(x) for x in zip(*batch, strict=True)] for batch in resumed] == full  # before: CacheLockedError
    assert [[tuple(x) for x in zip(*batch, strict=True)] for batch in resumed] == full


@pytest.mark.parametrize("retain", ["none", "auto"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_makes_each_pass_read_that_epoch_alone_in_its_order_persistent_workers_too(
    s3_source, tmp_path, num_workers, retain
):
    """A loop of one pass per epoch (Hugging Face's Trainer, Accelerate) calls set_epoch before
    each: before, there was none, and with ``epochs=1`` every pass replayed epoch 0's order.
    Persistent workers started in the first pass see the later calls. With retention, a pass
    is a pipeline of the plan's epochs that stops at its epoch's end."""
    s3_source.folders(12, {"f": 500})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1, "shuffle": True, "seed": 3}
    opts["retain"] = retain
    kw = {"batch_size": None, "num_workers": num_workers, "persistent_workers": num_workers > 0}
    whole = CachePipeDataset(s3_source.url, tmp_path / "a", "1MiB", epochs=3, **opts)
    every = [tuple(x) for x in torch.utils.data.DataLoader(whole, **kw)]  # one pass over 3 epochs
    dataset = CachePipeDataset(s3_source.url, tmp_path / "b", "1MiB", epochs=3, **opts)
    loader = torch.utils.data.DataLoader(dataset, **kw)
    passes = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        passes.append([tuple(x) for x in loader])
    assert passes == [every[:12], every[12:24], every[24:]]  # each epoch's order, each pass one epoch
    assert passes[0] != passes[1] != passes[2]


@pytest.mark.parametrize("retain", ["none", "auto"])
def test_a_checkpoint_in_a_set_epoch_pass_resumes_to_the_end_of_that_epoch(s3_source, tmp_path, retain):
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    s3_source.folders(12, {"f": 500})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1, "shuffle": True}
    opts |= {"seed": 4, "epochs": 3, "retain": retain}

    def loader(cache: str, epoch: int | None) -> tuple[CachePipeDataset, stateful.StatefulDataLoader]:
        dataset = CachePipeDataset(s3_source.url, tmp_path / cache, "1MiB", **opts)
        if epoch is not None:
            dataset.set_epoch(epoch)
        return dataset, stateful.StatefulDataLoader(dataset, batch_size=None, num_workers=2)

    _, first = loader("a", 1)
    got = []
    for n, sample in enumerate(first, 1):
        got.append(tuple(sample))
        if n == 5:
            state = first.state_dict()
    _, whole = loader("b", None)
    assert got == [tuple(x) for x in whole][12:24]  # epoch 1
    for name, epoch in (("c", 1), ("d", None)):  # set again (as a Trainer resuming does), or not
        dataset, resumed = loader(name, epoch)
        resumed.load_state_dict(state)
        assert got[:5] + [tuple(x) for x in resumed] == got  # the rest of epoch 1, and no further
        dataset.set_epoch(2)
        assert [tuple(x) for x in resumed] == [tuple(x) for x in whole][24:]  # the next pass: epoch 2 alone


def test_passes_that_replay_one_shuffled_order_are_logged_and_set_epoch_past_the_plan_is_refused(s3_source, tmp_path, caplog):
    s3_source.folders(4, {"f": 100})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1, "shuffle": True}
    dataset = CachePipeDataset(s3_source.url, tmp_path / "a", "1MiB", **opts)
    first = list(dataset)
    assert not [r for r in caplog.records if "set_epoch" in r.getMessage()]
    assert list(dataset) == first  # epochs=1: the same epoch, and said so
    list(dataset)
    assert [r.levelname for r in caplog.records if "set_epoch(epoch) before each pass" in r.getMessage()] == ["WARNING"]  # once
    with pytest.raises(ValueError, match=r"set_epoch\(1\) with epochs=1: the plan has epochs 0 to 0; give the dataset epochs=N"):
        dataset.set_epoch(1)
    for bad in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match=r"expected an integer >= 0"):
            dataset.set_epoch(bad)
    endless = CachePipeDataset(s3_source.url, tmp_path / "b", "1MiB", **{**opts, "epochs": None})
    endless.set_epoch(10**6)  # any epoch of an endless plan
    with pytest.raises(ValueError, match=r"start_epoch=1: call dataset\.set_epoch"):
        CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", start_epoch=1, **opts)


def test_with_resume_true_a_pass_after_a_finished_one_reads_its_share_again(s3_source, tmp_path):
    """Found in review: resume=True continues each worker's journal, and a pass after one that
    finished (in this process, or a restarted one) found its journal at the end: it read nothing."""
    s3_source.folders(5, {"f": 100})
    opts = {"transform": read, "storage_options": s3_source.options, "rank": 0, "world_size": 1, "resume": True}
    dataset = CachePipeDataset(s3_source.url, tmp_path / "a", "1MiB", **opts)
    first = list(dataset)
    assert len(first) == 5
    assert list(dataset) == first  # before: []
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    assert [tuple(x) for x in loader] == first  # a worker process: its journal, of a pass that ended
    with pytest.raises(ValueError, match=r"set_epoch\(0\) with resume=True"):
        dataset.set_epoch(0)


def test_an_item_over_a_worker_s_share_of_the_cache_is_said_to_be_over_that_share(tmp_path):
    """First-hour review: a DataLoader worker's pipeline has capacity / num_workers, and its
    OversizeError named that as "the cache capacity", a figure the user never gave."""
    for name, size in (("a", 600_000), ("b", 1000)):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "f").write_bytes(b"x" * size)
    dataset = CachePipeDataset(str(tmp_path / "src"), tmp_path / "c", "1MiB", transform=read, rank=0, world_size=1)
    it = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2))
    try:
        with pytest.raises(Exception, match="OversizeError") as failed:  # re-raised by the DataLoader in the main process
            list(it)
    finally:
        it._shutdown_workers()  # the worker error leaves the loader's queue threads to its shutdown
    # named with both its sizes (as listed, and in the cache's blocks: its file's and its folder's), and over what
    block = block_of(tmp_path)
    said = (
        f"item 'a' is 600000 bytes listed, {footprint([600_000], 1, block)} bytes in the filesystem's blocks of {block} "
        "bytes (each file rounded up to whole blocks, a block per folder), larger than this DataLoader worker's share "
        "of the cache (capacity 1048576 / num_workers 2) of 524288 bytes less "
    )
    assert said in str(failed.value), failed.value


def test_a_worker_waits_for_a_cache_folder_whose_owner_is_not_written_yet_or_gone():
    """A fresh clone's run failed test_a_checkpoint_after_a_whole_pass... once with "in use by
    another process": the next pass's worker found the folder's lock taken by a worker that had
    not yet written its pid into the lock file (it does just after its flock), read no owner, and
    did not wait for it as for a sibling. A pid that is gone (the file still naming the last
    owner while the next writes its own) is waited for too; a live stranger is not."""
    from cachepipe.torch import _sibling

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    host = socket.gethostname()
    assert _sibling("another process")
    assert _sibling(f"pid {done.stdout.strip()} {host}")  # gone
    assert not _sibling(f"pid 1 {host}")  # alive, another parent
    assert not _sibling(f"pid {os.getpid()} elsewhere")


def _name_slowly(path):
    """A transform that takes a while (the workers' downloads run ahead, as far as their shares let them)."""
    import time

    time.sleep(0.03)
    return path.name


def test_the_workers_folders_and_their_notes_stay_under_the_capacity_given(tmp_path):
    """Blocks review: each DataLoader worker's cache had ``capacity / num_workers``, and its own
    folder ``cache_dir/rank<r>-worker<k>`` and its reader note beside it (a block each, which no
    cache's ledger counts) came on top: what ``cache_dir`` held reached the capacity and two
    blocks per worker (this test's peak was 147456 bytes under 139264)."""
    from mounts import mounted

    from cachepipe import Pipeline

    src = tmp_path / "src"
    for i in range(24):  # items of three 512-byte files: 4 blocks each with their folder
        for j in range(3):
            (src / f"d{i:02d}").mkdir(parents=True, exist_ok=True)
            (src / f"d{i:02d}" / f"f{j}").write_bytes(bytes([i]) * 512)
    disk = tmp_path / "disk"
    with mounted(disk, ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)]):
        block = block_of(disk)
        options = {"rank": 0, "world_size": 1, "worker": 0, "num_workers": 2}
        with Pipeline(str(src), disk / "probe", "1MiB", **options) as probe:
            state = probe._cache.ledger.overhead  # what a worker's cache counts for its own state
        # a capacity whose halves hold a worker's state and three items exactly
        capacity = 2 * (state + 3 * footprint([512] * 3, 1, block))
        cache = disk / "cache"
        dataset = CachePipeDataset(str(src), cache, f"{capacity}B", transform=_name_slowly, rank=0, world_size=1)
        with Sampler(cache) as sampler:
            got = sorted(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2))
        assert got == sorted(p.name for p in src.iterdir())
        assert sampler.samples > 0 and sampler.peak <= capacity, f"{sampler.peak} bytes under {capacity}"
