"""Each benchmark script runs end to end on a tiny dataset and reports every case and method.

A script runs as a subprocess (:func:`run_script`): its moto server, s3fs sessions and threads
live and die there, outside this test session's warning filters and thread-leak guard. No timing
is asserted, only that the report is complete and consistent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cachepipe import fscalls
from cachepipe.stores.base import FIRST_PAGE_KEYS

ROOT = Path(__file__).resolve().parents[1]  # the source tree under test, as the scripts' --trees resolve it
BENCHMARKS = ROOT / "benchmarks"
CASES = {"video", "small-files"}
METHODS = {"cachepipe", "sequential", "original"}


SHM = "/dev/shm"  # noqa: S108 - tmpfs on every Linux
SCRATCH = {"TMPDIR": SHM} if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else {}
"""The scripts' scratch (``tempfile``'s folder: their S3 servers' data, the caches and sources
they make where no option names a folder) on tmpfs. What the tests check is each report's
completeness, not a disk's speed; on this project's VM (``/tmp`` on ext4 mounted with
``discard``) a file and its folder deleted cost about 3 ms against 0.03 ms on tmpfs, and
bench_core.py's catalog part alone deletes 1,200 cached items (its run: a median of 14.4 s on
the disk, 2.3 s on tmpfs). A folder a test names (``--disk``, ``--dir``: ``tmp_path``) is on
the disk still."""


def run_script(script: str | Path, *args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (a file name in benchmarks/, or a path) with ``args`` in a fresh interpreter
    that imports this tree's cachepipe (``PYTHONPATH``: not an installed one, another checkout's),
    its scratch on tmpfs (:data:`SCRATCH`), its output captured; fail the test, with the end of
    its stderr, unless it exits 0."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path, **SCRATCH},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def run_json(script: str, *args: str, timeout: float = 120, cwd: Path | None = None) -> dict[str, Any]:
    """The report that ``script`` prints with ``args`` and ``--json`` (see :func:`run_script`)."""
    return json.loads(run_script(script, *args, "--json", timeout=timeout, cwd=cwd).stdout)


def test_a_script_run_imports_the_tree_under_test(tmp_path):
    """The scripts test this tree's cachepipe, not the one installed (an editable install of
    another checkout, as a worktree's shared venv has): run_script put nothing on the path."""
    script = tmp_path / "which.py"
    script.write_text("import cachepipe; print(cachepipe.__file__)\n")
    assert Path(run_script(script, cwd=tmp_path).stdout.strip()).parents[1] == ROOT


def test_quick_benchmark_reports_every_case_and_method(tmp_path):
    report = run_json("bench_pipeline.py", "--quick", "--repeats", "1", cwd=tmp_path)

    results = {(r["case"], r["method"]): r for r in report["results"]}
    assert set(results) == {(c, m) for c in CASES for m in METHODS}
    assert set(report["cases"]) == CASES
    assert "--quick" in report["command"]
    for (case, method), r in results.items():
        assert len(r["runs"]) == 1, (case, method)
        assert r["median_wall_s"] > 0 and r["mb_per_s"] > 0, (case, method)
        assert r["ratio_to_sequential"] > 0, (case, method)
        assert r["median_first_item_s"] is not None and r["median_first_item_s"] > 0, (case, method)
        assert r["median_requests"] > 0, (case, method)
        assert r["runs"][0]["bytes"] > 0 and r["runs"][0]["items"] > 0, (case, method)
    for case in CASES:
        same_bytes = {results[(case, m)]["runs"][0]["bytes"] for m in METHODS}
        assert len(same_bytes) == 1, f"{case}: methods delivered different byte counts {same_bytes}"
        assert results[(case, "sequential")]["ratio_to_sequential"] == 1.0
        # reported, not judged: what a 5 ms sampler catches depends on timing
        assert isinstance(results[(case, "cachepipe")]["peak_cache_bytes"], int)


def test_retention_through_the_pipeline_benchmark_runs():
    out = run_script("bench_retain_pipeline.py", "--items", "20", "--epochs", "2").stdout
    assert "auto" in out and "MIN" in out


