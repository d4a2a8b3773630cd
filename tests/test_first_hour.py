"""The first hour of a new user (issue #16): warnings visible without logging set up, wrong
input refused at once with its value named, and paths that outlive their item failing loudly."""

from __future__ import annotations

import io
import logging
import os
import platform
import re
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sampling import block_of

from cachepipe import CacheLockedError, ConfigError, Pipeline
from cachepipe.blocks import footprint
from cachepipe.cache.lock import OwnerLock
from cachepipe.map import map_items
from cachepipe.map.cli import main as map_main
from cachepipe.stores import open_store

ROOT = Path(__file__).resolve().parents[1]


def _source(tmp_path: Path, names: tuple[str, ...] = ("a", "b")) -> Path:
    src = tmp_path / "src"
    for name in names:
        (src / name).mkdir(parents=True)
        (src / name / "data.bin").write_bytes(name.encode() * 100)
    return src


# ---- visible by default ---------------------------------------------------------------
_SCRIPT = """
import logging, sys
from cachepipe import Pipeline
from cachepipe.stores import open_store

SETUP

class Flaky:
    def __init__(self, url, fail_times):
        self.inner, self.fail_times, self.calls = open_store(url), fail_times, 0
        self.url = url
    def list(self):
        return self.inner.list()
    def get(self, key, out, start, end):
        if key.startswith("bad/"):
            self.calls += 1
            if self.fail_times is None:
                raise PermissionError(13, "denied by the test store", key)
            if self.calls <= self.fail_times:
                raise ConnectionError("the test store is down")
        return self.inner.get(key, out, start, end)
    def close(self):
        self.inner.close()

src, cache, fail_times = sys.argv[1], sys.argv[2], eval(sys.argv[3])
store = Flaky(src, fail_times)
with Pipeline(src, cache, "10MiB", store=store, on_error="skip", retries=60, retry_backoff=0) as pipe:
    got = [item.name for item in pipe]
print(",".join(got))
"""


def _run(tmp_path: Path, setup: str, fail_times: int | None) -> subprocess.CompletedProcess[str]:
    src = _source(tmp_path, ("bad", "good"))
    script = _SCRIPT.replace("SETUP", setup)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", script, str(src), str(tmp_path / "cache"), repr(fail_times)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )


def test_a_skipped_item_is_on_stderr_when_logging_is_not_configured(tmp_path: Path) -> None:
    done = _run(tmp_path, "", fail_times=None)
    assert done.stdout.strip() == "good"
    assert "skipping failed item" in done.stderr
    assert "bad" in done.stderr


def test_configured_logging_decides_alone(tmp_path: Path) -> None:
    done = _run(tmp_path, "logging.basicConfig(level=logging.ERROR, format='USER %(name)s %(message)s')", fail_times=None)
    assert done.stdout.strip() == "good"
    lines = done.stderr.splitlines()
    assert lines and all(line.startswith("USER ") for line in lines), done.stderr  # the user's handler, nothing else
    assert "skipping" not in done.stderr  # a WARNING, under the level the user chose


def test_a_retry_storm_is_a_few_lines(tmp_path: Path) -> None:
    done = _run(tmp_path, "", fail_times=40)  # 40 transient failures, then the item downloads
    assert done.stdout.strip() == "bad,good"
    retries = [line for line in done.stderr.splitlines() if "retry " in line]
    assert 1 <= len(retries) <= 3, done.stderr
    assert "similar messages are held back" in retries[-1]


def test_rate_limit_admits_a_burst_per_period_and_counts_the_rest() -> None:
    from cachepipe.logfallback import RateLimit  # here: the module is new, the other tests run without it

    now = [0.0]
    limit = RateLimit(burst=2, period=10.0, clock=lambda: now[0])
    assert [limit.admit("k") for _ in range(5)] == ["", " (similar messages are held back for 10 s)", None, None, None]
    assert limit.admit("other") == ""
    now[0] = 10.0
    assert limit.admit("k") == " (3 similar messages held back)"


class _SetOn(logging.Handler):
    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def test_a_stalled_producer_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = _source(tmp_path, ("a",))
    seen = _SetOn("no item ready")
    inner = open_store(str(src))

    class Stalled:
        url = str(src)

        def list(self):  # type: ignore[no-untyped-def]
            return inner.list()

        def get(self, key, out, start, end):  # type: ignore[no-untyped-def]
            seen.event.wait(30)  # the download stalls until the consumer has warned about it
            return inner.get(key, out, start, end)

        def close(self) -> None:
            inner.close()

    logging.getLogger("cachepipe").addHandler(seen)
    try:
        with caplog.at_level(logging.WARNING, "cachepipe"):
            with Pipeline(str(src), tmp_path / "c", "10MiB", store=Stalled(), stall_warning=0.05) as pipe:
                assert [item.name for item in pipe] == ["a"]
    finally:
        logging.getLogger("cachepipe").removeHandler(seen)
    stalls = [r.getMessage() for r in caplog.records if "no item ready" in r.getMessage()]
    assert stalls and "1 downloading" in stalls[0]


