"""An operator's week with the daemon: reloads, signals, probes and the commands an SRE runs,
against a real ``cachepipe serve`` subprocess (and its config file), with faults at the network
(the fault proxy) where a test must hold a listing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from test_service_lifecycle import FILES, write_config
from waiting import wait_until

import cachepipe
from cachepipe.client import Client
from cachepipe.errors import ConfigError
from cachepipe.service.config import load_config
from cachepipe.service.testing import DaemonProcess
from cachepipe.stores import check_store


def test_a_pipeline_a_reload_rebuilds_is_reported_reloading_not_open_while_it_lists(s3_source, fault_proxy, tmp_path, short_dir):
    # A reload that rebuilds a pipeline (here a new cache_dir) closes it and lists its source
    # again, minutes for a large bucket, while its consumers wait. Meanwhile `cachepipe status`
    # said "open", /v1/health "ok" and cachepipe_pipeline_up 1, for a pipeline that served nothing.
    proxy, endpoint = fault_proxy
    s3_source.folders(2, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, endpoint)
    gate = threading.Event()
    try:
        with DaemonProcess(config) as daemon, Client("train", sock) as client:
            data = yaml.safe_load(config.read_text())
            wait_until(lambda: client.status()["pipelines"]["train"]["stats"]["items_ready"] == 2, 30, "the items")
            data["pipelines"]["train"]["cache_dir"] = str(tmp_path / "moved")  # a new cache: listed anew
            config.write_text(yaml.safe_dump(data))
            proxy.hold(lambda head: head.startswith("GET "), gate, limit=60)
            before = len(proxy.requests)  # the start's
            daemon.signal(signal.SIGHUP)
            daemon.wait_for("RELOADING=1")
            wait_until(lambda: len(proxy.requests) > before, 30, "the rebuilt pipeline's listing")
            reloading = client.status()["pipelines"]["train"]
            assert reloading["state"] == "reloading"
            # before: the closed pipeline's counters (items_ready 2), which the rebuilt one does not go on from
            assert (reloading["stats"], reloading["pass"], reloading["leased"]) == (None, None, 0), reloading
            assert client.health() == {"status": "degraded", "pipelines": {"train": "reloading"}}
            assert 'cachepipe_pipeline_up{pipeline="train"} 0.0' in client.metrics()
            gate.set()
            assert "train: " in daemon.wait_for("READY=1")
            assert client.status()["pipelines"]["train"]["state"] == "open"
            assert client.health() == {"status": "ok", "pipelines": {"train": "open"}}
            assert 'cachepipe_pipeline_up{pipeline="train"} 1.0' in client.metrics()
    finally:
        gate.set()


def test_an_environment_override_of_null_sets_the_field_to_null_as_the_file_does(tmp_path, monkeypatch):
    # `epochs: null` (endless), `lease_timeout: null` (never) and `tcp_port: null` (no listener)
    # are documented values of the file, and every field can be overridden by a CACHEPIPE_*
    # variable; but CACHEPIPE_PIPELINES__TRAIN__EPOCHS=null was refused (exit 78: "unable to
    # parse string as an integer"): no variable could set a field back to null.
    config = tmp_path / "cachepipe.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "socket": str(tmp_path / "api.sock"),
                "tcp_port": 9464,
                "pipelines": {"train": {"source": "s3://bucket/p/", "cache_dir": str(tmp_path / "c"), "capacity": "1MiB"}},
            }
        )
    )
    monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__EPOCHS", "null")
    monkeypatch.setenv("CACHEPIPE_PIPELINES__TRAIN__LEASE_TIMEOUT", "null")
    monkeypatch.setenv("CACHEPIPE_TCP_PORT", "null")
    loaded = load_config(config)
    assert (loaded.pipelines["train"].epochs, loaded.pipelines["train"].lease_timeout, loaded.tcp_port) == (None, None, None)


def cachepipe_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m cachepipe ARGS`` of the cachepipe this test imported, to its end (120 s at most)."""
    return subprocess.run(
        [sys.executable, "-m", "cachepipe", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(cachepipe.__file__).parents[1])},
        timeout=120,
        check=False,
    )


def test_wait_with_no_socket_yet_says_it_waits_its_timeout_not_the_startup_timeout(short_dir):
    # The Kubernetes probes run `cachepipe wait --timeout 5`; with no socket yet it said "waiting
    # up to 10 s for a daemon to start there (--startup-timeout ...)" and gave up after 5 s, and
    # with --startup-timeout 0 it said nothing at all while it waited its --timeout.
    sock = short_dir / "none.sock"
    for extra in ([], ["--startup-timeout", "0"]):
        done = cachepipe_cli("wait", "--socket", str(sock), "--timeout", "0.5", *extra)
        assert done.returncode == 4, done.stderr
        first, *rest = done.stderr.splitlines()
        assert first.startswith(f"cachepipe wait: no daemon socket at {sock} yet; waiting up to 0.5 s for a daemon"), first
        assert "(--timeout;" in first, first
        # its end, one message: before, two glued ("... was not ready within 0.5 s: cannot reach the
        # cachepipe daemon at ...: [Errno 2] ... (tried for 0.5 s) (is `cachepipe serve` running?
        # `cachepipe wait` waits for it to be ready)"), which told `cachepipe wait` to use itself
        assert rest == [
            (
                f"cachepipe: waited 0.5 s for a cachepipe daemon to serve at {sock}: no socket there; start one "
                "(`cachepipe serve --config FILE`), or name the socket one serves (--socket or $CACHEPIPE_SOCKET)"
            )
        ], done.stderr