def test_core_benchmark_reports_handoff_and_catalog(tmp_path):
    report = run_json(
        *("bench_core.py", "--quick", "--split", "--switch-interval", "0.02"),
        *("--disk", str(tmp_path), "--no-tmpfs"),  # tmpfs: the same code, twice the runs
        timeout=180,
    )
    assert report["places"]["disk"]["path"] == str(tmp_path)
    assert report["places"]["disk"]["file_system"].split(",")[0] in fscalls.LOCAL_FILESYSTEMS  # as the cache chose its calls
    assert {(r["cache_on"], r["shape"], r["batch"], r["capacity"]) for r in report["handoff"].values()} >= {
        ("disk", shape, batch, regime) for shape in ("folders", "files") for batch in (1, 64) for regime in ("roomy", "fills")
    }
    for key, r in report["handoff"].items():
        if r["capacity"] == "fills":  # half the items' charge, against twice it and room for the state
            assert r["capacity_bytes"] < report["handoff"][key.removesuffix(" fills")]["capacity_bytes"] / 4
        assert r["items"] == 300 and r["items_per_s"] > 0 and r["floor_items_per_s"] > 0
        assert r["switch_interval_s"] == 0.02  # as the measuring process ran
        assert r["gc_us_per_item"] > 0  # 300 items allocate far more than the 700 objects of a young collection
        assert 0 < r["gc_longest_cpu_ms"] <= r["gc_us_per_item"] * r["items"] / 1e3 * (1 + 1e-9)  # one of them
    assert set(report["split"]) >= {"disk folders", "disk files"}
    for r in report["split"].values():
        assert r["consumer_side_items_per_s"] > 0 and r["one_thread_items_per_s"] > 0 and r["pipeline_switches_per_item"] > 0
    assert set(report["catalog"]) == {"stream", "full"}
    for r in report["catalog"].values():
        assert r["catalog"] == 5000 and r["first_item_s"] is not None and r["peak_rss_mib"] > 0


def test_first_page_probe_runs_on_tiny_folders():
    """benchmarks/probe_first_page.py end to end on 20 and 200 folders (SeaweedFS from the test
    extra); no timing is asserted, only that both first pages were listed and timed."""
    report = run_json("probe_first_page.py", "--small", "20", "--large", "200", "--repeats", "2", timeout=300)
    assert report["max_keys"] == FIRST_PAGE_KEYS  # by default, the first page that cachepipe asks for
    assert report["keys"] == {"small": 20, "large": min(200, FIRST_PAGE_KEYS)}
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in report["seconds"].values())


def test_cluster_simulation_reports_every_section():
    """benchmarks/sim_cluster.py on a tiny job (pure, no network): every section is reported, and
    a node that keeps its items with room for its whole share hits every read after epoch 1."""
    tiny = ["--nodes", "4", "--ranks", "2", "--workers", "2", "--items", "2000", "--sim-nodes", "2", "--sim-items", "512"]
    report = run_json("sim_cluster.py", *tiny, "--manifest-sample", "100")
    # 16 consumers x 2 pages of 2,000 keys: a whole listing asks full pages of 1,000 from its first
    assert report["listing"]["per_process"]["list_requests"] == 16 * 2
    assert report["listing"]["node"]["list_requests"] == 2
    assert report["manifest_sample"]["bytes_per_item"] > 0
    assert report["gets"]["rows"][0]["gets_per_s"] > 0
    rows = {(r["scheme"], r["capacity_of_node_share"]): r for r in report["hits"]["rows"]}
    assert len(rows) == 10
    assert rows[("node, node-local shuffle", 1.0)]["hit_by_epoch"][1:] == [1.0, 1.0]
    jitter, none = report["slowdown"]["monte_carlo"]
    assert jitter["peak_per_100ms_after_throttle"] < none["peak_per_100ms_after_throttle"]


def test_partition_benchmark_runs_and_fixed_downloads_a_fitting_share_once():
    rows = {(r["data"], r["capacity"], r["partition"]): r for r in run_json("bench_partition.py", "--items", "200")["rows"]}
    for data in ("equal sizes", "variable sizes"):
        assert rows[data, 1.0, "fixed"]["x_data"] == 1.0  # a deterministic simulation, not a timing
        assert rows[data, 1.0, "epoch"]["x_data"] > 1.5


