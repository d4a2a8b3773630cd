"""CachePipeDataset: the mistakes of a first hour with it, each said so rather than a silent
wrong result or a stall (found playing a training engineer's week against it, with real
DataLoader workers)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until
from zygote import Zygote

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


@pytest.mark.parametrize(("train_workers", "val_workers"), [(0, 0), (2, 2), (2, 0), (0, 2)])
def test_training_and_validation_over_one_cache_dir_read_at_once_are_refused_without_a_minute_s_wait_saying_so(
    s3_source, s3_client, tmp_path, monkeypatch, train_workers, val_workers
):
    """Evaluation inside the training loop, both datasets over one cache_dir: the validation
    loader's folders are the training loader's (cache_dir/rank0-worker<k>), which it holds. Before:
    "in use by pid N; close it first", naming neither cause nor fix; with workers on both sides,
    said after a minute's wait (SIBLING_WAIT) for a worker of the same DataLoader to stop. Now
    refused once the training worker holding the folder, of another dataset (its note beside the
    folder says), has waited for its DataLoader for IDLE_WAIT (1 s); at once where the holder is
    the main process or its worker. The waits for a worker of the same dataset and for one of
    another that makes a sample set to an hour (forked workers inherit them), and the validation
    DataLoader's timeout (20 s) bounds the old wait: there, a timeout, not this refusal."""
    import cachepipe.torchlocal

    monkeypatch.setattr(cachepipe.torchlocal, "SIBLING_WAIT", 3600.0)  # the refusal does not come from these waits
    monkeypatch.setattr(cachepipe.torchlocal, "DATASET_WAIT", 3600.0)
    s3_source.folders(20, {"f": 100})  # 10 a training worker: it holds its folder past its first samples
    s3_client.put_object(Bucket="data", Key="val/v0/f", Body=b"v" * 100)
    options = {"transform": read, "storage_options": s3_source.options}
    train = CachePipeDataset(s3_source.url, tmp_path / "c", "1MiB", **options)
    val = CachePipeDataset("s3://data/val/", tmp_path / "c", "1MiB", **options)

    def evaluate_in_the_loop() -> None:
        for _ in torch.utils.data.DataLoader(train, batch_size=None, num_workers=train_workers):
            list(torch.utils.data.DataLoader(val, batch_size=None, num_workers=val_workers, timeout=20 if val_workers else 0))

    # a CacheLockedError (a RuntimeError), which a DataLoader re-raises from its worker as a RuntimeError
    with pytest.raises(RuntimeError, match=r"two datasets over one cache_dir \(training and validation\).*own cache_dir"):
        evaluate_in_the_loop()


def _folders(tmp_path: Path, count: int) -> Path:
    """A local source of ``count`` items ``i0``, ``i1``... (folders of one 100-byte file)."""
    src = tmp_path / "src"
    for n in range(count):
        (src / f"i{n}").mkdir(parents=True)
        (src / f"i{n}" / "f").write_bytes(b"x" * 100)
    return src


def test_a_dataset_made_for_each_pass_over_one_cache_dir_waits_for_the_last_pass_s_workers_to_stop(tmp_path, monkeypatch):
    """A dataset made for each pass over one cache_dir, each pass's iterator assigned over the
    last one broken off: the DataLoader makes the new iterator's workers, then drops the old one,
    whose workers stop once their sample in hand is made (here a slow transform's, 0.5 s). The new
    workers, finding their folders held by another dataset's workers, wait while those make a
    sample (their notes say so), not refused as the training and validation datasets read at
    once are (IDLE_WAIT shortened below the transform's time: a wait that did not tell a worker
    making a sample from one waiting for its DataLoader would refuse)."""
    import cachepipe.torchlocal

    monkeypatch.setattr(cachepipe.torchlocal, "IDLE_WAIT", 0.2)
    src = _folders(tmp_path, 6)

    def slow(path):
        time.sleep(0.5)  # the old workers are each in a transform when their iterator is dropped
        return path.name

    names = []
    for _ in range(2):
        dataset = CachePipeDataset(str(src), tmp_path / "c", "1MiB", transform=slow, rank=0, world_size=1)
        it = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=30))
        names.append([next(it), next(it)])  # the second pass's workers wait for the first's (refused, with no wait)
    del it
    assert names == [["i0", "i1"]] * 2, names  # (rank 0 of 1: worker 0 reads i0, i2..., worker 1 i1, i3...)


