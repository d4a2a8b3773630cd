"""Client and CLI against a live daemon subprocess (moto S3 behind it); the HTTP protocol with curl."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cachepipe import UnknownItemError
from cachepipe.cli import EXIT_END, EXIT_REFUSED, EXIT_TIMEOUT, format_status, main
from cachepipe.client import Client, ServedItem, ServiceError
from cachepipe.jobclient import JobClient
from cachepipe.service.testing import DaemonProcess

KIB = 1024
FILES = {"a.bin": KIB, "b.txt": 10}
CLI = [sys.executable, "-m", "cachepipe.cli"]


@pytest.fixture
def served(s3_source, s3_endpoint, tmp_path, short_dir):
    """A daemon serving 'train' (6 folders of the moto source); yields its socket path."""
    s3_source.folders(6, FILES)
    sock = short_dir / "api.sock"
    config = {
        "socket": str(sock),
        "pipelines": {
            "train": {
                "source": s3_source.url,
                "cache_dir": str(tmp_path / "cache"),
                "capacity": "1MiB",
                "storage_options": {"endpoint_url": s3_endpoint},
            }
        },
    }
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(config))
    with DaemonProcess(path):
        yield sock


def run(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}, check=False
    )


ALL = [f"item{i:03d}" for i in range(6)]


# ---- Client ------------------------------------------------------------------------------
def test_iterating_a_client_acks_each_item_on_next(served, monkeypatch):
    monkeypatch.setenv("CACHEPIPE_SOCKET", str(served))  # the default socket, as the daemon reads it
    names = []
    for item in Client(pipeline="train"):
        assert isinstance(item, ServedItem) and item.path.is_dir()
        assert (item / "a.bin").stat().st_size == KIB and sorted(item.files) == ["a.bin", "b.txt"]
        names.append(item.name)
    assert names == ALL
    with Client() as client:  # the daemon's only pipeline
        stats = client.status()["pipelines"]["train"]["stats"]
        assert stats["items_acked"] == 6 and stats["items_released"] == 0
        assert client.get(timeout=5) is None  # every item was delivered


def test_breaking_out_of_the_loop_releases_the_item(served):
    client = Client("train", served)
    for item in client:
        first = item
        break
    with Client("train", served, auto_ack=False) as again:
        assert again.get(timeout=30).name == first.name  # released, not evicted: handed out first
        assert again.status()["pipelines"]["train"]["stats"]["items_released"] == 1


def test_explicit_ack_release_renew_and_lease_checks(served):
    with Client("train", served, auto_ack=False) as client:
        a = client.get(timeout=30)
        b = client.get(timeout=30)
        assert (a.name, b.name) == ("item000", "item001") and a.lease != b.lease
        client.renew(a)
        client.release(b)
        assert client.get(timeout=30).name == "item001"  # back at the front of the queue
        with pytest.raises(UnknownItemError, match=r"handed out under another lease \(your lease expired after lease_timeout="):
            client.ack(a.path, lease="1-999")  # a lease that is not the live one: refused (409), saying so
        client.ack(a)
        with pytest.raises(UnknownItemError):
            client.ack(a)  # only once
        with pytest.raises(UnknownItemError):
            client.release(served.parent / "elsewhere")


def test_client_errors(served, short_dir):
    with Client("nope", served) as client:
        with pytest.raises(ServiceError) as info:
            client.get(timeout=1)
        assert info.value.status == 404 and "train" in str(info.value)
    with Client("train", short_dir / "absent.sock", startup_timeout=0.5) as client:  # the default waits 10 s
        with pytest.raises(ConnectionError, match=r"cannot reach the cachepipe daemon .* \(tried for 0.5 s\)") as err:
            client.status()
        assert "TCP" not in str(err.value)
    with Client("train", "127.0.0.1:5311", startup_timeout=0) as client, pytest.raises(ConnectionError) as err:
        client.status()  # a TCP address given as the socket: a file of that name was looked for, without a word
    assert str(err.value).endswith("; a socket path, not a TCP address: write http://127.0.0.1:5311 for TCP")
    with Client("train", served, auto_ack=False) as client:
        for _ in range(6):
            client.get(timeout=30)
        with pytest.raises(TimeoutError):
            client.get(timeout=0.3)  # all six are leased (600 s): nothing comes in time
    client = Client("train", served)
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.status()


# ---- CLI ---------------------------------------------------------------------------------
def test_cli_next_ack_release_status(served):
    sock = str(served)
    first = run("next", "--socket", sock)
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip()
    assert path.endswith("/item000") and Path(path, "a.bin").exists()

    second = run("next", "--socket", sock, "--pipeline", "train", "--json")
    item = json.loads(second.stdout)
    assert item["name"] == "item001" and item["lease"] and item["path"].endswith("/item001")

    assert run("release", item["path"], "--lease", item["lease"], "--socket", sock).returncode == 0
    assert run("ack", item["path"], "--lease", item["lease"], "--socket", sock).returncode == EXIT_REFUSED  # released already
    assert run("ack", path, "--socket", sock).returncode == 0
    assert not Path(path).exists()
    refused = run("ack", path, "--socket", sock)
    assert refused.returncode == EXIT_REFUSED and "not an item handed out" in refused.stderr

    table = run("status", "--socket", sock)
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[1].split()[:6] == ["PIPELINE", "STATE", "READY", "LEASED", "HANDED", "ACKED"]
    assert lines[2].split()[:2] == ["train", "open"] and lines[2].split()[5] == "1"
    info = json.loads(run("status", "--json", "--socket", sock).stdout)
    assert info["pipelines"]["train"]["stats"]["items_acked"] == 1


def test_cli_exit_codes(served, short_dir):
    env = {"CACHEPIPE_SOCKET": str(served)}  # the default socket, as the daemon reads it
    with Client("train", served, auto_ack=False) as client:
        items = [client.get(timeout=30) for _ in range(5)]
        last = run("next", env=env).stdout.strip()
        assert last.endswith("/item005")
        timeout = run("next", "--timeout", "0.3", env=env)
        assert timeout.returncode == EXIT_TIMEOUT, timeout.stderr  # all six leased
        for item in items:
            client.ack(item)
    assert run("ack", last, env=env).returncode == 0
    end = run("next", env=env)
    assert end.returncode == EXIT_END and "every item was delivered" in end.stderr
    down = run("status", "--socket", str(short_dir / "absent.sock"), "--startup-timeout", "0.5")  # the default waits 10 s
    assert down.returncode == 1 and "cannot reach the cachepipe daemon" in down.stderr and "tried for 0.5 s" in down.stderr
    assert run("next", "--timeout", "x").returncode == 2  # usage
    for bad in ("-1", "nan"):  # before: -1 took an item, nan exited 1 without naming the option
        usage = run("next", "--timeout", bad)
        assert usage.returncode == 2 and f"--timeout/-t: {bad!r}: expected a number of seconds >= 0" in usage.stderr, usage.stderr


def test_bash_consumer_with_cachepipe_next_and_done_markers(served, tmp_path):
    """The README's shell loop: take with `cachepipe next`, ack with a .done marker."""
    exe = shutil.which("cachepipe", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the cachepipe console script is not installed (pip install -e .)")
    script = f"""
        set -u
        while true; do
            path=$({exe} next --timeout 30) || {{ status=$?; break; }}
            cat "$path/b.txt" > /dev/null
            basename "$path" >> {tmp_path}/seen
            touch "$path/.done"
        done
        exit $status   # 3: every item was delivered; 4: timeout; 1: error
    """
    proc = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CACHEPIPE_SOCKET": str(served)},
        check=False,
    )
    assert proc.returncode == EXIT_END, proc.stderr
    assert (tmp_path / "seen").read_text().split() == ALL
    with Client("train", served) as client:
        assert client.status()["pipelines"]["train"]["stats"]["items_acked"] == 6