def test_a_consumer_that_holds_the_room_of_the_next_item_is_told_what_it_needs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A consumer that keeps items (auto_ack=False) and asks for one more than the capacity
    # serves beside them waits for room only its own acks can free. The warning said "items
    # handed out ... hold their space" without the room the next item waits for, or what
    # capacity would serve such a consumer.
    src = tmp_path / "src"
    for name in ("a", "b", "c"):
        (src / name).mkdir(parents=True)
        (src / name / "data.bin").write_bytes(b"x" * (64 << 10))
    seen = _SetOn("no item ready")
    logging.getLogger("cachepipe").addHandler(seen)
    try:
        with caplog.at_level(logging.WARNING, "cachepipe"):
            with Pipeline(str(src), tmp_path / "c", "180KiB", auto_ack=False, stall_warning=0.05) as pipe:
                held = [pipe.get(timeout=30), pipe.get(timeout=30)]
                with pytest.raises(TimeoutError):
                    pipe.get(timeout=1)
                assert seen.event.is_set()
                pipe.ack_many(held)
                assert [item.name for item in [pipe.get(timeout=30)]] == ["c"]
    finally:
        logging.getLogger("cachepipe").removeHandler(seen)
    stall = next(r.getMessage() for r in caplog.records if "no item ready" in r.getMessage())
    assert "0 downloading, 2 handed out" in stall, stall
    assert re.search(r"; the next item waits for \d+\.\d KiB more room", stall), stall  # 64 KiB + its folder, less what is free
    assert "ack or release them" in stall and "a capacity that holds the items you keep, the next one" in stall, stall


# ---- refuse what is wrong, at once -----------------------------------------------------
def test_an_empty_cache_dir_is_refused(tmp_path: Path) -> None:
    src = _source(tmp_path)
    with pytest.raises(ValueError, match=r"cache_dir '': expected a directory path.*current directory"):
        Pipeline(str(src), "", "10MiB")


def test_a_cache_inside_an_open_cache_is_refused(tmp_path: Path) -> None:
    src = _source(tmp_path)
    outer, inner = tmp_path / "c", tmp_path / "c" / "inner"
    with Pipeline(str(src), outer, "10MiB"):
        with pytest.raises(CacheLockedError) as err:
            Pipeline(str(src), inner, "10MiB").open()
    message = str(err.value)
    assert f"'{inner}'" in message and f"'{outer}' that contains it" in message and f"pid {os.getpid()}" in message


def test_a_cache_around_an_open_cache_is_refused(tmp_path: Path) -> None:
    src = _source(tmp_path)
    outer, inner = tmp_path / "c", tmp_path / "c" / "x" / "inner"
    with Pipeline(str(src), inner, "10MiB"):
        with pytest.raises(CacheLockedError) as err:
            Pipeline(str(src), outer, "10MiB").open()
        assert not (outer / ".cachepipe" / "staging").exists()  # refused before it cleaned anything
    message = str(err.value)
    assert f"'{outer}'" in message and f"'{inner}' that lies inside it" in message
    with Pipeline(str(src), outer, "10MiB") as pipe:  # its owner closed: no longer refused
        assert [item.name for item in pipe] == ["a", "b"]


def test_the_nested_check_sees_another_process_and_forgets_a_dead_one(tmp_path: Path) -> None:
    src = _source(tmp_path)
    outer = tmp_path / "c"
    (outer / ".cachepipe").mkdir(parents=True)
    holder = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from cachepipe.cache.lock import OwnerLock
        lock = OwnerLock(Path({str(outer / ".cachepipe" / "lock")!r}), Path({str(outer)!r}))
        lock.acquire()
        print("held", flush=True)
        sys.stdin.read()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(CacheLockedError, match=rf"pid {child.pid} .*'{outer}' that contains it"):
            Pipeline(str(src), outer / "inner", "10MiB").open()
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    with Pipeline(str(src), outer / "inner", "10MiB") as pipe:  # a dead owner holds nothing
        assert [item.name for item in pipe] == ["a", "b"]
    lock = OwnerLock(outer / ".cachepipe" / "lock", outer)  # and the check took nothing from it
    lock.acquire()
    lock.release()


def test_a_source_without_scheme_that_does_not_exist_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"source 'bucket/video/': no such local path, and no scheme.*'s3://bucket/video/'"):
        Pipeline("bucket/video/", tmp_path / "c", "10MiB")
    assert not (tmp_path / "c").exists()


def test_a_bad_option_says_what_is_wrong_without_pydantics_link(tmp_path: Path) -> None:
    """Each error of a ``ValidationError`` ended with pydantic's "For further information visit
    https://errors.pydantic.dev/..." line: a page on pydantic, not on the option. The message
    says the rest as before; the exception is still pydantic's, with its errors' types and context."""
    from pydantic import ValidationError

    src = _source(tmp_path)
    with pytest.raises(ValidationError) as info:
        Pipeline(str(src), tmp_path / "c", "10GiBB", epochs=-1)
    text = str(info.value)
    assert text.splitlines() == [
        "2 validation errors for PipelineConfig",
        "capacity",
        (
            "  Value error, capacity '10GiBB': expected a positive number of bytes or a size like '50GiB', '1.5GB', '512M', "
            "'1g', or a share of free disk space like '80%' [type=value_error, input_value='10GiBB', input_type=str]"
        ),
        "epochs",
        "  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=-1, input_type=int]",
    ], text
    errors = info.value.errors()
    assert [(e["type"], e["loc"], e.get("ctx", {}).get("ge")) for e in errors] == [
        ("value_error", ("capacity",), None),
        ("greater_than_equal", ("epochs",), 1),
    ]
    with pytest.raises(ValidationError) as info:  # a credential's input hidden, as before, and no link either
        Pipeline(str(src), tmp_path / "c", "1MiB", storage_options="key=AKIA-SECRET", epochs=0)
    assert "AKIA-SECRET" not in str(info.value) and "errors.pydantic.dev" not in str(info.value), str(info.value)
    with pytest.raises(ValidationError) as info:  # map's options, called from Python
        map_items(["true"], str(src), str(tmp_path / "dst"), cache_dir=tmp_path / "m", capacity="1MiB", jobs=0)
    assert "jobs\n  Input should be greater than or equal to 1" in str(info.value), str(info.value)
    assert "errors.pydantic.dev" not in str(info.value), str(info.value)


