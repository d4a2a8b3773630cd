"""The daemon's jobs: what a job may ask for, what the daemon's jobs section bounds, the errors.

One real daemon subprocess per test over the moto server; requests through ``JobClient`` and
raw HTTP on the socket.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import via
from removing import remove_tree
from test_service_lifecycle import NextDaemon
from test_state_files import _upload_held
from waiting import wait_until

from cachepipe.client import Client, ServiceError, StoreError
from cachepipe.errors import ConfigError
from cachepipe.jobclient import JobClient
from cachepipe.manifest import index
from cachepipe.service.config import load_config
from cachepipe.service.daemon import _changed_keys
from cachepipe.service.testing import DaemonExited, DaemonProcess

KIB = 1024


def write_config(tmp_path: Path, sock: Path, jobs: dict) -> Path:
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump({"socket": str(sock), "jobs": jobs}))
    return path


def register(sock: Path, name: str, body: dict, rank: int = 0) -> dict:
    with JobClient(name, body, rank, socket=sock) as lane:
        return lane.register()


def spec(where, **kw) -> dict:
    return {"source": where.url, "world_size": 2, "ranks": [0, 1], "num_workers": 1, **kw}


def one_rank_job(where, tmp_path: Path, sock: Path, **options) -> tuple[Path, dict]:
    """A daemon's config with a jobs section over ``where`` (1 MiB), and the spec of a job of one
    rank; ``options``: jobs.options (``storage_options`` replaces ``where``'s, to route through a proxy)."""
    jobs = {"root": str(tmp_path / "jobs"), "capacity": "1MiB", "sources": [where.url]}
    jobs["options"] = {"storage_options": where.options, **options}
    return write_config(tmp_path, sock, jobs), {**spec(where), "world_size": 1, "ranks": [0]}


def taking(lane: JobClient, timeout: float) -> tuple[threading.Thread, dict]:
    """``lane.take((0, 0))`` started in a thread; the dict gets what it returned (``"item"``) or raised (``"error"``)."""
    got: dict = {}

    def take() -> None:
        try:
            got["item"] = lane.take((0, 0), timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - what the lane got, checked by the test
            got["error"] = exc

    waiter = threading.Thread(target=take)
    waiter.start()
    return waiter, got


def test_jobs_register_once_conflict_and_end(s3_source, tmp_path, short_dir):
    s3_source.folders(6, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    root = tmp_path / "jobs"
    jobs = {"root": str(root), "capacity": "1MiB", "sources": [s3_source.url], "max_jobs": 2}
    jobs["options"] = {"storage_options": s3_source.options}
    with DaemonProcess(write_config(tmp_path, sock, jobs)):
        with JobClient("train", spec(s3_source), 0, socket=sock) as lane:
            info = lane.register()
            assert info["created"] is True and info["items"] == 6 and info["cache_dir"] == str(root / "train")
            assert register(sock, "train", spec(s3_source), 1)["created"] is False  # the same job
            item = lane.take((0, 0), timeout=30)
            assert Path(item.path).parent == root / "train" and item.cursor == (0, 0)

            with pytest.raises(ServiceError, match=r"registered with seed=0, this registration asks for seed=1") as err:
                register(sock, "train", spec(s3_source, seed=1), 0)
            assert err.value.status == 409
            with pytest.raises(ServiceError, match=r"asks for the rest of jobs.capacity .*, and 0 bytes are available") as err:
                register(sock, "other", spec(s3_source), 0)  # the first job holds all of it
            assert err.value.status == 409
            with pytest.raises(ServiceError, match=r"may read only under") as err:
                register(sock, "x", spec(s3_source, source="s3://elsewhere/"), 0)
            assert err.value.status == 400
            with pytest.raises(ServiceError, match=r"a '\.' or '\.\.' path segment") as err:  # before: registered, read
                register(sock, "x", spec(s3_source, source=s3_source.url + "../secret/"), 0)
            assert err.value.status == 400
            with pytest.raises(ServiceError, match=r"job name '\.\./evil'") as err:
                register(sock, "../evil", spec(s3_source), 0)
            assert not (tmp_path / "evil").exists()
            with pytest.raises(ServiceError, match=r"num_workers") as err:
                register(sock, "y", spec(s3_source, num_workers=0), 0)
            assert err.value.status == 400
            assert "Input should be greater than or equal to 1" in str(err.value)
            assert "errors.pydantic.dev" not in str(err.value) and "further information" not in str(err.value)
            with pytest.raises(ServiceError, match=r"lease_timeout") as err:
                register(sock, "y", spec(s3_source, lease_timeout=5), 0)  # not a job's to set
            with (
                pytest.raises(ServiceError, match=r"this node serves ranks \[0, 1\] of world_size 2"),
                JobClient("train", spec(s3_source), 5, socket=sock) as stray,
            ):
                stray.take((0, 0), timeout=5)

            client = lane._client
            body = {"rank": 0, "worker": 0, "epoch": 0, "index": 0, "timeout": 5, "report_skips": "yes"}
            status, data = client._request("POST", "/v1/jobs/train/take", body, 10)
            assert status == 400 and "'report_skips' 'yes': expected true or false" in json.loads(data)["message"]
            # a misspelt key (or one a daemon is too old for) was ignored, silently
            for route, body in (
                ("jobs/train/take", {"rank": 0, "report_skip": True}),
                ("jobs/train/consume", {"rank": 0, "timeout": 1}),
                ("ack", {"leases": []}),
                ("pipelines/a{0}b/next", {"time_out": 1}),  # braces in the path are not a format string
            ):
                status, data = client._request("POST", f"/v1/{route}", body, 10)
                message, key = json.loads(data)["message"], next(k for k in body if k != "rank")
                assert status == 400 and f"unknown key(s) '{key}' in the body: expected some of " in message, message
            # so was a misspelt key of an ack object (an ack without its lease applies to whoever holds the item)
            ack = {"path": "/x", "leese": "L"}
            for route, body in (("ack", {"items": [ack]}), ("pipelines/p/next", {"ack": ack}), ("renew", {"items": [ack]})):
                status, data = client._request("POST", f"/v1/{route}", body, 10)
                message = json.loads(data)["message"]
                assert status == 400 and "unknown key(s) 'leese' in an object of" in message, message
                assert message.endswith("expected some of 'lease', 'path'"), message
            for method, route in (("DELETE", "jobs/train"), ("GET", "status")):  # they take no body key
                status, data = client._request(method, f"/v1/{route}", {"force": True}, 10)
                message = json.loads(data)["message"]
                assert status == 400 and message == f"{method} /v1/{route}: unknown key(s) 'force' in the body: it takes none"
            status, data = client._request("DELETE", "/v1/jobs/train", None, 10)
            assert status == 200 and json.loads(data)["result"] == "deleted"
        assert not (root / "train").exists()  # its items are deleted, and then its folder


def test_a_job_refused_for_want_of_room_is_told_what_it_asked_and_what_is_available(s3_source, tmp_path, short_dir):
    # A second job with no capacity of its own, after the first took all of jobs.capacity, was
    # told it "asks for 0 bytes".
    s3_source.folders(2, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    config, job = one_rank_job(s3_source, tmp_path, sock)
    with DaemonProcess(config):
        register(sock, "a", {**job, "capacity": "768KiB"})
        with pytest.raises(ServiceError) as err:
            register(sock, "b", {**job, "capacity": "512KiB"})
        assert err.value.status == 409
        assert str(err.value).startswith(
            "job 'b' asks for capacity 524288 bytes, and 262144 bytes are available: jobs.capacity is 1048576 bytes and "
            "the registered jobs hold 786432 ('a' 786432): give the job a capacity of at most 262144 bytes, "
            "or delete a job that ended (`cachepipe delete-job NAME`, or DELETE /v1/jobs/NAME) ("
        ), err.value
        register(sock, "c", job)  # no capacity: the rest
        with pytest.raises(ServiceError) as err:
            register(sock, "d", job)
        assert str(err.value).startswith(
            "job 'd' asks for the rest of jobs.capacity (its spec gives no capacity), and 0 bytes are available: "
            "jobs.capacity is 1048576 bytes and the registered jobs hold 1048576 ('a' 786432, 'c' 262144): "
            "delete a job that ended (`cachepipe delete-job NAME`, or DELETE /v1/jobs/NAME) ("
        ), err.value


def test_manifests_listed_uploaded_and_checked(s3_source, tmp_path, short_dir):
    s3_source.folders(5, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    root = tmp_path / "jobs"
    jobs = {"root": str(root), "capacity": "1MiB", "sources": [s3_source.url], "max_manifest": "64KiB"}
    jobs["options"] = {"storage_options": s3_source.options}
    with DaemonProcess(write_config(tmp_path, sock, jobs)):
        with JobClient("train", spec(s3_source), 0, socket=sock) as lane:
            digest = lane.index(s3_source.url)
            data = lane.manifest_bytes(digest)
            mine = index(s3_source.url, tmp_path / "m.json.gz", storage_options=s3_source.options)
            assert digest == mine.digest and gzip.decompress(data)  # the same catalog as a listing here
            assert lane.upload_manifest((tmp_path / "m.json.gz").read_bytes()) == digest

            info = register(sock, "train", spec(s3_source, catalog=digest), 0)
            assert info["catalog_digest"] == digest and info["items"] == 5

            with pytest.raises(ServiceError, match=r"is not a manifest of `cachepipe index`") as err:
                lane.upload_manifest(b"not gzip")
            assert err.value.status == 400
            with pytest.raises(ServiceError, match=r"expected at most 65536") as err:
                lane.upload_manifest(os.urandom(70 * KIB))
            assert err.value.status == 413
            with pytest.raises(ServiceError, match=r"no manifest of that digest was uploaded"):
                register(sock, "b", spec(s3_source, catalog="0" * 32, capacity=KIB * 64), 0)
            with pytest.raises(ServiceError, match=r"manifest and catalog: give one"):
                register(sock, "b", spec(s3_source, catalog=digest, manifest="s3://data/m.gz"), 0)
            with pytest.raises(ServiceError, match=r"no manifest 'f+' on this daemon") as err:
                lane.manifest_bytes("f" * 32)
            assert err.value.status == 404
    # no upload leftovers; ".lock": the writers' lock; "jobs": the note that job train plans from it
    assert sorted(p.name for p in (root / ".manifests").iterdir()) == [".lock", f"{digest}.json.gz", "jobs"]
    assert (root / ".manifests" / "jobs" / "train").read_text() == f"{digest}\n"


@pytest.mark.parametrize("grown", [False, True], ids=["same-data", "source-grew"])
def test_a_lane_registered_again_after_a_daemon_restart_refuses_a_changed_catalog(s3_source, tmp_path, short_dir, grown):
    """The daemon killed and restarted forgets its jobs; a lane's next request registers the job
    again, which lists the source again. Before, a source that had changed meanwhile gave a new
    plan under the lane's old position: items skipped and repeated, silently. Now the lane goes
    on over the same data, and refuses to over other data."""
    s3_source.folders(6, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    config, one = one_rank_job(s3_source, tmp_path, sock)
    with JobClient("train", one, 0, socket=sock, startup_timeout=30) as lane:
        with DaemonProcess(config) as daemon:
            lane.register()
            item = lane.take((0, 0), timeout=30)
            daemon.signal(signal.SIGKILL)
            daemon.proc.wait(30)
        if grown:
            s3_source.put("item006/a.bin", b"x" * KIB)
        with DaemonProcess(config):
            if not grown:
                assert lane.take(item.next, timeout=30).cursor == item.next
                return
            with pytest.raises(RuntimeError, match=r"registered again .* now plans from another catalog"):
                lane.take(item.next, timeout=30)


def test_a_registered_lane_waits_out_a_daemon_restart_longer_than_a_start(s3_source, tmp_path, short_dir, caplog):
    """Before, a lane waited startup_timeout (10 s) for a daemon that went away, then raised:
    systemd restarts a crashed daemon after RestartSec=5s and it then opens its caches, so a
    crash cost the training job. A lane that has registered now waits outage_timeout (300 s),
    saying so in the log; one that never reached a daemon still fails after startup_timeout."""
    s3_source.folders(4, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    config, one = one_rank_job(s3_source, tmp_path, sock)
    with JobClient("train", one, 0, socket=sock, startup_timeout=0.5) as lane:
        with pytest.raises(ConnectionError, match=r"tried for 0.5 s"):
            lane.register()  # no daemon yet: a wrong socket fails fast
        with DaemonProcess(config) as daemon:
            lane.register()
            item = lane.take((0, 0), timeout=30)
            daemon.signal(signal.SIGKILL)
            daemon.proc.wait(30)
        later = DaemonProcess(config)
        starter = threading.Timer(2.0, later.start)  # back after 2 s and its start: past startup_timeout
        statuses: list = []

        def plain() -> None:  # a client that never reached the daemon, waiting for it to start
            with Client(socket=sock, startup_timeout=30) as client:
                statuses.append(client.health()["status"])

        other = threading.Thread(target=plain)
        starter.start()
        try:
            with caplog.at_level(logging.WARNING, logger="cachepipe.client"):
                other.start()
                assert lane.take(item.next, timeout=60).cursor == item.next  # before: ConnectionError after 0.5 s
                other.join(60)
        finally:
            starter.join()
            later.close()
    assert statuses == ["ok"]
    warned = sorted(r.getMessage() for r in caplog.records)  # each long wait says so as it begins
    assert warned == [f"the cachepipe daemon at {sock} is not answering yet: trying for up to {n} s" for n in (30, 300)]
    with pytest.raises(ValueError, match=r"outage_timeout -1: expected a number of seconds >= 0"):
        JobClient("train", one, 0, socket=sock, outage_timeout=-1)


@pytest.mark.parametrize("found_by", ["health", "take"])
def test_a_job_whose_cache_directory_is_removed_is_dropped_and_its_lane_goes_on(s3_source, tmp_path, short_dir, found_by):
    """``rm -rf`` of a job's directory: before, the lanes were handed deleted paths, health said
    ok, and registering the job again failed with HTTP 500 until the daemon restarted. Now the
    daemon drops the job (found by a health check, or at the lane's next take), and the lane
    registers it again and gets the rest of its share from a fresh directory."""
    data = s3_source.folders(6, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    root = tmp_path / "jobs"
    jobs = {"root": str(root), "capacity": "1MiB", "sources": [s3_source.url]}
    jobs["options"] = {"storage_options": s3_source.options}
    one = {**spec(s3_source), "world_size": 1, "ranks": [0]}
    with DaemonProcess(write_config(tmp_path, sock, jobs)) as daemon, JobClient("train", one, 0, socket=sock) as lane:
        lane.register()
        taken = lane.take((0, 0), timeout=30)
        names = [taken.name]
        remove_tree(root / "train")
        if found_by == "health":
            with Client(socket=sock) as client:
                assert client.health()["status"] == "ok"  # the job is dropped: nothing is down
        else:
            time.sleep(1.1)  # past the at-most-once-a-second check at hand-out
        while (taken := lane.take(taken.next, timeout=30)) is not None:
            assert (Path(taken.path) / "a.bin").read_bytes() == data[taken.name]["a.bin"]
            names.append(taken.name)
        assert sorted(names) == sorted(data)
        assert "job train dropped: " in daemon.log() and "was removed while the pipeline was open" in daemon.log()


def test_a_relative_local_source_of_a_job_is_refused(tmp_path, short_dir):
    """A lane's relative source (or manifest) was read from the daemon's working directory ('/'
    under systemd), not the lane's: with no jobs.sources the job registered and read another folder."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f.bin").write_bytes(b"x")
    sock = short_dir / "api.sock"
    relative = os.path.relpath(src)  # found from the daemon's working directory: this process's
    with DaemonProcess(write_config(tmp_path, sock, {"root": str(tmp_path / "jobs"), "capacity": "1MiB"})):
        for field, body in (
            ("source", {"source": relative, "world_size": 1, "ranks": [0]}),
            ("manifest", {"source": str(src), "manifest": "m.json.gz", "world_size": 1, "ranks": [0]}),
        ):
            with pytest.raises(ServiceError, match=rf"{field} '[^']+': a relative local path; the daemon would") as err:
                register(sock, "train", body)
            assert err.value.status == 400
        with JobClient("x", {"source": str(src), "world_size": 1, "ranks": [0]}, 0, socket=sock) as lane:
            with pytest.raises(ServiceError, match=r"source '[^']+': a relative local path") as err:
                lane.index(relative)
            assert err.value.status == 400
            assert lane.take((0, 0), timeout=30).name == "a"  # an absolute one registers
        # (The same jobs-only daemon.) A consumer of pipelines was told "the daemon ... serves the
        # pipelines : name one", an empty list and advice it cannot follow.
        from cachepipe.client import Client

        with Client(socket=str(sock), startup_timeout=0) as client:
            with pytest.raises(ValueError, match=r"serves no pipeline \(jobs only\): its jobs are read by") as err:
                client.get(timeout=5)
            assert "name one" not in str(err.value)
    assert not (tmp_path / "jobs" / "train").exists()


def test_jobs_sources_are_prefixes_by_whole_path_segments():
    from cachepipe.service.jobs import _under

    assert _under("s3://b/data", "s3://b/data") and _under("s3://b/data/x/", "s3://b/data")
    assert _under("s3://b/data/x/", "s3://b/data/") and _under("s3://b/data", "s3://b/data/")
    assert not _under("s3://b/data-private/", "s3://b/data")  # before: a plain startswith let it through


def test_jobs_section_is_checked(tmp_path):
    def error_of(data: dict) -> str:
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"socket": "/run/x.sock", **data}))
        with pytest.raises(ConfigError) as err:
            load_config(path)
        return str(err.value)

    assert "no pipelines and no jobs section" in error_of({})
    assert "jobs.root = 'rel': expected an absolute path" in error_of({"jobs": {"root": "rel", "capacity": "1GiB"}})
    assert "jobs.options.cache_dir: set by the job or by the daemon" in error_of(
        {"jobs": {"root": "/j", "capacity": "1GiB", "options": {"cache_dir": "/x"}}}
    )
    assert "jobs.options.prefetch: set by the job or by the daemon" in error_of(
        {"jobs": {"root": "/j", "capacity": "1GiB", "options": {"prefetch": 4}}}
    )
    assert "jobs.options.start_epoch: set by the job or by the daemon" in error_of(
        {"jobs": {"root": "/j", "capacity": "1GiB", "options": {"start_epoch": 1}}}
    )
    assert "jobs.options.colour: not a pipeline option" in error_of(
        {"jobs": {"root": "/j", "capacity": "1GiB", "options": {"colour": 1}}}
    )
    assert "jobs.sources 'nope://b/': unknown URL scheme 'nope://'" in error_of(
        {"jobs": {"root": "/j", "capacity": "1GiB", "sources": ["s3://ok/", "nope://b/"]}}
    )
    for grace in (-1, "soon", float("inf")):
        message = error_of({"jobs": {"root": "/j", "capacity": "1GiB", "manifest_grace": grace}})
        assert "jobs.manifest_grace" in message, message
    overlap = {"jobs": {"root": "/data/jobs", "capacity": "1GiB"}}
    overlap["pipelines"] = {"train": {"source": "s3://b/", "cache_dir": "/data/jobs/train", "capacity": "1GiB"}}
    assert "overlaps jobs.root '/data/jobs'" in error_of(overlap)


def test_the_daemon_s_settings_shown_hold_no_credentials(tmp_path):
    """The repr of the daemon's settings (a log line, a debugger, an error's context) printed the
    jobs section's storage options whole, secret key included; as a pipeline's settings, not now."""
    path = tmp_path / "c.yaml"
    secret = {"key": "AKIDEXAMPLE", "secret": "s3cr3t-value", "client_kwargs": {"aws_session_token": "t0ken-value"}}
    path.write_text(
        yaml.safe_dump(
            {
                "socket": "/run/x.sock",
                "jobs": {"root": "/j", "capacity": "1GiB", "options": {"storage_options": secret}},
                "pipelines": {"train": {"source": "s3://b/", "cache_dir": "/c", "capacity": "1GiB", "storage_options": secret}},
            }
        )
    )
    config = load_config(path)
    assert config.jobs.options["storage_options"] == secret  # kept for the jobs' stores
    for shown in (repr(config), str(config), repr(config.jobs)):
        assert "s3cr3t-value" not in shown and "t0ken-value" not in shown, shown


def test_a_take_left_waiting_by_a_consumer_that_went_away_does_not_move_the_lane_of_the_next(
    s3_source, fault_proxy, tmp_path, short_dir
):
    """A consumer asks for (0, 5), whose download is slow, and goes away (a DataLoader worker
    killed while it waited: a loop left with ``break``, a rank killed and restarted); the
    daemon's request thread still waits for the item. A new consumer of the lane reads it from
    (0, 0), its first item taking 2 s to read. Found by review of a first fix, which moved the
    lane back a turn (1 s) later, to (0, 5), consuming the steps before it: the new consumer's
    item was deleted while it read it (FileNotFoundError). Now the request left waiting is
    refused (LaneConflictError, 409 to a client that is gone) and moves nothing."""
    import socket

    from conftest import via

    proxy, endpoint = fault_proxy
    data = s3_source.folders(8, {"a.bin": 32 * KIB})
    sock = short_dir / "api.sock"
    jobs = {"root": str(tmp_path / "jobs"), "capacity": "1MiB", "sources": [s3_source.url]}
    jobs["options"] = {"storage_options": via(s3_source, endpoint)}
    one = {**spec(s3_source), "world_size": 1, "ranks": [0]}  # room for every item: all are planned at once
    fifth = sorted(data)[5]  # one lane of one rank: its share is the catalog in order
    gate = threading.Event()
    proxy.hold(lambda head: f"{fifth}/a.bin" in head, gate)
    try:
        with DaemonProcess(write_config(tmp_path, sock, jobs)) as daemon, JobClient("train", one, 0, socket=sock) as lane:
            lane.register()
            body = json.dumps({"rank": 0, "worker": 0, "epoch": 0, "index": 5, "timeout": 60}).encode()
            with socket.socket(socket.AF_UNIX) as gone, Client(socket=sock) as probe:
                gone.connect(str(sock))
                gone.sendall(
                    b"POST /v1/jobs/train/take HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                wait_until(lambda: any(f"{fifth}/a.bin" in head for head in proxy.requests), 30, "the download of (0, 5)")
                # The register planned every item at once: (0, 5)'s download says nothing of the take.
                # Its request thread counts it waiting, then moves the lane to (0, 5): a loaded machine
                # answered the new consumer's take of (0, 0) first, and the late move consumed (0, 0).
                wait_until(lambda: probe.status()["jobs"]["job/train"]["waiting"] == 1, 30, "the take of (0, 5) to wait")
            threading.Timer(4.0, gate.set).start()  # the item arrives later, for nobody
            cursor, names, failed = (0, 0), [], []
            while (item := lane.take(cursor, timeout=60)) is not None:
                time.sleep(2.0 if not names else 0.1)  # a transform, before it reads the item
                try:
                    assert (Path(item.path) / "a.bin").read_bytes() == data[item.name]["a.bin"]
                except FileNotFoundError:
                    failed.append(tuple(item.cursor))
                names.append(item.name)
                cursor = item.next
                lane.consume(cursor)
            log = daemon.log()
    finally:
        gate.set()
    assert names == sorted(data)
    assert failed == []  # with the first fix: [(0, 0)], deleted while it was read
    assert "lane 0.0: another consumer moved the lane to (0, 0) while this one waited for (0, 5)" in log


def a_job_whose_first_item_is_held(s3_source, fault_proxy, tmp_path, sock, folders, **hold):
    """A one-rank job over ``folders`` folders read through the fault proxy, whose first item's
    download the proxy holds until the gate returned is set: ``(config, job, first, gate)``."""
    proxy, endpoint = fault_proxy
    first = min(s3_source.folders(folders, {"a.bin": KIB}))
    config, one = one_rank_job(s3_source, tmp_path, sock, storage_options=via(s3_source, endpoint))
    gate = threading.Event()
    proxy.hold(lambda head: f"{first}/a.bin" in head, gate, **hold)
    return config, one, first, gate


def test_a_take_waiting_when_the_daemon_stops_is_answered_stopping_and_asks_the_next_daemon(
    s3_source, fault_proxy, tmp_path, short_dir
):
    """A lane's take waits for an item whose download is slow when the daemon stops (a
    `systemctl restart`). Before, the stop closed the job's node pipeline under the request, which
    was answered 500 "internal" (RuntimeError: closed), and JobClient raised ServiceError: the
    DataLoader worker died on a restart it is meant to wait out (found in review). Now it is 503
    "stopping", and the lane asks the next daemon, which hands it the item."""
    sock = short_dir / "api.sock"
    config, one, first, gate = a_job_whose_first_item_is_held(s3_source, fault_proxy, tmp_path, sock, 4)
    try:
        with JobClient("train", one, 0, socket=sock) as lane:
            with DaemonProcess(config) as daemon, Client(socket=sock) as admin:
                lane.register()
                waiter, got = taking(lane, 60)
                wait_until(lambda: admin.status()["jobs"]["job/train"]["waiting"], what="the take waiting in the daemon")
                assert daemon.stop() == 0
            gate.set()
            with DaemonProcess(config):
                waiter.join(60)
    finally:
        gate.set()
    assert "error" not in got, got  # before: ServiceError 500 internal "... is closed"
    assert got["item"].name == first


def test_a_take_waiting_when_its_job_is_deleted_is_answered_404_to_register_again(s3_source, fault_proxy, tmp_path, short_dir):
    """A lane's take waits for an item whose download is slow when its job is deleted (`cachepipe
    delete-job --force`, or another node's script). The delete closed the job's node pipeline
    under the request, which was answered 500 "internal" (RuntimeError: closed): a consumer in
    any language gave up where the docs say a lane still reading registers the job again. Now
    it is 404, as for a job not registered."""
    sock = short_dir / "api.sock"
    config, one, _first, gate = a_job_whose_first_item_is_held(s3_source, fault_proxy, tmp_path, sock, 2)
    body = json.dumps({"rank": 0, "worker": 0, "epoch": 0, "index": 0, "timeout": 60}).encode()
    try:
        with DaemonProcess(config), Client(socket=sock) as admin, socket.socket(socket.AF_UNIX) as waiting:
            register(sock, "train", one)
            waiting.settimeout(30)  # a bound on the test's own wait
            waiting.connect(str(sock))
            waiting.sendall(b"POST /v1/jobs/train/take HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: admin.status()["jobs"]["job/train"]["waiting"], what="the take waiting in the daemon")
            admin.delete_job("train")
            answer = b""
            while not answer.endswith(b"}\n") and (chunk := waiting.recv(65536)):
                answer += chunk
    finally:
        gate.set()
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 "), answer  # before: 500 internal "NodePipeline(...) is closed"
    assert json.loads(text) == {
        "error": "not_found",
        "message": "job 'train' was deleted (or dropped, its cache directory removed) while this request was served; "
        "register it again (PUT /v1/jobs/train) to start over",
    }


def test_a_take_waiting_through_two_restarts_waits_for_the_daemon_after_each(s3_source, fault_proxy, tmp_path, short_dir):
    """A lane's take waits for an item whose download is held through two daemon restarts
    (`systemctl restart`, twice). JobClient kept one clock for 503 "stopping" answers for the
    whole request, also while the restarted daemon served it (the job registered again, the take
    waiting there): when that daemon stopped too, more than outage_timeout after the first stop,
    the take raised the 503 at once instead of waiting for the next daemon. And it registered the
    job again once per request: within its wait, the third daemon's 404 was raised (ServiceError
    "no job 'train'")."""
    sock = short_dir / "api.sock"
    # (limit: not ready under any daemon until the gate opens)
    config, one, first, gate = a_job_whose_first_item_is_held(s3_source, fault_proxy, tmp_path, sock, 2, limit=600)
    # outage_timeout: room for each restart, the old daemon's exit and the new one's own start
    # (NextDaemon, staged): 6 s failed 1 run in 3 at load 9, as test_service_lifecycle's twin
    wait = 10

    def waiting() -> bool:
        with Client(socket=sock) as admin:
            return bool(admin.status()["jobs"].get("job/train", {}).get("waiting"))

    daemon = DaemonProcess(config).start()
    try:
        with JobClient("train", one, 0, socket=sock, startup_timeout=1, outage_timeout=wait) as lane:
            lane.register()
            waiter, got = taking(lane, 120)
            wait_until(waiting, 30, "the take waiting in the daemon")
            with NextDaemon(config, tmp_path / "go-2") as restart:
                restart.staged()
                assert daemon.stop() == 0  # the take is answered 503 stopping, and waits for the next daemon
                stopped = time.monotonic()  # after the 503, which the stop answers before its exit
                daemon.close()
                daemon = restart.start()
            wait_until(waiting, 30, "the take registering the job again and waiting in the next daemon")
            threading.Event().wait(max(stopped + wait + 1 - time.monotonic(), 0))  # past the first stop's wait
            with NextDaemon(config, tmp_path / "go-3") as restart:
                restart.staged()
                assert daemon.stop() == 0  # before: ServiceError 503 stopping at once
                daemon.close()
                daemon = restart.start()
            gate.set()
            waiter.join(60)
    finally:
        gate.set()
        daemon.close()
    assert "error" not in got, got
    assert got["item"].name == first


def test_a_store_connection_reset_while_the_daemon_lists_for_a_job_is_answered_as_a_store_error(
    s3_source, fault_proxy, tmp_path, short_dir
):
    """Registering a job (and ``POST /v1/manifests``) lists the source in the request's thread.
    The request handler took a BrokenPipeError or ConnectionResetError out of a route for its
    client gone (the connection closed, no answer): a store's reset raised as such would have
    reached the lane as a dropped connection. It did not: the store's seam raises a reset as a
    plain ConnectionError naming the endpoint (stores/fsspec_errors.py), and the lane gets the
    error answer of any store failure. Passed before (written to check the suspicion). Since, the
    handler takes only its client's socket failing for the client gone (ClientGone; any other
    such error is a 500: tests/test_service_client_gone.py)."""
    proxy, endpoint = fault_proxy
    s3_source.folders(2, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    # retries 0: the first reset fails the listing
    config, one = one_rank_job(s3_source, tmp_path, sock, storage_options=via(s3_source, endpoint), retries=0)
    with DaemonProcess(config) as daemon, JobClient("train", one, 0, socket=sock) as lane:
        proxy.inject("refuse", 100)  # each connection to the store is accepted, then reset
        with pytest.raises(ServiceError, match=rf"connection to {endpoint} failed for {s3_source.url}: ") as err:
            lane.register()  # a ServiceError: answered; a dropped connection would be a ConnectionError
        assert (err.value.status, err.value.code) == (503, "store_unavailable")  # transient: ask again later
        assert "ConnectionResetError" in daemon.log() or "RemoteDisconnected" in daemon.log()
        proxy.clear()
        assert lane.register()["items"] == 2  # the same daemon lists it once the store answers


def test_each_store_failure_of_a_listing_for_jobs_is_answered_with_its_status_and_code_and_logged_in_a_line(
    s3_source, fault_proxy, tmp_path, short_dir
):
    """Every store failure of the daemon's listing (``PUT /v1/jobs/JOB``, ``POST /v1/manifests``)
    was answered 500 ``internal`` and logged with a stack trace, as a bug of ours: a client could
    not tell a store that may answer later from one that refuses, or a source that names nothing.
    Each is answered with its own status and code (a :class:`StoreError`), the message naming the
    store and the cause, and logged as one warning line. Failed before: 500 ``internal``."""
    proxy, endpoint = fault_proxy
    sock = short_dir / "api.sock"
    missing = "s3://no-such-bucket/train/"
    config, one = one_rank_job(s3_source, tmp_path, sock, storage_options=via(s3_source, endpoint), retries=0)
    jobs = yaml.safe_load(config.read_text())
    jobs["jobs"]["sources"].append(missing)
    config.write_text(yaml.safe_dump(jobs))
    cases = [  # (fault, source, status, code, message)
        ("403", s3_source.url, 502, "store_error", rf"access denied to {s3_source.url}"),
        ("InvalidAccessKeyId", s3_source.url, 502, "store_error", rf"{endpoint} rejected the credentials"),
        ("503", s3_source.url, 503, "store_unavailable", r"unavailable .*SlowDown"),
        (None, missing, 422, "source_not_found", r"no such bucket .*NoSuchBucket"),
        (None, s3_source.url, 422, "empty_source", r"the source lists no objects"),
    ]
    with DaemonProcess(config) as daemon:
        for fault, source, status, code, message in cases:
            with JobClient("train", {**one, "source": source}, 0, socket=sock) as lane:
                for request in (lane.register, lambda: lane.index(source)):  # noqa: B023 - called in this turn
                    proxy.clear()
                    if fault is not None:
                        proxy.inject(fault, 100)
                    with pytest.raises(StoreError, match=message) as err:
                        request()
                    assert (err.value.status, err.value.code) == (status, code), err.value
                    assert err.value.retryable == (status == 503)
        log = daemon.log()
        assert "Traceback" not in log and "internal" not in log
        answered = [line for line in log.splitlines() if line.startswith("WARNING cachepipe.service.api: ")]
        assert len(answered) == 2 * len(cases), log  # one line per answer
        assert "PUT /v1/jobs/train: 502 store_error: [Errno 13] access denied to " in answered[0]
        proxy.clear()
        s3_source.folders(2, {"a.bin": KIB})
        with JobClient("train", one, 0, socket=sock) as lane:
            assert lane.register()["items"] == 2  # the same daemon lists it once the store answers


def test_a_manifest_listed_by_the_daemon_is_retried_as_jobs_options_say(s3_source, fault_proxy, tmp_path, short_dir):
    """``POST /v1/manifests`` lists for jobs, with ``jobs.options``' credentials: it takes their
    retries too, as a job's own listing does. It listed with the default 12 retries whatever they
    said (against a store resetting every connection, about 55 s before its answer). Failed
    before: the SlowDown was retried, and the listing answered 200."""
    proxy, endpoint = fault_proxy
    s3_source.folders(2, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    config, one = one_rank_job(s3_source, tmp_path, sock, storage_options=via(s3_source, endpoint), retries=0)
    with DaemonProcess(config) as daemon, JobClient("train", one, 0, socket=sock) as lane:
        proxy.inject("503", 1)  # one SlowDown: the first listing's first request
        with pytest.raises(StoreError, match=r"SlowDown") as err:
            lane.index(s3_source.url)
        assert (err.value.status, err.value.code) == (503, "store_unavailable")
        assert "retry 1/" not in daemon.log()
        assert len(lane.index(s3_source.url)) == 32  # the next listing: the store answers


def test_a_store_endpoint_that_never_answers_is_answered_as_a_store_error(s3_source, tmp_path, short_dir):
    """An endpoint that refuses the daemon's first connection (a wrong ``endpoint_url``) is not
    retried by the daemon, nor worth retrying by a client: 502 ``store_error``, not 503. Failed
    before: 500 ``internal``."""
    with socket.socket() as free:  # a port nobody listens on: refused
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    sock = short_dir / "api.sock"
    config, one = one_rank_job(s3_source, tmp_path, sock, storage_options=via(s3_source, f"http://127.0.0.1:{port}"))
    with DaemonProcess(config) as daemon, JobClient("train", one, 0, socket=sock) as lane:
        with pytest.raises(StoreError, match=rf"cannot reach http://127.0.0.1:{port} for {s3_source.url}: ") as err:
            lane.register()
        assert (err.value.status, err.value.code) == (502, "store_error")
        assert not err.value.retryable
        assert "Traceback" not in daemon.log()


def test_a_reload_that_changes_the_jobs_section_says_it_takes_a_restart(s3_source, tmp_path, short_dir):
    """First-hour review: a reload ignored a new jobs.capacity or jobs.sources and logged
    "nothing changed"; a job asking for the new source was then refused by the old section.
    Then it said "the jobs section changed", not which keys: each key not applied is named now
    (its value not: jobs.options may hold credentials)."""
    s3_source.folders(2, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    config, _ = one_rank_job(s3_source, tmp_path, sock)
    with DaemonProcess(config) as daemon:
        data = yaml.safe_load(config.read_text())
        data["jobs"]["capacity"] = "2MiB"
        data["jobs"]["options"]["storage_options"]["secret"] = "the-new-secret"
        config.write_text(yaml.safe_dump(data))
        daemon.reload()
        said = "reload: jobs.capacity and jobs.options.storage_options.secret changed (values not shown): not applied"
        assert said in daemon.log()  # before: "the jobs section changed", which key unsaid
        assert "this takes a restart" in daemon.log()
        assert "the-new-secret" not in daemon.log()
        assert daemon.stop() == 0


def test_the_keys_a_reload_of_the_jobs_section_names():
    """What the reload's warning names (pure): each key changed, added or removed, nested keys
    dotted; a section added or removed as itself; never a value."""
    old = {"capacity": "1MiB", "sources": ["s3://a/"], "options": {"storage_options": {"secret": "s1"}}}
    new = {"capacity": "1MiB", "sources": ["s3://b/"], "options": {"storage_options": {"secret": "s2", "key": "k"}}}
    assert _changed_keys(old, new, "jobs") == [
        "jobs.options.storage_options.key",
        "jobs.options.storage_options.secret",
        "jobs.sources",
    ]
    assert _changed_keys(None, new, "jobs") == _changed_keys(old, None, "jobs") == ["jobs"]
    assert _changed_keys(old, dict(old), "jobs") == []


def test_a_job_registered_again_after_a_restart_keeps_its_share_of_the_disk_and_its_items(s3_source, tmp_path, short_dir):
    """Found in review (a team's first week on a node): a share of the disk as ``jobs.capacity``
    was resolved against the free space at each registration, of which the jobs' own cached items
    had taken their part. After a daemon restart (a DaemonSet's rolling update) a job registered
    again got a fraction of its capacity (90% of 1 MiB, then 90% of what its 512 KiB left), dropped
    the items it kept (``retain="auto"``) and downloaded them again."""
    from test_disk_faults import tmpfs

    s3_source.folders(16, {"f": 32 * KIB})
    sock = short_dir / "api.sock"
    with tmpfs(tmp_path / "disk", "1m") as disk:
        jobs = {"root": str(disk / "jobs"), "capacity": "90%", "sources": [s3_source.url]}
        jobs["options"] = {"storage_options": s3_source.options}
        config = write_config(tmp_path, sock, jobs)
        job = {"source": s3_source.url, "world_size": 1, "ranks": [0], "num_workers": 1, "epochs": 2, "retain": "auto"}

        def read_epoch(lane: JobClient, epoch: int) -> dict:
            cursor: tuple[int, int] = (epoch, 0)
            while cursor[0] == epoch:
                cursor = lane.take(cursor, timeout=30).next
            lane.consume(cursor)
            with Client(socket=sock) as client:
                return client.status()["jobs"]["job/train"]["stats"]

        with DaemonProcess(config), JobClient("train", job, 0, socket=sock) as lane:
            lane.register()
            first = read_epoch(lane, 0)
        assert first["bytes_downloaded"] == 16 * 32 * KIB
        with DaemonProcess(config), JobClient("train", job, 0, socket=sock) as lane:
            lane.register()
            second = read_epoch(lane, 1)
    assert second["capacity"] == pytest.approx(first["capacity"], rel=0.02)
    assert second["bytes_downloaded"] == 0  # every item kept across the restart, none downloaded again


def test_a_take_waiting_when_its_job_is_deleted_registers_it_again_as_a_take_after_the_delete_does(
    s3_source, fault_proxy, tmp_path, short_dir
):
    """A lane's take waits for an item whose download is slow when the job is deleted (`cachepipe
    delete-job --force` on a run thought stopped). A take that comes after the delete registers
    the job again and starts over (docs/reference/http-api.md); before, one waiting at the delete
    was answered 500 "internal" (RuntimeError: the node pipeline closed under it), and JobClient
    raised ServiceError: the DataLoader worker died with an error that said nothing of the delete.
    Now it is 404, as after the delete, and the lane registers the job again and gets its item."""
    sock = short_dir / "api.sock"
    config, one, first, gate = a_job_whose_first_item_is_held(s3_source, fault_proxy, tmp_path, sock, 4)
    try:
        with DaemonProcess(config), Client(socket=sock) as admin, JobClient("train", one, 0, socket=sock) as lane:
            lane.register()
            waiter, got = taking(lane, 60)
            wait_until(lambda: admin.status()["jobs"]["job/train"]["waiting"], what="the take waiting in the daemon")
            admin.delete_job("train")
            gate.set()
            waiter.join(60)
            registered = list(admin.status()["jobs"])
    finally:
        gate.set()
    assert "error" not in got, got  # before: ServiceError 500 internal "... is closed"
    assert got["item"].name == first and registered == ["job/train"]


def test_a_delete_does_not_wait_for_another_job_s_registration_to_list(s3_source, fault_proxy, tmp_path, short_dir):
    """A registration holds the daemon's one registration at a time while its source lists (for
    minutes on a large bucket); a delete of another job answers meanwhile. (A first fix of the
    test above held that lock through a delete's close: `cachepipe delete-job` waited for every
    listing under way.) A registration of the deleted name waits for its close alone."""
    proxy, endpoint = fault_proxy
    s3_source.folders(4, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    config, one = one_rank_job(s3_source, tmp_path, sock, storage_options=via(s3_source, endpoint))
    gate, done = threading.Event(), threading.Event()
    try:
        with DaemonProcess(config), Client(socket=sock) as admin:
            register(sock, "first", {**one, "capacity": "256KiB"})
            proxy.hold(lambda head: "list-type=2" in head, gate, limit=120)  # the next listing waits for the gate
            second = threading.Thread(target=lambda: register(sock, "second", {**one, "capacity": "256KiB"}))
            second.start()
            wait_until(lambda: sum("list-type=2" in head for head in proxy.requests) >= 2, 30, "the second job's listing")

            def delete() -> None:
                admin.delete_job("first")
                done.set()

            deleting = threading.Thread(target=delete)
            deleting.start()
            wait_until(done.is_set, 30, "the delete to answer while the second job lists")
            gate.set()
            second.join(60)
            deleting.join(60)
            assert sorted(admin.status()["jobs"]) == ["job/second"]
    finally:
        gate.set()


def test_a_registration_waiting_for_its_job_s_delete_holds_no_other_job_s_registration(s3_source, tmp_path):
    """A job deleted while its lanes read (`cachepipe delete-job --force`): its lanes register it
    again at once, and that registration waits for the delete's close, which deletes every item
    of the job's cache (minutes for a large one). It waited holding the daemon's one registration
    at a time: every other job's registration (another job's ranks starting) waited for the
    delete too. In this process (a profile hook holds the delete's close in a deletion), over the
    moto server."""
    from cachepipe.plan import Cursor
    from cachepipe.service.jobs import Jobs, JobsConfig

    s3_source.folders(4, {"a.bin": KIB})
    config = JobsConfig(
        root=tmp_path / "jobs", capacity="1MiB", sources=[s3_source.url], options={"storage_options": s3_source.options}
    )
    one = {"source": s3_source.url, "world_size": 1, "ranks": [0], "capacity": "256KiB"}
    jobs = Jobs(config)
    held, go, waits = threading.Event(), threading.Event(), threading.Event()
    done: dict[str, object] = {}

    def hook(frame, event, arg) -> None:
        if event != "c_call":
            return
        name = getattr(arg, "__name__", None)
        if name == "rmdir" and not held.is_set():
            held.set()  # the delete's close deletes an item
            go.wait(30)
        elif name == "acquire" and frame.f_code.co_name == "wait":
            waits.set()  # the registration of the deleted job blocks, waiting for the delete

    def run(what: str, target, hooked: bool = False) -> threading.Thread:
        def body() -> None:
            if hooked:
                sys.setprofile(hook)
            try:
                done[what] = target()
            except Exception as exc:  # noqa: BLE001 - checked below
                done[what] = exc
            finally:
                sys.setprofile(None)

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    threads = []
    try:
        jobs.register("a", one)
        assert jobs.take("a", 0, 0, Cursor(0, 0), 30)  # an item on disk: the delete deletes it
        threads.append(run("delete", lambda: jobs.delete("a"), hooked=True))
        assert held.wait(30)
        threads.append(run("again", lambda: jobs.register("a", one), hooked=True))
        assert waits.wait(30)  # the lane registering the job again waits for the delete's close
        threads.append(run("other", lambda: jobs.register("b", one)))
        wait_until(lambda: "other" in done, 30, "another job's registration while the delete deletes")
        assert done["other"][0] is True, done  # created; before: waited for the delete's close
    finally:
        go.set()
        for thread in threads:
            thread.join(60)
        jobs.close()
    assert done["delete"] is None and done["again"][0] is True, done


def _aged(path: Path, seconds: float = 3600) -> None:
    """Make ``path`` look written ``seconds`` ago (its mtime, as the grace reads it)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_the_manifests_no_job_names_are_removed_after_the_grace_when_a_job_is_deleted_and_at_start(
    s3_source, tmp_path, short_dir
):
    """Every manifest given to the daemon or listed by it (node mode lists at every distributed
    run: a growing source, a new one each time) was kept under ``jobs.root/.manifests`` for good,
    outside any capacity, until the disk filled. Now those no job names are removed once older
    than ``jobs.manifest_grace``, when a job is deleted and at the start; those a registered
    job, or a job folder (for the job registered again after a restart), names are kept."""
    s3_source.folders(2, {"a.bin": KIB})
    sock, root = short_dir / "api.sock", tmp_path / "jobs"
    jobs = {"root": str(root), "capacity": "1MiB", "sources": [s3_source.url], "manifest_grace": 60, "max_jobs": 5}
    jobs["options"] = {"storage_options": s3_source.options}
    config = write_config(tmp_path, sock, jobs)
    folder = root / ".manifests"
    digests = []
    with DaemonProcess(config) as daemon, Client(socket=sock) as admin:
        with JobClient("lister", spec(s3_source), 0, socket=sock) as lane:
            for n in range(6):  # the source grows between listings: a manifest each
                s3_source.put(f"grown{n}/a.bin", b"x")
                digests.append(lane.index(s3_source.url))
        kept, gone, dropped, fresh, orphan, shared = digests
        for name, digest in (("kept", kept), ("gone", gone), ("dropped", dropped), ("one", shared), ("two", shared)):
            register(sock, name, spec(s3_source, catalog=digest, capacity=64 * KIB))
        for digest in (kept, gone, orphan, shared):
            _aged(folder / f"{digest}.json.gz")
        admin.delete_job("gone")
        admin.delete_job("one")  # "two" still plans from it
        names = {p.name for p in folder.glob("*.json.gz")}
        assert names == {f"{d}.json.gz" for d in (kept, dropped, fresh, shared)}, (names, digests)
        log = daemon.log()
        assert f"manifest {gone} removed: its last job, 'gone', was deleted (written 36" in log, log
        assert f"manifest {orphan} removed: no job names it (written 36" in log, log
        admin.delete_job("two")
        assert not (folder / f"{shared}.json.gz").exists()
        assert f"manifest {shared} removed: its last job, 'two', was deleted" in daemon.log()
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(60) == 0
    remove_tree(root / "dropped")  # its folder removed by hand: nothing will register it again
    for digest in (kept, dropped, fresh):
        _aged(folder / f"{digest}.json.gz")
    _aged(folder / "jobs" / "dropped")
    with DaemonProcess(config) as daemon:
        assert sorted(p.name for p in folder.glob("*.json.gz")) == [f"{kept}.json.gz"]  # the folder "kept" names it
        log = daemon.log()
        for digest in (dropped, fresh):
            assert f"manifest {digest} removed: no job folder under jobs.root names it (the daemon's start)" in log, log
        assert register(sock, "kept", spec(s3_source, catalog=kept, capacity=64 * KIB))["catalog_digest"] == kept
        # a removal waits for no write: while an upload is under way (held for its last byte), none is removed
        with Client(socket=sock) as admin, JobClient("kept", spec(s3_source), 0, socket=sock) as lane:
            body = lane.manifest_bytes(kept)
            with contextlib.closing(_upload_held(sock, body)) as held:
                wait_until(lambda: list(folder.glob(".upload-*")), 60, "the held upload's temporary file")
                admin.delete_job("kept")
                assert (folder / f"{kept}.json.gz").exists()
                assert f"manifests in {folder}: none removed now: a manifest is being written there" in daemon.log()
                held.sendall(body[-1:])
                held.settimeout(60)
                assert held.recv(4096).startswith(b"HTTP/1.1 200 ")


def test_a_second_daemon_on_a_jobs_root_another_serves_is_refused_naming_it(s3_source, tmp_path, short_dir):
    """Two daemons on one jobs.root (a second ``cachepipe serve`` with another socket, a new one
    started while the old one drains) both served: each gave its jobs all of jobs.capacity, and
    each removed job folders and manifests it thought unused. Now the second is refused at its
    start, naming the root and the first; it starts once the first stopped. ``serve --check``
    beside the first says it holds the root, and passes (it is run before a restart of that one)."""
    root = tmp_path / "jobs"
    configs = []
    for n in ("one", "two"):
        (tmp_path / n).mkdir()
        configs.append(write_config(tmp_path / n, short_dir / f"{n}.sock", {"root": str(root), "capacity": "1MiB"}))
    with DaemonProcess(configs[0]) as first:
        second = DaemonProcess(configs[1])
        try:
            with pytest.raises(DaemonExited) as err:
                second.start()
        finally:
            second.close()
        assert not (short_dir / "two.sock").exists()  # the refused daemon's socket is not left behind
        message = f"jobs.root {str(root)!r} is in use by another cachepipe daemon (pid {first.pid} on {socket.gethostname()}, "
        assert message in str(err.value) and f"socket {short_dir / 'one.sock'})" in str(err.value), str(err.value)
        check = [sys.executable, "-m", "cachepipe.cli", "serve", "--check", "--config", str(configs[1])]
        checked = subprocess.run(check, capture_output=True, text=True, timeout=60, check=False)
        assert checked.returncode == 0, checked.stderr  # before: the same, without a word of the first daemon
        held = (
            f"jobs.root {str(root)!r} is held by a running cachepipe daemon (pid {first.pid} on {socket.gethostname()}, "
            f"socket {short_dir / 'one.sock'}): a restart or reload of that daemon is fine; a second daemon on this "
            "jobs.root would exit 1 while that one runs (one daemon per jobs.root)\n"
        )
        assert held in checked.stdout, checked.stdout
        first.signal(signal.SIGTERM)
        assert first.proc.wait(60) == 0
    with DaemonProcess(configs[1]), Client(socket=short_dir / "two.sock") as client:
        assert client.status()["pid"]


def test_a_job_folder_without_a_note_keeps_the_manifests_at_start(s3_source, tmp_path, short_dir):
    """A job folder whose note is missing (left by a cachepipe before the notes, 2026-12-01, or
    whose note could not be written): the start removed every manifest older than the grace,
    the one that job plans from too, and its lanes, registering it again after the restart (an
    upgrade), were refused: 409 ``no manifest of that digest was uploaded``. Such a folder
    keeps them all now, said in the log, until its job registers again (which notes it); a
    job registered without a catalog notes so, and keeps none."""
    s3_source.folders(2, {"a.bin": KIB})
    sock, root = short_dir / "api.sock", tmp_path / "jobs"
    jobs = {"root": str(root), "capacity": "1MiB", "sources": [s3_source.url], "manifest_grace": 60}
    jobs["options"] = {"storage_options": s3_source.options}
    config = write_config(tmp_path, sock, jobs)
    folder = root / ".manifests"
    with DaemonProcess(config) as daemon:
        with JobClient("lister", spec(s3_source), 0, socket=sock) as lane:
            planned = lane.index(s3_source.url)
            s3_source.put("grown/a.bin", b"x")
            orphan = lane.index(s3_source.url)
        register(sock, "old", spec(s3_source, catalog=planned, capacity=64 * KIB))
        register(sock, "plain", spec(s3_source, capacity=64 * KIB))  # lists the source: no catalog
        daemon.signal(signal.SIGTERM)
        assert daemon.proc.wait(60) == 0
    (folder / "jobs" / "old").unlink()  # as a version before the notes left it
    for digest in (planned, orphan):
        _aged(folder / f"{digest}.json.gz")
    with DaemonProcess(config) as daemon, Client(socket=sock) as admin:
        assert register(sock, "old", spec(s3_source, catalog=planned, capacity=64 * KIB))["catalog_digest"] == planned
        assert f"{orphan}.json.gz" in {p.name for p in folder.glob("*.json.gz")}  # kept by the start
        assert f"manifests in {folder}: none removed: the job folder 'old' names none" in daemon.log(), daemon.log()
        register(sock, "plain", spec(s3_source, capacity=64 * KIB))
        admin.delete_job("plain")  # every job folder is noted now: the orphan goes
        assert sorted(p.name for p in folder.glob("*.json.gz")) == [f"{planned}.json.gz"]


def test_a_job_s_folder_stays_with_its_items_under_the_capacity_it_takes(s3_source, tmp_path, short_dir):
    """Blocks review (a guard, no defect found): a job's node cache has all the capacity the job
    took of ``jobs.capacity``, and its folder ``jobs.root/NAME`` is a block no cache's ledger
    counts; what keeps the job under its capacity is its state's charge, which counts the
    journal as it was at the open and the whole journal's budget besides (a block at least
    more than the state takes). Measured as the cache counts (the Sampler's walk, in whole
    blocks), the daemon's lock and the manifests' folder left out (outside jobs.capacity)."""
    from sampling import Sampler, block_of, charge
    from test_disk_faults import tmpfs
    from test_node import state_of

    from cachepipe.cache import tree_bytes

    data = s3_source.folders(12, {"a": 512, "b": 512, "c": 512})
    sock = short_dir / "api.sock"
    with tmpfs(tmp_path / "disk", "4m") as disk:
        block = block_of(disk)
        # a capacity that holds the job's state and three items exactly
        capacity = state_of(s3_source.url, disk, storage_options=s3_source.options) + 3 * charge(disk, [512] * 3, 1)
        root = disk / "jobs"
        jobs = {"root": str(root), "capacity": f"{capacity}B", "sources": [s3_source.url]}
        jobs["options"] = {"storage_options": s3_source.options}
        job = {"source": s3_source.url, "world_size": 1, "ranks": [0], "num_workers": 1}
        got = []
        with DaemonProcess(write_config(tmp_path, sock, jobs)), JobClient("train", job, 0, socket=sock) as lane:
            lane.register()
            with Sampler(root) as sampler:
                cursor: tuple[int, int] = (0, 0)
                while (item := lane.take(cursor, timeout=30)) is not None:
                    got.append(item.name)
                    time.sleep(0.05)  # a slow consumer: the downloads run ahead, as far as the cap lets them
                    cursor = item.next
                lane.consume(cursor)
            # beside the jobs: the daemon's lock and the manifests' folder, outside jobs.capacity (docs/multinode.md)
            outside = block + tree_bytes(root / ".manifests", block=block) + block * (root / ".manifests").is_dir()
    assert sorted(got) == sorted(data)
    assert sampler.samples > 0 and sampler.peak - outside <= capacity, f"{sampler.peak - outside} bytes under {capacity}"