def test_protocol_with_curl(served):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")

    def call(method: str, route: str, body: str | None = None) -> tuple[int, str]:
        args = [curl, "-sS", "--unix-socket", str(served), "-X", method, "-w", "\n%{http_code}", f"http://localhost{route}"]
        if body is not None:
            args += ["-H", "Content-Type: application/json", "-d", body]
        out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
        text, _, code = out.rpartition("\n")
        return int(code), text

    code, text = call("POST", "/v1/pipelines/train/next", '{"timeout": 30}')
    item = json.loads(text)
    assert code == 200 and set(item) == {"pipeline", "name", "path", "lease", "size", "files"} and item["size"] == KIB + 10
    code, text = call(
        "POST", "/v1/pipelines/train/next", json.dumps({"timeout": 30, "ack": {"path": item["path"], "lease": item["lease"]}})
    )
    second = json.loads(text)
    assert code == 200 and second["name"] == "item001"
    code, text = call("POST", "/v1/ack", json.dumps({"path": item["path"], "lease": item["lease"]}))
    assert code == 409 and json.loads(text)["error"] == "lease_conflict"  # acked already (piggybacked)
    assert call("POST", "/v1/release", json.dumps({"path": second["path"], "lease": second["lease"]}))[0] == 200
    assert call("POST", "/v1/renew", json.dumps({"path": second["path"], "lease": second["lease"]}))[0] == 409
    code, text = call("GET", "/v1/health")
    assert code == 200 and json.loads(text)["status"] == "ok"
    code, text = call("GET", "/metrics")
    assert code == 200 and 'cachepipe_items_acked_total{pipeline="train"} 1.0' in text
    assert call("GET", "/v1/status")[0] == 200
    assert call("POST", "/v1/pipelines/nope/next", "{}")[0] == 404
    assert call("GET", "/v1/pipelines/train/next")[0] == 405
    assert call("GET", "/v1/nothing")[0] == 404
    assert call("POST", "/v1/pipelines/train/next", "{not json")[0] == 400
    assert call("POST", "/v1/pipelines/train/next", '{"timeout": -1}')[0] == 400
    assert call("POST", "/v1/ack", '{"lease": "x"}')[0] == 400
    assert call("POST", "/v1/ack", '{"path": "/etc/passwd"}')[0] == 409  # not handed out (outside every cache)
    for _ in range(5):
        assert call("POST", "/v1/pipelines/train/next", "{}")[0] == 200
    assert call("POST", "/v1/pipelines/train/next", '{"timeout": 0.2}')[0] == 408  # all six leased