def test_a_misspelt_option_is_refused_naming_the_option_it_resembles(tmp_path: Path) -> None:
    src = _source(tmp_path)
    with pytest.raises(ValueError, match=r"max_concurency=4.*did you mean 'max_concurrency'\?") as raised:
        Pipeline(str(src), tmp_path / "c", "10MiB", max_concurency=4)
    assert "on_error" in str(raised.value)  # and what is accepted
    with pytest.raises(ValueError, match=r"on_eror='skip'.*did you mean 'on_error'\?"):
        Pipeline(str(src), tmp_path / "c", "10MiB", on_eror="skip")
    assert not (tmp_path / "c").exists()


def test_a_cache_dir_under_home_is_the_users_home_not_a_folder_named_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _source(tmp_path)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    with Pipeline(str(src), "~/cache", "10MiB") as pipe:
        assert [item.name for item in pipe] == ["a", "b"]
    assert pipe.config.cache_dir == home / "cache"
    assert (home / "cache" / ".cachepipe").is_dir()
    assert not (work / "~").exists()


def test_index_refuses_a_source_without_scheme_as_the_pipeline_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachepipe.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["index", "bucket/video/", "-o", str(tmp_path / "m.gz")]) == 1
    err = capsys.readouterr().err
    assert "source 'bucket/video/': no such local path, and no scheme" in err and "'s3://bucket/video/'" in err
    assert not (tmp_path / "m.gz").exists()


def test_index_refuses_a_destination_a_slash_short_of_its_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachepipe.cli import main

    src = _source(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["index", str(src), "-o", "s3:/bucket/m.gz"]) == 1
    err = capsys.readouterr().err
    assert "manifest 's3:/bucket/m.gz': a scheme without its '//'; expected a URL like 's3://bucket/m.gz'" in err
    (tmp_path / "s3:" / "bucket").mkdir(parents=True)  # as a `cachepipe map SRC s3:/bucket/out/` makes it
    assert main(["index", str(src), "-o", "s3:/bucket/m.gz"]) == 1
    assert "a scheme without its '//'" in capsys.readouterr().err
    assert not (tmp_path / "s3:" / "bucket" / "m.gz").exists()


def test_index_names_the_url_a_destination_without_scheme_may_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachepipe.cli import main

    src = _source(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["index", str(src), "-o", "bucket/m.gz"]) == 1
    err = capsys.readouterr().err
    assert "no such folder 'bucket' (an object URL needs its scheme: 's3://bucket/m.gz')" in err


def test_index_with_a_storage_option_not_key_value_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cachepipe.cli import main

    src = _source(tmp_path)
    assert main(["index", str(src), "-o", str(tmp_path / "m.gz"), "--storage-option", "anon"]) == 2  # as `map -o anon`
    assert "storage option 'anon': expected KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "m.gz").exists()


def test_index_refuses_a_folder_or_nothing_as_its_destination_before_listing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachepipe.cli import main

    src = _source(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["index", str(src), "-o", str(out)]) == 1
    assert f"manifest '{out}': is a folder; expected a file path, such as '{out / 'manifest.gz'}'" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]  # no temp file beside it
    assert main(["index", str(src), "-o", ""]) == 1
    assert "manifest '': expected a file path or an object URL" in capsys.readouterr().err


