"""The daemon as a real subprocess against the moto server: parallel consumers, leases and
re-delivery after kill -9, marker acks, SIGHUP reload, SIGTERM, sd_notify, socket permissions,
unit files, the benchmark's smoke run.

Waiting is always on an event: the daemon's sd_notify messages (READY=1, RELOADING=1,
WATCHDOG=1, read from our own NOTIFY_SOCKET by DaemonProcess), a blocking ``next``, a process
exit; where only the daemon's counters can tell (a marker ack), the status endpoint is polled
with a deadline.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import http.client
import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from removing import remove_tree
from waiting import wait_until

from cachepipe import UnknownItemError
from cachepipe.client import Client, ServiceError
from cachepipe.service.logs import JournalFormatter
from cachepipe.service.markers import acked_by
from cachepipe.service.testing import DaemonExited, DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
KIB = 1024
FILES = {"a.bin": KIB, "b.txt": 10}


def write_config(tmp_path: Path, sock: Path, endpoint: str, pipelines: dict[str, dict], **top) -> Path:
    data = {"socket": str(sock), **top, "pipelines": {}}
    for name, options in pipelines.items():
        data["pipelines"][name] = {
            "source": "s3://data/video/",
            "cache_dir": str(tmp_path / f"cache-{name}"),
            "capacity": "1MiB",
            "storage_options": {"endpoint_url": endpoint},
            **options,
        }
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def stats(client: Client, name: str = "train") -> dict:
    return client.status()["pipelines"][name]["stats"]


def marker_acks(client: Client, kind: str, name: str = "train") -> float:
    """The daemon's count of items of pipeline ``name`` acknowledged by ``kind`` ("marker" or
    "deleted"), from its metrics (0 before the first)."""
    sample = f'cachepipe_marker_acks_total{{kind="{kind}",pipeline="{name}"}} '
    lines = [line for line in client.metrics().splitlines() if line.startswith(sample)]
    return float(lines[0].split()[-1]) if lines else 0.0


CONSUMER = r"""
import json, os, sys
from cachepipe.client import Client
names = []
for item in Client(pipeline="train", socket=sys.argv[1], timeout=60):
    assert sorted(os.listdir(item)) == ["a.bin", "b.txt"], os.listdir(item)
    assert os.path.getsize(item / "a.bin") == 1024
    names.append(item.name)
    if len(names) == 1:
        print(item.name, flush=True)  # holding its first item...
        sys.stdin.readline()  # ... until every consumer holds one
print(json.dumps(names))
"""

HOLDER = r"""
import json, sys
from cachepipe.client import Client
client = Client(pipeline="train", socket=sys.argv[1]).open()
item = client.get(timeout=60)
print(json.dumps(item.to_json()), flush=True)
sys.stdin.read()  # hold the item until killed
"""


def test_parallel_consumers_get_disjoint_items_and_all_of_them(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(30, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CONSUMER, str(sock)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        try:
            held = [proc.stdout.readline().strip() for proc in procs]  # each blocks until it holds an item
            assert len(set(held)) == 4 and all(held), held  # four live leases at once, on four different items
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            results = []
            for proc in procs:
                out, err = proc.communicate(timeout=90)
                assert proc.returncode == 0, err
                results.append(json.loads(out))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()
        everything = [name for names in results for name in names]
        assert sorted(everything) == [f"item{i:03d}" for i in range(30)]  # all of them, none twice
        with Client("train", sock) as client:
            s = stats(client)
            assert s["items_acked"] == 30 and s["items_redelivered"] == 0
        assert not any(p.name.startswith("item") for p in (tmp_path / "cache-train").iterdir())


def test_killed_consumer_item_is_redelivered_after_its_lease(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(5, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {"lease_timeout": 1.5}})
    with DaemonProcess(config):
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(sock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            held = json.loads(holder.stdout.readline())
        finally:
            holder.kill()  # kill -9 in the middle of the item
            holder.wait()
            holder.stdin.close()
            holder.stdout.close()
        with Client("train", sock, auto_ack=False) as client:
            acked, again = [], None
            while (item := client.get(timeout=30)) is not None:  # blocks until the dead lease expires
                if item.name == held["name"] and again is None:
                    again = item  # the dead consumer's item, handed out again: its lease is over for good
                    with pytest.raises(UnknownItemError, match="lease expired"):
                        client.ack(held["path"], lease=held["lease"])  # the dead consumer's late ack: 409
                try:
                    client.ack(item)
                except UnknownItemError:
                    # A stall of the machine longer than the 1.5 s lease between this hand-out
                    # and its ack: the item went back to the queue and comes to us again.
                    continue
                acked.append(item.name)
            assert again is not None and again.lease != held["lease"]
            assert sorted(acked) == [f"item{i:03d}" for i in range(5)]  # nothing lost, none acked twice
            s = stats(client)
            assert s["items_redelivered"] >= 1 and s["items_acked"] == 5  # more than 1 only after a stall
            metric = 'cachepipe_items_redelivered_total{pipeline="train"} '
            lines = [line for line in client.metrics().splitlines() if line.startswith(metric)]
            assert lines == [f"{metric}{float(s['items_redelivered'])}"], lines


def test_done_markers_and_deletions_ack(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(4, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}, "shards": {"items": "files"}})
    with DaemonProcess(config), Client("train", sock, auto_ack=False) as train, Client("shards", sock, auto_ack=False) as shards:
        first = train.get(timeout=30)
        (first / ".done").touch()  # a consumer that does not speak HTTP
        wait_until(lambda: stats(train)["items_acked"] == 1, what="the .done marker to ack")
        assert not first.path.exists()

        second = train.get(timeout=30)
        shutil.rmtree(second)  # deleting the folder acks too
        wait_until(lambda: stats(train)["items_acked"] == 2, what="the deletion to ack")
        with pytest.raises(UnknownItemError):
            train.ack(second)  # already acknowledged by the deletion

        shard = shards.get(timeout=30)  # items: files -> one object, acked by deleting the file
        assert shard.path.is_file() and shard.name == "item000/a.bin"
        shard.path.unlink()
        wait_until(lambda: stats(shards, "shards")["items_acked"] == 1, what="the file deletion to ack")

        # the pipeline counts an ack, then the daemon counts its kind: wait for the daemon's counts too
        kinds = [("marker", "train"), ("deleted", "train"), ("deleted", "shards")]
        wait_until(lambda: all(marker_acks(train, *kind) for kind in kinds), what="the marker acks' metrics")
        assert [marker_acks(train, *kind) for kind in kinds] == [1, 1, 1], train.metrics()


def inotify_watches(pid: int) -> int:
    """How many inotify watches process ``pid`` holds (the kernel's count, /proc/PID/fdinfo)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:  # closed meanwhile
            continue
        count += sum(line.startswith("inotify wd:") for line in text.splitlines())
    return count


def test_the_marker_watch_is_the_cache_directory_and_the_items_handed_out(s3_source, s3_endpoint, tmp_path, short_dir):
    # Downloads into staging, publishes and the evictions of items nobody holds can acknowledge
    # nothing: the daemon watches only the cache directory (an item deleted) and, while they are
    # handed out, the items' folders (a .done made), so those cost it no inotify event.
    s3_source.folders(6, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        wait_until(lambda: stats(client)["items_ready"] == 6, what="every item to be downloaded")
        assert inotify_watches(daemon.pid) == 1  # the cache directory
        first, second = client.get_many(2, timeout=30)
        wait_until(lambda: inotify_watches(daemon.pid) == 3, what="the items' own watches (LOOK_AFTER on)")
        client.ack(first)
        assert inotify_watches(daemon.pid) == 2
        (second / ".done").touch()
        wait_until(lambda: stats(client)["items_acked"] == 2, what="the .done marker to ack")
        wait_until(lambda: inotify_watches(daemon.pid) == 1, what="the acknowledged item's watch to end")


def test_a_client_that_acks_over_the_api_has_its_items_not_watched_for_markers(s3_source, s3_endpoint, tmp_path, short_dir):
    # Client(markers=False): the daemon adds no watch for the items it hands that client (each
    # watch was about half of its work per item), so a .done made in them acknowledges
    # nothing; deleting one still does (the cache directory's watch), and API acks work as ever.
    s3_source.folders(4, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}, "shards": {"items": "files"}})
    with (
        DaemonProcess(config) as daemon,
        Client("train", sock, auto_ack=False, markers=False) as unwatched,
        Client("train", sock, auto_ack=False) as watched,
        Client("shards", sock, auto_ack=False, markers=False) as shards,
    ):
        wait_until(lambda: stats(unwatched)["items_ready"] == 4, what="every item to be downloaded")
        first, second = unwatched.get_many(2, timeout=30)
        assert inotify_watches(daemon.pid) == 2  # the cache directories' alone
        (first / ".done").touch()
        third = watched.get(timeout=30)
        wait_until(lambda: inotify_watches(daemon.pid) == 3, what="the watched item's own watch (LOOK_AFTER on)")
        (third / ".done").touch()  # had first been watched, its event would have come first
        # the ack deletes the item, then counts it: wait for both (a loaded machine read the count between)
        wait_until(lambda: not third.path.exists() and stats(unwatched)["items_acked"] >= 1, what="the marker to ack")
        assert first.path.exists() and stats(unwatched)["items_acked"] == 1  # first's .done was not seen
        shutil.rmtree(second)  # deleting an item acknowledges it whoever took it
        wait_until(lambda: stats(unwatched)["items_acked"] == 2, what="the deletion to ack")
        unwatched.ack(first)
        assert stats(unwatched)["items_acked"] == 3
        shard = shards.get(timeout=30)  # a single-file item in a subfolder: that folder is watched as ever
        assert shard.name == "item000/a.bin"
        wait_until(lambda: inotify_watches(daemon.pid) == 3, what="the shard's subfolder watch")
        shard.path.unlink()
        wait_until(lambda: stats(shards, "shards")["items_acked"] == 1, what="the file deletion to ack")
    with pytest.raises(TypeError, match=r"markers 'no': expected True \(a \.done acknowledges an item\) or False"):
        Client("train", sock, markers="no")  # type: ignore[arg-type]


