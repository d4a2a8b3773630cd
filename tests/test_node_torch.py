"""Node mode, real processes: a ``cachepipe serve`` daemon with a jobs section, two "ranks"
(separate processes, as torchrun starts them) each with a DataLoader of two worker processes
reading ``CachePipeDataset(node=SOCKET)`` over the moto server.

Checked: every item exactly once per epoch across the node; each (rank, worker) gets exactly
what ``plan.py`` assigns it, in order; the node's cap held (sampled while they run); one job,
listed once, for all four lanes; a rank killed mid-epoch (SIGKILL, its workers die with it) and
restarted from its ``StatefulDataLoader`` checkpoint gets exactly the rest of its items.

The ranks run tests/torch_rank_child.py, forked from a zygote (tests/zygote.py) that imported
torch once for the module: a rank starts in milliseconds, not the 3 s its imports take.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from sampling import Sampler
from zygote import Forked, Zygote

pytest.importorskip(
    "torch", reason="PyTorch is not installed (make test installs torch==2.13.0 where the CPU wheel is available)"
)
pytest.importorskip("torchdata", reason="torchdata is not installed (make test installs it with torch)")

from cachepipe.client import Client
from cachepipe.plan import Plan
from cachepipe.service.testing import DaemonProcess

KIB = 1024
CAPACITY = 48 * KIB
OPTIONS = {"epochs": 2, "shuffle": True, "seed": 5}


def write_config(tmp_path: Path, sock: Path, url: str, options: dict, capacity: int = CAPACITY, **job_options) -> Path:
    data = {
        "socket": str(sock),
        "jobs": {
            "root": str(tmp_path / "jobs"),
            "capacity": capacity,
            "sources": [url],
            "options": {"storage_options": options, "max_concurrency": 4, **job_options},
        },
    }
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


_RANKS: list[Zygote] = []  # the module's fork server of ranks, while its tests run (see ranks)


@pytest.fixture(scope="module", autouse=True)
def ranks() -> Iterator[Zygote]:
    """The fork server of the ranks (tests/torch_rank_child.py): torch, torchdata and cachepipe's
    adapter imported once for the module, a rank forked per start (a fresh process, its
    DataLoader workers its own children), not a Python started that imports torch each time.
    Autouse, and kept in ``_RANKS``, so that :func:`start_rank` keeps its arguments."""
    with Zygote("torch_rank_child") as zygote:
        _RANKS.append(zygote)
        try:
            yield zygote
        finally:
            _RANKS.remove(zygote)


def start_rank(rank: int, cfg: dict, world_size: int = 2) -> Forked:
    """Rank ``rank`` of ``world_size`` (RANK, LOCAL_RANK... as torchrun sets them), forked from the zygote."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
    return _RANKS[-1].spawn({**cfg, "kind": "node", "env": env})


def both_ranks(cfg: dict) -> list[list[list]]:
    """Ranks 0 and 1 run at once with ``cfg`` to their end (each must exit 0): their samples."""
    procs = [start_rank(rank, cfg) for rank in (0, 1)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outs.append(samples(out))
    return outs


def samples(out: str) -> list[list]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("[")]


def expected(data: dict, rank: int, worker: int) -> list[list]:
    names = sorted(data)
    sizes = [len(data[n]["f"]) for n in names]
    plan = Plan(sizes, rank=rank, world_size=2, worker=worker, num_workers=2, **OPTIONS)
    return [[s.epoch, names[s.item]] for s in plan]


def by_worker(got: list[list], worker: int) -> list[list]:
    return [[epoch, name] for w, epoch, name, _ in got if w == worker]


@pytest.fixture
def dataset(s3_source):
    data = s3_source.folders(26, {"f": 2 * KIB})
    return s3_source, data


