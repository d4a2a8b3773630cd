"""The store contract, one set of tests for every backend: s3 (s3fs) and obs (OBS SDK) against the
moto server, local files, fsspec memory."""

from __future__ import annotations

import io

import pytest

from cachepipe.stores import open_store


@pytest.fixture
def store(source):
    s = open_store(source.url, source.options)
    yield s
    s.close()


def test_lists_every_object_recursively_in_key_order_relative_to_the_root(source, store):
    bodies = {"b/2.bin": b"22", "a/x/1.bin": b"1", "a/0.bin": b"", "c d/ü.txt": b"uu"}
    for key, body in bodies.items():
        source.put(key, body)
    listed = list(store.list())
    assert [o.key for o in listed] == sorted(bodies)
    assert {o.key: o.size for o in listed} == {k: len(v) for k, v in bodies.items()}


def test_ranged_get_streams_exactly_the_range(source, store):
    body = bytes(range(256)) * 40
    source.put("f/obj", body)
    for start, end in [(0, len(body)), (100, 2000), (len(body) - 7, len(body))]:
        out = io.BytesIO()
        assert store.get("f/obj", out, start, end) == end - start
        assert out.getvalue() == body[start:end]


def test_missing_key_is_file_not_found_naming_it(source, store):
    source.put("f/present", b"x")
    with pytest.raises(FileNotFoundError, match="absent"):
        store.get("f/absent", io.BytesIO(), 0, 1)


def test_missing_bucket_is_file_not_found(remote_source):
    url = remote_source.url.replace("//data/", "//no-such-bucket/")
    s = open_store(url, remote_source.options)
    try:
        with pytest.raises(FileNotFoundError, match="no-such-bucket"):
            list(s.list())
    finally:
        s.close()


def test_s3_gets_take_the_direct_path_unless_an_option_needs_the_sdk(s3_source):
    """Plain s3fs options use presigned GETs over plain HTTP (the fault tests run through it);
    options the direct path would not apply keep every request in s3fs."""
    from cachepipe.stores.fsspec import FsspecStore

    s3_source.put("a/f", b"0123456789")
    plain = FsspecStore(s3_source.url, s3_source.options)
    assert plain._direct is not None
    for extra in (
        {"client_kwargs": {"endpoint_url": s3_source.options["endpoint_url"], "verify": False}},
        {"requester_pays": True},
        {"s3_additional_kwargs": {"SSECustomerKey": "k"}},
    ):
        store = FsspecStore(s3_source.url, {**s3_source.options, **extra, "skip_instance_cache": True})
        assert store._direct is None, extra
    import io

    buf = io.BytesIO()
    assert plain.get("a/f", buf, 2, 7) == 5 and buf.getvalue() == b"23456"
    plain.close()
