"""Review of s57's store changes (fork safety; a multipart upload whose completion failed but
whose object is there counted done): defects shown by the tests marked ``xfail`` (strict: each
fails on the code as it is, and passes once its defect is fixed), and behaviour checked sound."""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import threading

import pytest
from waiting import in_a_fork, wait_until

from cachepipe.errors import StoreClosedError, is_transient
from cachepipe.stores import open_store
from cachepipe.stores.fsspec import FsspecStore

MIB = 1024 * 1024
PART = 5 * MIB  # the least part size S3 takes


def _uploads(s3_client) -> list[str]:
    """The keys of the multipart uploads under way in the bucket ``data``."""
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket="data").get("Uploads", [])]


def _complete(head: str) -> bool:
    return head.startswith("POST ") and "uploadId=" in head.split("\r\n", maxsplit=1)[0]


def _abort(head: str) -> bool:
    return head.startswith("DELETE ") and "uploadId=" in head.split("\r\n", maxsplit=1)[0]


@pytest.fixture(params=["s3", "obs"])
def uploads(request, s3_client, fault_proxy, tmp_path):
    """(store on ``data/out/`` through the fault proxy, s3fs's or the OBS SDK's, parts of 5 MiB;
    the proxy; an 11 MiB file: 3 parts)."""
    if request.param == "obs":
        pytest.importorskip("obs")
    s3_client.create_bucket(Bucket="data")
    proxy, endpoint = fault_proxy
    if request.param == "s3":
        retries = {"retries": {"max_attempts": 1, "mode": "standard"}}
        store = open_store("s3://data/out/", {"endpoint_url": endpoint, "key": "k", "secret": "s", "config_kwargs": retries})
    else:
        store = open_store("obs://data/out/", {"server": endpoint, "access_key_id": "k", "secret_access_key": "s"})
    store.upload_part_size = PART
    local = tmp_path / "out.bin"
    local.write_bytes(os.urandom(2 * PART + MIB))
    try:
        yield store, proxy, local
    finally:
        store.close()


@pytest.mark.xfail(
    strict=True,
    reason="defect: a completion that failed over an identical older object is counted done and its upload never aborted",
)
def test_a_failed_completion_over_an_identical_object_leaves_no_upload_behind(uploads, s3_client):
    """The same output uploaded again (an item of ``cachepipe map`` done again after an attempt
    killed before its marker, or after its command changed; a versioned bucket; two writers of
    one output): its completion refused for good (403, every time), and the object of the first
    upload at the key, of the same size and, made of the same bytes in the same parts, of the
    same ETag. The check after the failed completion takes that object for this upload's, counts
    the upload done, and sends no abort: the upload is still there, its 11 MiB of parts billed
    and listed by no listing, and nothing says so (no warning, no error)."""
    store, proxy, local = uploads
    store.put(local, "big.bin")  # the first upload, completed
    first = s3_client.head_object(Bucket="data", Key="out/big.bin")["ETag"]
    done = threading.Event()
    done.set()
    proxy.hold(_complete, done, answer="403")  # the second upload's completion, refused
    store.put(local, "big.bin")  # counted done: no error
    assert s3_client.head_object(Bucket="data", Key="out/big.bin")["ETag"] == first  # the first upload's object
    heads = [h.split("\r\n", maxsplit=1)[0] for h in proxy.requests]
    assert _uploads(s3_client) == [], f"left, no abort sent: {[h for h in heads if _abort(h)]}"


@pytest.mark.xfail(
    strict=True,
    reason="defect: a completion answered NoSuchUpload whose object cannot be checked fails the output for good (not found)",
)
@pytest.mark.parametrize("uploads", ["s3"], indirect=True)  # OBS's SDK does not retry: its lost answer is transient already
def test_a_completion_answered_no_such_upload_is_a_transient_failure_when_it_cannot_be_checked(uploads, s3_client):
    """A completion answered NoSuchUpload (what some S3 stores answer to a completion that s3fs
    retried after the first completed the object but lost its answer; or the upload aborted by a
    lifecycle rule), and the check after it (a HEAD) unanswered: its answer lost each time
    (s3fs's tries used up; the endpoint flaky, as when the completion's answer was lost). The
    upload raises FileNotFoundError "not
    found ... s3://data/out/big.bin (NoSuchUpload ...)", an error for good, of an output that is
    being written: ``cachepipe map`` fails the item and does not retry it, though uploading it
    again would do (and the object may be there). Expected: a transient error."""
    store, proxy, local = uploads
    done = threading.Event()
    done.set()
    proxy.hold(_complete, done, answer="NoSuchUpload")
    proxy.hold(lambda head: head.startswith("HEAD "), done, answer="lost", keep=True)
    store.fs.retries = 1  # s3fs's tries of the HEAD (5: ~1.9 s of back-off, the same outcome)
    with pytest.raises(OSError, match=r"s3://data/out/big\.bin") as raised:
        store.put(local, "big.bin")
    assert is_transient(raised.value), f"{type(raised.value).__name__}: {raised.value}"


