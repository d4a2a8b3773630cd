"""What a notebook user meets, against the moto server through obs:// (and s3:// where cheap).

The tqdm.auto progress bar; re-running a cell on the same cache_dir; the stop button
(KeyboardInterrupt) in the loop body and while the loop waits for a folder; no signal handlers
installed, and a pipeline run from a worker thread; ``capacity="80%"``; the obs-vs-s3 benchmark.
tests/test_pipeline.py covers the same ground for s3:// in general; these add the obs:// path and
the notebook specifics.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import tqdm.auto
from waiting import wait_until

from cachepipe import CacheLockedError, Pipeline, open_store
from cachepipe.config import Share

KIB = 1024
ROOT = Path(__file__).resolve().parents[1]
FOLDER = {"video.mp4": 64 * KIB, "text.txt": 100}
obs_only = pytest.mark.parametrize("remote_source", ["obs"], indirect=True)


def cachepipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("cachepipe")]


def assert_no_leftovers(cache: Path) -> None:
    assert os.listdir(cache) == [".cachepipe"]
    staging = cache / ".cachepipe" / "staging"
    assert not staging.exists() or os.listdir(staging) == []
    assert cachepipe_threads() == []


class GatedStore:
    """A store whose first GET under ``hold`` blocks until :attr:`gate` is set: a download in flight."""

    def __init__(self, inner, hold: str) -> None:
        self.inner, self.url, self.hold = inner, inner.url, hold
        self.held = threading.Event()
        self.gate = threading.Event()

    def list(self):
        return self.inner.list()

    def get(self, key, out, start, end):
        if key.startswith(self.hold) and not self.held.is_set():
            self.held.set()
            self.gate.wait(30)
        return self.inner.get(key, out, start, end)

    def close(self) -> None:
        self.inner.close()


# ---- progress bar ----------------------------------------------------------------------
@obs_only
def test_progress_bar_is_tqdm_auto(remote_source, tmp_path, monkeypatch, capsys):
    """tqdm.auto renders as a widget in Jupyter and as text elsewhere: the bar must come from it."""
    remote_source.folders(4, FOLDER)
    auto_tqdm, bars = tqdm.auto.tqdm, []

    class Recording(auto_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    with Pipeline(remote_source.url, tmp_path / "c", "1MiB", storage_options=remote_source.options, progress=True) as pipe:
        for _path in pipe:
            pass
    [bar] = bars
    assert isinstance(bar, auto_tqdm) and bar.total == bar.n == 4
    assert bar.disable  # closed with the pipeline
    err = capsys.readouterr().err
    assert "cachepipe" in err and "4/4" in err and "/1MiB" in err


# ---- re-running a cell -----------------------------------------------------------------
@obs_only
def test_rerun_while_open_names_the_owner_and_disturbs_nothing_then_works_after_close(remote_source, tmp_path):
    data = remote_source.folders(4, FOLDER)
    cache = tmp_path / "cache"
    first = Pipeline(remote_source.url, cache, "1MiB", storage_options=remote_source.options, auto_ack=False).open()
    try:
        item = first.get(timeout=30)
        with pytest.raises(CacheLockedError) as info:
            Pipeline(remote_source.url, cache, "1MiB", storage_options=remote_source.options).open()
        assert info.value.owner.startswith(f"pid {os.getpid()} ")
        assert str(cache) in str(info.value) and "close it first" in str(info.value)
        # the refused pipeline touched neither the first one's items nor its downloads
        first.ack(item)
        rest = []
        while (got := first.get(timeout=30)) is not None:
            assert {rel: (got / rel).read_bytes() for rel in FOLDER} == data[got.name]
            rest.append(got.name)
            first.ack(got)
        assert [item.name, *rest] == sorted(data)
    finally:
        first.close()
    with Pipeline(remote_source.url, cache, "1MiB", storage_options=remote_source.options) as again:
        assert [p.name for p in again] == sorted(data)
    assert_no_leftovers(cache)


# ---- the stop button -------------------------------------------------------------------
def test_keyboard_interrupt_in_the_loop_body_stops_downloads_and_leaves_no_staging(remote_source, tmp_path):
    remote_source.folders(8, {"video.mp4": 256 * KIB, "text.txt": 100})
    cache = tmp_path / "cache"
    store = GatedStore(open_store(remote_source.url, remote_source.options), hold="item002/")
    with pytest.raises(KeyboardInterrupt):  # noqa: PT012 - the error is expected from the whole block, not from one call
        with Pipeline(
            remote_source.url, cache, capacity=5 * 257 * KIB, store=store, part_size="64KiB", max_concurrency=4
        ) as pipe:
            for _path in pipe:
                assert store.held.wait(10), "item002 never started downloading"
                assert os.listdir(cache / ".cachepipe" / "staging"), "nothing in flight to clean up"
                store.gate.set()  # the request in flight completes while the pipeline closes
                raise KeyboardInterrupt
    stats = pipe.stats()
    assert stats.items_handed == 1 and stats.bytes_downloaded < stats.bytes_listed
    assert_no_leftovers(cache)


def _blocked_in_take(thread_id: int) -> bool:
    frame = sys._current_frames().get(thread_id)
    innermost = frame
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return innermost is not None and innermost.f_code.co_name == "wait" and "take" in names


def test_keyboard_interrupt_while_the_loop_waits_for_a_folder(remote_source, tmp_path):
    """The stop button pressed while the first folder is still downloading: SIGINT to the main thread."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        pytest.skip("needs Python's default SIGINT handler in the main thread")
    remote_source.folders(3, FOLDER)
    cache = tmp_path / "cache"
    store = GatedStore(open_store(remote_source.url, remote_source.options), hold="item000/")
    main = threading.main_thread().ident
    problems = []

    def press_stop() -> None:
        try:
            assert store.held.wait(10), "item000 never started downloading"
            wait_until(lambda: _blocked_in_take(main))
            signal.pthread_kill(main, signal.SIGINT)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            problems.append(exc)
        finally:
            store.gate.set()

    presser = threading.Thread(target=press_stop, name="press-stop")
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt), Pipeline(remote_source.url, cache, "1MiB", store=store) as pipe:  # noqa: PT012 - the error is expected from the whole block, not from one call
            for _path in pipe:
                raise AssertionError("the loop body ran: the interrupt came too late")
    finally:
        presser.join(30)
    assert problems == []
    assert pipe.stats().items_handed == 0
    assert_no_leftovers(cache)