def test_a_dataset_made_for_each_pass_waits_as_long_as_torch_lets_the_last_pass_s_workers_stop(tmp_path, monkeypatch):
    """Each pass's iterator assigned over the last one broken off, whose workers are each in a
    sample that does not end: torch joins the dropped iterator's workers one after the other,
    each for MP_STATUS_CHECK_INTERVAL (5 s), and terminates those still alive after the last
    join, so a worker may hold its folder num_workers times that long. The new workers waited
    DATASET_WAIT (6 s) in all for a worker of another dataset making a sample, and were refused
    ("two datasets over one cache_dir") while torch still stopped the old ones (with 2 workers, up
    to 10 s). Here the interval is 1 s and DATASET_WAIT 1 s (forked workers inherit both): the old
    workers are ended about 2 s after the drop."""
    import threading

    import torch.utils.data._utils

    import cachepipe.torchlocal

    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 1.0)
    monkeypatch.setattr(cachepipe.torchlocal, "DATASET_WAIT", 1.0)
    src = _folders(tmp_path, 6)
    made = tmp_path / "made"
    made.mkdir()

    def first_only(path):
        if any(made.glob(f"{os.getpid()}-*")):  # this worker's second sample: one that never ends
            (made / f"{os.getpid()}-blocked").touch()
            threading.Event().wait()
        (made / f"{os.getpid()}-first").touch()
        return path.name

    def name(path):
        return path.name

    old = CachePipeDataset(str(src), tmp_path / "c", "1MiB", transform=first_only, rank=0, world_size=1)
    it = iter(torch.utils.data.DataLoader(old, batch_size=None, num_workers=2, timeout=30))
    assert next(it) == "i0"
    wait_until(lambda: len(list(made.glob("*-blocked"))) == 2, what="both old workers in a sample that does not end")
    new = CachePipeDataset(str(src), tmp_path / "c", "1MiB", transform=name, rank=0, world_size=1)
    it = iter(torch.utils.data.DataLoader(new, batch_size=None, num_workers=2, timeout=30))  # the old one dropped
    assert [next(it), next(it)] == ["i0", "i1"]
    del it


def test_a_new_iterator_of_one_dataset_waits_as_long_as_torch_lets_the_broken_off_one_s_workers_stop(tmp_path, monkeypatch):
    """``it = iter(loader)`` over an iterator broken off, whose workers are each in a sample that
    does not end: the new workers wait for the old ones, of the same dataset, up to SIBLING_WAIT
    (60 s), while torch may take 5 s per worker to stop them: with more than 11 workers, the new
    ones were refused while torch still stopped the old. They wait as long as that, and
    DATASET_WAIT more. Here the interval is 1 s, DATASET_WAIT 1 s and SIBLING_WAIT 0.5 s (forked
    workers inherit them): the old workers are ended about 2 s after the drop."""
    import threading

    import torch.utils.data._utils

    import cachepipe.torchlocal

    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 1.0)
    monkeypatch.setattr(cachepipe.torchlocal, "DATASET_WAIT", 1.0)
    monkeypatch.setattr(cachepipe.torchlocal, "SIBLING_WAIT", 0.5)
    src = _folders(tmp_path, 6)
    made, blocking = tmp_path / "made", tmp_path / "blocking"
    made.mkdir()
    blocking.touch()

    def first_only(path):
        if blocking.exists() and any(made.glob(f"{os.getpid()}-*")):  # this old worker's second sample: never ends
            (made / f"{os.getpid()}-blocked").touch()
            threading.Event().wait()
        (made / f"{os.getpid()}-first").touch()
        return path.name

    dataset = CachePipeDataset(str(src), tmp_path / "c", "1MiB", transform=first_only, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=30)
    it = iter(loader)
    assert next(it) == "i0"
    wait_until(lambda: len(list(made.glob("*-blocked"))) == 2, what="both old workers in a sample that does not end")
    blocking.unlink()  # the new workers' samples end
    it = iter(loader)  # the old one dropped
    assert [next(it), next(it)] == ["i0", "i1"]
    del it