def test_an_item_handed_out_again_after_its_lease_expired_is_watched_as_its_new_consumer_asks(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    # Nothing ends a hand-out whose lease expired but the item's next hand-out: the watch (or its
    # absence) must follow the new consumer's choice, not the old one's.
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {"lease_timeout": 1}})
    with (
        DaemonProcess(config) as daemon,
        Client("train", sock, auto_ack=False, markers=False) as unwatched,
        Client("train", sock, auto_ack=False) as watched,
    ):
        first = unwatched.get(timeout=30)
        assert inotify_watches(daemon.pid) == 1
        again = watched.get(timeout=30)  # the same item, once the first lease expired
        assert again.name == first.name and again.lease != first.lease
        wait_until(lambda: inotify_watches(daemon.pid) == 2, what="its own watch (LOOK_AFTER on)")
        third = unwatched.get(timeout=30)  # and back
        assert third.name == first.name and third.lease != again.lease
        assert inotify_watches(daemon.pid) == 1
        fourth = watched.get(timeout=30)  # and watched again
        assert fourth.name == first.name and fourth.lease != third.lease
        wait_until(lambda: inotify_watches(daemon.pid) == 2, what="its own watch again")
        # The watch works: a .done made in it acknowledges the item. Its 1 s lease can run out
        # (a stall of the machine) before the daemon judges the marker, which is then refused
        # ("ignored" in the log, by the pipeline, as any ack of an expired lease): take the item
        # again, as this consumer, and make a new marker in that hand-out.
        item, ignored = fourth, f"marker of {fourth.path} ignored"
        for _ in range(5):
            before = daemon.log().count(ignored)
            (item.path / "new").write_bytes(b"")
            os.replace(item.path / "new", item.path / ".done")  # a new marker: an event, a new inode
            outcome = wait_until(
                lambda before=before: (
                    ("acked" if stats(watched)["items_acked"] == 1 else None)
                    or ("ignored" if daemon.log().count(ignored) > before else None)
                ),
                what=f"the daemon to judge the .done made in {item.name}",
            )
            if outcome == "acked":
                break
            refusal = [line for line in daemon.log().splitlines() if ignored in line][-1]
            assert "its lease expired" in refusal, refusal  # refused for its lease, not for its marker
            item = watched.get(timeout=30)
            assert item.name == first.name
            wait_until(lambda: inotify_watches(daemon.pid) == 2, what="its own watch again (LOOK_AFTER on)")
        else:
            raise AssertionError("every marker came after its hand-out's lease expired")
        assert not fourth.path.exists()


def test_done_file_shipped_in_the_dataset_never_acks_an_item_under_its_lease(
    s3_source, s3_client, s3_endpoint, tmp_path, short_dir
):
    # Issue #18 finding 6: every item ships its own `.done`. That marker is part of the item, not a
    # consumer's ack, even when an event in the item's watched folder makes the daemon judge it:
    # here the consumer writes it again (an event that would ack the item had it not shipped one).
    s3_source.folders(3, {"a.bin": 600 * KIB, ".done": 0})
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        for _ in range(3):
            item = client.get(timeout=30)
            assert ".done" in item.files
            wait_until(lambda: inotify_watches(daemon.pid) == 2, what="the item's own watch (LOOK_AFTER on)")
            (item.path / ".done").write_bytes(b"")  # written (and closed) again; touch() on a file is a utime
            wait_until(lambda: f"marker of {item.path} ignored" in daemon.log(), what=f"the daemon to judge {item.name}'s marker")  # noqa: B023 - called at once, inside this iteration
            assert item.path.exists() and (item.path / ".done").exists(), f"{item.name} vanished under its live lease"
            client.renew(item)  # the lease is live: not acknowledged behind our back
            client.ack(item)
        assert client.get(timeout=30) is None
        s = stats(client)
        assert s["items_acked"] == 3 and s["items_redelivered"] == 0
        assert "cachepipe_marker_acks_total{" not in client.metrics()  # no marker acknowledged anything