def test_format_status_is_a_table():
    info = {
        "version": "0.1.0",
        "pid": 1,
        "uptime_seconds": 65,
        "socket": "/run/s",
        "pipelines": {
            "train": {
                "state": "open",
                "leased": 2,
                "source": "s3://b/p/",
                "stats": {
                    "items_ready": 3,
                    "items_handed": 7,
                    "items_acked": 5,
                    "items_redelivered": 0,
                    "items_failed": 0,
                    "bytes_in_cache": 3 * 1024**2,
                    "capacity": 50 * 1024**3,
                },
            },
            "val": {"state": "down", "error": "EmptySourceError: no items", "leased": 0, "source": "s3://b/v/", "stats": None},
        },
    }
    text = format_status(info)
    lines = text.splitlines()
    assert lines[0] == "cachepipe 0.1.0, pid 1, up 1m5s, socket /run/s"
    assert lines[2].split() == ["train", "open", "3", "2", "7", "5", "0", "0", "3.0", "MiB", "50.0", "GiB", "s3://b/p/"]
    assert lines[3].split()[:2] == ["val", "down"] and lines[-1] == "val: EmptySourceError: no items"


# ---- jobs in the CLI -------------------------------------------------------------------------
@pytest.fixture
def jobs_served(tmp_path, short_dir):
    """A daemon with a jobs section only (no pipelines) over a local source of 2 folders; yields
    its socket path and a job's spec (one rank)."""
    src = tmp_path / "src"
    for i in range(2):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "a.bin").write_bytes(bytes(100))
    sock = short_dir / "api.sock"
    config = tmp_path / "cachepipe.yaml"
    config.write_text(yaml.safe_dump({"socket": str(sock), "jobs": {"root": str(tmp_path / "jobs"), "capacity": "1MiB"}}))
    with DaemonProcess(config):
        yield sock, {"source": str(src), "world_size": 1, "ranks": [0]}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``cachepipe ARGS`` in this process (no interpreter to start): exit status, stdout, stderr."""
    status = main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_status_shows_a_row_per_job(jobs_served, capsys):
    # A daemon whose only work was jobs showed a header of pipelines and nothing else; with no
    # job registered yet it still did (an empty table), now a line saying what it serves.
    sock, spec = jobs_served
    status, out, _ = cli(capsys, "status", "--socket", str(sock))
    assert status == 0 and out.splitlines()[1:] == [
        (
            "no pipelines: this daemon serves jobs only, and none is registered now (CachePipeDataset(node=SOCKET) "
            "registers its job at its first iteration, docs/multinode.md; `cachepipe status` then shows a row per job)"
        )
    ], out
    with JobClient("train", {**spec, "num_workers": 2}, 0, socket=sock) as lane:
        assert lane.take((0, 0), timeout=30).name == "item0"
        status, out, _ = cli(capsys, "status", "--socket", str(sock))
        lines = out.splitlines()
        assert status == 0 and len(lines) == 3, out  # no table of pipelines: there are none
        assert (
            " ".join(lines[1].split())
            == "JOB STATE LANES DONE WAITING READY TAKEN CONSUMED FAILED SKIPPED CACHED CAPACITY SOURCE"
        )
        row = lines[2].split()
        assert row[:5] == ["train", "open", "2", "0", "0"] and row[6:10] == ["1", "0", "0", "0"], out
        assert row[-3:] == ["1.0", "MiB", spec["source"]], out
        lane.consume((1, 0))  # both lanes move past the end of their share
        with JobClient("train", {**spec, "num_workers": 2}, 0, worker=1, socket=sock) as other:
            other.consume((1, 0))
        info = json.loads(cli(capsys, "status", "--json", "--socket", str(sock))[1])
        assert info["jobs"]["job/train"]["lanes_done"] == 2
        row = cli(capsys, "status", "--socket", str(sock))[1].splitlines()[2].split()
        assert row[:4] == ["train", "done", "2", "2"], row


def test_delete_job_names_what_exists_and_refuses_a_job_still_read_without_force(jobs_served, capsys, tmp_path):
    sock, spec = jobs_served
    socket = ["--socket", str(sock)]
    with JobClient("train", spec, 0, socket=sock) as lane:
        assert lane.take((0, 0), timeout=30).name == "item0"
    status, _, err = cli(capsys, "delete-job", "nope", *socket)
    assert status == 1 and "no job 'nope' on this daemon: the jobs registered are 'train'" in err, err

    status, _, err = cli(capsys, "delete-job", "train", *socket)  # its lane has not read its share
    assert status == EXIT_REFUSED, err
    assert err.startswith("cachepipe: job 'train': 1 of its 1 lanes have not consumed their share"), err
    assert err.rstrip().endswith("--force deletes it anyway"), err
    assert (tmp_path / "jobs" / "train" / "item0").is_dir()  # nothing was deleted

    assert cli(capsys, "delete-job", "train", "--force", *socket) == (0, "", "")
    assert not (tmp_path / "jobs" / "train" / "item0").exists()  # its items are deleted
    with Client(socket=sock) as client:
        assert client.status()["jobs"] == {}
    status, _, err = cli(capsys, "delete-job", "train", *socket)
    assert status == 1 and "no job 'train' on this daemon: no job is registered" in err, err

    with JobClient("done", spec, 0, socket=sock) as lane:
        lane.register()
        lane.consume((1, 0))  # its one lane read its whole share: deleted without --force
    assert cli(capsys, "delete-job", "done", *socket) == (0, "", "")


def test_format_status_puts_the_jobs_below_the_pipelines():
    stats = {"items_ready": 1, "items_handed": 4, "items_acked": 3, "items_failed": 0, "items_skipped": 1}
    stats |= {"bytes_in_cache": 1024, "capacity": 2048}
    job = {"job": "train", "spec": {"source": "s3://b/j/"}, "lanes": [[0, 0], [1, 0]], "lanes_done": 1, "waiting": 1}
    info = {
        "pipelines": {"val": {"state": "open", "leased": 0, "source": "s3://b/v/", "stats": {"items_ready": 2}}},
        "jobs": {"job/train": {**job, "stats": stats}},
    }
    lines = format_status(info).splitlines()
    assert lines[1].split()[0] == "PIPELINE" and lines[2].split()[:3] == ["val", "open", "2"] and lines[3] == ""
    assert lines[4].split()[:3] == ["JOB", "STATE", "LANES"]
    assert lines[5].split() == ["train", "open", "2", "1", "1", "1", "4", "3", "0", "1", "1.0", "KiB", "2.0", "KiB", "s3://b/j/"]


def test_cli_next_prints_a_name_that_is_not_utf8_as_its_bytes_and_acks_it(tmp_path, short_dir):
    """A file name of Latin-1 bytes is handed out as those bytes, under a locale whose stdout is
    strict (en_US.UTF-8's: ``PYTHONIOENCODING=utf-8`` stands in for it). Before, ``next`` took
    the item and then failed to print it: the consumer never got the path it now holds."""
    src = os.fsencode(tmp_path / "src")
    os.makedirs(src + b"/caf\xe9")
    with open(src + b"/caf\xe9/f", "wb") as fh:
        fh.write(b"x" * 10)
    sock = short_dir / "api.sock"
    train = {"source": f"file://{tmp_path / 'src'}", "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB"}
    config = {"socket": str(sock), "pipelines": {"train": train}}
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(config))
    strict = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    with DaemonProcess(path):
        for args in (["next"], ["next", "--with-lease"]):
            taken = subprocess.run([*CLI, *args, "--socket", str(sock)], capture_output=True, env=strict, timeout=60, check=False)
            assert taken.returncode == 0, taken.stderr.decode(errors="replace")
            printed = taken.stdout.rstrip(b"\n").split(b" ")[-1]
            assert printed == os.fsencode(tmp_path / "cache") + b"/caf\xe9"
            with open(printed + b"/f", "rb") as fh:
                assert fh.read() == b"x" * 10
            lease = ["--lease", taken.stdout.split(b" ")[0].decode()] if "--with-lease" in args else []
            verb = "ack" if lease else "release"
            argv = [*CLI, verb, printed, *lease, "--socket", str(sock)]
            done = subprocess.run(argv, capture_output=True, env=strict, timeout=60, check=False)
            assert done.returncode == 0, done.stderr.decode(errors="replace")
        assert not os.path.exists(printed)