def test_index_of_a_scheme_whose_backend_is_not_installed_is_one_line(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    done = subprocess.run(
        [sys.executable, "-m", "cachepipe", "index", "gs://my-bucket/videos/", "-o", str(tmp_path / "m.gz")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("cachepipe index: ") and "gcsfs" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_s3_without_the_s3_extra_names_the_extra_to_install(tmp_path: Path) -> None:
    shadow = tmp_path / "site" / "s3fs"  # an environment where `import s3fs` fails, as without cachepipe[s3]
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 's3fs'\", name='s3fs')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(tmp_path / "site"), str(ROOT)))}
    script = "from cachepipe import Pipeline\nPipeline('s3://my-bucket/videos/', sys.argv[1], '1GiB').open()"
    done = subprocess.run(
        [sys.executable, "-c", f"import sys\n{script}", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert "ImportError: s3:// needs s3fs, which is not installed: pip install 'cachepipe[s3]'" in done.stderr, done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "cachepipe", "index", "s3://my-bucket/videos/", "-o", str(tmp_path / "m.gz")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        1,
        "cachepipe index: s3:// needs s3fs, which is not installed: pip install 'cachepipe[s3]'\n",
    )


def test_serve_without_config_says_where_one_comes_from(capsys: pytest.CaptureFixture[str]) -> None:
    from cachepipe.cli import main

    assert main(["serve"]) == 2  # usage, as argparse's errors
    err = capsys.readouterr().err
    assert err.startswith("cachepipe serve: --config FILE is required") and "cachepipe print-config > cachepipe.yaml" in err


def test_serve_with_the_config_as_an_argument_says_to_give_it_as_config(capsys: pytest.CaptureFixture[str]) -> None:
    # argparse said "unrecognized arguments: conf.yaml" under the top-level usage, naming no option
    from cachepipe.cli import main

    assert main(["serve", "--check", "conf.yaml"]) == 2
    assert capsys.readouterr().err == (
        "cachepipe serve: unexpected argument 'conf.yaml': give the config file as --config conf.yaml\n"
    )
    assert main(["serve", "--config", "a.yaml", "b.yaml"]) == 2
    assert capsys.readouterr().err == "cachepipe serve: unexpected argument 'b.yaml': the config is --config a.yaml\n"


def test_index_takes_no_storage_option_as_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachepipe.cli import main

    src = _source(tmp_path)
    monkeypatch.chdir(tmp_path)
    for argv, said in (
        (["-o", "m.gz", "-o", "anon=true"], "-o given twice ('m.gz', then 'anon=true')"),  # map's -o carried over
        (["-o", "anon=true"], "-o 'anon=true': expected the manifest's path or object URL, not KEY=VALUE"),
    ):
        with pytest.raises(SystemExit) as stop:
            main(["index", str(src), *argv])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert said in err and "--storage-option KEY=VALUE" in err, err
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no manifest named 'anon=true', nor m.gz


@pytest.mark.parametrize("startup", ["0.3", "0"])
def test_next_without_a_daemon_says_at_once_that_it_waits_for_one(tmp_path: Path, startup: str) -> None:
    """Before, `cachepipe next` with no daemon said nothing for its whole startup timeout (10 s by default)."""
    sock = tmp_path / "none.sock"
    done = subprocess.run(
        [sys.executable, "-m", "cachepipe", "next", "--socket", str(sock), "--startup-timeout", startup],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        check=False,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 1
    assert lines[-1].startswith(f"cachepipe: cannot reach the cachepipe daemon at {sock}: "), done.stderr
    waiting = f"cachepipe next: no daemon socket at {sock} yet; waiting up to {startup} s for a daemon to start there"
    assert [line.startswith(waiting) for line in lines[:-1]] == ([True] if startup != "0" else [])


@pytest.mark.parametrize(
    ("socket", "said"),
    [
        ("http://127.0.0.1:notaport", "its port is not a number from 0 to 65535"),
        ("ftp://host/x", "a URL of scheme 'ftp'"),
        ("http://host", "no port"),
        ("http://:7480", "no host"),
    ],
)
def test_a_daemon_address_that_is_neither_a_path_nor_http_host_port_is_refused_naming_it(
    socket: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: Python's "Port could not be cast to integer value as 'notaport'", naming neither
    --socket nor what it takes; ftp://host/x was tried as a socket path for 10 s."""
    from cachepipe import Client
    from cachepipe.cli import main

    expected = f"socket {socket!r}: {said}; expected a Unix socket path, or http://HOST:PORT for a daemon's TCP listener"
    with pytest.raises(ValueError, match=re.escape(expected)):
        Client(socket=socket)
    assert main(["next", "--socket", socket]) == 1
    assert capsys.readouterr().err.startswith(f"cachepipe: {expected}")


def test_ctrl_c_on_a_waiting_next_is_one_line_and_exit_130(tmp_path: Path) -> None:
    import signal
    import socket

    path = tmp_path / "d.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:  # a daemon that takes the request, never answers
        server.bind(str(path))
        server.listen(1)
        server.settimeout(60)
        child = subprocess.Popen(
            [sys.executable, "-m", "cachepipe", "next", "--socket", str(path), "--startup-timeout", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 - a child of this test alone
        )
        conn, _ = server.accept()
        with conn:
            assert conn.recv(4096)  # its first request is sent: next waits for the answer
            child.send_signal(signal.SIGINT)
            out, err = child.communicate(timeout=60)
    assert (child.returncode, out, err) == (130, "", "cachepipe next: interrupted\n")


def test_a_skipped_oversize_item_is_logged_as_skipped_not_advised_to_be(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = _source(tmp_path)
    (src / "big").mkdir()
    (src / "big" / "data.bin").write_bytes(b"x" * 3 * 1024 * 1024)
    with caplog.at_level(logging.WARNING, "cachepipe"):
        with Pipeline(str(src), tmp_path / "c", "2MiB", on_oversize="skip") as pipe:
            assert [item.name for item in pipe] == ["a", "b"]
    # named with both its sizes: as listed, and what it takes in the cache's blocks (its file's, its folder's)
    block = block_of(tmp_path)
    assert (
        f"skipping item 'big' (on_oversize='skip'): 3145728 bytes listed, {footprint([3 * 1024 * 1024], 1, block)} "
        f"bytes in the filesystem's blocks of {block} bytes (each file rounded up to whole blocks, a block per "
        "folder), larger than the cache capacity of 2097152 bytes less "
    ) in caplog.text
    assert "pass on_oversize='skip'" not in caplog.text  # already passed


def test_an_empty_source_says_whether_it_listed_nothing_or_only_objects_outside_folders(tmp_path: Path) -> None:
    from cachepipe import EmptySourceError

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EmptySourceError, match=r"found no folders with objects: .*lists no objects; check the bucket and"):
        Pipeline(str(empty), tmp_path / "c", "10MiB").open()
    shards = tmp_path / "shards"  # a prefix of files, given in the default items="folders"
    shards.mkdir()
    for name in ("shard-000.tar", "shard-001.tar"):
        (shards / name).write_bytes(b"x" * 100)
    with pytest.raises(EmptySourceError, match=r"found no folders with objects: .*2 objects.*none in a folder.*items='files'"):
        Pipeline(str(shards), tmp_path / "c", "10MiB").open()


def test_a_url_with_one_slash_after_its_scheme_is_refused_naming_the_url_it_means(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for written in ("s3:/bucket/video/", "s3:bucket/video/"):
        with pytest.raises(ConfigError, match=r"expected a URL like 's3://bucket/video/'") as raised:
            Pipeline(written, tmp_path / "c", "10MiB")
        assert "s3://s3:" not in str(raised.value)


def test_a_capacity_under_one_mib_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = _source(tmp_path)
    with caplog.at_level(logging.WARNING, "cachepipe"):
        Pipeline(str(src), tmp_path / "c", "100")
    assert "capacity '100' is 100 bytes, less than 1 MiB" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "cachepipe"):
        Pipeline(str(src), tmp_path / "c", "1e5")
    assert "capacity '1e5' is 100000 bytes, less than 1 MiB" in caplog.text  # a number in a string, without a unit
    caplog.clear()
    with caplog.at_level(logging.WARNING, "cachepipe"):
        Pipeline(str(src), tmp_path / "c", "1MiB")
        Pipeline(str(src), tmp_path / "c", "512KiB")  # a unit: meant
    assert "capacity" not in caplog.text


def test_map_refuses_a_missing_command_before_downloading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _source(tmp_path)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"command 'nosuchcmd-cachepipe': not found on PATH"):
        map_items(["nosuchcmd-cachepipe", "{}"], str(src), str(tmp_path / "out"), cache_dir=cache, capacity="10MiB")
    status = map_main(
        [str(src), str(tmp_path / "out"), "--cache", str(cache), "--capacity", "10MiB", "--", "nosuchcmd-cachepipe"]
    )
    assert status == 1
    assert "command 'nosuchcmd-cachepipe': not found on PATH" in capsys.readouterr().err
    plain = tmp_path / "not-executable"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"command '{plain}': is not executable"):
        map_items([str(plain)], str(src), str(tmp_path / "out"), cache_dir=cache, capacity="10MiB")
    assert not cache.exists()  # nothing was downloaded


@pytest.mark.parametrize(
    ("dest", "said"),
    [
        ("s3:/my-bucket/out/", "dest 's3:/my-bucket/out/': a scheme without its '//'; expected a URL like 's3://my-bucket/out/'"),
        (
            "my-bucket/out/",
            (
                "dest 'my-bucket/out/': no scheme, and no local folder 'my-bucket' to make it in; expected a URL like "
                "'s3://my-bucket/out/'"
            ),
        ),
    ],
)
def test_map_refuses_a_destination_that_would_be_a_local_folder_made_by_mistake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dest: str, said: str
) -> None:
    src = _source(tmp_path)
    monkeypatch.chdir(tmp_path)
    status = map_main([str(src), dest, "--cache", str(tmp_path / "cache"), "--capacity", "10MiB", "--", "true"])
    assert status == 1
    err = capsys.readouterr().err
    assert err.startswith(f"cachepipe map: {said}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no folder 's3:' or 'my-bucket', no cache
    # local: a relative path in an existing folder, as an absolute path is
    assert map_main([str(src), "out", "--cache", str(tmp_path / "cache"), "--capacity", "10MiB", "--", "true"]) == 0
    assert (tmp_path / "out").is_dir()


@pytest.mark.parametrize("command", [["cp", "-r", "{}", "{out}"], ["true"]])
def test_map_without_its_destination_says_dst_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    status = map_main([str(_source(tmp_path)), "--cache", str(tmp_path / "cache"), "--capacity", "10MiB", "--", *command])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cachepipe map: DST '{command[0]}' is a command: give DST before the options and '--'"), err


def test_map_over_a_scheme_whose_backend_is_not_installed_is_one_line(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    flags = ["--cache", str(tmp_path / "c"), "--capacity", "1MiB"]
    done = subprocess.run(
        [sys.executable, "-m", "cachepipe.map", "gs://b/x/", str(tmp_path / "out"), *flags, "--", "true"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr.count("\n")) == (1, 1), done.stderr
    assert done.stderr.startswith("cachepipe map: gs:// needs a backend: ") and "gcsfs" in done.stderr, done.stderr


# ---- paths that outlive their item -----------------------------------------------------
def test_an_acknowledged_item_refuses_to_be_a_path(tmp_path: Path) -> None:
    src = _source(tmp_path)
    with Pipeline(str(src), tmp_path / "c", "10MiB", auto_ack=False) as pipe:
        item = pipe.get()
        assert item is not None and (item / "data.bin").read_bytes() == b"a" * 100
        pipe.ack(item)
        with pytest.raises(FileNotFoundError, match="item 'a' was acknowledged: its files are deleted"):
            open(item / "data.bin")  # noqa: SIM115 - the error is the point
        with pytest.raises(FileNotFoundError, match="was acknowledged"):
            os.fspath(item)


def test_items_kept_past_the_loop_refuse_to_be_paths(tmp_path: Path) -> None:
    src = _source(tmp_path)
    with Pipeline(str(src), tmp_path / "c", "10MiB") as pipe:
        kept = list(pipe)  # auto_ack: each is acknowledged when the loop asks for the next
    with pytest.raises(FileNotFoundError, match="item 'a' was acknowledged"):
        os.fspath(kept[0])
    with Pipeline(str(src), tmp_path / "c", "10MiB", auto_ack=False) as pipe:
        held = pipe.get()
    assert held is not None
    with pytest.raises(FileNotFoundError, match="item 'a' was deleted when its pipeline closed"):
        os.fspath(held)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_pipeline_refuses_use_in_a_forked_child(tmp_path: Path) -> None:
    src = _source(tmp_path)
    with Pipeline(str(src), tmp_path / "c", "10MiB", auto_ack=False) as pipe:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what get() did, then leave without running any cleanup
            try:
                pipe.get(timeout=5)
                outcome = b"no error"
            except RuntimeError as exc:
                outcome = b"ok" if b"cannot be used in process" in str(exc).encode() else str(exc).encode()
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the test
                outcome = repr(exc).encode()
            os.write(write, outcome)
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as fh:
            outcome = fh.read()
        os.waitpid(pid, 0)
        assert outcome == b"ok"
        assert [pipe.get(), pipe.get()] != [None, None]  # the parent's pipeline is untouched


# ---- the endpoint of AWS_ENDPOINT_URL, as the quick start sets it ---------------------
def test_errors_name_the_endpoint_set_by_aws_endpoint_url(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from cachepipe import StoreUnreachableError

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    fresh = {"skip_instance_cache": True}  # s3fs would reuse a client made for another endpoint
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    with pytest.raises(StoreUnreachableError, match=f"cannot reach {closed} "):
        Pipeline("s3://bucket/video/", tmp_path / "c1", "10MiB", storage_options=fresh).open()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    with pytest.raises(FileNotFoundError, match=f"no such bucket at {s3_endpoint}"):
        Pipeline("s3://nobucket/video/", tmp_path / "c2", "10MiB", storage_options=fresh).open()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", closed)  # botocore's S3-only variable comes first
    with pytest.raises(StoreUnreachableError, match=f"cannot reach {closed} "):
        Pipeline("s3://bucket/video/", tmp_path / "c3", "10MiB", storage_options=fresh).open()


def test_an_https_endpoint_that_speaks_http_is_unreachable_naming_it(s3_endpoint: str, tmp_path: Path) -> None:
    from cachepipe import StoreUnreachableError

    wrong = s3_endpoint.replace("http://", "https://")
    # the direct path, then s3fs (custom TLS verification), there with one botocore attempt: its
    # default retries of the handshake, with backoff, took 4-8 s before the same error
    once = {"retries": {"max_attempts": 1, "mode": "standard"}}
    for options in ({"endpoint_url": wrong}, {"endpoint_url": wrong, "client_kwargs": {"verify": True}, "config_kwargs": once}):
        with pytest.raises(StoreUnreachableError, match=f"cannot reach {wrong} for s3://bucket/video/: .*TLS") as raised:
            Pipeline("s3://bucket/video/", tmp_path / "c", "10MiB", storage_options=options).open()
        assert "http://" in str(raised.value).split("TLS", 1)[1]  # the likely fix, named


def test_a_name_of_undecodable_bytes_is_logged_by_a_strict_file_handler(tmp_path: Path) -> None:
    """A user's log file opened with a strict encoding (``logging.FileHandler(path, encoding="utf-8")``)
    gets the line of an item whose name holds surrogates, escaped as stderr writes them. Before,
    the line was lost and logging printed "--- Logging error ---" with a traceback instead."""
    script = textwrap.dedent(
        """
        import logging, sys
        import fsspec
        from cachepipe import Pipeline
        handler = logging.FileHandler(sys.argv[1], encoding="utf-8")  # errors: strict (basicConfig's escape)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger().addHandler(handler)
        root, fs = "memory://spelled/data", fsspec.filesystem("memory")
        fs.pipe(f"{root}/\\udcc3\\udca9/f", b"B" * 10)  # spells the UTF-8 of "é": unsafe, skipped
        fs.pipe(f"{root}/ok/f", b"A" * 10)
        with Pipeline(root, sys.argv[2], "1MiB", on_error="skip") as pipe:
            print(",".join(item.name for item in pipe))
        """
    )
    log = tmp_path / "train.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", script, str(log), str(tmp_path / "c")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "Logging error" not in done.stderr, done.stderr
    assert "\\udcc3\\udca9" in log.read_text(encoding="utf-8")


def test_a_strict_file_handler_on_a_module_s_logger_gets_a_name_of_undecodable_bytes(tmp_path: Path) -> None:
    """The same, with the handler on a child logger of the library's (``cachepipe.map``), whose
    handlers see a record before those of ``cachepipe``: the escaping, a handler there, came
    too late for it ("--- Logging error ---", and the line lost). Map fails an item named by the
    Latin-1 bytes ``caf\\xe9`` (its command exits 1), which ``cachepipe.map`` logs."""
    src = os.fsencode(tmp_path / "src")
    os.makedirs(src + b"/caf\xe9")
    with open(src + b"/caf\xe9/f", "wb") as fh:
        fh.write(b"x")
    script = textwrap.dedent(
        """
        import logging, sys
        from cachepipe.map import map_items
        handler = logging.FileHandler(sys.argv[1], encoding="utf-8")  # errors: strict
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("cachepipe.map").addHandler(handler)
        result = map_items(["false"], sys.argv[2], sys.argv[3], cache_dir=sys.argv[4], capacity="1MiB", retries=0)
        print(result.items_failed)
        """
    )
    log = tmp_path / "map.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", script, str(log), str(tmp_path / "src"), str(tmp_path / "out"), str(tmp_path / "c")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
    assert "Logging error" not in done.stderr, done.stderr
    assert "item caf\\udce9 failed after 1 attempt(s)" in log.read_text(encoding="utf-8")


def test_printable_escapes_surrogates_in_a_message_and_a_traceback_and_leaves_the_rest() -> None:
    from cachepipe.logfallback import printable

    plain = logging.LogRecord("cachepipe.x", logging.WARNING, __file__, 1, "item %s: %d", ("café", 3), None)
    printable(plain)
    assert (plain.msg, plain.args, plain.exc_text) == ("item %s: %d", ("café", 3), None)  # its template kept
    try:
        raise OSError(f"cannot open {os.fsdecode(b'caf' + bytes([0xE9]))}")
    except OSError:
        exc_info = sys.exc_info()
    odd = logging.LogRecord("cachepipe.x", logging.ERROR, __file__, 1, "item %s failed", ("caf\udce9",), exc_info)
    printable(odd)
    assert odd.getMessage() == "item caf\\udce9 failed"
    text = logging.Formatter().format(odd)
    text.encode("utf-8")  # strict: no surrogate left
    assert text.endswith("OSError: cannot open caf\\udce9")


def test_records_of_the_library_alone_are_made_printable_and_the_factory_is_installed_once() -> None:
    import cachepipe  # noqa: F401 - installs the record factory
    from cachepipe.logfallback import printable_records

    factory = logging.getLogRecordFactory()
    printable_records("cachepipe")  # as a module imported again would
    assert logging.getLogRecordFactory() is factory
    ours = factory("cachepipe.map", logging.WARNING, __file__, 1, "item %s", ("caf\udce9",), None)
    near = factory("cachepipex", logging.WARNING, __file__, 1, "item %s", ("caf\udce9",), None)
    theirs = factory("other", logging.WARNING, __file__, 1, "item %s", ("caf\udce9",), None)
    assert ours.getMessage() == "item caf\\udce9"
    assert near.getMessage() == theirs.getMessage() == "item caf\udce9"  # a user's records are theirs


def test_a_source_or_destination_whose_own_name_is_not_utf8_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    """Names below a source may be any bytes; the source's own path (and map's destination) is
    text. Before, pydantic's "unable to parse raw data as a unicode string" was all a user got."""
    odd = os.fsencode(tmp_path) + b"/caf\xe9"
    os.makedirs(odd + b"/item")
    with open(odd + b"/item/f", "wb") as fh:
        fh.write(b"x")
    path = os.fsdecode(odd)
    want = r"its part 'caf\\udce9' holds the byte 0xE9, which is not UTF-8.*ln -s"
    with pytest.raises(ValueError, match=want):
        Pipeline(path, tmp_path / "c", "1MiB")
    with pytest.raises(ValueError, match=want):
        map_items(["true"], path, str(tmp_path / "out"), cache_dir=tmp_path / "c2", capacity="1MiB")
    with pytest.raises(ValueError, match=want):
        map_items(["true"], str(tmp_path / "src"), path + "/out", cache_dir=tmp_path / "c3", capacity="1MiB")


def test_lines_naming_undecodable_bytes_are_held_back_as_any_of_their_kind() -> None:
    """With no logging configured, a storm of one kind of warning is cut to a few lines. A line
    naming an item of undecodable bytes had its message escaped in place of its template
    (logfallback.printable), which made each such line a kind of its own: all of them were printed
    (ten of ten here; a dataset of Latin-1 names failing: a line per item). Checked in a fresh
    interpreter: the handlers cachepipe puts on its logger at import, and nothing configured."""
    script = textwrap.dedent(
        """
        import logging, cachepipe
        log = logging.getLogger("cachepipe.cache")
        for i in range(10):
            log.warning("item %s skipped", f"caf\\udce9{i}")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 3 and lines[0].endswith("item caf\\udce90 skipped"), lines
    assert "similar messages are held back" in lines[-1], lines


def test_unpack_on_a_python_without_tarfiles_filters_is_refused_at_once_naming_the_version(tmp_path: Path) -> None:
    """Python before 3.10.12 (and 3.11.4) has no ``tarfile`` extraction filters, which unpack
    needs: every tar member then failed with "extract() got an unexpected keyword argument
    'filter'", item by item. Checked in a fresh interpreter whose tarfile has them removed, as
    such a Python's has not; ``cachepipe map --unpack`` is a usage error (exit 2) there."""
    (tmp_path / "src" / "item").mkdir(parents=True)
    (tmp_path / "src" / "item" / "f").write_bytes(b"x")
    script = textwrap.dedent(
        """
        import sys, tarfile
        del tarfile.data_filter  # as in Python 3.10.11
        from cachepipe import Pipeline
        src, cache = sys.argv[1], sys.argv[2]
        Pipeline(src, cache + "/a", "1MiB").close()  # without unpack: as before
        try:
            Pipeline(src, cache + "/b", "1MiB", unpack=True)
        except ValueError as exc:  # pydantic's ValidationError, as for every bad option
            print(exc)
        from cachepipe.cli import main
        sys.exit(main(["map", src, cache + "/out", "--cache", cache + "/m", "--capacity", "1MiB", "--unpack", "--", "true"]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", script, str(tmp_path / "src"), str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    version = platform.python_version()
    want = f"needs tarfile's extraction filters, which Python {version} has not: upgrade to Python 3.10.12, 3.11.4 or newer"
    assert want in done.stdout and "unpack" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 2 and want in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


# ---- an endpoint that is another server (a storage system's web console, one port off) -----------
class _WebPage(BaseHTTPRequestHandler):
    """Any request answered with an HTML page, at the server's ``status``."""

    def _page(self) -> None:
        body = b"<!doctype html><html><body>console</body></html>"
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = _page  # noqa: N815 - http.server's names

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        pass


@pytest.mark.parametrize("status", [200, 404, 403])
@pytest.mark.parametrize("scheme", ["s3", "obs"])
def test_an_endpoint_that_is_a_web_page_is_named_as_perhaps_not_the_stores_api(
    scheme: str, status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing answered by a web server (MinIO's console is one port off its API) said "not
    found at ...: s3://bucket/data/", "OBS bucket 'bucket' does not exist" or "ParseError":
    each read as a wrong prefix or bucket. Each now says the answer is not the store's."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WebPage)
    server.status = status  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name="web-page")
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    for name in ("OBS_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    if scheme == "s3":
        options = {"endpoint_url": endpoint, "key": "k", "secret": "s", "skip_instance_cache": True}
    else:
        options = {"server": endpoint, "access_key_id": "k", "secret_access_key": "s"}
    service = scheme.upper()
    try:
        with pytest.raises(
            OSError, match=re.escape(f"not an {service} answer: is {endpoint} the store's {service} API endpoint")
        ) as raised:
            Pipeline(f"{scheme}://bucket/data/", tmp_path / "c", "10MiB", storage_options=options).open()
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert "does not exist" not in str(raised.value)  # the bucket is not said to be missing
    assert "does not exist" not in str(raised.value)


def test_a_missing_bucket_or_object_of_a_real_store_is_not_said_to_be_another_server(s3_endpoint: str, s3_client) -> None:
    """The hint above is for answers without the store's error code: a real store's 404s and
    HEADs (which have no body, but a code from the SDK) do not get it."""
    from cachepipe.stores.obs import ObsStore

    s3_client.create_bucket(Bucket="real")
    for url, options in (
        ("s3://nobucket/data/", {"endpoint_url": s3_endpoint, "skip_instance_cache": True}),
        ("obs://nobucket/data/", {"server": s3_endpoint, "access_key_id": "k", "secret_access_key": "s"}),
    ):
        store = ObsStore(url, options) if url.startswith("obs") else open_store(url, options)
        try:
            with pytest.raises(FileNotFoundError) as raised:
                list(store.list())
            assert "answer: is" not in str(raised.value)
            with pytest.raises(FileNotFoundError) as raised:
                store.get("missing", io.BytesIO(), 0, 1)
            assert "answer: is" not in str(raised.value)
            with pytest.raises(FileNotFoundError, match=r"no such bucket|does not exist") as raised:
                store.check_bucket()  # a HEAD: no body, its code the SDK's
            assert "answer: is" not in str(raised.value)
        finally:
            store.close()
        real = url.replace("nobucket", "real")
        store = ObsStore(real, options) if url.startswith("obs") else open_store(real, options)
        try:
            assert store.exists("missing") is False
            store.check_bucket()
        finally:
            store.close()


@pytest.mark.parametrize(("given", "meant"), [("OBS://bucket/videos/", "obs://bucket/videos/"), ("S3://b/p/", "s3://b/p/")])
def test_a_scheme_in_capitals_says_schemes_are_lower_case(tmp_path: Path, given: str, meant: str) -> None:
    # It listed every protocol fsspec knows, obs and s3 among them, as if the scheme were unknown.
    with pytest.raises(ConfigError, match=re.escape(f"in {given!r}: schemes are lower case; expected {meant!r}")):
        Pipeline(given, tmp_path / "cache", "1MiB").open()


def test_a_local_folder_that_cannot_be_listed_fails_the_listing_not_leaves_its_items_out(tmp_path: Path) -> None:
    """fsspec's ``find`` passes over a folder it cannot list (its ``walk`` omits errors): a local
    source with a folder this user may not read was listed without its items, and read to its
    end without a word (``index`` wrote 2 of 3 items, exit 0). The listing fails instead, naming
    the folder. (Root reads any folder: the command runs without CAP_DAC_OVERRIDE/READ_SEARCH.)"""
    from conftest import as_a_user

    prefix = as_a_user()
    src = _source(tmp_path, ("a", "b", "c"))
    (src / "b").chmod(0o000)
    try:
        done = subprocess.run(
            [*prefix, sys.executable, "-m", "cachepipe", "index", str(src), "-o", str(tmp_path / "m.gz")],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
            check=False,
        )
    finally:
        (src / "b").chmod(0o755)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("cachepipe index: ") and str(src / "b") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "m.gz").exists()


def test_an_http_source_whose_server_refuses_is_unreachable_not_empty(tmp_path: Path) -> None:
    """An ``http://`` source whose server refuses the connection was "no items ...: the source
    lists no objects; check the bucket and the prefix" (fsspec's ``find`` omits the error). The
    error says to check the URL, not an ``endpoint_url`` that an http source has not."""
    import socket

    from cachepipe import EmptySourceError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port}") as raised:
        Pipeline(f"http://127.0.0.1:{port}/videos/", tmp_path / "c", "10MiB", retries=0).open()
    assert not isinstance(raised.value, EmptySourceError), raised.value
    assert str(raised.value).endswith("; check the URL"), raised.value  # its host is the URL's: no endpoint_url


def test_a_source_that_names_one_object_says_so_not_to_check_the_bucket(tmp_path: Path, s3_endpoint: str, s3_client) -> None:
    """A source URL that names one object (a tar shard, a local file) lists nothing under it, and
    was "the source lists no objects; check the bucket and the prefix" though the object is
    there. It says that the URL names an object, and the prefix to give instead."""
    from cachepipe import EmptySourceError

    shard = tmp_path / "shards" / "shard-000.tar"
    shard.parent.mkdir()
    shard.write_bytes(b"x" * 100)
    s3_client.create_bucket(Bucket="one-object")
    s3_client.put_object(Bucket="one-object", Key="shards/shard-000.tar", Body=b"x" * 100)
    options = {
        "": {},
        "s3": {"endpoint_url": s3_endpoint},
        "obs": {"server": s3_endpoint, "access_key_id": "k", "secret_access_key": "s"},
    }
    for source, parent in (
        (str(shard), f"{shard.parent}/"),
        ("s3://one-object/shards/shard-000.tar", "s3://one-object/shards/"),
        ("obs://one-object/shards/shard-000.tar", "obs://one-object/shards/"),
    ):
        scheme = source.partition("://")[0] if "://" in source else ""
        with pytest.raises(EmptySourceError) as raised:
            Pipeline(source, tmp_path / "c", "10MiB", items="files", storage_options=options[scheme]).open()
        message = str(raised.value)
        assert "names one object, not a prefix" in message and f"such as {parent!r}" in message, message
        assert "check the bucket" not in message


def test_map_without_a_command_or_unpack_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``cachepipe map SRC DST --cache C --capacity N`` with no ``-- CMD`` and no ``--unpack`` is a
    command line short of what it needs: exit status 2, as ``--help`` and the CLI reference say
    of usage errors (it was 1, the status of a run that failed)."""
    src = _source(tmp_path)
    status = map_main([str(src), str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--capacity", "10MiB"])
    assert status == 2
    err = capsys.readouterr().err
    assert "nothing to do: give a command" in err and "--unpack" in err, err
    assert not (tmp_path / "cache").exists()