@pytest.mark.parametrize("how", ["replaced", "touched"])
def test_a_marker_left_in_a_released_item_does_not_ack_its_next_hand_out(s3_source, s3_endpoint, tmp_path, short_dir, how):
    # The daemon looks for a .done at hand-out only where one can be: not on an item's first
    # hand-out since its download (nobody has had its path), but on every later one. A consumer
    # releases an item and then leaves a .done in it: the next hand-out must not count that
    # marker (an event on it that changes nothing is judged and ignored), and the new consumer's
    # own marker still acknowledges: a new file moved into place, or the left one touched again
    # (Path.touch() of a file that exists changes only its times: an IN_ATTRIB, which the watch
    # did not ask for before, so the item stayed leased and went out again and again).
    s3_source.folders(2, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        item = client.get(timeout=30)
        client.release(item)
        (item.path / ".done").touch()  # made after the release: the item is not handed out, nothing watches it
        again = client.get(timeout=30)  # a released item goes out again first
        assert again.name == item.name and again.lease != item.lease
        wait_until(lambda: inotify_watches(daemon.pid) == 2, what="its own watch (LOOK_AFTER on)")
        with open(again.path / ".done", "ab"):  # opened for writing and closed: an event, the same marker
            pass
        wait_until(lambda: f"marker of {again.path} ignored" in daemon.log(), what="the daemon to judge the old marker")
        assert again.path.exists(), "the marker left before this hand-out acknowledged it"
        client.renew(again)  # still leased to us
        if how == "replaced":
            (again.path / "new").write_bytes(b"")
            os.replace(again.path / "new", again.path / ".done")  # this consumer's own marker
        else:
            (again.path / ".done").touch()  # exists: only its times change
        wait_until(lambda: stats(client)["items_acked"] == 1, what="the new marker to ack")
        assert not again.path.exists()


def raw_request(sock_path: Path, data: bytes, timeout: float = 10.0) -> tuple[int, dict]:
    """Send ``data`` as is on a new connection; (status, JSON body) of the answer."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(str(sock_path))
        conn.sendall(data)
        response = http.client.HTTPResponse(conn)
        response.begin()
        body = response.read()
        return response.status, json.loads(body) if body else {}
    finally:
        conn.close()


def post(sock_path: Path, route: str, body: bytes) -> tuple[int, dict]:
    """POST ``body`` (sent as is) to ``route`` on a new connection; (status, JSON body)."""
    return raw_request(
        sock_path, b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (route.encode(), len(body), body)
    )


def test_slow_clients_are_cut_off_and_do_not_lock_out_a_consumer(s3_source, s3_endpoint, tmp_path, short_dir):
    # Issue #18 finding 7: 16 connections that announce a body of 100 bytes and send one held
    # every slot (max_clients: 16) for as long as they liked.
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}}, max_clients=16, header_timeout=1, body_timeout=1)
    slow = []
    with DaemonProcess(config) as daemon:
        try:
            for i in range(20):
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.settimeout(10)  # a bound on the test's own waits, not a timed assertion
                conn.connect(str(sock))
                head = (
                    b"POST /v1/ack HTTP/1.1\r\nHost: x\r\n"
                    if i % 2
                    else b"POST /v1/ack HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
                )
                conn.sendall(head)  # odd ones never end their headers, even ones never send their body
                slow.append(conn)
            with Client("train", sock, auto_ack=False) as client:
                item = client.get(timeout=30)  # served at once: a slow connection made room
                assert item.name == "item000"
                client.ack(item)
            answers = []
            for conn in slow:  # each one ends: made room for another, or cut off at its deadline with 408
                chunks = []
                while chunk := conn.recv(65536):
                    chunks.append(chunk)
                answers.append(b"".join(chunks))
            timed_out = [a for a in answers if a]
            assert timed_out and all(a.startswith(b"HTTP/1.1 408 ") for a in timed_out), answers
            assert b"not received within" in timed_out[0]
            assert "not received within header_timeout" in daemon.log() or "not received within body_timeout" in daemon.log()
        finally:
            for conn in slow:
                conn.close()


def test_malformed_requests_are_400_with_the_reason(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config):
        nested = b"[" * 100_000 + b"]" * 100_000
        status, body = post(sock, "/v1/ack", nested)
        assert status == 400 and body["error"] == "bad_request" and "nested too deeply" in body["message"], body
        for lengths in ((b"2", b"2"), (b"2", b"5")):
            head = b"".join(b"Content-Length: %s\r\n" % n for n in lengths)
            status, body = raw_request(sock, b"POST /v1/pipelines/train/next HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
            assert status == 400 and "Content-Length given 2 times" in body["message"], body
        status, body = raw_request(sock, b"POST /v1/pipelines/train/next HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}")
        assert status == 400 and body["message"] == "Content-Length '+2': expected a number of bytes", body
        status, body = raw_request(
            sock, b'POST /v1/pipelines/train/next HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\n\r\n{"markers": "no"}'
        )
        assert status == 400 and body["message"].startswith("'markers' 'no': expected true (the default"), body
        status, body = raw_request(
            sock, b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 60_000 + b"\r\nX-Big2: " + b"a" * 60_000 + b"\r\n\r\n"
        )
        assert status == 431 and "over 65536 bytes" in body["message"], body
        with Client("train", sock) as client:
            assert [i.name for i in client] == ["item000"]  # nothing was taken by the refused requests


def test_sighup_reload_applies_a_valid_config_and_keeps_the_old_one_on_errors(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(3, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        held = client.get(timeout=30)
        write_config(tmp_path, sock, s3_endpoint, {"train": {"capacity": "2MiB"}, "val": {}}, log_level="debug")
        daemon.reload()
        status = client.status()
        assert set(status["pipelines"]) == {"train", "val"}
        assert status["pipelines"]["train"]["stats"]["capacity"] == 2 * 1024**2
        with (
            Client(None, sock) as unnamed,
            pytest.raises(ValueError, match=r"val: name one \(Client\(pipeline=NAME\); cachepipe next --pipeline NAME\)"),
        ):
            unnamed.get(timeout=1)  # it said "pass pipeline=NAME" to the CLI too
        client.ack(held)  # a capacity change applies live: the lease survived it
        held = client.get(timeout=30)
        write_config(tmp_path, sock, s3_endpoint, {"train": {"capacity": "2MiB", "ordered": False}, "val": {}}, log_level="debug")
        daemon.reload()
        with pytest.raises(UnknownItemError, match="rebuilt by a reload"):
            client.ack(held)  # any other change rebuilds the pipeline, which ends the leases of the old one
        assert client.get(timeout=30).name == held.name  # ... and delivers the item again

        write_config(tmp_path, sock, s3_endpoint, {"train": {"capacity": "10X", "ordered": False}})
        ready = daemon.reload()
        assert "reload failed" in ready
        assert "pipelines.train.capacity = '10X'" in daemon.log()
        status = client.status()
        assert set(status["pipelines"]) == {"train", "val"} and status["pipelines"]["train"]["stats"]["capacity"] == 2 * 1024**2
        assert client.health()["status"] == "ok"
        assert 'cachepipe_reloads_total{result="invalid"} 1.0' in client.metrics()


def test_a_reload_the_host_cannot_apply_keeps_the_daemon_and_its_configuration(s3_source, s3_endpoint, tmp_path, short_dir):
    """A reload whose socket_group does not exist (start would refuse it: exit 78, never
    restarted by systemd), or whose socket permissions cannot be applied (the socket file
    removed), is logged and the daemon serves on: before, either ended it with a traceback."""
    s3_source.folders(2, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        held = client.get(timeout=30)
        write_config(tmp_path, sock, s3_endpoint, {"train": {}}, socket_group="cachepipe-no-such-group")
        assert "reload failed" in daemon.reload()
        assert "socket_group 'cachepipe-no-such-group': no such group on this system" in daemon.log()
        write_config(tmp_path, sock, s3_endpoint, {"train": {}}, tcp_port=0, tcp_host="127.0.0..1")  # getaddrinfo: UnicodeError
        assert "reload failed" in daemon.reload()
        assert "tcp_host '127.0.0..1': not a host name or address" in daemon.log()
        client.ack(held)  # nothing was rebuilt: the lease is still good
        held = client.get(timeout=30)

        sock.unlink()  # our connection stays; new ones cannot come (a mistake of an operator)
        write_config(tmp_path, sock, s3_endpoint, {"train": {}}, socket_mode="0600")
        daemon.reload()
        assert "reload: socket permissions not applied" in daemon.log()
        client.ack(held)
        assert client.status()["pipelines"]["train"]["stats"]["items_acked"] == 2
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.log(), daemon.log()


def test_a_cache_directory_removed_under_the_daemon_takes_its_pipeline_down_until_a_reload(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    """``rm -rf`` of a pipeline's cache directory: before, the daemon handed out paths that no
    longer existed, then every download failed on staging and ``next`` timed out, while health
    said ok. Now the pipeline is down, health and ``next`` say why (503), the rest of the daemon
    serves on, and a reload starts the pipeline over in a fresh directory."""
    s3_source.folders(3, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}, "val": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        client.get(timeout=30)
        remove_tree(tmp_path / "cache-train")  # run again while the daemon's downloads make it fail
        health = client.health()
        assert health["status"] == "degraded" and health["pipelines"]["val"] == "open"
        assert health["pipelines"]["train"].startswith("down: CacheRemovedError: ")
        assert "cache-train was removed while the pipeline was open" in health["pipelines"]["train"]
        with pytest.raises(ServiceError, match="pipeline 'train' is down: CacheRemovedError"):
            client.get(timeout=5)
        with Client("val", sock) as val:
            assert val.get(timeout=30) is not None
        daemon.reload()
        assert client.health()["status"] == "ok"
        again = sorted(client.get(timeout=30).name for _ in range(3))  # a new pass: the journal went with the directory
        assert again == ["item000", "item001", "item002"]
        assert daemon.stop() == 0
        assert "Traceback" not in daemon.log(), daemon.log()


def test_an_item_deleted_after_the_downloads_found_the_cache_removed_is_not_acknowledged_with_a_traceback(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    """The deletion of a handed-out item is its acknowledgement (markers on). Once the downloads
    have found the cache's state folder gone, an ack raises CacheRemovedError, and one by a
    deletion raised it in the marker thread, which logged a traceback (seen once in the suite, as
    the test above). It is ignored now: the periodic check of the cache directories takes the
    pipeline down, as it does for a removal no item shows."""
    s3_source.folders(3, {"a.bin": 400 * KIB})  # two fit in the cache, the third waits for room
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}}, status_interval=3600)
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        first, second = client.get(timeout=30), client.get(timeout=30)
        remove_tree(tmp_path / "cache-train" / ".cachepipe")
        remove_tree(first.path)  # acknowledged: the third item's download finds the state folder gone
        wait_until(lambda: "downloads stopped: " in daemon.log(), 30, "the downloads to stop")
        remove_tree(second.path)  # acknowledged too, after that
        time.sleep(1)  # the deletion's event is judged; nothing checks the cache directory meanwhile
        assert "Traceback" not in daemon.log(), daemon.log()
        health = client.health()["pipelines"]["train"]
        assert health.startswith("down: CacheRemovedError"), health
        assert daemon.stop() == 0


def test_the_temporary_sockets_of_daemons_killed_while_starting_are_removed(s3_source, s3_endpoint, tmp_path, short_dir):
    """A daemon listens under ``.<socket>.<pid>.starting`` until it is ready; one killed before
    left it behind, and each later daemon removed only its own pid's (they piled up)."""
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is no process's now
    leftovers = {pid: short_dir / f".api.sock.{pid}.starting" for pid in (gone.pid, os.getpid())}
    for path in leftovers.values():
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))  # a socket file nobody listens on, as a killed daemon leaves
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon:
        assert not leftovers[gone.pid].exists()
        assert leftovers[os.getpid()].exists()  # a live process's (a daemon starting beside it): kept
        assert daemon.stop() == 0
    leftovers[os.getpid()].unlink()