def _once(match):
    """``match`` for the first request it accepts only."""
    taken: list[str] = []

    def first(head: str) -> bool:
        if taken or not match(head):
            return False
        taken.append(head)
        return True

    return first


def _read(store, key: str) -> bytes:
    out = io.BytesIO()
    store.get(key, out, 0, 1 << 20)
    return out.getvalue()


def test_a_fork_amid_the_parents_get_and_upload_leaves_each_process_its_own(s3_client, fault_proxy, tmp_path):
    """Sound: a process forked while a thread of its parent waits on a GET of the direct path (its
    connection in flight) and another on an upload (s3fs's, in the parent's event loop) reads,
    lists and uploads through the parent's store object with connections of its own, and so does
    a process it forks in turn (a grandchild: the parents' filesystems it keeps are two); the
    parent's GET and upload, let go after the forks, end as they would have."""
    s3_client.create_bucket(Bucket="data")
    s3_client.put_object(Bucket="data", Key="in/a", Body=b"A" * 1000)
    proxy, endpoint = fault_proxy
    store = FsspecStore("s3://data/in/", {"endpoint_url": endpoint, "key": "k", "secret": "s", "skip_instance_cache": True})
    assert store.direct
    local = tmp_path / "up"
    local.write_bytes(b"up")
    gate = threading.Event()
    proxy.hold(_once(lambda h: h.startswith("GET /data/in/a ")), gate)
    proxy.hold(_once(lambda h: h.startswith("PUT /data/in/parent ")), gate, keep=True)
    got: list[object] = []
    threads = [
        threading.Thread(target=lambda: got.append(_read(store, "a"))),
        threading.Thread(target=lambda: got.append(store.put(local, "parent"))),
    ]

    def grandchild() -> None:
        assert _read(store, "a") == b"A" * 1000
        store.put(local, "grandchild")

    def child() -> None:
        assert _read(store, "a") == b"A" * 1000
        store.put(local, "child")
        faulthandler.cancel_dump_traceback_later()  # in_a_fork's, of this process: its thread is not in a fork of it
        assert in_a_fork(grandchild) == 0
        assert store.exists("grandchild")
        assert [o.key for o in store.list()] == ["a", "child", "grandchild"]

    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: len([h for h in proxy.requests if h.startswith(("GET /data/in/a ", "PUT /data/in/parent "))]) == 2)
        assert in_a_fork(child) == 0
    finally:
        gate.set()
        for thread in threads:
            thread.join()
    try:
        assert sorted(got, key=repr) == [None, b"A" * 1000]  # the upload, the GET
        assert [o.key for o in store.list()] == ["a", "child", "grandchild", "parent"]
        assert _read(store, "a") == b"A" * 1000
    finally:
        store.close()


@pytest.mark.parametrize("uploads", ["obs"], indirect=True)  # abort cuts no upload of the fsspec backend (its docstring)
def test_an_obs_completion_cut_by_abort_raises_store_closed(uploads, s3_client, caplog):
    """Sound: an OBS store aborted (its pipeline or map closing) while its upload's completion
    waits for an answer: the completion is cut, and the check that follows it (a HEAD) is
    refused, not sent; the upload raises StoreClosedError (a closing owner reports no failure
    for it), not the HEAD's error, and is not counted done."""
    store, proxy, local = uploads
    gate = threading.Event()
    proxy.hold(_complete, gate)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            store.put(local, "big.bin")
        except BaseException as exc:  # noqa: BLE001 - the test checks it
            raised.append(exc)

    uploading = threading.Thread(target=run)
    with caplog.at_level(logging.INFO, "cachepipe"):
        uploading.start()
        try:
            wait_until(lambda: any(_complete(h) for h in proxy.requests), what="the completion, held")
            store.abort()
            uploading.join(20)
        finally:
            gate.set()
            uploading.join()
    assert len(raised) == 1 and isinstance(raised[0], StoreClosedError), raised
    heads = [h.split("\r\n", maxsplit=1)[0] for h in proxy.requests]
    assert not [h for h in heads if h.startswith("HEAD ")], heads  # the check refused, not sent
    assert not [r for r in caplog.records if "the upload is done" in r.getMessage()]