def test_wait_for_a_daemon_that_starts_says_once_that_it_waits(tmp_path, short_dir):
    # `cachepipe wait` (its default --timeout, 30 s) on no socket yet said it twice: its own line,
    # and the client's warning "the cachepipe daemon at ... is not answering yet: trying for up
    # to 30 s" (a wait longer than a start's). A daemon of jobs alone: nothing to list.
    sock = short_dir / "api.sock"
    config = tmp_path / "cachepipe.yaml"
    config.write_text(yaml.safe_dump({"socket": str(sock), "jobs": {"root": str(tmp_path / "jobs"), "capacity": "1MiB"}}))
    env = {**os.environ, "PYTHONPATH": str(Path(cachepipe.__file__).parents[1])}
    with subprocess.Popen(
        [sys.executable, "-m", "cachepipe", "wait", "--socket", str(sock)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as waiting:
        assert waiting.stderr is not None and waiting.stdout is not None
        first = waiting.stderr.readline()  # said at once: the wait has begun
        with DaemonProcess(config):
            waiting.wait(timeout=60)
        out, err = waiting.stdout.read(), waiting.stderr.read()  # not communicate(): readline's buffer holds the rest
    assert first.startswith(f"cachepipe wait: no daemon socket at {sock} yet; waiting up to 30 s"), first
    assert (waiting.returncode, out, err) == (0, "ok\n", ""), (first, err)


@pytest.mark.parametrize("engine", ["s3fs", "obstore"])
def test_a_password_in_the_endpoint_url_is_not_written_to_the_log(tmp_path, short_dir, engine):
    # The check of the options hides the credentials of an endpoint_url (user:secret@host) in its
    # messages, but the store's own errors named the endpoint whole: a start that could not
    # reach it wrote the password to the journal. Such an endpoint is now refused by the check
    # (the S3 client takes no credentials from it), its password still unsaid.
    config = tmp_path / "cachepipe.yaml"
    options = {"endpoint_url": "http://user:Pa55word@127.0.0.1:1", "key": "AKIAEXAMPLE", "secret": "s3cret", "engine": engine}
    pipeline = {"source": "s3://bucket/p/", "cache_dir": str(tmp_path / "c"), "capacity": "1MiB", "storage_options": options}
    config.write_text(yaml.safe_dump({"socket": str(short_dir / "api.sock"), "pipelines": {"train": pipeline}}))
    done = cachepipe_cli("serve", "--config", str(config))
    assert done.returncode == 78, done.stderr  # EX_CONFIG
    assert "endpoint_url 'http://***@127.0.0.1:1' for 's3://bucket/p/' holds credentials" in done.stderr, done.stderr
    assert "Pa55word" not in done.stderr + done.stdout
    assert "s3cret" not in done.stderr + done.stdout


def test_an_endpoint_url_with_its_scheme_in_capitals_runs_and_another_scheme_is_named(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    # botocore reads HTTP://host as http://host, but the check refused it (exit 78, "has no
    # scheme: write it http://HTTP://..."), as it said of ftp://host that it had no scheme.
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    upper = "HTTP://" + s3_endpoint.removeprefix("http://")
    with DaemonProcess(write_config(tmp_path, sock, upper)), Client("train", sock) as client:
        assert client.get(timeout=30) is not None
    config = write_config(tmp_path, sock, "ftp://" + s3_endpoint.removeprefix("http://"))
    with pytest.raises(ConfigError, match="its scheme 'ftp' is not http or https; expected a URL like"):
        check_store("s3://data/video/", yaml.safe_load(config.read_text())["pipelines"]["train"]["storage_options"])


def test_a_sighup_while_the_configuration_loads_is_a_reload_once_the_daemon_runs(tmp_path, short_dir):
    # `kill -HUP` (or a config manager's reload) early in a start, before the daemon's handler was
    # installed, ended the process (exit 129: SIGHUP's default action). The configuration is a
    # named pipe here, so that the daemon waits in its load until the test writes it.
    src = tmp_path / "src"
    (src / "item0").mkdir(parents=True)
    (src / "item0" / "a.bin").write_bytes(b"x")
    train = {"source": f"{src}/", "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB"}
    text = yaml.safe_dump({"socket": str(short_dir / "api.sock"), "pipelines": {"train": train}}).encode()
    fifo = tmp_path / "cachepipe.yaml"
    os.mkfifo(fifo)

    def give(config: bytes) -> None:
        """Write ``config`` to the daemon once it opened the pipe to read it."""
        fd = wait_until(lambda: _writer(fifo), 30, "the daemon reading its configuration")
        try:
            os.write(fd, config)
        finally:
            os.close(fd)

    daemon = DaemonProcess(fifo, log_path=tmp_path / "daemon.log")
    starting = threading.Thread(target=daemon.start)
    starting.start()
    try:
        wait_until(lambda: daemon.proc is not None, 30, "the daemon spawned")
        fd = wait_until(lambda: _writer(fifo), 30, "the daemon reading its configuration")
        daemon.signal(signal.SIGHUP)  # while it loads
        try:
            os.write(fd, text)
        finally:
            os.close(fd)
        starting.join(60)
        assert daemon.proc.poll() is None, daemon.log()  # before: exit 129
        give(text)  # the reload it owes reads the configuration again
        daemon.wait_for("READY=1", 30)
        assert any(m.startswith("RELOADING=1") for m in daemon.messages), daemon.messages
        assert daemon.stop() == 0
    finally:
        daemon.close()
        starting.join(30)


def _writer(fifo: Path) -> int | None:
    """A write end of ``fifo`` once a reader has it open; None before."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader yet
        return None