def test_an_item_taken_over_tcp_by_a_consumer_killed_while_it_waited_is_released_at_once(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    """Over TCP the reply to a consumer that is gone is written without an error (the peer's
    reset comes later): the daemon looks for its end of file before it hands the item out."""
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}}, tcp_port=0)
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        port = re.search(r"http://127\.0\.0\.1:(\d+)", daemon.log()).group(1)
        held = client.get(timeout=30)
        waiting = subprocess.Popen(
            [sys.executable, "-m", "cachepipe.cli", "next", "--socket", f"http://127.0.0.1:{port}", "--timeout", "60"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: client.status()["pipelines"]["train"]["waiting"] == 1, what="the consumer to wait in next")
        waiting.kill()
        waiting.wait()
        client.release(held)  # the item is ready again: the gone consumer's request takes it
        wait_until(lambda: "consumer went away before receiving" in daemon.log(), what="the release to be logged")
        assert client.get(timeout=10).name == held.name  # not leased to nobody until lease_timeout
        assert daemon.stop() == 0


def test_sigterm_exits_0_quickly_and_leaves_published_items(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(4, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    cache = tmp_path / "cache-train"
    with DaemonProcess(config) as daemon:
        with Client("train", sock, auto_ack=False) as client:
            held = client.get(timeout=30)
            wait_until(lambda: stats(client)["items_ready"] == 3, what="every item to be downloaded")
            client.ack(client.get(timeout=30))
            client.get(timeout=30), client.get(timeout=30)  # everything is leased now
            waiting = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cachepipe.cli",
                    "next",
                    "--socket",
                    str(sock),
                    "--timeout",
                    "60",
                    "--startup-timeout",
                    "0",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            wait_until(lambda: client.status()["pipelines"]["train"]["waiting"] == 1, what="the consumer to wait in next")
        start = time.monotonic()
        assert daemon.stop(timeout=15) == 0
        assert time.monotonic() - start < 10
        assert "STOPPING=1" in daemon.wait_for("STOPPING=1")
        _out, err = waiting.communicate(timeout=30)  # the consumer waiting in `next` is let go at once
        assert waiting.returncode == 1 and "shutting down" in err, err
        assert not sock.exists()
        left = sorted(p.name for p in cache.iterdir() if p.name.startswith("item"))
        assert held.name in left and len(left) == 3  # published and handed-out items stay; the acked one is gone
    with DaemonProcess(config), Client("train", sock, auto_ack=False) as client:
        assert stats(client)["items_listed"] == 4  # listed before READY=1
        names = []
        while (item := client.get(timeout=30)) is not None:
            names.append(item.name)
            client.ack(item)
        assert sorted(names) == sorted(left)  # resumed: the acked item is not delivered again
        # each is counted as the planner finds it on disk, which READY=1 does not wait for (the
        # count read at once was 0 with the planner's thread a second late): by now, every one
        assert stats(client)["items_reused"] == len(left)


def test_an_ack_of_a_lease_from_before_a_restart_does_not_evict_the_item_handed_out_again(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    """A restarted daemon (resume) hands the unacknowledged items out again in the same order:
    their leases had the same ids as before (each daemon counted from 1), so a consumer still
    working on its item from before the restart acked it, and evicted the item another consumer
    had just been given."""
    s3_source.folders(2, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as first:
        before = first.get(timeout=30)
        assert daemon.stop() == 0
    with DaemonProcess(config), Client("train", sock, auto_ack=False) as second:
        again = second.get(timeout=30)
        assert again.name == before.name
        with pytest.raises(UnknownItemError, match="another lease"):
            second.ack(before)  # the first consumer's ack, sent to the new daemon
        assert again.path.exists()
        second.ack(again)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH (keeping the working directory off the path) is 3.11+")
def test_the_daemon_process_runs_the_cachepipe_its_caller_imported(s3_source, s3_endpoint, tmp_path, short_dir, monkeypatch):
    # A benchmark of another checkout, run from this one's folder, must measure that checkout's
    # daemon: `python -m` puts the working directory first on the path, ahead of PYTHONPATH.
    impostor = tmp_path / "elsewhere" / "cachepipe"
    impostor.mkdir(parents=True)
    (impostor / "__init__.py").write_text("")
    (impostor / "cli.py").write_text("raise SystemExit(97)\n")
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    monkeypatch.chdir(impostor.parent)
    with DaemonProcess(config), Client("train", sock) as client:
        assert client.get(timeout=30) is not None


def test_sd_notify_ready_status_and_watchdog(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(2, FILES)
    config = write_config(tmp_path, short_dir / "api.sock", s3_endpoint, {"train": {}}, status_interval=0.2)
    daemon = DaemonProcess(config, env={"WATCHDOG_USEC": "400000"})  # WatchdogSec=0.4s: a beat every 0.2 s
    with daemon:
        ready = daemon.messages[0]
        assert ready.startswith("READY=1\nSTATUS=train: ") and "cached" in ready
        # the status first: it is sent once, when it changes, and may come before the second beat
        # (a wait for the beats first passed over it); the beats go on
        daemon.wait_for("STATUS=train: 2 ready", timeout=20)  # updated as the downloads finish
        daemon.wait_for("WATCHDOG=1", timeout=10)
        daemon.wait_for("WATCHDOG=1", timeout=10)
        assert daemon.stop() == 0
        daemon.wait_for("STOPPING=1")


def test_an_unread_notify_socket_does_not_stop_the_daemon_from_stopping(s3_source, s3_endpoint, tmp_path, short_dir):
    """A supervisor that sets NOTIFY_SOCKET and stops reading it (here: nobody reads between
    start and stop) fills the socket's queue (net.unix.max_dgram_qlen, often 10 datagrams):
    the daemon drops its messages, warns once, and still stops on SIGTERM. It used to block in
    send() for good, its main loop with it (seen as a 30 s stop timeout in a long benchmark)."""
    s3_source.folders(1, FILES)
    config = write_config(tmp_path, short_dir / "api.sock", s3_endpoint, {"train": {}})
    daemon = DaemonProcess(config, env={"WATCHDOG_USEC": "20000"})  # a heartbeat every 10 ms
    with daemon:
        # heartbeats unread until the queue is full and one could not be sent (the daemon warns)
        wait_until(lambda: "cannot notify systemd" in daemon.log(), timeout=30, what="the notify socket's queue to fill")
        assert daemon.stop(timeout=20) == 0
        log = daemon.log()
    assert log.count("cannot notify systemd") == 1, log
    assert "stopped" in log


def test_socket_mode_group_and_no_tcp_listener(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    other = next((g for g in grp.getgrall() if g.gr_gid != os.getgid()), None)
    group = other.gr_name if other is not None and os.geteuid() == 0 else None
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}}, socket_group=group)
    with DaemonProcess(config) as daemon:
        st = sock.stat()
        assert oct(st.st_mode & 0o777) == oct(0o660)
        if group is not None:
            assert st.st_gid == other.gr_gid
        assert listening_tcp_ports(daemon.pid) == []
        with Client("train", sock) as client:
            assert client.health() == {"status": "ok", "pipelines": {"train": "open"}}


def test_tcp_listener_when_configured_is_on_loopback(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(2, FILES)
    config = write_config(tmp_path, short_dir / "api.sock", s3_endpoint, {"train": {}}, tcp_port=0)
    with DaemonProcess(config) as daemon:
        ports = listening_tcp_ports(daemon.pid)
        assert len(ports) == 1 and ports[0][0] == "127.0.0.1"
        names = [item.name for item in Client("train", f"http://127.0.0.1:{ports[0][1]}", timeout=30)]
        assert names == ["item000", "item001"]


def test_a_second_daemon_on_the_same_socket_is_refused(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config):
        other = tmp_path / "other"
        other.mkdir()
        second = write_config(other, sock, s3_endpoint, {"train": {}})
        with pytest.raises(DaemonExited, match="in use: another cachepipe daemon"):
            DaemonProcess(second).start()
        assert sock.exists()  # the first daemon's socket is untouched


def listening_tcp_ports(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state that process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as fh:
            next(fh)
            for line in fh:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:
                    addr, port = local.split(":")
                    host = ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)) if table == "tcp" else addr
                    found.append((host, int(port, 16)))
    return found


# ---- pieces without a daemon --------------------------------------------------------------
def test_marker_policy():
    root = "/cache"
    assert acked_by(root, "/cache/item1/.done", "created", False, "folders") == ("/cache/item1", "marker")
    assert acked_by(root, "/cache/item1", "deleted", True, "folders") == ("/cache/item1", "deleted")
    assert acked_by("/cache/", "/cache/item1", "deleted", True, "folders") == ("/cache/item1", "deleted")
    assert acked_by(root, "/cache/item1/sub/.done", "created", False, "folders") is None
    assert acked_by(root, "/cache/item1/a.bin", "deleted", False, "folders") is None
    assert acked_by(root, "/cache/.cachepipe/staging/3/.done", "created", False, "folders") is None
    assert acked_by(root, "/cache/.cachepipe", "deleted", True, "folders") is None
    assert acked_by(root, "/elsewhere/item1/.done", "created", False, "folders") is None
    assert acked_by(root, "/cache-2/item1/.done", "created", False, "folders") is None  # a sibling, not under it
    assert acked_by(root, "/cache", "deleted", True, "folders") is None  # the cache directory itself
    assert acked_by(root, "/cache/../item1", "deleted", True, "folders") is None
    assert acked_by(root, "/cache/a/b.tar", "deleted", False, "files") == ("/cache/a/b.tar", "deleted")
    assert acked_by("/", "/item1/.done", "created", False, "folders") == ("/item1", "marker")  # a cache at /
    assert acked_by(root, "/cache/a/b.tar.done", "created", False, "files") is None  # files: deletion only


def test_marker_watcher_sees_what_acknowledges_a_handed_out_item_and_nothing_else(tmp_path):
    # MarkerWatcher alone, on real files: what each watch reports, for both item kinds.
    from cachepipe.service.markers import MarkerWatcher

    got: list[tuple[str, str, str]] = []
    seen = threading.Condition()

    def on_ack(name: str, item: str, how: str, looked: bool) -> None:  # as the daemon: the hand-out ends
        watcher.unfollow(item)
        with seen:
            got.append((name, item, how))
            seen.notify_all()

    def next_ack() -> tuple[str, str, str]:
        with seen:
            assert seen.wait_for(lambda: got, timeout=10), "no acknowledgement within 10 s"
            return got.pop(0)

    folders, files = tmp_path / "folders", tmp_path / "files"
    for name in ("a", "b", "c", "held"):
        (folders / name).mkdir(parents=True)
    (files / "sub").mkdir(parents=True)
    for name in ("top.tar", "sub/x.tar", "sub/y.tar"):
        (files / name).write_bytes(b"x")
    watcher = MarkerWatcher(on_ack)
    watcher.start()
    try:
        watcher.watch("f", folders, "folders")
        watcher.watch("s", files, "files")
        for name in ("a", "b", "c"):
            watcher.follow("f", str(folders / name))
        for name in ("top.tar", "sub/x.tar"):
            watcher.follow("s", str(files / name))

        (folders / "held" / ".done").write_bytes(b"")  # not handed out: no acknowledgement
        shutil.rmtree(folders / "held")
        (files / "sub" / "y.tar").unlink()
        (folders / "a" / "tmp").write_bytes(b"")
        os.rename(folders / "a" / "tmp", folders / "a" / ".done")  # a marker moved into place
        assert next_ack()[1:] == (str(folders / "a"), "marker")  # (its closed tmp file was not a .done)
        os.rename(folders / "b", tmp_path / "b-away")  # moved out of the cache: deleted
        assert next_ack()[1:] == (str(folders / "b"), "deleted")
        (files / "top.tar").unlink()
        assert next_ack() == ("s", str(files / "top.tar"), "deleted")
        (files / "sub" / "x.tar").unlink()
        assert next_ack() == ("s", str(files / "sub" / "x.tar"), "deleted")

        watcher.unfollow(str(folders / "c"))  # its hand-out ended: its marker is not watched any more
        (folders / "c" / ".done").write_bytes(b"")
        watcher.follow("f", str(folders / "a"))
        (folders / "a" / ".done").unlink()
        (folders / "a" / ".done").write_bytes(b"")  # a watched item after an unwatched one's marker
        assert next_ack()[1:] == (str(folders / "a"), "marker")
        with seen:
            assert not got, got
    finally:
        watcher.stop()


def test_an_item_gets_its_own_watch_only_once_held_for_look_after_and_a_marker_made_before_counts(tmp_path, monkeypatch):
    # An item acknowledged soon after its hand-out (a batch acked over the API with the next)
    # costs no watch; one still held LOOK_AFTER seconds on gets it, and whatever acknowledged it
    # in between (a .done made, a single file deleted) is found by a look when it is added, also
    # where the watch cannot be added (a single file's subfolder gone: ENOENT; the cache
    # directory's watch sees only the subfolder go, which acknowledges nothing by itself).
    from cachepipe.service import markers

    monkeypatch.setattr(markers, "LOOK_AFTER", 2.0)  # long: "no watch yet" is asserted within it
    got: list[tuple[str, str, str]] = []
    seen = threading.Condition()

    def on_ack(name: str, item: str, how: str, looked: bool) -> None:
        watcher.unfollow(item)
        with seen:
            got.append((name, item, how))
            seen.notify_all()

    folders, files = tmp_path / "folders", tmp_path / "files"
    for name in ("quick", "held", "early"):
        (folders / name).mkdir(parents=True)
    for sub in ("sub", "gone"):
        (files / sub).mkdir(parents=True)
        (files / sub / "x.tar").write_bytes(b"x")
    watcher = markers.MarkerWatcher(on_ack)
    watcher.start()
    try:
        watcher.watch("f", folders, "folders")
        watcher.watch("s", files, "files")
        assert inotify_watches(os.getpid()) == 2  # the cache directories
        for name in ("quick", "held", "early"):
            watcher.follow("f", str(folders / name))
        watcher.follow("s", str(files / "sub" / "x.tar"))
        watcher.follow("s", str(files / "gone" / "x.tar"))
        watcher.unfollow(str(folders / "quick"))  # acknowledged over the API at once
        (folders / "early" / ".done").write_bytes(b"")  # before any watch of its own
        (files / "sub" / "x.tar").unlink()  # likewise: its subfolder is not watched yet
        shutil.rmtree(files / "gone")
        assert inotify_watches(os.getpid()) == 2  # no item's own watch yet
        with seen:
            assert seen.wait_for(lambda: len(got) == 3, timeout=10), got
            assert sorted(got) == [
                ("f", str(folders / "early"), "marker"),
                ("s", str(files / "gone" / "x.tar"), "deleted"),
                ("s", str(files / "sub" / "x.tar"), "deleted"),
            ]
        wait_until(lambda: inotify_watches(os.getpid()) == 3, what="the held item's own watch")  # "held" only
        (folders / "held" / ".done").write_bytes(b"")  # seen by its watch now
        with seen:
            assert seen.wait_for(lambda: len(got) == 4, timeout=10), got
            assert got[3] == ("f", str(folders / "held"), "marker")
        wait_until(lambda: inotify_watches(os.getpid()) == 2, what="the acknowledged item's watch to end")
    finally:
        watcher.stop()


def test_an_acknowledgement_that_fails_in_a_look_is_logged_and_the_watch_goes_on(tmp_path, monkeypatch, caplog):
    # The daemon's ack can fail (its journal write, on a full disk): the look that found the
    # marker logs it, and later items are still watched and acknowledged.
    from cachepipe.service import markers

    monkeypatch.setattr(markers, "LOOK_AFTER", 0.05)
    got: list[str] = []
    seen = threading.Condition()

    def on_ack(name: str, item: str, how: str, looked: bool) -> None:
        if item.endswith("first"):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        watcher.unfollow(item)
        with seen:
            got.append(item)
            seen.notify_all()

    folders = tmp_path / "folders"
    for name in ("first", "second"):
        (folders / name).mkdir(parents=True)
        (folders / name / ".done").write_bytes(b"")  # before its watch: found by the look
    watcher = markers.MarkerWatcher(on_ack)
    watcher.start()
    try:
        watcher.watch("f", folders, "folders")
        with caplog.at_level("ERROR", logger="cachepipe.service.markers"):
            watcher.follow("f", str(folders / "first"))
            wait_until(lambda: "looking for an acknowledgement of" in caplog.text, what="the failed ack logged")
        watcher.follow("f", str(folders / "second"))
        with seen:
            assert seen.wait_for(lambda: got, timeout=10), "the watch stopped after a failed acknowledgement"
        assert got == [str(folders / "second")]
    finally:
        watcher.stop()


def test_turning_markers_on_by_reload_does_not_count_a_marker_older_than_the_hand_out(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    # Items handed out while markers were off recorded no .done at hand-out: the watches a
    # reload adds for them look for none (one there may be an earlier consumer's); a .done made
    # after the reload acknowledges as ever.
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}}, markers=False)
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        first = client.get(timeout=30)
        client.release(first)
        (first.path / ".done").touch()  # left by the consumer that released it
        again = client.get(timeout=30)
        assert again.name == first.name
        data = yaml.safe_load(config.read_text())
        data["markers"] = True
        config.write_text(yaml.safe_dump(data))
        daemon.reload()
        wait_until(lambda: inotify_watches(daemon.pid) == 2, what="the reload's watches: the cache's and the item's")
        time.sleep(0.6)  # past LOOK_AFTER and a read of the events: nothing may acknowledge it
        assert stats(client)["items_acked"] == 0, "the earlier consumer's .done acknowledged the new hand-out"
        (again.path / "new").write_bytes(b"")
        os.replace(again.path / "new", again.path / ".done")  # this consumer's marker
        wait_until(lambda: stats(client)["items_acked"] == 1, what="the new marker to ack")


def test_a_marker_shipped_in_an_item_is_not_logged_at_each_hand_out(s3_source, s3_endpoint, tmp_path, short_dir):
    # The look when an item's own watch is added finds the dataset's .done in every hand-out
    # held that long: refused as ever, but not an INFO line each time (no consumer made it).
    s3_source.folders(1, {"a.bin": 1024, ".done": 0})
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        item = client.get(timeout=30)
        wait_until(lambda: inotify_watches(daemon.pid) == 2, what="its own watch, and the look")
        time.sleep(0.2)
        assert f"marker of {item.path} ignored" not in daemon.log()
        assert stats(client)["items_acked"] == 0


@pytest.mark.parametrize("fstype", ["ext4", "nfs4"])
def test_the_marker_watch_adds_and_removes_watches_keeping_the_interpreters_lock(tmp_path, monkeypatch, caplog, fstype):
    """The marker watch's watches go through the C functions bound by ``ctypes.PyDLL`` (measured
    in benchmarks/README.md): its removals always, its additions under a cache directory on a
    local file system only (on NFS or FUSE a path lookup can wait for a server); a watch that
    cannot be added still says why (its errno comes through)."""
    import ctypes
    from collections import Counter
    from types import SimpleNamespace

    from cachepipe.service import inotify, markers

    counts: Counter[str] = Counter()
    calls = inotify._calls()
    assert all(call._flags_ & ctypes._FUNCFLAG_PYTHONAPI for call in (calls.held_add, calls.held_rm))  # PyDLL: the lock is kept
    assert not calls.add._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # CDLL: it lets the lock go

    def counted(name, call):
        def counting(*args):
            counts[name] += 1
            return call(*args)

        return counting

    counting = SimpleNamespace(
        init1=calls.init1,
        add=counted("add", calls.add),
        held_add=counted("held add", calls.held_add),
        held_rm=counted("held remove", calls.held_rm),
    )
    monkeypatch.setattr(inotify, "_calls", lambda: counting)
    monkeypatch.setattr(markers, "filesystem_at", lambda _path: fstype)  # as /proc/self/mountinfo would say
    monkeypatch.setattr(markers, "LOOK_AFTER", 0.01)  # an item's own watch is added 10 ms after its hand-out
    watcher = markers.MarkerWatcher(lambda *_: None)
    watcher.start()
    try:
        (tmp_path / "c" / "item").mkdir(parents=True)
        watcher.watch("p", tmp_path / "c", "folders")
        watcher.follow("p", str(tmp_path / "c" / "item"))
        wait_until(lambda: inotify_watches(os.getpid()) == 2, what="the item's own watch")
        watcher.unfollow(str(tmp_path / "c" / "item"))
        local = fstype == "ext4"
        assert counts == Counter({"held add" if local else "add": 2, "held remove": 1})  # the root's, the item's
        (tmp_path / "c" / "sub" / "item").mkdir(parents=True)  # a nested item: its folder may be a link or a mount
        watcher.follow("p", str(tmp_path / "c" / "sub" / "item"), at_once=True)
        assert inotify_watches(os.getpid()) == 2  # the root's, the nested item's
        watcher.unfollow(str(tmp_path / "c" / "sub" / "item"))
        assert counts["held add"] == (2 if local else 0) and counts["add"] == (1 if local else 3)  # the nested item's lets it go
        assert counts["held remove"] == 2
        (tmp_path / "d" / "sub").mkdir(parents=True)  # a single-file item in a subfolder: the same
        (tmp_path / "d" / "sub" / "f").write_bytes(b"")
        watcher.watch("q", tmp_path / "d", "files")
        watcher.follow("q", str(tmp_path / "d" / "sub" / "f"), at_once=True)
        watcher.unfollow(str(tmp_path / "d" / "sub" / "f"))
        watcher.unwatch("q")
        assert counts["held add"] == (3 if local else 0) and counts["add"] == (2 if local else 5)  # d's own watch kept it
        assert counts["held remove"] == 4  # sub's watch with its item, then d's
        (tmp_path / "c" / "a-file").write_bytes(b"")  # handed out as a folder item: its watch fails (ENOTDIR)
        with caplog.at_level("WARNING", logger="cachepipe.service.markers"):
            watcher.follow("p", str(tmp_path / "c" / "a-file"))
            wait_until(lambda: "cannot watch" in caplog.text, what="the failed watch's warning")
        assert "Not a directory" in caplog.text
        watcher.unwatch("p")
        assert str(tmp_path / "c") not in markers._held_under
    finally:
        watcher.stop()


def test_marker_provenance_policy(tmp_path):
    from cachepipe.service.markers import HandOut, HandOuts, marker_counts

    consumer_made = (1, 42, 2_000)
    assert marker_counts(HandOut("L1", shipped=False, before=None), consumer_made)
    assert not marker_counts(None, consumer_made)  # not handed out
    assert not marker_counts(HandOut("L1", shipped=False, before=None), None)  # gone again: a stale event
    assert not marker_counts(HandOut("L1", shipped=True, before=None), consumer_made)  # one of the item's files
    assert not marker_counts(HandOut("L1", shipped=False, before=consumer_made), consumer_made)  # there before the hand-out

    item = tmp_path / "item1"
    item.mkdir()
    (item / ".done").touch()  # left by an earlier consumer (or unpacked with the item)
    handouts, path = HandOuts(), str(item)
    assert handouts.record([(path, "L2", ("a.bin",), True, True)]) == []
    assert handouts.lease_for(path, "marker") == (None, "this .done was there before the item was handed out", None)
    assert handouts.lease_for(path, "deleted") == ("L2", "", None)
    (item / "new").write_bytes(b"")
    os.replace(item / "new", item / ".done")  # this consumer's own marker (a new file, made while the old one existed)
    assert handouts.lease_for(path, "marker") == ("L2", "", None)
    assert handouts.record([(path, "L3", ("a.bin", ".done"), True, False)]) == [path]  # L2 expired: replaced
    assert handouts.lease_for(path, "marker")[0] is None
    assert handouts.forget([(path, "L2")]) == []  # an older lease: the current hand-out stays
    assert len(handouts) == 1
    (under,) = handouts.under(tmp_path).items()
    assert under[0] == path and under[1].lease == "L3" and under[1].markers is False
    assert handouts.under(tmp_path / "item") == {}  # a sibling folder whose name starts the same is not under it
    handouts.forget_under(tmp_path)
    assert handouts.lease_for(path, "deleted") == (None, "not handed out", None)
    handouts.record([(path, "L4", ("a.bin",), False, True), (f"{path}x", "L5", ("a.bin",), False, True)])
    assert handouts.forget([(path, None), (f"{path}x", "L4"), ("/elsewhere", None)]) == [path]  # lease L5 stays
    assert len(handouts) == 1


def test_journal_log_format():
    record = logging.LogRecord("cachepipe.service", logging.WARNING, __file__, 1, "two\nlines", None, None)
    assert JournalFormatter(journal=True).format(record) == "<4>cachepipe.service: two\n<4>lines"
    assert JournalFormatter(journal=False).format(record) == "WARNING cachepipe.service: two\nlines"
    from cachepipe.service.logs import stream_is_journal

    with open(os.devnull, "w") as fh:
        st = os.fstat(fh.fileno())
        assert stream_is_journal(fh, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not stream_is_journal(fh, {})
    assert not stream_is_journal(io.StringIO(), {"JOURNAL_STREAM": "1:2"})


def test_unit_files_pass_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    exe = shutil.which("cachepipe", path=str(Path(sys.executable).parent)) or shutil.which("cachepipe")
    if exe is None:
        pytest.skip("the cachepipe console script is not installed (pip install -e .)")
    units = []
    for src, dest in (("cachepipe.service", "cachepipe.service"), ("cachepipe@.service", "cachepipe@train.service")):
        text = (ROOT / "systemd" / src).read_text().replace("/usr/local/bin/cachepipe", exe)  # verify wants an executable
        (tmp_path / dest).write_text(text)
        units.append(str(tmp_path / dest))
    proc = subprocess.run([tool, "verify", *units], capture_output=True, text=True, timeout=60, check=False)
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if str(tmp_path) in line or "cachepipe" in line]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr
    for unit in units:
        text = Path(unit).read_text()
        for directive in (
            "Type=notify",
            "Restart=on-failure",
            "RuntimeDirectory=cachepipe",
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            "ReadWritePaths=",
            "PrivateTmp=yes",
            "User=cachepipe",
            "Group=cachepipe",
            "ExecReload=/bin/kill -HUP $MAINPID",
        ):
            assert directive in text, (unit, directive)
    assert "/etc/cachepipe/%i.yaml" in (tmp_path / "cachepipe@train.service").read_text()


def _run_bench_service(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/bench_service.py`` with ``args`` in ``cwd``, output captured."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_service.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def _bench_service(cwd: Path, *args: str) -> str:
    """Run ``benchmarks/bench_service.py`` with ``args``; its standard output."""
    proc = _run_bench_service(cwd, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_benchmark_quick_smoke(tmp_path):
    out = _bench_service(tmp_path, "--quick")
    assert "next+ack" in out and "items/s" in out and "bench_service.py" in out
    assert "shell: cachepipe next, cachepipe ack" in out  # a process per call, as a shell loop pays
    assert "the loop (for item in client)" in out and "get_many(64)" in out
    assert "deletion floor (2 plain threads" in out
    assert "caches in /tmp (" in out  # and their file system


def test_benchmark_refuses_a_shell_count_below_one(tmp_path):
    proc = _run_bench_service(tmp_path, "--shell", "0")
    assert proc.returncode == 2 and "--shell 0: expected a number of items >= 1" in proc.stderr, proc.stderr


@pytest.mark.parametrize("consumers", [(), ("--api-acks",), ("--local", "--fills")], ids=["default", "api-acks", "local-fills"])
def test_benchmark_batched_only_smoke(tmp_path, consumers):
    report = json.loads(_bench_service(tmp_path, "--quick", "--batched-only", *consumers, "--json"))
    assert report["latencies"] == {} and report["command"].endswith(" ".join(["--batched-only", *consumers, "--json"]))
    assert report["regime"] == ("fills" if "--fills" in consumers else "roomy")  # fills: 1/8 of the items fit, timed from full
    (row,) = report["parallel"]
    assert row["batch"] == 64 and row["items"] == 60 and row["items_per_s"] > 0
    assert row["deletion_floor_items_per_s"] > 0 and row["of_floor"] > 0
    assert report["cache_file_system"] not in ("", "?")  # the disk figures depend on it (an ext4's journal)


def next_requests(client: Client) -> float:
    """``next`` requests the daemon answered, from its metrics."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in client.metrics().splitlines()
        if line.startswith("cachepipe_api_requests_total{") and 'route="next"' in line
    )


@contextlib.contextmanager
def all_ready(n: int, s3_source, s3_endpoint, tmp_path: Path, sock: Path) -> Iterator[Client]:
    """A daemon serving ``n`` tiny folders as 'train', all downloaded; yields a client to watch it."""
    s3_source.folders(n, {"f": 10})
    with DaemonProcess(write_config(tmp_path, sock, s3_endpoint, {"train": {}})), Client("train", sock) as probe:
        wait_until(lambda: stats(probe)["items_ready"] == n)
        yield probe


def quick_loop(sock: Path, probe: Client, at: int, *, stop: bool = False, pause: float = 0.0) -> tuple[list[str], int]:
    """Loop over 'train' with a body of microseconds; at the ``at``-th item, note how many items the
    loop holds taken ahead, then stop there or pause ``pause`` seconds. Returns (names seen, held)."""
    seen, held = [], 0
    for item in Client("train", sock, timeout=60, markers=False):
        seen.append(item.name)
        if len(seen) == at:
            held = stats(probe)["items_handed"] - at
            if stop:
                break
            threading.Event().wait(pause)
    return seen, held


def test_a_quick_client_loop_takes_batches_acks_them_with_the_next_request_and_gives_back_what_it_did_not_reach(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    names = [f"item{i:03d}" for i in range(40)]
    sock = short_dir / "api.sock"
    with all_ready(40, s3_source, s3_endpoint, tmp_path, sock) as probe:
        first, held = quick_loop(sock, probe, 10, stop=True)
        assert held > 0  # it stopped inside a batch
        got = stats(probe)
        assert got["items_acked"] == 9 and got["items_released"] >= 1 + held  # more if a batch was ended early (HOLD)
        before = next_requests(probe)
        rest = [item.name for item in Client("train", sock, timeout=60, markers=False)]
        assert first + rest[1:] == names and rest[0] == first[-1]  # the item it stopped in comes again, then the rest
        assert next_requests(probe) - before <= 20  # one per item and one for the end (32) before batches
        assert stats(probe)["items_acked"] == 40


def test_a_client_loop_that_slows_down_gives_its_batch_back(s3_source, s3_endpoint, tmp_path, short_dir):
    sock = short_dir / "api.sock"
    with all_ready(40, s3_source, s3_endpoint, tmp_path, sock) as probe:
        seen, held = quick_loop(sock, probe, 10, pause=0.5)  # far longer than HOLD: the batch is ended when the loop moves on
        assert held > 0 and seen == [f"item{i:03d}" for i in range(40)]
        got = stats(probe)
        assert got["items_acked"] == 40 and got["items_released"] >= held  # given back, not held on


def test_the_items_of_a_client_loop_that_acks_them_are_not_watched_for_markers(s3_source, s3_endpoint, tmp_path, short_dir):
    # With auto_ack the loop acknowledges every item itself: the daemon adds no watch for its
    # items (a watch was most of its work per item), so a .done made in one is ignored, where it
    # raced the loop's ack (the marker acked it first and the loop's ack was refused). A loop
    # without auto_ack, and get_many, are watched as the client says.
    sock = short_dir / "api.sock"
    with all_ready(12, s3_source, s3_endpoint, tmp_path, sock) as probe:
        pid = probe.status()["pid"]
        watches = []
        for item in Client("train", sock, timeout=60):
            watches.append(inotify_watches(pid))
            if len(watches) == 3:
                (item / ".done").touch()
                threading.Event().wait(0.3)  # the marker watch reads its events every 50 ms
            if len(watches) == 6:
                break
        assert watches == [1] * 6  # the cache directory's watch alone
        assert stats(probe)["items_acked"] == 5 and "cachepipe_marker_acks_total{" not in probe.metrics()
        with Client("train", sock, timeout=60, auto_ack=False) as by_hand:
            for item in by_hand:
                wait_until(lambda: inotify_watches(pid) == 2, what="this item's watch: a .done would acknowledge it")
                by_hand.ack(item)
                break
            batch = by_hand.get_many(3, timeout=60)
            wait_until(lambda: inotify_watches(pid) == 4, what="the batch's watches")
            by_hand.ack_many(batch)
        assert stats(probe)["items_acked"] == 9


def test_an_item_acked_by_hand_in_a_quick_client_loop_is_refused_and_the_others_are_acked(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    names = [f"item{i:03d}" for i in range(30)]
    sock = short_dir / "api.sock"
    with all_ready(30, s3_source, s3_endpoint, tmp_path, sock) as probe:
        seen = []

        def loop() -> None:
            for item in Client("train", sock, timeout=60, markers=False):
                seen.append(item.name)
                if len(seen) == 5:
                    probe.ack(item)  # by hand, as well as by the loop

        with pytest.raises(UnknownItemError, match="item004"):
            loop()
        assert stats(probe)["items_acked"] == len(seen)  # each item the loop moved past, once
        assert [item.name for item in Client("train", sock, timeout=60)] == names[len(seen) :]  # none comes again
