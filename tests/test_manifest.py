"""A source listed once into a manifest; pipelines plan from it without listing (issue #17, item 1)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from mounts import mounted

from cachepipe import ConfigError, EmptySourceError, Pipeline
from cachepipe.catalog import Catalog
from cachepipe.cli import main
from cachepipe.manifest import index, read_manifest, write_manifest
from cachepipe.stores.base import ObjectInfo


def _dataset(root: Path, names: list[str]) -> str:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "a.txt").write_text(f"{name} a")
        (root / name / "b.bin").write_bytes(name.encode() * 3)
    return root.as_uri() + "/"


def _names(pipe: Pipeline) -> list[str]:
    return [item.name for item in pipe]


def test_index_to_a_local_file_writes_header_and_items(tmp_path):
    source = _dataset(tmp_path / "src", ["s0", "s1", "s2"])
    dest = tmp_path / "m" / "manifest.gz"
    dest.parent.mkdir()
    manifest = index(source, dest)
    with gzip.open(dest, "rt", encoding="utf-8") as fh:
        header = json.loads(fh.readline())
        lines = [json.loads(line) for line in fh]
    assert header["version"] == 1
    assert header["source"] == source and header["items"] == "folders" and header["count"] == 3
    assert header["digest"] == manifest.digest and len(header["digest"]) == 32
    assert header["listed_at"].endswith("Z")
    assert [line[0] for line in lines] == ["s0", "s1", "s2"]
    assert lines[0][1][0][:2] == ["a.txt", 4]
    again = read_manifest(dest)
    assert again.digest == manifest.digest and again.count == 3 and again.source == source


def test_two_listings_of_the_same_data_have_the_same_digest_and_a_change_gives_another(tmp_path):
    source = _dataset(tmp_path / "src", ["s0", "s1"])
    first = index(source, tmp_path / "one.gz")
    second = index(source, tmp_path / "two.gz")
    assert first.digest == second.digest
    (tmp_path / "src" / "s1" / "b.bin").write_bytes(b"other size")
    assert index(source, tmp_path / "three.gz").digest != first.digest


def test_digest_covers_names_rels_sizes_and_etags():
    def digest(*objects: ObjectInfo) -> str:
        return Catalog.from_listing(objects).digest()

    base = digest(ObjectInfo("a/x", 1, "e1"), ObjectInfo("b/y", 2, None))
    assert base == digest(ObjectInfo("a/x", 1, "e1"), ObjectInfo("b/y", 2, None))
    assert base != digest(ObjectInfo("a/z", 1, "e1"), ObjectInfo("b/y", 2, None))  # rel
    assert base != digest(ObjectInfo("a/x", 1, "e1"), ObjectInfo("c/y", 2, None))  # name
    assert base != digest(ObjectInfo("a/x", 3, "e1"), ObjectInfo("b/y", 2, None))  # size
    assert base != digest(ObjectInfo("a/x", 1, "e2"), ObjectInfo("b/y", 2, None))  # etag


def test_index_to_s3_and_a_pipeline_with_it_does_not_list(s3_client, s3_options, tmp_path):
    s3_client.create_bucket(Bucket="data")
    for name in ("s0", "s1", "s2"):
        s3_client.put_object(Bucket="data", Key=f"set/{name}/a.txt", Body=name.encode())
    manifest = index("s3://data/set/", "s3://data/manifests/set.gz", storage_options=s3_options)
    assert manifest.count == 3
    head = s3_client.head_object(Bucket="data", Key="manifests/set.gz")
    assert head["ContentLength"] > 0
    # an object added after the listing: a pipeline that listed would deliver it
    s3_client.put_object(Bucket="data", Key="set/s3/a.txt", Body=b"late")
    with Pipeline(
        "s3://data/set/", tmp_path / "c", "1MiB", storage_options=s3_options, manifest="s3://data/manifests/set.gz"
    ) as pipe:
        assert _names(pipe) == ["s0", "s1", "s2"]
    with Pipeline("s3://data/set/", tmp_path / "d", "1MiB", storage_options=s3_options) as pipe:
        assert _names(pipe) == ["s0", "s1", "s2", "s3"]


def test_pipeline_with_a_local_manifest_delivers_the_indexed_items_only(tmp_path):
    source = _dataset(tmp_path / "src", ["s0", "s1"])
    index(source, tmp_path / "m.gz")
    _dataset(tmp_path / "src", ["s2"])
    with Pipeline(source, tmp_path / "c", "1MiB", manifest=tmp_path / "m.gz", shuffle=True, epochs=2) as pipe:
        names = _names(pipe)
    assert sorted(names) == ["s0", "s0", "s1", "s1"]


def test_manifest_of_another_source_or_mode_is_refused_naming_both(tmp_path):
    source = _dataset(tmp_path / "src", ["s0"])
    other = _dataset(tmp_path / "other", ["t0"])
    index(source, tmp_path / "m.gz")
    with pytest.raises(ConfigError, match="manifest") as exc:
        Pipeline(other, tmp_path / "c", "1MiB", manifest=str(tmp_path / "m.gz")).open()
    assert source in str(exc.value) and other in str(exc.value)
    with pytest.raises(ConfigError, match=r"items='folders'.*items='files'"):
        Pipeline(source, tmp_path / "c", "1MiB", items="files", manifest=str(tmp_path / "m.gz")).open()


@pytest.mark.parametrize("damage", ["truncate", "alter", "garbage"])
def test_corrupt_or_truncated_manifest_is_refused(tmp_path, damage):
    source = _dataset(tmp_path / "src", ["s0", "s1", "s2"])
    path = tmp_path / "m.gz"
    index(source, path)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "alter":  # a well-formed gzip whose content no longer matches the header's digest
        lines = gzip.decompress(path.read_bytes()).decode().splitlines()
        lines[2] = lines[2].replace("s1", "s9")
        path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    else:
        path.write_bytes(b"not a manifest at all")
    with pytest.raises(ConfigError, match="corrupt or truncated"):
        Pipeline(source, tmp_path / "c", "1MiB", manifest=path).open()


def test_missing_manifest_is_file_not_found_saying_how_to_write_it(tmp_path):
    source = _dataset(tmp_path / "src", ["s0"])
    with pytest.raises(FileNotFoundError, match=r"manifest '.*none.gz': no such file; write it with `cachepipe index SRC -o "):
        Pipeline(source, tmp_path / "c", "1MiB", manifest=tmp_path / "none.gz").open()


def test_empty_manifest_option_is_refused(tmp_path):
    with pytest.raises(ValueError, match="manifest ''"):
        Pipeline(str(tmp_path), tmp_path / "c", "1MiB", manifest="")


def test_state_dict_records_the_catalog_digest_and_load_refuses_another(tmp_path):
    source = _dataset(tmp_path / "src", ["s0", "s1", "s2"])
    first = index(source, tmp_path / "one.gz")
    with Pipeline(source, tmp_path / "c", "1MiB", manifest=tmp_path / "one.gz", auto_ack=False) as pipe:
        item = pipe.get()
        assert item is not None
        pipe.ack(item)
        state = pipe.state_dict()
    assert state["catalog_digest"] == first.digest
    # same sizes, other names: the plan's own checks (n_items, sizes_digest) would accept it
    (tmp_path / "src" / "s2").rename(tmp_path / "src" / "s3")
    second = index(source, tmp_path / "two.gz")
    assert second.digest != first.digest
    pipe = Pipeline(source, tmp_path / "d", "1MiB", manifest=tmp_path / "two.gz")
    pipe.load_state_dict(state)
    with pytest.raises(ConfigError, match=f"catalog_digest='{first.digest}'.*{second.digest}"):
        pipe.open()
    (tmp_path / "src" / "s3").rename(tmp_path / "src" / "s2")
    resumed = Pipeline(source, tmp_path / "e", "1MiB", manifest=tmp_path / "one.gz")
    resumed.load_state_dict(state)
    with resumed:
        assert _names(resumed) == ["s1", "s2"]


def test_listed_pipeline_state_dict_has_the_same_digest_as_the_manifest(tmp_path):
    source = _dataset(tmp_path / "src", ["s0", "s1"])
    manifest = index(source, tmp_path / "m.gz")
    with Pipeline(source, tmp_path / "c", "1MiB", shuffle=True) as pipe:
        assert pipe.state_dict()["catalog_digest"] == manifest.digest


def test_resume_from_the_journal_refuses_another_manifest(tmp_path):
    source = _dataset(tmp_path / "src", ["s0", "s1"])
    index(source, tmp_path / "one.gz")
    with Pipeline(source, tmp_path / "c", "1MiB", manifest=tmp_path / "one.gz", resume=True, keep_on_close=True) as pipe:
        assert pipe.get() is not None
    (tmp_path / "src" / "s1").rename(tmp_path / "src" / "s2")
    index(source, tmp_path / "two.gz")
    with pytest.raises(ConfigError, match="catalog_digest"):
        Pipeline(source, tmp_path / "c", "1MiB", manifest=tmp_path / "two.gz", resume=True).open()


def test_write_manifest_to_a_store_that_cannot_be_written_is_an_error_naming_it(tmp_path):
    catalog = Catalog.from_listing([ObjectInfo("a/x", 1)])
    with pytest.raises(ConfigError, match="manifest 's3://'"):
        write_manifest("s3://", "memory://x/", "folders", catalog)


def test_cli_index_exit_codes(tmp_path, s3_client, s3_options, capsys):
    source = _dataset(tmp_path / "src", ["s0", "s1"])
    assert main(["index", source, "-o", str(tmp_path / "m.gz")]) == 0
    out = capsys.readouterr().out
    assert "2 folders" in out and read_manifest(tmp_path / "m.gz").digest in out
    # nothing to list
    (tmp_path / "empty").mkdir()
    assert main(["index", (tmp_path / "empty").as_uri(), "-o", str(tmp_path / "e.gz")]) == 1
    assert "no items" in capsys.readouterr().err
    assert not (tmp_path / "e.gz").exists()
    # to s3, with storage options
    s3_client.create_bucket(Bucket="out")
    opts = [f"--dest-option={k}={v}" for k, v in s3_options.items()]
    assert main(["index", source, "-o", "s3://out/m.gz", "--items", "files", *opts]) == 0
    capsys.readouterr()
    assert read_manifest("s3://out/m.gz", s3_options).items == "files"
    # a destination bucket that does not exist
    assert main(["index", source, "-o", "s3://nobucket/m.gz", *opts]) == 1
    assert "nobucket" in capsys.readouterr().err
    # a local manifest in a folder that does not exist: said naming the folder (it named the temporary file)
    assert main(["index", source, "-o", str(tmp_path / "nowhere" / "m.gz")]) == 1
    assert f"manifest '{tmp_path}/nowhere/m.gz': no such folder '{tmp_path}/nowhere'" in capsys.readouterr().err
    # -o is required: a usage error
    with pytest.raises(SystemExit) as exc:
        main(["index", source])
    assert exc.value.code == 2


def test_torch_dataset_passes_the_manifest_through(tmp_path):
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    from cachepipe.torch import CachePipeDataset

    source = _dataset(tmp_path / "src", ["s0", "s1"])
    index(source, tmp_path / "m.gz")
    _dataset(tmp_path / "src", ["s2"])
    ds = CachePipeDataset(source, tmp_path / "c", "1MiB", manifest=str(tmp_path / "m.gz"), rank=0, world_size=1)
    assert [p.name for p in torch.utils.data.DataLoader(ds, batch_size=None)] == ["s0", "s1"]


def test_daemon_config_accepts_a_manifest(tmp_path):
    from cachepipe.service.config import ServiceConfig

    cfg = ServiceConfig.model_validate(
        {
            "pipelines": {
                "train": {"source": "s3://b/p/", "cache_dir": str(tmp_path / "c"), "capacity": "1GiB", "manifest": "s3://b/m.gz"}
            }
        }
    )
    assert cfg.pipelines["train"].manifest == "s3://b/m.gz"


def test_cli_index_of_an_empty_source_says_why_as_a_pipeline_does(tmp_path, s3_source, capsys):
    # `cachepipe index` said only "found no folders with objects", where Pipeline.open() says
    # whether the prefix lists nothing or only objects outside folders.
    options = [f"--storage-option={k}={v}" for k, v in s3_source.options.items()]

    def said() -> tuple[str, str, str]:
        assert main(["index", s3_source.url, "-o", str(tmp_path / "m.gz"), *options]) == 1
        cli = capsys.readouterr().err.strip().removeprefix("cachepipe index: ")
        messages = []
        for shuffle in (False, True):  # a listing that streams, and one listed whole first
            with pytest.raises(EmptySourceError) as raised:
                Pipeline(s3_source.url, tmp_path / "c", "10MiB", storage_options=s3_source.options, shuffle=shuffle).open()
            messages.append(str(raised.value))
        return cli, *messages

    nothing = said()
    assert nothing[0].endswith(
        "with objects: the source lists no objects; check the bucket and the prefix (keys are case-sensitive)"
    )
    assert nothing[0] == nothing[1] == nothing[2]
    for name in ("shard-000.tar", "shard-001.tar"):
        s3_source.put(name, b"x" * 100)
    loose = said()
    assert "the 2 objects it lists lie directly under it, none in a folder; items='folders'" in loose[0]
    assert loose[0] == loose[1] == loose[2]
    assert not (tmp_path / "m.gz").exists()


@pytest.fixture
def second_timestamps(tmp_path):
    """A small real ext4 with 128-byte inodes, whose file times have a granularity of 1 s (as
    ext3's, HFS+'s, or FAT's 2 s), loop-mounted at tmp_path / "disk" (root only, as CI runs)."""
    image, disk = tmp_path / "disk.img", tmp_path / "disk"
    image.write_bytes(b"")
    os.truncate(image, 8 << 20)
    with mounted(disk, ["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], ["mount", "-o", "loop", str(image), str(disk)]):
        yield disk


def test_a_manifest_copied_over_a_held_one_within_a_second_is_read_again(second_timestamps):
    # The held read of a file was found by (device, inode, size, mtime, ctime): a manifest of
    # another source copied over it (cp: the same inode) in the same second, at the same size,
    # kept all five, so a pipeline of that source got the held one and was refused ("lists
    # source .../x"), and one of the same source would have planned from the old catalog.
    import os
    import shutil

    disk = second_timestamps
    for src in ("x", "y"):
        for name in ("s0", "s1"):
            (disk / src / name).mkdir(parents=True)
            (disk / src / name / "a.txt").write_text(f"{src} {name}")
    index((disk / "x").as_uri(), disk / "x.gz")
    listed = index((disk / "y").as_uri(), disk / "y.gz").catalog
    # the same size as x's: y's written at another listed_at until it is (60 tries missed once: 227 against 225 bytes)
    for second in range(3600):
        if os.path.getsize(disk / "x.gz") == os.path.getsize(disk / "y.gz"):
            break
        at = f"2026-01-01T00:{second // 60:02d}:{second % 60:02d}Z"
        write_manifest(disk / "y.gz", (disk / "y").as_uri(), "folders", listed, listed_at=at)
    assert os.path.getsize(disk / "x.gz") == os.path.getsize(disk / "y.gz")
    for _ in range(5):  # until both copies land in one second (the first try, but at a second's edge)
        shutil.copyfile(disk / "x.gz", disk / "m.gz")
        held = read_manifest(disk / "m.gz")  # as a DataLoader's dataset holds it
        before = os.stat(disk / "m.gz")
        shutil.copyfile(disk / "y.gz", disk / "m.gz")
        after = os.stat(disk / "m.gz")
        keys = ("st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
        if all(getattr(before, k) == getattr(after, k) for k in keys):
            break
    else:
        pytest.fail("no copy landed in the same second as the one before it")
    assert held.source == (disk / "x").as_uri()
    assert read_manifest(disk / "m.gz").source == (disk / "y").as_uri()
    with Pipeline((disk / "y").as_uri(), disk / "c", "1MiB", manifest=disk / "m.gz") as pipe:
        assert {item.name: (item / "a.txt").read_text() for item in pipe} == {"s0": "y s0", "s1": "y s1"}