# ---- signals and threads ---------------------------------------------------------------
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def test_no_signal_handlers_and_a_pipeline_works_in_a_worker_thread(remote_source, tmp_path):
    data = remote_source.folders(3, FOLDER)
    before = {s: signal.getsignal(s) for s in SIGNALS}
    pipe = Pipeline(remote_source.url, tmp_path / "main", "1MiB", storage_options=remote_source.options, progress=True)
    assert {s: signal.getsignal(s) for s in SIGNALS} == before
    with pipe:
        for _path in pipe:
            assert {s: signal.getsignal(s) for s in SIGNALS} == before
    assert {s: signal.getsignal(s) for s in SIGNALS} == before

    result: dict = {}

    def worker() -> None:  # e.g. a DataLoader-style prefetch thread, or ipywidgets' callbacks
        try:
            with Pipeline(
                remote_source.url, tmp_path / "worker", "1MiB", storage_options=remote_source.options, progress=True
            ) as p:
                result["names"] = [path.name for path in p]
                result["stats"] = p.stats()
        except BaseException as exc:  # noqa: BLE001 - collected for the test's assertion
            result["error"] = exc

    thread = threading.Thread(target=worker, name="notebook-worker")
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    assert result["names"] == sorted(data) and result["stats"].items_acked == 3
    assert {s: signal.getsignal(s) for s in SIGNALS} == before
    assert_no_leftovers(tmp_path / "worker")


# ---- capacity="80%" ---------------------------------------------------------------------
@obs_only
def test_capacity_80_percent_resolves_against_free_space(remote_source, tmp_path, capsys):
    remote_source.folders(2, FOLDER)
    cache = tmp_path / "cache"
    cache.mkdir()
    free_before = shutil.disk_usage(cache).free
    with Pipeline(remote_source.url, cache, "80%", storage_options=remote_source.options, progress=True) as pipe:
        assert pipe.config.capacity == Share(0.8)
        list(pipe)
        capacity = pipe.stats().capacity
    free_after = shutil.disk_usage(cache).free
    low, high = sorted((free_before, free_after))
    assert 0.8 * low * 0.98 <= capacity <= 0.8 * high * 1.02  # other processes may write meanwhile
    assert f"/{capacity / 2**20:.0f}MiB" in capsys.readouterr().err  # shown on the bar too


# ---- benchmark smoke -------------------------------------------------------------------
def test_bench_obs_vs_s3_quick_smoke():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_obs_vs_s3.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {(r["case"], r["backend"]): r for r in report["results"]}
    assert set(rows) == {(c, b) for c in ("video", "small-files") for b in ("s3", "obs")}
    for (case, backend), row in rows.items():
        assert row["runs"] and all(run["bytes_read"] > 0 for run in row["runs"])
        assert len({run["bytes_read"] for run in rows[(case, "s3")]["runs"] + rows[(case, "obs")]["runs"]}) == 1
        assert row["mb_per_s"] > 0
        assert (row["obs_to_s3"] is None) == (backend == "s3")
    assert "bench_obs_vs_s3.py --quick --json" in report["command"]