def test_two_ranks_by_two_workers_read_their_plan_shares_from_one_node_cache(dataset, tmp_path, short_dir):
    source, data = dataset
    digests = {name: hashlib.md5(files["f"]).hexdigest() for name, files in data.items()}
    sock = short_dir / "api.sock"
    cfg = {"url": source.url, "socket": str(sock), "options": OPTIONS}
    with DaemonProcess(write_config(tmp_path, sock, source.url, source.options)), Sampler(tmp_path / "jobs" / "train") as sampler:
        outs = both_ranks(cfg)
        with Client(socket=sock) as client:
            jobs = client.status()["jobs"]
    # one cache under the node's capacity (in whole blocks, as it counts; the manifest, the
    # daemon's lock beside it are outside jobs.capacity)
    assert sampler.samples > 0 and sampler.peak <= CAPACITY
    for epoch in (0, 1):
        assert sorted(name for got in outs for _, e, name, _ in got if e == epoch) == sorted(data)
    assert all(digests[name] == digest for got in outs for _, _, name, digest in got)
    for rank in (0, 1):
        for worker in (0, 1):
            assert by_worker(outs[rank], worker) == expected(data, rank, worker)
    assert list(jobs) == ["job/train"]  # one job for the four lanes: one listing
    job = jobs["job/train"]
    assert job["lanes"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert job["stats"]["items_listed"] == 26 and job["stats"]["items_acked"] == 52


def test_a_rank_killed_mid_epoch_resumes_from_its_stateful_dataloader_checkpoint(dataset, tmp_path, short_dir):
    source, data = dataset
    sock = short_dir / "api.sock"
    checkpoint = tmp_path / "loader.pkl"
    cfg = {"url": source.url, "socket": str(sock), "options": OPTIONS}
    killed = {**cfg, "checkpoint_at": 5, "checkpoint": str(checkpoint), "die_at": 9}
    with DaemonProcess(write_config(tmp_path, sock, source.url, source.options)), Sampler(tmp_path / "jobs" / "train") as sampler:
        other = start_rank(1, cfg)
        first = start_rank(0, killed)
        out, err = first.communicate(timeout=120)
        assert first.returncode == -9, err
        before = samples(out)
        assert len(before) == 9 and "checkpoint" in out
        again = start_rank(0, {**cfg, "resume": str(checkpoint)})
        out_again, err = again.communicate(timeout=120)
        assert again.returncode == 0, err
        out_other, err = other.communicate(timeout=120)
        assert other.returncode == 0, err
    assert sampler.peak <= CAPACITY
    after = samples(out_again)
    for worker in (0, 1):  # up to the checkpoint, then from it: exactly the share, nothing twice
        assert by_worker(before[:5], worker) + by_worker(after, worker) == expected(data, 0, worker)
        assert by_worker(samples(out_other), worker) == expected(data, 1, worker)


def test_a_loaded_state_is_for_one_iteration_and_the_next_pass_is_whole(s3_source, tmp_path, short_dir):
    """Before, every later iteration of a resumed node-mode dataset started from the loaded state
    again: ``for epoch in ...: for x in loader`` lost the items before it in every later pass.
    26 items, more than the node's capacity holds: the resumed pass sends the lane back from
    where the first left it, and before, in 3 of 4 runs its next download waited for ever for
    room that the items the lane had left behind (shelved after the wait began) took."""
    from cachepipe.torch import CachePipeDataset

    source, data = s3_source, s3_source.folders(26, {"f": 2 * KIB})
    sock = short_dir / "api.sock"
    options = {"node": str(sock), "job": "train", "rank": 0, "world_size": 1, "transform": lambda item: item.name}
    with DaemonProcess(write_config(tmp_path, sock, source.url, source.options)):
        first = CachePipeDataset(source.url, **options)
        it = iter(first)
        head = [next(it) for _ in range(4)]
        state = first.state_dict()
        it.close()
        resumed = CachePipeDataset(source.url, **options)
        resumed.load_state_dict(state)
        rest = list(resumed)
        again = list(resumed)
    assert head + rest == sorted(data) and again == sorted(data)


def test_two_nodes_under_torch_distributed_list_once(dataset, ranks, fault_proxy, tmp_path, short_dir):
    """Two nodes (a daemon each, one rank each): rank 0's daemon lists, the other node gets the
    manifest through the process group, and both plan from that one catalog."""
    import socket

    from cachepipe.manifest import index

    source, data = dataset
    proxy, endpoint = fault_proxy
    options = {**source.options, "endpoint_url": endpoint}
    index(source.url, tmp_path / "one.json.gz", storage_options=options)
    one = sum(1 for head in proxy.requests if "list-type=2" in head.split("\r\n", 1)[0])
    proxy.requests.clear()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemons, procs = [], []
    try:
        for rank in (0, 1):
            node = tmp_path / f"node{rank}"
            node.mkdir()
            sock = short_dir / f"api{rank}.sock"
            daemons.append(DaemonProcess(write_config(node, sock, source.url, options)).__enter__())
            cfg = {"url": source.url, "socket": str(sock), "options": OPTIONS}
            env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(ranks.spawn({**cfg, "kind": "node-dist", "env": env}))
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outs.append(samples(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(30)
        for daemon in daemons:
            daemon.__exit__(None, None, None)
    assert sum(1 for head in proxy.requests if "list-type=2" in head.split("\r\n", 1)[0]) == one
    for epoch in (0, 1):  # the two nodes' shares, planned from one catalog, cover every item once
        assert sorted(name for got in outs for _, e, name, _ in got if e == epoch) == sorted(data)
    for rank in (0, 1):
        for worker in (0, 1):
            assert by_worker(outs[rank], worker) == expected(data, rank, worker)


@pytest.mark.parametrize("seed", [3, 4])
def test_workers_of_one_rank_over_unequal_items_and_epochs_do_not_hang(s3_source, tmp_path, short_dir, seed):
    """Under the defaults (partition="epoch"), with a cache that holds the whole epoch: before,
    worker 1's next item could be one planned for worker 0 further on. One copy of an item at a
    time, so worker 1 waited for worker 0 to pass it, and worker 0 waited for the main process,
    which waited for worker 1's sample: the job hung (in seeds 3 and 4 of 0-5; the others pass
    either way). Now worker 1 shares worker 0's copy."""
    data = {f"item{i:02d}": {"f": os.urandom((1 + i % 8) * KIB)} for i in range(40)}
    for name, files in data.items():
        s3_source.put(f"{name}/f", files["f"])
    sock = short_dir / "api.sock"
    options = {"epochs": 3, "shuffle": True, "seed": seed}
    cfg = {"url": s3_source.url, "socket": str(sock), "options": options}
    with DaemonProcess(write_config(tmp_path, sock, s3_source.url, s3_source.options, capacity=1 << 20)):
        proc = start_rank(0, cfg, world_size=1)
        try:
            out, err = proc.communicate(timeout=60)  # before: hung (in seeds 3 and 4 of 0-5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise
    assert proc.returncode == 0, err
    got = samples(out)
    assert len(got) == 3 * len(data) and all(hashlib.md5(data[n]["f"]).hexdigest() == d for _, _, n, d in got)


def test_two_ranks_over_items_of_different_sizes_read_as_many_items_from_the_node(s3_source, tmp_path, short_dir):
    """Two ranks, 25 items, one large: by bytes alone rank 0 would read 1 or 2 items an epoch and
    rank 1 the rest (a DDP job then hangs in a collective). The dataset's default for several
    ranks, equal_steps="pad", reaches the daemon in the job's spec: 13 items a rank an epoch."""
    data = {f"item{i:02d}": {"f": os.urandom(20 * KIB if i == 3 else KIB + 37 * i)} for i in range(25)}
    for name, files in data.items():
        s3_source.put(f"{name}/f", files["f"])
    sock = short_dir / "api.sock"
    cfg = {"url": s3_source.url, "socket": str(sock), "options": OPTIONS}
    with DaemonProcess(write_config(tmp_path, sock, s3_source.url, s3_source.options, capacity=1 << 20)):
        outs = both_ranks(cfg)
        with Client(socket=sock) as client:
            spec = client.status()["jobs"]["job/train"]["spec"]
    assert spec["equal_steps"] == "pad"
    assert [len(got) for got in outs] == [26, 26]  # 13 a rank in each of 2 epochs
    names, sizes = sorted(data), [len(data[n]["f"]) for n in sorted(data)]
    for rank in (0, 1):
        for worker in (0, 1):
            plan = Plan(sizes, rank=rank, world_size=2, worker=worker, num_workers=2, equal_steps="pad", **OPTIONS)
            assert by_worker(outs[rank], worker) == [[s.epoch, names[s.item]] for s in plan]


@pytest.mark.parametrize(
    ("sizes", "batch_size", "cut"),
    [
        ([8 * KIB] + [KIB] * 6, None, 3),  # worker 0's share is one item: it ends while worker 1 still has five
        ([KIB] * 7, 2, 4),  # worker 1's last batch is short: its share ended inside the batch
    ],
)
def test_a_checkpoint_after_one_worker_ended_its_lane_resumes_without_repeating_it(
    s3_source, tmp_path, short_dir, sizes, batch_size, cut
):
    """Found in review: a DataLoader worker whose lane ended before the loader's pass did (a
    short last batch, or a smaller share than the other workers') saved the job's beginning as
    its state; StatefulDataLoader keeps that worker state with the loader's, and a resume from a
    checkpoint taken after it delivered that worker's whole share again."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cachepipe.torch import CachePipeDataset

    for i, size in enumerate(sizes):
        s3_source.put(f"item{i:03d}/f", bytes(size))
    sock = short_dir / "api.sock"
    options = {"node": str(sock), "job": "train", "rank": 0, "world_size": 1, "transform": lambda item: item.name}

    def loader() -> StatefulDataLoader:
        return StatefulDataLoader(CachePipeDataset(s3_source.url, **options), batch_size=batch_size, num_workers=2)

    def names(batches: list) -> list[str]:
        return sorted(name for batch in batches for name in ([batch] if isinstance(batch, str) else batch))

    with DaemonProcess(write_config(tmp_path, sock, s3_source.url, s3_source.options)):
        first, got = loader(), []
        for n, batch in enumerate(first, 1):
            got.append(batch)
            if n == cut:
                state = first.state_dict()
        resumed = loader()
        resumed.load_state_dict(state)
        rest = list(resumed)
        again = list(resumed)
    assert names(got) == [f"item{i:03d}" for i in range(len(sizes))]
    assert names(got[:cut] + rest) == names(got)  # before: the ended worker's share again
    assert again == got  # and the pass after it is whole


def test_set_epoch_in_node_mode_reads_that_epoch_per_pass_and_a_checkpoint_resumes_to_its_end(s3_source, tmp_path, short_dir):
    """One pass per epoch through the daemon: each (persistent) DataLoader worker reads its lane's
    share of the epoch set, in the plan's order; the items of the next epoch already on disk
    wait for the next pass; a StatefulDataLoader checkpoint taken in the pass resumes to the
    end of that epoch, not of the plan."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cachepipe.torch import CachePipeDataset

    data = s3_source.folders(12, {"f": 2 * KIB})
    names = sorted(data)
    plan = {"epochs": 3, "shuffle": True, "seed": 5}
    share = {  # (worker, epoch) -> names, as plan.py assigns them
        (w, e): [names[s.item] for s in Plan([2 * KIB] * 12, worker=w, num_workers=2, **plan) if s.epoch == e]
        for w in (0, 1)
        for e in range(3)
    }
    sock = short_dir / "api.sock"
    options = {"node": str(sock), "job": "train", "rank": 0, "world_size": 1, **plan}
    options["transform"] = lambda item: [torch_worker(), item.cursor.epoch, item.name]

    def pass_of(loader) -> list[list]:
        return [list(x) for x in loader]

    with DaemonProcess(write_config(tmp_path, sock, s3_source.url, s3_source.options, capacity=64 * KIB)):
        dataset = CachePipeDataset(s3_source.url, **options)
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            got = pass_of(loader)
            assert {e for _, e, _ in got} == {epoch}
            assert [[n for w, _, n in got if w == worker] for worker in (0, 1)] == [share[0, epoch], share[1, epoch]]
        dataset.set_epoch(1)
        again = []
        for n, sample in enumerate(loader, 1):
            again.append(list(sample))
            if n == 5:
                state = loader.state_dict()
        assert again == got  # epoch 1 again
        del loader
        resumed_dataset = CachePipeDataset(s3_source.url, **options)
        resumed = StatefulDataLoader(resumed_dataset, batch_size=None, num_workers=2)
        resumed.load_state_dict(state)
        assert again[:5] + pass_of(resumed) == again  # the rest of epoch 1, and no further
        resumed_dataset.set_epoch(2)
        last = pass_of(resumed)
    assert [[n for w, e, n in last if w == worker and e == 2] for worker in (0, 1)] == [share[0, 2], share[1, 2]]
    assert len(last) == 12


def torch_worker() -> int:
    import torch

    return torch.utils.data.get_worker_info().id


def test_an_item_skipped_on_one_rank_is_repeated_in_its_place_so_both_ranks_run_as_many_steps(s3_source, tmp_path, short_dir):
    # equal_steps="pad" (the default over 2 ranks), on_error="skip", an archive that does not
    # match its .md5 at the source (the daemon unpacks and checks it): the daemon reports the
    # skipped step (report_skips) and the lane's worker yields the sample before it again
    from test_torch_skips import put_items, substituted

    names, sizes = put_items(s3_source, 13, set())
    shares = {
        (r, w): [names[s.item] for s in Plan(sizes, rank=r, world_size=2, worker=w, num_workers=2, equal_steps="pad", **OPTIONS)]
        for r in (0, 1)
        for w in (0, 1)
    }
    bad = {shares[1, 0][2], shares[1, 1][0]}  # rank 1's, in epoch 0: a middle item and a first one
    put_items(s3_source, 13, {names.index(b) for b in bad})
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_source.url, s3_source.options, unpack=True)
    cfg = {"url": s3_source.url, "socket": str(sock), "options": {**OPTIONS, "on_error": "skip"}}
    with DaemonProcess(config):
        outs = both_ranks(cfg)
    assert len(outs[0]) == len(outs[1]) == 2 * 7  # 13 items padded to 14: 7 a rank, each of 2 epochs
    for rank in (0, 1):
        for worker in (0, 1):
            assert [name for _, name in by_worker(outs[rank], worker)] == substituted(shares[rank, worker], bad)


def test_a_checkpoint_before_only_skipped_steps_resumes_from_the_node(s3_source, tmp_path, short_dir):
    """Found in review: a state taken after a worker's last good sample, with only skipped items
    left in its pass, could not be resumed (NothingToRepeatError: the resumed worker had no
    sample to repeat). The state is at that sample now, which the resumed worker reads again."""
    from test_torch_skips import planned, put_items

    from cachepipe.torch import CachePipeDataset

    names, sizes = put_items(s3_source, 4, set())
    share = planned(sizes, names, rank=0, world_size=2)
    put_items(s3_source, 4, {names.index(share[-1])})
    sock = short_dir / "api.sock"
    options = {"node": str(sock), "job": "train", "rank": 0, "world_size": 2, "node_ranks": [0], "on_error": "skip"}

    def dataset() -> CachePipeDataset:
        return CachePipeDataset(s3_source.url, transform=lambda item: item.name, **options)

    with DaemonProcess(write_config(tmp_path, sock, s3_source.url, s3_source.options, unpack=True)):
        assert list(dataset()) == [share[0]] * 2  # the last item's step: a repeat of the first
        first = dataset()
        it = iter(first)
        head = [next(it)]
        state = first.state_dict()
        it.close()
        resumed = dataset()
        resumed.load_state_dict(state)
        assert head + list(resumed) == [share[0]] * 2