def test_a_dataset_made_for_each_pass_waits_for_the_last_pass_s_workers_still_collating_a_batch(tmp_path, monkeypatch):
    """A worker hands a batch's last sample, then collates the batch (collate_fn) and sends it:
    its note says it waits for its DataLoader meanwhile. A dropped iterator's workers, each in a
    collate_fn that takes long, were taken for workers of another dataset reading at the same
    time and the new pass's workers refused after IDLE_WAIT (1 s), while torch still stopped them
    (here: 1 s per worker, interval patched; forked workers inherit it). The main thread of a
    worker that waits for its DataLoader runs nothing; one that collates does: waited for."""
    import torch.utils.data._utils

    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 1.0)
    src = _folders(tmp_path, 8)
    made = tmp_path / "made"
    made.mkdir()

    def first_only(batch):
        if any(made.glob(f"{os.getpid()}-*")):  # this worker's second batch: a collate that runs on
            (made / f"{os.getpid()}-collating").touch()
            while True:
                pass
        (made / f"{os.getpid()}-first").touch()
        return batch

    def name(path):
        return path.name

    old = CachePipeDataset(str(src), tmp_path / "c", "1MiB", transform=name, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(old, batch_size=2, num_workers=2, collate_fn=first_only, timeout=30)
    it = iter(loader)
    assert next(it) == ["i0", "i2"]
    wait_until(lambda: len(list(made.glob("*-collating"))) == 2, what="both old workers collating their second batch")
    new = CachePipeDataset(str(src), tmp_path / "c", "1MiB", transform=name, rank=0, world_size=1)
    it = iter(torch.utils.data.DataLoader(new, batch_size=None, num_workers=2, timeout=30))  # the old one dropped
    assert [next(it), next(it)] == ["i0", "i1"]
    del it


def test_a_note_on_a_worker_folder_describes_its_live_holder_alone(tmp_path):
    """The note beside a worker's folder (which dataset reads it, making a sample or not) is of
    the live process it names: once that process is killed (SIGKILL, its note left as it was),
    or for another holder of the folder, it says nothing, and the folder's holder is waited for
    as a worker of the same dataset."""
    from cachepipe.torchreader import Reader, reader

    folder = tmp_path / "rank0-worker0"
    child = subprocess.Popen([sys.executable, "-c", NOTE, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "noted\n"
        owner = f"pid {child.pid} {socket.gethostname()}"
        assert reader(folder, owner) == Reader("another", 3, "idle", 1)
        assert reader(folder, f"pid {os.getpid()} {socket.gethostname()}") is None  # another holder: not its note
    finally:
        child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
    assert (tmp_path / ".rank0-worker0.reader").exists()  # left as it was
    assert reader(folder, owner) is None


def test_a_note_that_is_a_named_pipe_or_a_link_is_no_note(tmp_path):
    """A worker that finds its folder held reads the note beside it: a named pipe there (planted
    in a cache_dir others may write) made the read wait for a writer, for ever, and the worker
    with it; a symbolic link was followed to whatever it names. Neither is a note."""
    from cachepipe.torchreader import reader

    folder, note = tmp_path / "rank0-worker0", tmp_path / ".rank0-worker0.reader"
    owner = f"pid {os.getpid()} {socket.gethostname()}"
    os.mkfifo(note)
    read: list[object] = []
    thread = threading.Thread(target=lambda: read.append(reader(folder, owner)))
    thread.start()
    thread.join(10)
    waited = thread.is_alive()
    if waited:  # the read waits for a writer: given one, so that the thread ends
        with open(note, "w"):
            pass
        thread.join()
    assert not waited and read == [None]
    note.unlink()
    start = proc_stat_start(os.getpid())
    (tmp_path / "elsewhere").write_text(f"{os.getpid()} {start} d 2 idle {0:020d}\n")
    note.symlink_to(tmp_path / "elsewhere")
    assert reader(folder, owner) is None


def test_a_note_that_is_a_socket_is_no_note(tmp_path):
    """A UNIX socket where the note is (bound by a program that took the name): its open fails
    with ENXIO, which went up through the worker's open of its pipeline and failed the worker,
    where a named pipe or a link there is no note."""
    from cachepipe.torchreader import reader

    folder, note = tmp_path / "rank0-worker0", tmp_path / ".rank0-worker0.reader"
    if len(str(note)) > 100:
        pytest.skip("the path is too long for a UNIX socket's address")
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(note))
        assert reader(folder, f"pid {os.getpid()} {socket.gethostname()}") is None


def proc_stat_start(pid: int) -> str:
    from cachepipe.torchreader import proc_stat

    fields = proc_stat(pid)
    assert fields is not None
    return fields[19]


def test_a_note_written_where_a_symbolic_link_lies_replaces_the_link_not_its_target(tmp_path):
    """The note is written to ``.rank<r>-worker<k>.reader.tmp``, then renamed into place. A
    symbolic link of that name (planted in a cache_dir others may write, or any left there) was
    followed: the file it pointed to was truncated and overwritten with the note. The link is
    now replaced; what it points to is left."""
    from cachepipe.torchreader import ReaderNote, reader

    folder, victim = tmp_path / "rank0-worker0", tmp_path / "victim"
    victim.write_text("not the note's\n")
    (tmp_path / ".rank0-worker0.reader.tmp").symlink_to(victim)
    note = ReaderNote(folder, "d", 2)
    try:
        assert victim.read_text() == "not the note's\n"
        assert reader(folder, f"pid {os.getpid()} {socket.gethostname()}") is not None  # noted all the same
    finally:
        note.close()


NOTE = r"""
import sys
from pathlib import Path
from cachepipe.torchreader import ReaderNote
note = ReaderNote(Path(sys.argv[1]), "another", 3)
note.idle()
print("noted", flush=True)
sys.stdin.read()  # until killed
"""


LATE = r"""
import json, logging, sys, torch
from cachepipe.torch import CachePipeDataset
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
cfg = json.loads(sys.argv[1])
dataset = CachePipeDataset(cfg["url"], cfg["cache"], "1MiB", transform=lambda path: path.name, storage_options=cfg["options"],
                           epochs=3, shuffle=True)
loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
dataset.set_epoch(0)
first = list(loader)  # set_epoch before the pass: no warning
it = iter(loader)
second = [next(it)]  # worker 0 began its pass: with epoch 0
dataset.set_epoch(1)
second += list(it)
print(json.dumps([len(first), len(second)]), flush=True)
"""


def test_set_epoch_called_while_a_pass_of_workers_runs_is_said_by_the_workers_that_began_before_it(s3_source, tmp_path):
    """set_epoch(e) after iter(loader), once the workers began: they read the epoch before to
    its end (as documented: a pass keeps its epochs), silently before; now each such worker says so."""
    s3_source.folders(4, {"f": 100})
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "c"), "options": s3_source.options}
    run = subprocess.run([sys.executable, "-c", LATE, json.dumps(cfg)], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == [4, 4]
    said = [line for line in run.stderr.splitlines() if "was called while this pass" in line]
    assert 1 <= len(said) <= 2, run.stderr  # worker 0, and worker 1 if it began before the call
    assert all(line.startswith("WARNING") and "set_epoch(1)" in line for line in said), said


@pytest.fixture(scope="module")
def ranks() -> Iterator[Zygote]:
    """A fork server of ranks (tests/torch_rank_child.py), as test_torch.py's."""
    with Zygote("torch_rank_child", "s3://data/video/") as zygote:
        yield zygote


def test_ranks_whose_launcher_sets_no_rank_variables_read_their_own_shares(s3_source, ranks, tmp_path):
    """mp.spawn, or a launcher of its own, gives init_process_group the rank and world size and
    sets no RANK/WORLD_SIZE. The dataset, made after it, took them from torch.distributed, but
    each DataLoader worker started by spawn (mp.spawn's ranks start theirs so) or forkserver
    (Python 3.14's default), which has no process group, took rank 0 of 1 again: every rank read
    every item (here: its workers' folders were rank 0's, which rank 0's workers held)."""
    from test_torch import fork_ranks

    from cachepipe.plan import permutation

    data = s3_source.folders(13, {"f": 500})
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "cache"), "options": s3_source.options}
    cfg |= {"dist": "explicit", "context": "forkserver"}  # (spawn: the same, slower to start)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outputs = fork_ranks(ranks, cfg, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # two ranks, two epochs, equal_steps="pad": 14 items an epoch, the first of its permutation twice
    firsts = [sorted(data)[permutation(13, 5, epoch)[0]] for epoch in (0, 1)]
    assert sorted(name for out in outputs for name, _ in out) == sorted(list(data) * 2 + firsts)
    assert [len(out) for out in outputs] == [14, 14]
    assert sorted(p.name for p in (tmp_path / "cache").glob("rank*")) == [f"rank{r}-worker{w}" for r in (0, 1) for w in (0, 1)]