def test_manifest_benchmark_reports_every_phase():
    report = run_json("bench_manifest.py", "--items", "500")
    assert report["items"] == 500 and report["manifest_bytes"] > 0
    assert set(report["phases"]) == {"digest", "write", "read", "plan", "group", "list-files", "list-folders"}
    assert report["phases"]["group"]["items"] == report["phases"]["list-files"]["items"] == report["items"]
    assert report["phases"]["list-folders"]["items"] == report["items"]
    assert report["phases"]["plan"]["share"] > 0


def test_startup_benchmark_times_each_start_of_a_tree():
    out = run_script("bench_startup.py", "--trees", str(ROOT), "--runs", "1", "--bytecode", "off").stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["help"], ["status"], ["serve"])]
    assert [(r[0], r[1], r[-1]) for r in rows] == [(kind, "none", "1.00") for kind in ("help", "status", "serve")]


def test_epoch_start_benchmark_passes_reuse_the_kept_items():
    """benchmarks/bench_epoch_start.py on 20 items, 2 DataLoader workers, one round with a share
    of the disk: a pass after the first, of every item with nothing downloaded again (the script
    raises otherwise). No timing is asserted."""
    pytest.importorskip("torch", reason="the torch extra is not installed")
    sizes = ("--items", "20", "--files", "2", "--workers", "2", "--batch", "4", "--runs", "1", "--capacities", "50%")
    firsts = run_json("bench_epoch_start.py", "--trees", str(ROOT), *sizes)["first_batch_seconds"]
    key = f"{ROOT} DataLoader 50%"
    assert list(firsts) == [key]
    assert len(firsts[key]) == 1 and firsts[key][0] > 0, firsts


def test_reopen_benchmark_times_each_open_of_a_kept_cache(tmp_path):
    """benchmarks/bench_reopen.py on 3 kept folders of 2 files, one round, its source and cache
    under tmp_path: the table has a row per capacity, each open timed (the script raises if an
    open downloaded anything). No timing is asserted beyond its being measured."""
    proc = run_script(
        "bench_reopen.py", "--trees", str(ROOT), "--items", "3", "--files", "2", "--runs", "1", "--dir", str(tmp_path)
    )
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("open() over 3 kept folders, 6 files, on "), lines
    rows = [line.split() for line in lines if line.split()[:1] in (["10GiB"], ["50%"])]
    assert [(r[0], r[1], r[3]) for r in rows] == [("10GiB", str(ROOT), "1.00"), ("50%", str(ROOT), "1.00")], lines
    assert all(int(r[2]) > 0 for r in rows), lines  # median ms: an open reads the saved listing, tens of ms
    assert f"deleting {tmp_path}{os.sep}cachepipe-reopen-" in proc.stderr and not any(tmp_path.iterdir())


def test_dst_listing_benchmark_lists_the_whole_and_one_rank_s_part(tmp_path):
    """benchmarks/bench_dst_listing.py on 64 folders of 2 files, one round: the whole listing
    has every key, the middle rank of 4 its own items' (16 folders) and those of the item before
    them (its bound: ``item0000031``, the first item's name less one, sorts before that item's
    keys), no more; a Pipeline over it hands out its first item."""
    report = run_json(
        *("bench_dst_listing.py", "--trees", str(ROOT), "--items", "64", "--files", "2"), "--ranks", "4", "--runs", "1"
    )
    runs = report["runs"]
    assert [r["keys"] for r in runs[f"{ROOT} whole"]] == [128] and [r["keys"] for r in runs[f"{ROOT} rank"]] == [34]
    assert [r["keys"] for r in runs[f"{ROOT} first"]] == [1]  # a Pipeline over the tree, to its first item
    assert all(r["seconds"] > 0 and r["peak_mib"] > 0 for values in runs.values() for r in values)


