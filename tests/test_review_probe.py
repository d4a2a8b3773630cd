"""Review probes: set_epoch passes with retain="auto", and equal_steps with skipped items."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from conftest import listed  # noqa: E402
from test_torch_skips import planned, put_items, substituted  # noqa: E402

from cachepipe.errors import OversizeError  # noqa: E402
from cachepipe.plan import Plan  # noqa: E402
from cachepipe.torch import CachePipeDataset  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def tagged(path):
    info = torch.utils.data.get_worker_info()
    return f"{0 if info is None else info.id}:{path.name}"


def flat(batches, batch_size):
    if batch_size is None:
        return list(batches)
    return [x for b in batches for x in b]


def by_worker(samples, num_workers):
    out = [[] for _ in range(max(num_workers, 1))]
    for s in samples:
        w, name = s.split(":")
        out[int(w)].append(name)
    return out


def make(s3_source, tmp_path, name, **options):
    opts = {"rank": 0, "world_size": 2, "on_error": "skip", "storage_options": s3_source.options}
    return CachePipeDataset(s3_source.url, tmp_path / name, "1MiB", transform=tagged, **(opts | options))


def shares_of(names, sizes, num_workers, epochs, **plan):
    """Per worker, per epoch, the names planned (rank 0 of 2, equal_steps pad)."""
    out = []
    for w in range(max(num_workers, 1)):
        steps = list(
            Plan(sizes, equal_steps="pad", rank=0, world_size=2, worker=w, num_workers=max(num_workers, 1), epochs=epochs, **plan)
        )
        out.append([[names[s.item] for s in steps if s.epoch == e] for e in range(epochs)])
    return out


def setup_faults(s3_source, tmp_path, n, pick):
    """``n`` items (archive + md5, plain objects); ``pick(names, sizes)`` -> names to delete after listing."""
    names, sizes = put_items(s3_source, n, set())
    manifest = listed(s3_source, tmp_path)
    bad = pick(names, sizes)
    for b in bad:
        s3_source.delete(f"{b}/f.tar")
    return names, sizes, manifest, bad


@pytest.mark.parametrize(
    ("num_workers", "batch_size", "drop_last"), [(0, None, False), (2, None, False), (2, 2, False), (1, 2, True)]
)
def test_equal_steps_checkpoint_at_every_step_resumes_to_the_planned_count(
    s3_source, tmp_path, num_workers, batch_size, drop_last
):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    plan = {"shuffle": True, "seed": 5}
    epochs = 2

    def pick(names, sizes):
        sh = shares_of(names, sizes, num_workers, epochs, **plan)
        w0 = sh[0]
        bad = {w0[0][0], w0[0][-1], w0[1][0]}  # first, last of epoch 0 (the boundary), first of epoch 1
        if num_workers == 2:
            bad |= {sh[1][0][1], sh[1][0][2]}  # consecutive in worker 1
        # not a worker's last step of the pass: a checkpoint before it hits DEFECT 1 (below)
        return bad - {w[-1][-1] for w in sh}

    names, sizes, manifest, bad = setup_faults(s3_source, tmp_path, 11, pick)
    sh = shares_of(names, sizes, num_workers, epochs, **plan)
    expected_counts = [sum(len(e) for e in w) for w in sh]
    kw = {"batch_size": batch_size, "num_workers": num_workers}
    if batch_size is not None:
        kw["drop_last"] = drop_last

    def loader(name):
        ds = make(s3_source, tmp_path, name, manifest=manifest, epochs=epochs, **plan)
        return stateful.StatefulDataLoader(ds, **kw)

    full = list(loader("full"))
    got = by_worker(flat(full, batch_size), num_workers)
    if not drop_last:
        assert [len(g) for g in got] == expected_counts
        for w in range(len(sh)):
            assert got[w] == substituted(sh[w][0] + sh[w][1], bad), w
    for k in range(1, len(full)):
        first = loader(f"a{k}")
        it = iter(first)
        head = [next(it) for _ in range(k)]
        state = first.state_dict()
        del it
        resumed = loader(f"b{k}")
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert len(head) + len(rest) == len(full), k
        both = by_worker(flat(head + rest, batch_size), num_workers)
        assert [len(g) for g in both] == [len(g) for g in got], k
        for w in range(len(got)):
            assert set(both[w]) == set(got[w]), (k, w)


def test_a_checkpoint_before_only_skipped_steps_resumes(s3_source, tmp_path):
    names, sizes, manifest, bad = setup_faults(
        s3_source, tmp_path, 4, lambda names, sizes: {planned(sizes, names, rank=0, world_size=2)[-1]}
    )
    share = planned(sizes, names, rank=0, world_size=2)
    assert len(share) == 2 and share[-1] in bad
    full = list(make(s3_source, tmp_path, "full", manifest=manifest))
    assert full == [f"0:{share[0]}"] * 2  # its step taken by a repeat of the sample before it
    ds = make(s3_source, tmp_path, "a", manifest=manifest)
    it = iter(ds)
    head = [next(it)]
    state = ds.state_dict()
    it.close()
    resumed = make(s3_source, tmp_path, "b", manifest=manifest)
    resumed.load_state_dict(state)
    assert len(head + list(resumed)) == len(full)  # raises NothingToRepeatError


def item_gets(proxy) -> list[str]:
    return [h.split()[1].split("/")[-2] for h in proxy.requests if h.startswith("GET") and "/item" in h.split()[1]]


def read_name(path):
    return path.name


@pytest.mark.parametrize("partition", ["fixed", "epoch"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_passes_with_retention_under_a_small_cap_match_one_pass(
    s3_source, fault_proxy, tmp_path, num_workers, partition
):
    from sampling import Sampler

    proxy, endpoint = fault_proxy
    s3_source.folders(20, {"f": 2000})
    workers = max(num_workers, 1)
    capacity = workers * (10 // workers * 2000 + 6 * 1024)  # about half of each worker's share
    options = {**s3_source.options, "endpoint_url": endpoint}
    opts = {"transform": read_name, "storage_options": options, "rank": 0, "world_size": 1, "shuffle": True}
    opts |= {"seed": 3, "epochs": 3, "retain": "auto", "partition": partition}
    kw = {"batch_size": None, "num_workers": num_workers}
    whole = CachePipeDataset(s3_source.url, tmp_path / "a", capacity, **opts)
    with Sampler(tmp_path / "a") as sampler:
        every = list(torch.utils.data.DataLoader(whole, **kw))
    assert sampler.peak <= capacity
    one_pass = len(item_gets(proxy))
    proxy.requests.clear()
    dataset = CachePipeDataset(s3_source.url, tmp_path / "b", capacity, **opts)
    loader = torch.utils.data.DataLoader(dataset, **kw)
    passes = []
    with Sampler(tmp_path / "b") as sampler:
        for epoch in range(3):
            dataset.set_epoch(epoch)
            passes.append(list(loader))
    assert sampler.peak <= capacity
    assert passes == [every[:20], every[20:40], every[40:]]
    passes_gets = len(item_gets(proxy))
    proxy.requests.clear()
    again = CachePipeDataset(s3_source.url, tmp_path / "c", capacity, **opts)
    assert list(torch.utils.data.DataLoader(again, **kw)) == every
    print("GETs: one pass", one_pass, "again", len(item_gets(proxy)), "set_epoch passes", passes_gets)
    assert passes_gets <= one_pass + 2 * workers, (passes_gets, one_pass)


def bare(samples):
    return [s.split(":")[1] for s in samples]


@pytest.mark.parametrize("retain", ["auto", "none"])
def test_set_epoch_passes_with_skips_yield_each_epoch_s_planned_count_and_resume_at_every_step(s3_source, tmp_path, retain):
    plan = {"shuffle": True, "seed": 7, "epochs": 3, "retain": retain}

    def pick(names, sizes):
        sh = shares_of(names, sizes, 1, 3, shuffle=True, seed=7)[0]
        # last of epoch 0, first and middle of epoch 1, first two of epoch 2 (consecutive)
        return {sh[0][-1], sh[1][0], sh[1][2], sh[2][0], sh[2][1]} - {sh[1][-1], sh[2][-1]}

    names, sizes, manifest, bad = setup_faults(s3_source, tmp_path, 11, pick)
    sh = shares_of(names, sizes, 1, 3, shuffle=True, seed=7)[0]
    ds = make(s3_source, tmp_path, "full", manifest=manifest, **plan)
    full = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = bare(ds)
        assert got == substituted(sh[epoch], bad), epoch
        full.append(got)
    for k in range(1, len(full[1])):
        ds = make(s3_source, tmp_path, f"a{k}", manifest=manifest, **plan)
        ds.set_epoch(1)
        it = iter(ds)
        head = [next(it) for _ in range(k)]
        state = ds.state_dict()
        it.close()
        assert bare(head) == full[1][:k]
        resumed = make(s3_source, tmp_path, f"b{k}", manifest=manifest, **plan)
        resumed.set_epoch(1)
        resumed.load_state_dict(state)
        rest = bare(resumed)
        assert len(head) + len(rest) == len(full[1]), (k, state)
        assert rest == substituted(sh[1][k:], bad) or "repeat" in state, (k, state)
        resumed.set_epoch(2)
        assert bare(resumed) == full[2], k


@pytest.mark.parametrize("persistent", [False, True])
def test_set_epoch_passes_with_skips_in_a_stateful_loader_of_two_workers(s3_source, tmp_path, persistent):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    plan = {"shuffle": True, "seed": 7, "epochs": 3, "retain": "auto"}

    def pick(names, sizes):
        sh = shares_of(names, sizes, 2, 3, shuffle=True, seed=7)
        return {sh[0][0][-1], sh[1][1][0], sh[0][1][1], sh[1][2][0]} - {w[e][-1] for w in sh for e in (1, 2)}

    names, sizes, manifest, bad = setup_faults(s3_source, tmp_path, 13, pick)
    sh = shares_of(names, sizes, 2, 3, shuffle=True, seed=7)
    kw = {"batch_size": 2, "num_workers": 2, "persistent_workers": persistent}

    def loader(name):
        ds = make(s3_source, tmp_path, name, manifest=manifest, **plan)
        return ds, stateful.StatefulDataLoader(ds, **kw)

    ds, ld = loader("full")
    full = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        got = by_worker(flat(ld, 2), 2)
        assert got == [substituted(sh[w][epoch], bad) for w in range(2)], epoch
        full.append(got)
    del ld
    n_batches = (len(full[1][0]) + 1) // 2 + (len(full[1][1]) + 1) // 2
    for k in range(1, n_batches + 1):
        ds, ld = loader(f"a{k}")
        ds.set_epoch(1)
        it = iter(ld)
        head = [next(it) for _ in range(k)]
        state = ld.state_dict()
        del it, ld
        ds2, resumed = loader(f"b{k}")
        ds2.set_epoch(1)
        resumed.load_state_dict(state)
        both = by_worker(flat(head, 2) + flat(resumed, 2), 2)
        assert [len(b) for b in both] == [len(f) for f in full[1]], k
        assert [set(b) for b in both] == [set(f) for f in full[1]], k
        ds2.set_epoch(2)
        assert by_worker(flat(resumed, 2), 2) == full[2], k
        del resumed


def read_bytes(path):
    return path.name, (path / "f").read_bytes()


def test_two_datasets_over_one_cache_dir_do_not_read_each_other_s_items(s3_source, s3_client, tmp_path):
    # dataset A's set_epoch pass with retain="auto" keeps its items on close (epoch 0 of 3);
    # dataset B, another source with the same names and sizes, then uses the same cache_dir
    for i in range(4):
        s3_source.put(f"item{i:03d}/f", b"A" * 500)
        s3_client.put_object(Bucket="data", Key=f"other/item{i:03d}/f", Body=b"B" * 500)
    opts = {"transform": read_bytes, "storage_options": s3_source.options, "rank": 0, "world_size": 1}
    a = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", epochs=3, retain="auto", **opts)
    a.set_epoch(0)
    assert {data for _, data in a} == {b"A" * 500}
    b = CachePipeDataset("s3://data/other/", tmp_path / "c", "1MiB", epochs=3, retain="auto", **opts)
    b.set_epoch(0)
    got = {data for _, data in b}
    assert got == {b"B" * 500}, "B yielded A's bytes"


def node_tagged(item):
    info = torch.utils.data.get_worker_info()
    return f"{0 if info is None else info.id}:{item.name}"


def node_config(tmp_path, sock, s3_source):
    import yaml
    from test_node_torch import write_config

    config = write_config(tmp_path, sock, s3_source.url, s3_source.options, capacity=1 << 20)
    data = yaml.safe_load(config.read_text())
    data["jobs"]["sources"].append(str(tmp_path))  # the manifest listed before the faults
    config.write_text(yaml.safe_dump(data))
    return config


def node_dataset(s3_source, sock, manifest, **options):
    opts = {"node": str(sock), "job": "train", "rank": 0, "world_size": 2, "node_ranks": [0], "on_error": "skip"}
    return CachePipeDataset(s3_source.url, transform=node_tagged, manifest=manifest, **(opts | options))


def test_node_equal_steps_checkpoint_at_every_step_resumes_to_the_planned_count(s3_source, tmp_path, short_dir):
    from cachepipe.service.testing import DaemonProcess

    plan = {"shuffle": True, "seed": 5, "epochs": 2}

    def pick(names, sizes):
        sh = shares_of(names, sizes, 1, 2, shuffle=True, seed=5)[0]
        return {sh[0][0], sh[0][-1], sh[1][0], sh[1][2], sh[1][3]} - {sh[1][-1]}

    names, sizes, manifest, bad = setup_faults(s3_source, tmp_path, 11, pick)
    sh = shares_of(names, sizes, 1, 2, shuffle=True, seed=5)[0]
    sock = short_dir / "api.sock"
    with DaemonProcess(node_config(tmp_path, sock, s3_source)):
        full = bare(node_dataset(s3_source, sock, manifest, **plan))
        assert full == substituted(sh[0] + sh[1], bad)
        for k in range(1, len(full)):
            ds = node_dataset(s3_source, sock, manifest, **plan)
            it = iter(ds)
            head = [next(it) for _ in range(k)]
            state = ds.state_dict()
            it.close()
            resumed = node_dataset(s3_source, sock, manifest, **plan)
            resumed.load_state_dict(state)
            rest = bare(resumed)
            assert len(head) + len(rest) == len(full), (k, state)
            assert rest == substituted((sh[0] + sh[1])[k:], bad) or "repeat" in state, (k, state)


def test_node_a_checkpoint_before_only_skipped_steps_resumes(s3_source, tmp_path, short_dir):
    from cachepipe.service.testing import DaemonProcess

    names, sizes, manifest, _ = setup_faults(
        s3_source, tmp_path, 4, lambda names, sizes: {planned(sizes, names, rank=0, world_size=2)[-1]}
    )
    share = planned(sizes, names, rank=0, world_size=2)
    sock = short_dir / "api.sock"
    with DaemonProcess(node_config(tmp_path, sock, s3_source)):
        assert list(node_dataset(s3_source, sock, manifest)) == [f"0:{share[0]}"] * 2
        ds = node_dataset(s3_source, sock, manifest)
        it = iter(ds)
        head = [next(it)]
        state = ds.state_dict()
        it.close()
        resumed = node_dataset(s3_source, sock, manifest)
        resumed.load_state_dict(state)
        assert len(head + list(resumed)) == 2


OLD_COMMIT = "278bd33"  # the code before these features

OLD_SCRIPT = """
import json, sys
from cachepipe.torch import CachePipeDataset
cfg = json.loads(sys.argv[1])
ds = CachePipeDataset(cfg["url"], cfg["cache"], "1MiB", transform=lambda p: p.name, **cfg["opts"])
ds.set_epoch(cfg["epoch"])
it = iter(ds)
head = [next(it) for _ in range(cfg["k"])]
print(json.dumps([head, ds.state_dict()]))
it.close()
"""


@pytest.mark.parametrize("retain", ["auto", "none"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_state_saved_in_a_set_epoch_pass_before_these_features_still_resumes(s3_source, tmp_path, retain, k):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    old = tmp_path / "oldcode"
    old.mkdir()
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "archive", OLD_COMMIT, "cachepipe"], cwd=repo, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    s3_source.folders(6, {"f": 500})
    opts = {"storage_options": s3_source.options, "rank": 0, "world_size": 1, "shuffle": True, "seed": 2}
    opts |= {"epochs": 3, "retain": retain}
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "old"), "opts": opts, "epoch": 1, "k": k}
    run = subprocess.run(
        [sys.executable, "-c", OLD_SCRIPT, json.dumps(cfg)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(old)},
        cwd=old,
        timeout=120,
        check=True,
    )
    head, state = json.loads(run.stdout)
    assert "end_epoch" not in state
    ref = CachePipeDataset(s3_source.url, tmp_path / "ref", "1MiB", transform=read_name, **opts)
    ref.set_epoch(1)
    epoch1 = list(ref)
    assert head == epoch1[:k]
    new = CachePipeDataset(s3_source.url, tmp_path / "new", "1MiB", transform=read_name, **opts)
    new.set_epoch(1)
    new.load_state_dict(state)
    assert head + list(new) == epoch1
    new.set_epoch(2)
    ref.set_epoch(2)
    assert list(new) == list(ref)


@pytest.mark.parametrize("epochs", [3, None])
@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_loop_broken_mid_pass_then_set_epoch_again_reads_whole_epochs(s3_source, tmp_path, epochs, num_workers, persistent):
    s3_source.folders(10, {"f": 700})
    opts = {"transform": read_bytes, "storage_options": s3_source.options, "rank": 0, "world_size": 1, "shuffle": True}
    opts |= {"seed": 9, "epochs": epochs, "retain": "auto", "partition": "fixed"}
    kw = {"batch_size": None, "num_workers": num_workers, "persistent_workers": persistent}
    ref = CachePipeDataset(s3_source.url, tmp_path / "ref", 8000, **opts)
    ref_loader = torch.utils.data.DataLoader(ref, **kw)
    expected = {}
    for epoch in (0, 1, 2):
        ref.set_epoch(epoch)
        expected[epoch] = [(n, bytes(d)) for n, d in ref_loader]
    del ref_loader
    dataset = CachePipeDataset(s3_source.url, tmp_path / "c", 8000, **opts)  # under the share: evictions
    loader = torch.utils.data.DataLoader(dataset, **kw)
    for epoch, cut in ((0, 3), (0, None), (1, 5), (2, 1), (1, None), (2, None)):
        dataset.set_epoch(epoch)
        got = []
        for n, d in loader:
            got.append((n, bytes(d)))
            if cut is not None and len(got) == cut:
                break
        assert got == expected[epoch][: len(got)] and (cut is not None or len(got) == 10), (epoch, cut)


@pytest.mark.xfail(
    strict=True,
    raises=OversizeError,
    reason="NOTICED (pre-existing, 3ce8a7dc): an item in the window between Pipeline._fitting's estimate "
    "(foreign + journal budget) and _check_limit's (state files too, measured after recover) is neither left out "
    "by on_oversize='skip' nor fits: OversizeError is raised at open despite on_oversize='skip' (here in the first pass)",
)
def test_an_item_just_under_the_capacity_with_on_oversize_skip_is_skipped_or_read(s3_source, tmp_path):
    from cachepipe.cache.core import journal_budget_of

    names = [f"item{i:03d}" for i in range(4)]
    capacity = 9000
    budget = journal_budget_of(sum(len(n) + 2 for n in names), 4)  # "name/f": generous
    big = capacity - budget - 64
    for i, name in enumerate(names):
        s3_source.put(f"{name}/f", bytes(big if i == 0 else 300))
    opts = {"transform": read_name, "storage_options": s3_source.options, "rank": 0, "world_size": 1, "shuffle": True}
    opts |= {"seed": 1, "epochs": 3, "retain": "auto", "on_oversize": "skip"}
    dataset = CachePipeDataset(s3_source.url, tmp_path / "c", capacity, **opts)
    counts = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        counts.append(sorted(dataset))
    assert counts[0] == counts[1] == counts[2], counts
