"""State left on disk by one version of cachepipe and read by another (an upgrade, a rollback).

Each test writes the state as the other version wrote it, literally (bytes or a dict taken from
what that version wrote), and opens it with this one: a state of an earlier version is read as
it meant, one of a later version is refused naming the file and both versions, never misread.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from cachepipe import ConfigError, Pipeline
from cachepipe.manifest import index


def _local_source(root: Path, n: int) -> str:
    for i in range(n):
        (root / f"item{i:03d}").mkdir(parents=True)
        (root / f"item{i:03d}" / "f").write_bytes(b"x" * 100)
    return str(root)


# what cachepipe of 2026-11-25 (7fe8a14) left in cache_dir/.cachepipe/journal: a resume=True pass over
# _local_source(4), item000 acked, item001 in hand, item002 and item003 fetched ahead, closed with
# keep_on_close: no versions (J/R), no source or items mode in the plan's line
JOURNAL_2026_11_25 = b"""N 0
K {"balance": "bytes", "epochs": 1, "n_items": 4, "num_workers": 1, "partition": "epoch", "rank": 0, "seed": 0, \
"shuffle": false, "sizes_digest": "855601b7e8203aa45d95edf2a486cee8", "version": 1, "worker": 0, "world_size": 1}
C 0 0
I item000
P item000
A 0 item000
I item001
P item001
C 0 1
I item003
P item003
I item002
P item002
"""


def test_an_earlier_version_s_journal_resumes_where_it_stopped_and_reuses_its_items(tmp_path):
    """The promise of docs/architecture.md for an earlier journal: read as it meant. Its items of
    a source without ETags are reused (with ETags they are downloaded again: no version known)."""
    src = _local_source(tmp_path / "src", 4)
    cache = tmp_path / "cache"
    for name in ("item001", "item002", "item003"):
        (cache / name).mkdir(parents=True)
        (cache / name / "f").write_bytes(b"x" * 100)
    (cache / ".cachepipe").mkdir()
    (cache / ".cachepipe" / "journal").write_bytes(JOURNAL_2026_11_25)
    with Pipeline(src, cache, "1MiB", resume=True) as pipe:
        assert [p.name for p in pipe] == ["item001", "item002", "item003"]
        assert (pipe.stats().items_reused, pipe.stats().bytes_downloaded) == (3, 0)


def test_a_journal_of_a_later_version_is_refused_not_rebuilt(tmp_path):
    """A later cachepipe that changes the journal incompatibly writes ``V 2`` first. Before, this
    version took the line for damage: it rebuilt the state from the files, rewrote the journal
    (the later version's position and versions lost) and started the resumed pass over."""
    src = _local_source(tmp_path / "src", 3)
    cache = tmp_path / "cache"
    with Pipeline(src, cache, "1MiB", keep_on_close=True, resume=True, auto_ack=False, prefetch=3) as pipe:
        for _ in range(3):  # each on disk when the pipeline closes (a download under way then is not kept)
            assert pipe.get(timeout=30) is not None
    journal = cache / ".cachepipe" / "journal"
    later = b"V 2\n" + journal.read_bytes() + b"X 0 item000\n"  # an event this version does not know
    journal.write_bytes(later)
    with pytest.raises(ConfigError, match=rf"{journal}: written by a later cachepipe \(journal version 2; this one reads 1\)"):
        Pipeline(src, cache, "1MiB", resume=True).open()
    assert journal.read_bytes() == later
    assert sorted(p.name for p in cache.iterdir()) == [".cachepipe", "item000", "item001", "item002"]
    with pytest.raises(ConfigError, match="later cachepipe"):  # the lock was released: refused again, not locked
        Pipeline(src, cache, "1MiB").open()


def test_a_node_state_of_another_version_is_refused(tmp_path):
    """A node-mode state names its version (a later cachepipe that changes what a position means
    bumps it); this one refuses another before it asks the daemon for the lane. Before, the state
    named none and any was resumed (here: a wait for a daemon that is not there, then its error)."""
    from cachepipe.torch import CachePipeDataset

    saved = {  # a node state as this version writes it (test_node_torch: state_dict() mid-pass), from a later one
        "version": 2,
        "job": "train",
        "rank": 0,
        "worker": 0,
        "epoch": 0,
        "index": 4,
        "catalog_digest": "0" * 32,
        "plan": {"world_size": 1, "num_workers": 1, "shuffle": False, "seed": 0, "balance": "bytes"},
        "end_epoch": None,
    }
    dataset = CachePipeDataset("s3://data/video/", node=str(tmp_path / "no-daemon.sock"), job="train", rank=0, world_size=1)
    dataset.load_state_dict(saved)
    refused = r"state of lane 0\.0 was saved by another cachepipe \(state version 2; this one reads 1\)"
    with pytest.raises(ValueError, match=refused):
        next(iter(dataset))


def test_a_manifest_of_a_later_version_is_named_so_not_corrupt(tmp_path):
    """A fleet upgraded node by node: rank 0's later cachepipe writes the manifest, a node not yet
    upgraded reads it. Before, it was 'corrupt or truncated', which sent the user looking for
    damage and told them to write it again (the later version would write it again the same)."""
    src = _local_source(tmp_path / "src", 2)
    path = tmp_path / "m.json.gz"
    index(src, path)
    header, *items = gzip.decompress(path.read_bytes()).decode().splitlines(keepends=True)
    path.write_bytes(gzip.compress((json.dumps({**json.loads(header), "version": 2}) + "\n" + "".join(items)).encode()))
    with pytest.raises(ConfigError, match=r"written by a later cachepipe \(catalog version 2; this one reads 1\)") as refused:
        Pipeline(src, tmp_path / "cache", "1MiB", manifest=path).open()
    assert "corrupt" not in str(refused.value) and str(path) in str(refused.value)


@pytest.mark.parametrize("job", ["train", None])  # named, or derived from the spec (which equal_steps changed)
def test_a_node_state_saved_before_equal_steps_is_not_resumed_under_pad(tmp_path, job):
    """A node-mode state as cachepipe wrote it before equal_steps existed (2026-11-25, 7fe8a14:
    no end_epoch, no plan): its job planned every rank's share without padding. Since
    2026-11-29 a dataset over several ranks plans with equal_steps='pad' unless told otherwise,
    which deals other items to each lane. Before, a named job's lane resumed that position in
    the padded plan (some items read twice, some never), and a derived job name (a digest of a
    spec that now holds equal_steps) refused it as 'another job', though the settings were the
    same. Now refused naming equal_steps and the fix."""
    from cachepipe.torch import CachePipeDataset

    name = job or "torch-a5ea6bb87ae2"  # 7fe8a14's derived name for this dataset
    saved = {"job": name, "rank": 0, "worker": 0, "epoch": 0, "index": 5, "catalog_digest": "3ef65ac9fd8b235c966bd5dba6ffd795"}
    dataset = CachePipeDataset("s3://data/video/", node=str(tmp_path / "no-daemon.sock"), job=job, rank=0, world_size=2)
    dataset.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"before equal_steps.*equal_steps='pad'.*pass equal_steps=None to resume it"):
        next(iter(dataset))


def test_a_map_marker_of_a_later_format_is_refused_not_taken_for_done(tmp_path):
    """A later cachepipe that changes the completion marker so that this one would misread it
    writes ``{"format": N`` first. Before, this version found neither version nor command in
    its head, which is how it reads an earlier cachepipe's marker: done, for any input and
    command, so the item was skipped."""
    from cachepipe.map import map_items
    from cachepipe.map.uploader import DONE_MARKER

    src, dst = _local_source(tmp_path / "src", 2), tmp_path / "dst"
    (dst / "item000").mkdir(parents=True)
    later = {"format": 2, "version": "0123456789abcdef", "item": "item000", "bytes": 0, "finished": 0.0, "files": {}}
    (dst / "item000" / DONE_MARKER).write_text(json.dumps(later, indent=0))
    marker = f"{dst}/item000/{DONE_MARKER}"
    with pytest.raises(ConfigError, match=rf"{marker}: written by a later cachepipe \(marker format 2; this one reads 1\)"):
        map_items(["true"], src, str(dst), cache_dir=tmp_path / "cache", capacity="1MiB", progress=False)
    assert not (dst / "item001").exists()  # refused before anything ran