def test_held_retry_benchmark_times_every_take_on_the_nfs_like_mount(tmp_path):
    """benchmarks/bench_held_retry.py on 6 items, one round, its source and mount under
    tmp_path: a wait for each take. No timing is asserted."""
    if os.geteuid() != 0:
        pytest.skip("the script mounts tests/nfslike.py: root only (CI runs as root)")
    try:
        import mfusepy  # noqa: F401  (raises where libfuse cannot be found)
    except (ImportError, OSError) as exc:
        pytest.skip(f"no FUSE here (mfusepy, libfuse 3): {exc}")
    runs = run_json("bench_held_retry.py", "--trees", str(ROOT), "--items", "6", "--runs", "1", "--dir", str(tmp_path))["runs"]
    assert list(runs) == [str(ROOT)] and len(runs[str(ROOT)]) == 1
    assert len(runs[str(ROOT)][0]["waits"]) == 6 and not any(tmp_path.iterdir())


def test_node_epochs_benchmark_crosses_an_epoch_in_each_run():
    runs = run_json("bench_node_epochs.py", "--quick", timeout=300)["runs"]
    assert [r["retain"] for r in runs] == ["none", "auto"]
    for r in runs:
        assert r["taken"] >= 8 * 300 and r["crossed_after_s"] is not None  # every lane took its items, across the epoch's end
        assert r["median_take_ms"] > 0 and r["takes_near_crossing"] > 0


