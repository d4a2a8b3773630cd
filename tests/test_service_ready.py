"""The daemon is ready when it is reachable: consumers started with it or across a restart get
items, not errors; ``cachepipe wait``; a clean run logs no warning; ``serve --check`` checks the
host as ``serve`` would; ``serve`` without the service extra is one line, not a traceback.

The daemon runs as a real subprocess; waits are on events (a process exit, READY=1) with timeouts.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from cachepipe.client import Client
from cachepipe.service.testing import DaemonProcess

KIB = 1024
FILES = {"a.bin": KIB, "b.txt": 10}
CLI = [sys.executable, "-m", "cachepipe.cli"]


def write_config(tmp_path: Path, sock: Path, endpoint: str, source: str, **top) -> Path:
    data = {
        "socket": str(sock),
        **top,
        "pipelines": {
            "train": {
                "source": source,
                "cache_dir": str(tmp_path / "cache"),
                "capacity": "1MiB",
                "storage_options": {"endpoint_url": endpoint},
            }
        },
    }
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def wait_until(predicate, timeout: float = 30.0):
    """Poll a status query until it is true, with a deadline (returns False at the deadline)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return value


def cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# ---- readiness -----------------------------------------------------------------------------
def test_consumers_started_with_the_daemon_get_an_item_not_an_error(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(3, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, s3_source.url)
    # before the daemon: no socket yet; each waits for it as long as the daemon may take to start
    # on a loaded machine (DaemonProcess waits 60 s for READY=1), not the default 10 s
    taker = cli("next", "--socket", str(sock), "--timeout", "60", "--startup-timeout", "60")
    got: list = []

    def take() -> None:
        with Client("train", sock, auto_ack=False, startup_timeout=60) as client:
            got.append(client.get(timeout=60))

    thread = threading.Thread(target=take)
    thread.start()
    with DaemonProcess(config):
        out, err = taker.communicate(timeout=60)
        thread.join(60)
        assert taker.returncode == 0, err
        assert Path(out.strip()).is_dir()
        assert len(got) == 1 and got[0] is not None and got[0].path.is_dir()
        assert got[0].path != Path(out.strip())


def test_the_socket_appears_only_once_the_daemon_answers(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, s3_source.url)
    # With no patience at all, the first request after the socket appears must be answered.
    prober = cli("wait", "--socket", str(sock), "--timeout", "60")
    with DaemonProcess(config) as daemon:
        out, err = prober.communicate(timeout=60)
        assert prober.returncode == 0 and out.strip() == "ok", err
        taker = subprocess.run(
            [*CLI, "next", "--socket", str(sock), "--timeout", "30", "--startup-timeout", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert taker.returncode == 0, taker.stderr
        assert daemon.stop() == 0
    assert sorted(p.name for p in short_dir.iterdir()) == []  # no socket, no temporary name left


def test_wait_exits_4_when_no_daemon_comes_and_rejects_a_bad_timeout(short_dir):
    proc = subprocess.run(
        [*CLI, "wait", "--socket", str(short_dir / "none.sock"), "--timeout", "0.3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 4 and "waited 0.3 s for a cachepipe daemon to serve at" in proc.stderr, proc.stderr
    bad = subprocess.run([*CLI, "wait", "--timeout", "soon"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "'soon': expected a number of seconds >= 0" in bad.stderr
    with pytest.raises(ValueError, match=r"startup_timeout -1: expected a number of seconds >= 0"):
        Client("train", short_dir / "none.sock", startup_timeout=-1)


LOOP = r"""
set -u
while true; do
    path=$(cachepipe_cli next --timeout 60) || { status=$?; break; }
    echo "$path" >> "$SEEN"
    cachepipe_cli ack "$path" || true      # refused after a restart: the item comes again
done
exit "$status"
"""


def test_a_restart_does_not_end_a_consumer_loop(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(6, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, s3_source.url)
    seen = tmp_path / "seen.txt"
    seen.touch()
    env = {**os.environ, "CACHEPIPE_SOCKET": str(sock), "SEEN": str(seen)}
    # the loop's commands wait for the restarted daemon as long as it may take on a loaded machine
    # (DaemonProcess waits 60 s for READY=1), not the default 10 s
    script = f'cachepipe_cli() {{ {sys.executable} -m cachepipe.cli "$@" --startup-timeout 60; }}\n' + LOOP
    with DaemonProcess(config) as first:
        loop = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with Client("train", sock, auto_ack=False) as client:
            # the loop's second hand-out: only the daemon's counters tell (polled, with a deadline)
            handed_two = wait_until(lambda: client.status()["pipelines"]["train"]["stats"]["items_handed"] >= 2)
            assert handed_two, loop.poll()
        assert first.stop() == 0
    with DaemonProcess(config):
        _out, err = loop.communicate(timeout=120)
    assert loop.returncode == 3, f"the loop ended with {loop.returncode}: {err}"
    names = {Path(p).name for p in seen.read_text().split()}
    assert names == {f"item{i:03d}" for i in range(6)}


# ---- a clean run logs no warning -------------------------------------------------------------
def test_a_daemon_whose_source_holds_an_item_over_its_capacity_exits_78(s3_source, s3_endpoint, tmp_path, short_dir):
    # It exited 1 (could not start), which the shipped unit restarts every 5 s, each start listing
    # the same item again.
    s3_source.folders(2, {"big.bin": 2 * 1024 * KIB})
    config = write_config(tmp_path, short_dir / "api.sock", s3_endpoint, s3_source.url)
    proc = subprocess.run([*CLI, "serve", "--config", str(config)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 78, proc.stderr
    assert "cannot start: OversizeError" in proc.stderr and "on_oversize" in proc.stderr, proc.stderr


def test_a_clean_run_logs_no_warning(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(6, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, s3_source.url)
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        for _ in range(2):
            item = client.get(timeout=30)
            (item / ".done").touch()  # a marker ack
            assert wait_until(lambda item=item: not item.path.exists())
        data = yaml.safe_load(config.read_text())
        data["pipelines"]["train"]["lease_timeout"] = 300  # a change: the pipeline is rebuilt, its watch renewed
        config.write_text(yaml.safe_dump(data))
        daemon.reload()
        item = client.get(timeout=30)
        (item / ".done").touch()
        assert wait_until(lambda: not item.path.exists())
        assert daemon.stop() == 0
        log = daemon.log()
    assert "Warning" not in log and "Traceback" not in log, log


# ---- serve --check checks the host as serve does -------------------------------------------
def host_cases(tmp_path: Path) -> dict:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    return {
        "group": (
            {"socket_group": "cachepipe-no-such-group"},
            (
                "socket_group 'cachepipe-no-such-group': no such group on this system; expected an existing group name or "
                "number (create it: groupadd --system cachepipe-no-such-group; or leave socket_group out"
            ),
        ),
        "cache under a file": (
            {"pipelines": {"train": {"cache_dir": str(blocker / "cache")}}},
            f"pipelines.train.cache_dir '{blocker}/cache': '{blocker}' on its path is not a directory",
        ),
        "socket dir under a file": (
            {"socket": str(blocker / "api.sock")},
            f"socket '{blocker}/api.sock': its directory: '{blocker}' is not a directory",
        ),
        "socket path taken": ({"socket": str(blocker)}, f"socket '{blocker}': exists and is not a socket"),
        # access(2) lets root pass there: --check said "valid", and serve exited 1 (restarted by systemd, again and again)
        "cache under /proc": (
            {"pipelines": {"train": {"cache_dir": "/proc/cachepipe-cache"}}},
            "pipelines.train.cache_dir '/proc/cachepipe-cache': cannot be created: '/proc' is on a proc filesystem",
        ),
        "cache in /sys": (
            {"pipelines": {"train": {"cache_dir": "/sys/kernel"}}},
            "pipelines.train.cache_dir '/sys/kernel': is on a sysfs filesystem, which holds the kernel's own files",
        ),
        "tcp host": ({"tcp_port": 0, "tcp_host": "999.1.1.1"}, "tcp_host '999.1.1.1': cannot resolve it"),
        "tcp host elsewhere": ({"tcp_port": 0, "tcp_host": "192.0.2.1"}, "tcp_host '192.0.2.1': cannot listen there"),
        "tcp host typo": ({"tcp_port": 0, "tcp_host": "127.0.0..1"}, "tcp_host '127.0.0..1': not a host name or address"),
        "scheme": (
            {"pipelines": {"train": {"source": "nosuchscheme://b/p/"}}},
            "pipelines.train.source 'nosuchscheme://b/p/': unknown URL scheme 'nosuchscheme://'",
        ),
        # refused when the pipeline is built (serve exited 78 after binding its socket; --check said "valid")
        "storage option": (
            {"pipelines": {"train": {"storage_options": {"endpoint": "http://127.0.0.1:9"}}}},
            (
                "pipelines.train: storage_options['endpoint'] is not an option of s3:// (s3fs.core.S3FileSystem) "
                "for 's3://b/p/'; did you mean 'endpoint_url'?"
            ),
        ),
        "endpoint without scheme": (
            {"pipelines": {"train": {"storage_options": {"endpoint_url": "localhost:5123"}}}},
            (
                "pipelines.train: storage_options endpoint_url 'localhost:5123' for 's3://b/p/' has no scheme: write it "
                "http://localhost:5123"
            ),
        ),
        "endpoint with credentials": (  # --check said valid, serve exited 1: the host did not resolve
            {"pipelines": {"train": {"storage_options": {"endpoint_url": "http://AK:s3cr3t@127.0.0.1:9"}}}},
            (
                "pipelines.train: storage_options endpoint_url 'http://***@127.0.0.1:9' for 's3://b/p/' holds "
                "credentials (before its '@'), which the S3 client does not take from the URL"
            ),
        ),
        "obstore key without secret": (
            {"pipelines": {"train": {"storage_options": {"engine": "obstore", "key": "AK"}}}},
            (
                "pipelines.train: storage_options['key'] is given without storage_options['secret'] for 's3://b/p/': "
                "with engine='obstore' they go together"
            ),
        ),
        "obs client refuses": (
            {
                "pipelines": {
                    "train": {"source": "obs://b/p/", "storage_options": {"server": "http://127.0.0.1:9", "timeout": None}}
                }
            },
            (
                "pipelines.train: obs://b/p/: obs.ObsClient refused the storage options it was given "
                "(server='http://127.0.0.1:9', timeout=None): Exception: timeout can not be None"
            ),
        ),
        "options not a mapping": (  # was a traceback (AttributeError), exit 1
            {"pipelines": {"train": {"storage_options": {"client_kwargs": 5}}}},
            (
                "pipelines.train: storage_options client_kwargs for 's3://b/p/' is a value of type int: expected a "
                "mapping of option names to values"
            ),
        ),
        "obstore options not a mapping": (  # was a traceback (TypeError), exit 1
            {"pipelines": {"train": {"storage_options": {"engine": "obstore", "config_kwargs": {"s3": "path"}}}}},
            "pipelines.train: storage_options config_kwargs['s3'] for 's3://b/p/' is a value of type str: expected a mapping",
        ),
        "scheme short of a slash": (
            {"pipelines": {"train": {"source": "s3:/no-such-bucket/videos/"}}},
            (
                "pipelines.train: source 's3:/no-such-bucket/videos/': no such local path, and a scheme without its '//'; "
                "expected a URL like 's3://no-such-bucket/videos/'"
            ),
        ),
        "jobs storage option": (  # checked against jobs.sources at start, as a pipeline's (was: when a job registered)
            {
                "jobs": {
                    "root": str(tmp_path / "jobs"),
                    "capacity": "1GiB",
                    "sources": ["s3://b/"],
                    "options": {"storage_options": {"endpoint_url": "http://127.0.0.1:9", "endpont": "x"}},
                }
            },
            (
                "jobs.options.storage_options, for jobs.sources 's3://b/': storage_options['endpont'] is not an "
                "option of s3:// (s3fs.core.S3FileSystem) for 's3://b/'; did you mean 'endpoint_url'?"
            ),
        ),
        "no scheme": (  # a relative local path to the daemon, whatever its working directory holds
            {"pipelines": {"train": {"source": "no-such-bucket/videos/"}}},
            (
                "pipelines.train.source = 'no-such-bucket/videos/': a relative local path; the daemon would read it "
                "from its own working directory ('/' under systemd), not from the folder of its config file or of "
                "the shell that checks it: expected an absolute path (such as /srv/no-such-bucket/videos/), or a URL "
                "if an object store was meant (s3://no-such-bucket/videos/)"
            ),
        ),
    }


CASES = ["group", "cache under a file", "socket dir under a file", "socket path taken", "cache under /proc", "cache in /sys"]
CASES += ["tcp host", "tcp host elsewhere", "tcp host typo", "scheme", "storage option", "endpoint without scheme"]
CASES += ["endpoint with credentials"]
CASES += ["obstore key without secret", "obs client refuses", "options not a mapping", "obstore options not a mapping"]
CASES += ["scheme short of a slash", "no scheme", "jobs storage option"]


@pytest.mark.parametrize("case", CASES)
def test_check_reports_what_serve_would_refuse_naming_the_value(tmp_path, case):
    override, expected = host_cases(tmp_path)[case]
    data = {
        "socket": str(tmp_path / "s.sock"),
        "pipelines": {"train": {"source": "s3://b/p/", "cache_dir": str(tmp_path / "c"), "capacity": "1GiB"}},
    }
    for key, value in override.items():
        if key == "pipelines":
            data["pipelines"]["train"].update(value["train"])
        else:
            data[key] = value
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(data))
    said = []
    for args in (["serve", "--check", "--config", str(path)], ["serve", "--config", str(path)]):
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 78, (args, proc.stderr)
        assert expected in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and "s3cr3t" not in proc.stderr
        said.append(proc.stderr)
    assert said[0] == said[1]  # the same refusal, from the same checks
    assert not (tmp_path / "s.sock").exists()


def test_check_accepts_a_config_this_host_can_run(tmp_path):
    own_group = grp.getgrgid(os.getegid()).gr_name
    data = {
        "socket": str(tmp_path / "run" / "s.sock"),
        "socket_group": own_group,
        "pipelines": {"train": {"source": "s3://b/p/", "cache_dir": str(tmp_path / "new" / "c"), "capacity": "1GiB"}},
    }
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [*CLI, "serve", "--check", "--config", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0 and "valid" in proc.stdout, proc.stderr
    user = f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"  # whose rights were checked
    assert f"checked on this host, as {user}: the socket's folder and each cache_dir take a new folder" in proc.stdout
    assert not (tmp_path / "new").exists() and not (tmp_path / "run").exists()  # --check changes nothing
    assert sorted(os.listdir(tmp_path)) == ["cachepipe.yaml"]  # its probes are gone


# ---- serve without the service extra ---------------------------------------------------------
HIDE = r"""
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == sys.argv[1]:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
from cachepipe.cli import main
sys.exit(main(sys.argv[2:]))
"""


def serve_and_check(tmp_path: Path, *child: str) -> list[str]:
    """``cachepipe serve`` and ``serve --check`` of a small config, run by ``python -c *child``:
    each one's stderr, checked to be one line and exit 78 (a configuration the host cannot run)."""
    data = {
        "socket": str(tmp_path / "s.sock"),
        "pipelines": {"train": {"source": "s3://b/p/", "cache_dir": str(tmp_path / "c"), "capacity": "1GiB"}},
    }
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(data))
    errors = []
    for args in (["serve", "--config", str(path)], ["serve", "--check", "--config", str(path)]):
        proc = subprocess.run([sys.executable, "-c", *child, *args], capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 78, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        errors.append(proc.stderr)
    return errors


def test_serve_without_the_service_extra_is_one_line_naming_module_and_install(tmp_path):
    for error in serve_and_check(tmp_path, HIDE, "prometheus_client"):
        assert "'prometheus_client'" in error and "pip install 'cachepipe[service]'" in error
