"""Small hazards: temporary files a killed writer left for good (a manifest's local copy, a local
destination's ``.cachepipe.tmp``), a live capacity change that counted downloading bytes twice,
and the redaction of a one-character secret."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from cachepipe.manifest import index, read_manifest

CLI = [sys.executable, "-m", "cachepipe.cli"]


def _dataset(root: Path, names: list[str]) -> str:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "a.txt").write_text(f"{name} a")
    return root.as_uri() + "/"


def test_a_killed_index_to_a_url_leaves_its_copy_only_until_the_next_index(
    tmp_path, s3_client, s3_options, fault_proxy, monkeypatch
):
    """``index -o s3://...`` killed while its upload is under way left its local copy in $TMPDIR
    for good; the next ``index -o URL`` now removes it, and never a live one's."""
    proxy, endpoint = fault_proxy
    source = _dataset(tmp_path / "src", ["s0", "s1"])
    s3_client.create_bucket(Bucket="out")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    held, gate = threading.Event(), threading.Event()

    def upload(head: str) -> bool:
        if head.startswith("PUT /out/"):
            held.set()
            return True
        return False

    proxy.hold(upload, gate)
    opts = [f"--dest-option={k}={v}" for k, v in {**s3_options, "endpoint_url": endpoint}.items()]
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [*CLI, "index", source, "-o", "s3://out/m.gz", *opts]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert held.wait(30), proc.communicate(timeout=30)
        copies = os.listdir(tmp)
        assert len(copies) == 1, copies  # the live upload's copy
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        index(source, "s3://out/other.gz", dest_options=s3_options)  # another index meanwhile
        assert os.listdir(tmp) == copies  # the live writer's copy is kept
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        gate.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert os.listdir(tmp) == copies  # a SIGKILL leaves it
    index(source, "s3://out/m.gz", dest_options=s3_options)
    assert os.listdir(tmp) == []  # the next index removed it
    assert read_manifest("s3://out/m.gz", s3_options).count == 2