@pytest.mark.parametrize("context", [None, "spawn"])
def test_a_dataset_made_before_init_process_group_is_refused_when_read(s3_source, ranks, tmp_path, context):
    """Made before init_process_group under a launcher that sets no RANK/WORLD_SIZE, a dataset is
    rank 0 of 1 (taken when it is made, for its workers): every rank would read every item. Forked
    workers see torch.distributed and refuse; for spawned ones (none of their own) the parent
    refuses as it pickles the dataset for them, before any starts."""
    from test_torch import fork_ranks

    s3_source.folders(3, {"f": 100})
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "cache"), "options": s3_source.options}
    cfg |= {"dist": "explicit", "made_before": True, "context": context}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = fork_ranks(ranks, cfg, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # a forked worker's error comes as its traceback's text (last line "ValueError: ..."); the parent's as raised
    assert [error.removeprefix("ValueError: ") for error in errors] == [
        "this dataset was made as rank 0 of 1 (torch.distributed not initialised then, nor RANK/WORLD_SIZE set), "
        f"and torch.distributed is rank {rank} of 2: make the dataset after init_process_group, or give it rank= and world_size="
        for rank in (0, 1)
    ]


# forkserver's workers, as spawn's, start without the parent's state (their dataset pickled to
# them), and import torch once, in the server (tests/torch_rank_child.py preloads it there), where
# spawn's import it each
@pytest.mark.parametrize("context", [None, "forkserver"])
def test_a_dataset_made_before_init_process_group_under_torchrun_reads_its_own_share(s3_source, ranks, tmp_path, context):
    """Under torchrun (RANK and WORLD_SIZE set) a dataset made before init_process_group takes its
    rank from them, which torch.distributed agrees with when it is read: each rank reads its own
    share, in forked and spawned workers alike (the refusal above is for a launcher that sets
    none)."""
    from test_torch import fork_ranks

    data = s3_source.folders(4, {"f": 100})
    cfg = {"url": s3_source.url, "cache": str(tmp_path / "cache"), "options": s3_source.options}
    cfg |= {"dist": True, "made_before": True, "context": context}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outputs = fork_ranks(ranks, cfg, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert [len(out) for out in outputs] == [2, 2], outputs  # 4 items, one epoch: 2 a rank
    assert sorted(name for out in outputs for name, _ in out) == sorted(data)
