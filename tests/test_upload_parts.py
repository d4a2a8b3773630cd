"""Multipart uploads to S3 (``cachepipe map``'s outputs, :meth:`FsspecStore.put`): one that fails
is aborted after its parts in flight have ended, an abort that fails is told and does not hide
the upload's own error, one whose completion failed but completed the object is done, and an
upload holds a bounded number of parts in memory."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import subprocess
import sys
import threading

import pytest
from faultproxy import once
from waiting import wait_until

from cachepipe.errors import StoreClosedError, is_transient
from cachepipe.stores import open_store

MIB = 1024 * 1024
PART = 5 * MIB  # the least part size S3 takes


def _uploads(s3_client) -> list[str]:
    """The keys of the multipart uploads under way in the bucket ``data`` (started, neither completed nor aborted)."""
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket="data").get("Uploads", [])]


def _part(number: int):
    return lambda head: head.startswith("PUT ") and re.search(f"[?&]partNumber={number}[& ]", head.split("\r\n")[0]) is not None


def _abort(head: str) -> bool:
    return head.startswith("DELETE ") and "uploadId=" in head.split("\r\n", maxsplit=1)[0]


@pytest.fixture(params=["s3", "obs"])
def through_proxy(request, s3_client, fault_proxy, tmp_path):
    """(store on ``data/out/`` through the fault proxy, s3fs's (s3://) or the OBS SDK's (obs://),
    its parts of 5 MiB; the proxy; an 11 MiB file: parts of 5, 5 and 1 MiB)."""
    if request.param == "obs":
        pytest.importorskip("obs")
    s3_client.create_bucket(Bucket="data")
    proxy, endpoint = fault_proxy
    if request.param == "s3":
        retries = {"retries": {"max_attempts": 1, "mode": "standard"}}  # one botocore attempt per s3fs attempt
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


def test_a_refused_part_is_the_error_raised_when_the_abort_fails_too(through_proxy, s3_client, caplog):
    """A part refused (403) and then the abort of the upload refused too (503 after the client's
    retries). On S3 (s3fs) the abort's error was raised in place of the upload's, a store
    "unavailable" (a transient error, retried by ``cachepipe map``) where the destination had
    refused the upload for good; on OBS the abort's failure passed in silence. Neither named the
    upload left behind (billed, unseen by a listing). Now the refusal is raised and the abort's
    failure logged, naming the upload and the lifecycle rule that removes it."""
    store, proxy, local = through_proxy
    done = threading.Event()
    done.set()
    proxy.hold(_part(2), done, answer="403")
    proxy.hold(_abort, done, answer="503", keep=True)
    with (
        caplog.at_level(logging.WARNING, "cachepipe"),
        pytest.raises(PermissionError, match=r"access denied to (s3|obs)://data/out/big\.bin"),
    ):
        store.put(local, "big.bin")
    assert _uploads(s3_client) == ["out/big.bin"]  # the abort failed: it is still there
    [record] = [r for r in caplog.records if "multipart upload" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert "://data/out/big.bin" in record.getMessage() and "AbortIncompleteMultipartUpload" in record.getMessage()


def test_a_refused_part_leaves_no_upload_and_no_part_is_sent_after_the_abort(through_proxy, s3_client):
    """A part refused for good (403) while the others are in flight: the upload is aborted, and
    its other parts are not sent on after the abort (S3 may keep a part that arrives as its
    upload is aborted, billed until a second abort). s3fs aborted at once and let the other
    parts run on, and retry, after the put had raised."""
    store, proxy, local = through_proxy
    done = threading.Event()
    done.set()
    proxy.hold(_part(2), done, answer="403")
    with pytest.raises(PermissionError, match="access denied"):
        store.put(local, "big.bin")
    assert _uploads(s3_client) == []
    # requests only: the bytes of a body that hold a blank line are a "head" to the proxy too, and
    # those of a part cancelled as the abort is sent can reach it after the abort's head
    heads = [line for h in proxy.requests if re.fullmatch(r"[A-Z]+ \S+ HTTP/1\.1", line := h.split("\r\n")[0])]
    aborts = [i for i, h in enumerate(heads) if _abort(h)]
    assert len(aborts) == 1 and aborts[0] == len(heads) - 1, heads  # the abort is the upload's last request


MEASURE = """
import json, os, sys, tracemalloc
from cachepipe.stores import open_store
local, endpoint = sys.argv[1], sys.argv[2]
store = open_store("s3://data/out/", {"endpoint_url": endpoint, "key": "k", "secret": "s"})
store.upload_part_size = int(sys.argv[3])
store.check_bucket()  # botocore's client and S3 model (10 MiB) made before the count begins
tracemalloc.start()
store.put(local, "big.bin")
print(json.dumps(tracemalloc.get_traced_memory()[1]))
store.close()
"""


def test_an_upload_holds_a_few_parts_in_memory_not_ten(s3_client, s3_endpoint, tmp_path):
    """s3fs read ten parts of an upload into memory at once (its ``max_concurrency``), twice over
    while they were sent: 335 MiB for an output of 200 MiB at the default 16 MiB parts, for each
    of the ``--upload-concurrency`` files in flight. Now an upload holds at most
    :data:`~cachepipe.stores.fsspec.PARTS_IN_FLIGHT` parts. Measured in a process of its own
    (tracemalloc's peak), apart from the moto server: 12 parts of 5 MiB (about twice
    ``PARTS_IN_FLIGHT`` parts now: aiohttp copies each part it sends; 104 MiB before)."""
    from cachepipe.stores.fsspec import PARTS_IN_FLIGHT

    s3_client.create_bucket(Bucket="data")
    local = tmp_path / "out.mp4"
    with local.open("wb") as out:
        for _ in range(12):
            out.write(os.urandom(PART))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-c", MEASURE, str(local), s3_endpoint, str(PART)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    peak = json.loads(proc.stdout)
    head = s3_client.head_object(Bucket="data", Key="out/big.bin")
    assert head["ContentLength"] == 12 * PART and head["ETag"].strip('"').endswith("-12")
    assert head["ContentType"] == "video/mp4"  # s3fs's guess by the local file's name, as before
    assert peak < (2 * PARTS_IN_FLIGHT + 2) * PART, f"{peak / MIB:.1f} MiB"


def test_an_output_over_the_largest_single_put_is_uploaded_in_parts_whatever_the_part_size(s3_client, s3_endpoint, tmp_path):
    """An output under twice ``--upload-part-size`` went to s3fs's ``put_file`` as one PutObject,
    but s3fs makes a multipart upload of its own from 5 GiB (S3's largest PutObject): with a part
    size over 2.5 GiB, an output of 5 GiB and more was uploaded by s3fs's multipart (the abort's
    error in place of the upload's, parts sent on after it). It goes through cachepipe's. Shown
    at a smaller scale, the 5 GiB limit (``stores.base.MAX_PUT``, a constant) lowered to 6 MiB:
    a 7 MiB output in parts of 5 MiB is two parts."""
    from cachepipe.stores import base

    s3_client.create_bucket(Bucket="data")
    local = tmp_path / "out.bin"
    local.write_bytes(os.urandom(7 * MIB))
    store = open_store("s3://data/out/", {"endpoint_url": s3_endpoint, "key": "k", "secret": "s"})
    store.upload_part_size = PART
    try:
        base.MAX_PUT, limit = 6 * MIB, base.MAX_PUT
        try:
            store.put(local, "big.bin")
        finally:
            base.MAX_PUT = limit
    finally:
        store.close()
    head = s3_client.head_object(Bucket="data", Key="out/big.bin")
    assert head["ContentLength"] == 7 * MIB and head["ETag"].strip('"').endswith("-2"), head["ETag"]


@pytest.mark.parametrize("size", [64 * 1024, 0])
def test_a_refused_connection_leaves_no_task_traceback(s3_client, fault_proxy, tmp_path, caplog, size):
    """Connections to the store refused (closed as they open), then the upload gets through. s3fs
    sent its PutObject with ``Expect: 100-continue`` (botocore adds it to every upload), and aiohttp
    (3.14.5) writes such a request's head from a task of its own (an empty body's head too, at the
    body's end): when the connection was already closing, that task failed, its error reached no
    one (the request failed on the lost connection and was retried), and asyncio printed "Task
    exception was never retrieved" and a traceback on stderr, without cachepipe's prefix: for 17
    of 20 refused connections measured with 64 KiB, 12 of 12 with an empty output. Now an upload
    goes without the header, and an empty one without a body: no such task fails, no traceback."""
    s3_client.create_bucket(Bucket="data")
    proxy, endpoint = fault_proxy
    store = open_store("s3://data/out/", {"endpoint_url": endpoint, "key": "k", "secret": "s"})
    local = tmp_path / "out.bin"
    local.write_bytes(os.urandom(size))
    try:
        with caplog.at_level(logging.ERROR, "asyncio"):
            proxy.inject("refuse", 4)  # at about 5 in 6 a traceback each, before
            store.put(local, "small.bin")
            gc.collect()  # the failed task is reported as it is freed
    finally:
        store.close()
    assert proxy.injected["refuse"] == 4
    assert s3_client.get_object(Bucket="data", Key="out/small.bin")["Body"].read() == local.read_bytes()
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_an_upload_to_a_store_that_stops_answering_times_out(tmp_path):
    """A store that takes an upload's request and never answers. botocore's ``Expect:
    100-continue`` had aiohttp wait for a "100 Continue" before it sent the body, and its read
    timeout starts once the body is sent: the upload waited with no bound (still waiting after 40 s
    with a read timeout of 2 s, measured). Without the header the body goes at once, and the read
    timeout ends the request."""
    from faultproxy import silent

    local = tmp_path / "out.bin"
    local.write_bytes(os.urandom(4096))
    raised: list[BaseException] = []
    uploading: threading.Thread | None = None
    store = None
    try:
        with silent() as (endpoint, asked):
            retries = {"read_timeout": 1, "retries": {"max_attempts": 1, "mode": "standard"}}
            options = {"endpoint_url": endpoint, "key": "k", "secret": "s", "config_kwargs": retries, "skip_instance_cache": True}
            store = open_store("s3://data/out/", options)
            store.fs.retries = 1  # s3fs's own retries (5), each a read timeout

            def run() -> None:
                try:
                    store.put(local, "small.bin")
                except BaseException as exc:  # noqa: BLE001 - the test checks it
                    raised.append(exc)

            uploading = threading.Thread(target=run)
            uploading.start()
            wait_until(asked.is_set, what="the upload's request")
            wait_until(lambda: not uploading.is_alive(), timeout=30, what="the upload to time out")
    finally:
        if uploading is not None:
            uploading.join()  # if the fix failed: the connections the block ended end the upload too
        if store is not None:
            store.close()
    assert len(raised) == 1 and isinstance(raised[0], TimeoutError), raised


def _complete(head: str) -> bool:
    return head.startswith("POST ") and "uploadId=" in head.split("\r\n", maxsplit=1)[0]


def test_a_completion_whose_answer_was_lost_counts_as_done(through_proxy, s3_client, caplog):
    """The answer to CompleteMultipartUpload lost (the connection closed once the store had
    completed the object), and the completion retried answered NoSuchUpload, as some S3 stores
    answer it (moto answers it with the object). On S3, s3fs retried the completion, and its
    NoSuchUpload was raised: a FileNotFoundError, an error for good, which failed ``cachepipe
    map``'s item; on OBS (the SDK does not retry: ``max_retry_count=0``) the lost answer was
    raised, a transient error, and ``cachepipe map`` uploaded the whole output again. Both tried to
    abort the upload, answered NoSuchUpload, and warned that its parts stayed in the bucket. Now a
    failed completion is checked (one HEAD): the object there with the size sent and the ETag of the
    parts sent is the upload done, and no warning. Its abort is sent all the same, last, and answered
    NoSuchUpload (see the test of an identical older object, below)."""
    store, proxy, local = through_proxy
    done = threading.Event()
    done.set()
    proxy.hold(once(_complete), done, answer="lost")
    proxy.hold(_complete, done, answer="NoSuchUpload", keep=True)  # a completion retried (S3: s3fs's)
    with caplog.at_level(logging.INFO, "cachepipe"):
        store.put(local, "big.bin")
    assert s3_client.get_object(Bucket="data", Key="out/big.bin")["Body"].read() == local.read_bytes()
    assert _uploads(s3_client) == []
    said = [r for r in caplog.records if "multipart upload" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and "the upload is done" in said[0].getMessage(), said
    heads = [h.split("\r\n", maxsplit=1)[0] for h in proxy.requests]
    assert [h for h in heads if _abort(h)] == heads[-1:], heads


def test_a_refused_completion_over_an_object_of_the_same_size_is_a_failure(through_proxy, s3_client):
    """The completion refused for good (403), and an older object of the same size at the key: the
    check after the failed completion finds it, but not with the ETag of the parts sent, so the
    upload failed: aborted, and the refusal raised."""
    store, proxy, local = through_proxy
    older = os.urandom(local.stat().st_size)
    s3_client.put_object(Bucket="data", Key="out/big.bin", Body=older)
    done = threading.Event()
    done.set()
    proxy.hold(_complete, done, answer="403")
    with pytest.raises(PermissionError, match="access denied"):
        store.put(local, "big.bin")
    assert _uploads(s3_client) == []  # aborted
    assert s3_client.get_object(Bucket="data", Key="out/big.bin")["Body"].read() == older


def test_the_etag_of_a_multipart_upload_is_told_from_its_parts_etags():
    """:func:`~cachepipe.stores.base.multipart_etag` and the decision it serves, against the ETag
    S3's own formula gives (the MD5 of the parts' binary MD5s, and their count)."""
    import hashlib

    from cachepipe.stores.base import completed_anyway, multipart_etag

    parts = [b"a" * 10, b"b" * 10, b"c" * 3]
    etags = [f'"{hashlib.md5(p).hexdigest()}"' for p in parts]
    expected = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + "-3"
    assert multipart_etag(etags) == expected
    assert completed_anyway((23, f'"{expected.upper()}"'), 23, etags)
    assert not completed_anyway((22, f'"{expected}"'), 23, etags)  # another size
    assert not completed_anyway((23, f'"{hashlib.md5(b"".join(parts)).hexdigest()}"'), 23, etags)  # one PutObject's
    assert not completed_anyway(None, 23, etags)  # no object, or it could not be asked
    assert multipart_etag(['"not-an-md5"', etags[1]]) is None  # not an MD5's form: cannot be told
    assert not completed_anyway((23, f'"{expected}"'), 23, ['"not-an-md5"', *etags[1:]])


def putting(store, local, key: str) -> tuple[threading.Thread, list[BaseException]]:
    """A thread, not started, that puts ``local`` as ``key``, and the list its error goes to."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            store.put(local, key)
        except BaseException as exc:  # noqa: BLE001 - the test checks it
            raised.append(exc)

    return threading.Thread(target=run), raised


def test_an_abort_answered_no_such_upload_warns_of_no_parts_left(through_proxy, s3_client, caplog):
    """A completion refused for good (403), and the upload aborted by someone else (a lifecycle
    rule, another process) before cachepipe's abort, which S3 answers NoSuchUpload. The warning
    said "could not be aborted ...: its parts stay in the bucket", though none was left. Now an
    abort answered NoSuchUpload says (at INFO) that the upload is no longer there; the upload's own
    error is raised, as before."""
    store, proxy, local = through_proxy
    done, gate = threading.Event(), threading.Event()
    done.set()
    proxy.hold(_complete, done, answer="403")
    proxy.hold(_abort, gate, keep=True)
    uploading, raised = putting(store, local, "big.bin")
    with caplog.at_level(logging.INFO, "cachepipe"):
        uploading.start()
        try:
            wait_until(lambda: any(_abort(h) for h in proxy.requests), what="cachepipe's abort, held")
            [upload] = s3_client.list_multipart_uploads(Bucket="data")["Uploads"]
            s3_client.abort_multipart_upload(Bucket="data", Key=upload["Key"], UploadId=upload["UploadId"])
        finally:
            gate.set()
            uploading.join()
    assert len(raised) == 1 and isinstance(raised[0], PermissionError), raised
    assert _uploads(s3_client) == []
    said = [r for r in caplog.records if "multipart upload" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and "no longer there" in said[0].getMessage(), said


def test_a_failed_completion_over_an_identical_object_leaves_no_upload_behind(through_proxy, s3_client, caplog):
    """The same output uploaded again (an item of ``cachepipe map`` done again after an attempt
    killed before its marker, or after its command changed; two writers of one output): its
    completion refused for good (403, every time), and the object of the first upload at the key,
    of the same size and, made of the same bytes in the same parts, of the same ETag. The check
    after the failed completion took that object for this upload's and counted the upload done,
    with no abort: the upload stayed, its 11 MiB of parts billed and listed by no listing, and
    nothing said so (h-review, s57). Now the upload is aborted all the same, and the log says the
    object kept is an older one of the same bytes."""
    store, proxy, local = through_proxy
    store.put(local, "big.bin")  # the first upload, completed
    first = s3_client.head_object(Bucket="data", Key="out/big.bin")["ETag"]
    done = threading.Event()
    done.set()
    proxy.hold(_complete, done, answer="403")  # the second upload's completion, refused
    with caplog.at_level(logging.INFO, "cachepipe"):
        store.put(local, "big.bin")  # counted done: the object there has its bytes
    assert s3_client.head_object(Bucket="data", Key="out/big.bin")["ETag"] == first  # the first upload's object
    heads = [h.split("\r\n", maxsplit=1)[0] for h in proxy.requests]
    assert _uploads(s3_client) == [], f"left, no abort sent: {[h for h in heads if _abort(h)]}"
    said = [r for r in caplog.records if "multipart upload" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and "an older one of the same size and ETag" in said[0].getMessage()


@pytest.mark.parametrize("through_proxy", ["s3"], indirect=True)  # OBS's SDK does not retry: its lost answer is transient already
def test_a_completion_answered_no_such_upload_is_a_transient_failure_when_it_cannot_be_checked(through_proxy, s3_client):
    """A completion answered NoSuchUpload (what some S3 stores answer to a completion that s3fs
    retried after the first completed the object but lost its answer; or the upload aborted by a
    lifecycle rule), and the check after it (a HEAD) unanswered: its answer lost each time
    (s3fs's tries used up; the endpoint flaky, as when the completion's answer was lost). The
    upload raised FileNotFoundError "not found ... s3://data/out/big.bin (NoSuchUpload ...)", an
    error for good: ``cachepipe map`` failed the item, though uploading it again would do (h-review,
    s57). Now a transient error, which says so."""
    store, proxy, local = through_proxy
    done = threading.Event()
    done.set()
    proxy.hold(_complete, done, answer="NoSuchUpload")
    proxy.hold(lambda head: head.startswith("HEAD "), done, answer="lost", keep=True)
    store.fs.retries = 1  # s3fs's tries of the HEAD (5: ~1.9 s of back-off, the same outcome)
    with pytest.raises(OSError, match=r"s3://data/out/big\.bin") as raised:
        store.put(local, "big.bin")
    assert is_transient(raised.value), f"{type(raised.value).__name__}: {raised.value}"
    assert "upload it again" in str(raised.value)


@pytest.mark.parametrize("through_proxy", ["obs"], indirect=True)  # abort cuts no upload of the fsspec backend (its docstring)
def test_an_obs_completion_cut_by_abort_raises_store_closed(through_proxy, s3_client, caplog):
    """An OBS store aborted (its pipeline or map closing) while its upload's completion
    waits for an answer: the completion is cut, and the check that follows it (a HEAD) is
    refused, not sent; the upload raises StoreClosedError (a closing owner reports no failure
    for it), not the HEAD's error, and is not counted done."""
    store, proxy, local = through_proxy
    gate = threading.Event()
    proxy.hold(_complete, gate)
    uploading, raised = putting(store, local, "big.bin")
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