def test_node_benchmark_reports_both_parts():
    """benchmarks/bench_node.py --quick end to end (SeaweedFS from the test extra, moto without it):
    every method of both parts is reported, the node lists once where 8 pipelines list 8 times,
    and a node-local shuffle whose share fits downloads it once. No timing is asserted."""
    # 43 s alone at load 10; a full run beside others passed --quick's own limit (110 s) once
    report = run_json("bench_node.py", "--quick", "--time-limit", "280", timeout=300)
    a = report["part_a"]
    rows = {(r["capacity_share"], r["method"]): r for r in a["rows"]}
    assert set(rows) == {(s, m) for s in (0.5, 1.0) for m in ("per-process", "node", "node-fixed")}
    for (share, method), r in rows.items():
        assert r["list_requests"] == (8 if method == "per-process" else 1), (share, method)
        assert r["peak_connections"] >= 1 and r["bytes_downloaded"] > 0 and r["min_bytes"] > 0, (share, method)
        assert r["largest_item_bytes"] == (r["room_bytes"] // 8 if method == "per-process" else r["room_bytes"])
    fits = rows[1.0, "node-fixed"]
    assert fits["bytes_downloaded"] == a["node_epoch_bytes"], [  # its share fits: each item once
        {k: r.get(k) for k in ("proxy", "job_stats", "daemon_log")} for r in fits["runs"]
    ]
    b = {(r["case"], r["method"]): r for r in report["part_b"]["rows"]}
    assert set(b) == {(c, m) for c in ("node-large", "node-small") for m in ("per-process", "node", "node-procs")}
    for key, r in b.items():
        assert r["mb_per_s"] > 0 and r["items_per_s"] > 0 and r["consumers_cpu_s"] > 0, key
        assert (r["daemon_cpu_s"] is None) == (key[1] == "per-process"), key
        assert (r["workers_cpu_s"] or 0) > 0 if key[1] == "node-procs" else not r["workers_cpu_s"], key


MOTO_CHILD = """
import sys, urllib.error, urllib.request
sys.path.insert(0, sys.argv[1])
from common import Server
if __name__ == "__main__":
    server = Server("subprocess")
    # a credential scope with no service: moto prints that it cannot find a backend for it
    scope = "AWS4-HMAC-SHA256 Credential=k/20200101/z//aws4_request, SignedHeaders=host, Signature=x"
    try:
        urllib.request.urlopen(urllib.request.Request(server.endpoint + "/", headers={"Authorization": scope}), timeout=30)
    except urllib.error.HTTPError:
        pass
    server.stop()
"""


def test_the_benchmarks_moto_server_child_keeps_stdout_for_the_report(tmp_path):
    """The moto server child shares the benchmark's stdout, where ``--json`` reports go: moto's
    diagnostics (the OBS SDK's V2 signatures trigger one now and then) must not land in them."""
    script = tmp_path / "moto_child.py"
    script.write_text(MOTO_CHILD)
    proc = run_script(script, str(BENCHMARKS))
    assert proc.stdout == ""
    assert "Unable to find appropriate backend" in proc.stderr  # the request did reach moto's dispatcher


@pytest.mark.parametrize("mode", ["hazard", "tiny"])
def test_node_stress_runs_its_seeds_with_no_hang_wrong_item_or_overshoot(mode):
    """benchmarks/stress_node.py, 3 seeds of a mode: the report's counts (its hazard mode hung
    on 45 of 60 seeds before the node withdrew a download planned ahead for a lane not asking)."""
    summary = run_json("stress_node.py", "--mode", mode, "--seeds", "0", "3", timeout=180)["summary"]
    assert summary["seeds"] == 3 and summary["steps"] > 0
    assert {k: summary[k] for k in ("hung", "wrong", "over_capacity", "errors")} == dict.fromkeys(
        ("hung", "wrong", "over_capacity", "errors"), 0
    ), summary


def test_pipeline_stress_runs_its_seeds_with_no_hang_wrong_item_overshoot_or_leak():
    """benchmarks/stress_pipeline.py, 3 small seeds of its paged mode (a streamed listing that
    pauses between pages, the least capacity that serves the consumer's held items): the
    report's counts."""
    summary = run_json("stress_pipeline.py", "--mode", "paged", "--seeds", "0", "3", "--max-items", "200", timeout=180)["summary"]
    assert summary["seeds"] == 3 and summary["takes"] > 0
    assert {k: summary[k] for k in ("hung", "wrong", "over_capacity", "leaks", "errors")} == dict.fromkeys(
        ("hung", "wrong", "over_capacity", "leaks", "errors"), 0
    ), summary


def test_pipeline_stress_reports_a_hang_with_the_threads_stacks_and_the_warning_that_told_it():
    """Its beyond mode's seed 0 holds more items than the capacity serves and waits for ever
    (as docs/guide/guarantees.md says it may): the script reports the hang, dumps every
    thread's stack, and finds that the stall warning said why; the pipeline closed, nothing leaks."""
    proc = run_script("stress_pipeline.py", "--mode", "beyond", "--seeds", "0", "1", "--max-items", "60", "--timeout", "3",
                      "--json", timeout=120)  # fmt: skip
    summary = json.loads(proc.stdout)["summary"]
    assert summary["hung_seeds"] == [0] and summary["hung_silent_seeds"] == [], summary
    assert summary["leaks"] == summary["errors"] == summary["wrong"] == 0, summary
    assert "hung" in proc.stderr and "most recent call first" in proc.stderr


@pytest.mark.parametrize(
    ("mode", "counts"),
    [("lease", ("redelivered", "late_refused")), ("capacity", ("resized", "resize_refused")), ("faults", ("faults",))],
)  # faults: 1 seed (its moto server's start is most of its time)
def test_pipeline_stress_new_modes_run_their_seeds_clean_and_exercise_what_they_are_for(mode, counts):
    """benchmarks/stress_pipeline.py's lease mode (consumer threads that drop items: each comes again after
    its lease, and a late ack of the dropped object is refused), capacity mode (set_capacity
    mid-pass, the cache sampled against the capacity in force) and faults mode (moto S3 behind
    the fault proxy: 503s, resets and cut bodies, retried), 2 small seeds each (faults: 1): nothing wrong,
    and the events each mode is for did happen."""
    seeds = 1 if mode == "faults" else 2
    report = run_json("stress_pipeline.py", "--mode", mode, "--seeds", "0", str(seeds), "--max-items", "120", timeout=180)
    summary = report["summary"]
    assert summary["seeds"] == seeds and summary["takes"] > 0
    assert {k: summary[k] for k in ("hung", "wrong", "over_capacity", "leaks", "errors")} == dict.fromkeys(
        ("hung", "wrong", "over_capacity", "leaks", "errors"), 0
    ), summary
    assert all(summary[k] > 0 for k in counts), summary
