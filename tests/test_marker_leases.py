"""A ``.done`` marker that holds its lease: it acknowledges only the hand-out with that lease,
across daemon restarts; a marker is judged once its writer closed it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from test_service import FILES, inotify_watches, marker_acks, stats, write_config
from waiting import wait_until

from cachepipe.client import Client
from cachepipe.service.markers import MARKER_BYTES, HandOut, HandOuts, Verdict, marker_counts, read_marker
from cachepipe.service.testing import DaemonProcess

CLI = [sys.executable, "-m", "cachepipe.cli"]
REFUSED = 'cachepipe_markers_refused_total{pipeline="train"}'


def next_with_lease(sock: Path) -> tuple[str, Path]:
    """``cachepipe next --with-lease``, as a shell consumer runs it: (lease, path)."""
    got = subprocess.run(
        [*CLI, "next", "--socket", str(sock), "--timeout", "30", "--with-lease"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.rstrip("\n")
    lease, path = got.split(" ", 1)
    return lease, Path(path)


def mark(path: Path, lease: str) -> None:
    """The one-liner of docs/service/consumers.md, run by bash."""
    subprocess.run(["bash", "-c", 'printf %s "$1" > "$2/.done"', "mark", lease, str(path)], check=True, timeout=30)


def refused(client: Client) -> float:
    lines = [line for line in client.metrics().splitlines() if line.startswith(REFUSED + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_a_marker_holding_a_lease_from_before_a_restart_does_not_ack_the_items_next_holder(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    # A restarted daemon hands the items held before it out again: a consumer still working on
    # one from before the restart then made its .done, which acknowledged the item for its new
    # holder, whose files were deleted under it. A .done holding its lease acknowledges only
    # the hand-out with that lease.
    s3_source.folders(2, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon:
        old_lease, old_path = next_with_lease(sock)
        assert daemon.stop() == 0
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as probe:
        lease, path = next_with_lease(sock)
        assert path == old_path and lease != old_lease  # the same item, handed out again
        wait_until(lambda: inotify_watches(daemon.pid) == 2, what="the item's own watch (LOOK_AFTER on)")
        mark(path, old_lease)  # the consumer from before the restart is done with it
        wait_until(lambda: stats(probe)["items_acked"] or refused(probe), what="the daemon to judge the old consumer's .done")
        assert path.is_dir() and (path / "a.bin").exists(), "the old lease's .done acknowledged the new holder's item"
        assert stats(probe)["items_acked"] == 0 and refused(probe) == 1
        # the refusal is counted, then logged: wait for its line
        wait_until(lambda: "acknowledges nothing" in daemon.log(), what="the refused .done's warning")
        warning = [line for line in daemon.log().splitlines() if "acknowledges nothing" in line]
        assert len(warning) == 1 and str(path) in warning[0] and old_lease in warning[0], warning
        probe.renew(path, lease)  # still leased to its new holder
        mark(path, lease)  # the new holder's own marker: the same file, written again
        wait_until(lambda: stats(probe)["items_acked"] == 1, what="the new holder's .done to ack")
        assert not path.exists()
        # the pipeline counts the ack, then the daemon counts it as a marker's: wait for that count too
        wait_until(lambda: marker_acks(probe, "marker"), what="the marker ack's metric")
        assert marker_acks(probe, "marker") == 1 and stats(probe)["items_acked"] == 1


def test_a_marker_is_judged_when_its_writer_closes_it(s3_source, s3_endpoint, tmp_path, short_dir):
    # A .done just created is empty until its writer writes the lease: judged then, it was an
    # empty marker, which acknowledges the item's holder, whoever wrote it. The daemon waits for
    # the writer to close it.
    s3_source.folders(2, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with (
        DaemonProcess(config) as daemon,
        Client("train", sock, auto_ack=False) as client,
        Client("train", sock, auto_ack=False, markers=False) as other,
    ):
        item = client.get(timeout=30)
        wait_until(lambda: inotify_watches(daemon.pid) == 2, what="the item's own watch (LOOK_AFTER on)")
        probe = other.get(timeout=30)  # no watch of its own: its deletion is the cache directory's event
        with open(item.path / ".done", "w") as marker:  # created: an event, before the probe's
            marker.flush()
            shutil.rmtree(probe.path)  # the events are read in order: once this one acknowledged...
            wait_until(lambda: stats(client)["items_acked"] >= 1, what="the probe's deletion to ack")
            assert item.path.exists(), "the .done was judged before its writer wrote the lease into it"
            assert stats(client)["items_acked"] == 1
            marker.write(item.lease)
        wait_until(lambda: stats(client)["items_acked"] == 2, what="the closed .done to ack")
        assert not item.path.exists() and refused(client) == 0


def test_a_marker_made_as_a_link_is_judged_when_it_is_made(s3_source, s3_endpoint, tmp_path, short_dir):
    # A link (symbolic or hard) is complete when it is made: no writer closes it, so the watch
    # must see its creation (a .done created as a regular file waits for its writer's close).
    s3_source.folders(2, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as client:
        first, second = client.get(timeout=30), client.get(timeout=30)
        wait_until(lambda: inotify_watches(daemon.pid) == 3, what="the items' own watches (LOOK_AFTER on)")
        # the ack deletes the folder, then counts: wait for the count (the folder's going is seen first)
        os.symlink("/nonexistent", first.path / ".done")  # ln -s: a link counts as empty
        wait_until(lambda: stats(client)["items_acked"] == 1, what="the symbolic link's marker to ack")
        assert not first.path.exists()
        (tmp_path / "made-elsewhere").write_text("")
        os.link(tmp_path / "made-elsewhere", second.path / ".done")  # ln: complete when made
        wait_until(lambda: stats(client)["items_acked"] == 2, what="the hard link's marker to ack")
        assert not second.path.exists() and refused(client) == 0


def test_what_a_marker_holds_decides_whose_it_is(tmp_path):
    item = tmp_path / "item1"
    item.mkdir()
    path, handouts = str(item), HandOuts()
    handouts.record([(path, "ab12-3-4", ("a.bin",), True, True)])
    assert read_marker(item) == (None, "")
    assert handouts.lease_for(path, "marker") == Verdict(None, "the .done is gone")

    (item / ".done").write_text("ab12-3-4\n")  # echo "$LEASE" > .done: the newline is not part of it
    made, holds = read_marker(item)
    assert holds == "ab12-3-4" and made is not None
    assert handouts.lease_for(path, "marker") == Verdict("ab12-3-4")
    (item / ".done").write_text("ab12-3-3")  # an earlier daemon's lease (or an expired one)
    assert handouts.lease_for(path, "marker") == Verdict(
        None, "its .done holds another lease than the one the item is handed out under", "ab12-3-3"
    )
    (item / ".done").write_text("ok")  # anything but the lease or nothing
    assert handouts.lease_for(path, "marker").held == "ok"
    (item / ".done").write_text("")  # empty: the holder's, as markers always were
    assert handouts.lease_for(path, "marker") == Verdict("ab12-3-4")
    (item / ".done").write_bytes(b"x" * (MARKER_BYTES + 10))
    assert len(read_marker(item)[1]) == MARKER_BYTES + 1  # read no further: not a lease

    (item / ".done").unlink()
    secret = tmp_path / "secret"
    secret.write_text("ab12-3-4")
    (item / ".done").symlink_to(secret)  # not followed: an empty marker, judged by the link itself
    link, holds = read_marker(item)
    assert link is not None and holds == ""
    (item / ".done").unlink()
    os.mkfifo(item / ".done")  # not waited on
    reader = threading.Thread(target=read_marker, args=(item,))
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading a pipe named .done waited for a writer"
    (item / ".done").unlink()

    # the rule alone: a lease counts whatever was there at hand-out; nothing counts for a shipped .done
    made = (1, 2, 3)
    assert marker_counts(HandOut("L1", shipped=False, before=made), made, "L1")
    assert not marker_counts(HandOut("L1", shipped=False, before=None), made, "L0")
    assert not marker_counts(HandOut("L1", shipped=True, before=None), made, "L1")
    handouts.record([(path, "L5", ("a.bin", ".done"), False, True)])
    (item / ".done").write_text("L5")
    assert handouts.lease_for(path, "marker").lease is None and handouts.lease_for(path, "marker").held is None


def test_a_done_unpacked_from_an_item_s_archive_acknowledges_nothing(tmp_path, short_dir):
    # A dataset's archive that holds a .done of its own (a folder packed after a consumer marked
    # it): unpacked, it was on disk at the item's first hand-out, which looks up no marker (the
    # item's listed files, its archives, hold none), so its watch took it for the consumer's and
    # acknowledged the item, deleting its files while the consumer read them (h-arch's reading).
    import io
    import json
    import tarfile

    import yaml
    from test_service_foreign import ask

    for name, members in (("item0", {".done": b"", "a.txt": b"mine"}), ("item1", {"a.txt": b"x"})):
        (tmp_path / "src" / name).mkdir(parents=True)
        with tarfile.open(tmp_path / "src" / name / "data.tar", "w") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    sock = short_dir / "api.sock"
    train = {"source": f"{tmp_path / 'src'}/", "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB", "unpack": True}
    config = tmp_path / "cachepipe.yaml"
    config.write_text(yaml.safe_dump({"socket": str(sock), "pipelines": {"train": train}}))
    with DaemonProcess(config) as daemon, Client("train", sock, auto_ack=False) as probe:
        status, first = ask(sock, "POST", "/v1/pipelines/train/next", {"timeout": 30})
        assert status == 200 and first["name"] == "item0", first
        wait_until(lambda: inotify_watches(daemon.pid) == 2 or stats(probe)["items_acked"], what="item0's own watch")
        assert ask(sock, "POST", "/v1/pipelines/train/next", {"timeout": 30})[0] == 200
        # item1's own watch comes after item0's was looked into (one thread, in the order handed out)
        wait_until(lambda: inotify_watches(daemon.pid) == 3 or stats(probe)["items_acked"], what="item1's own watch")
        assert stats(probe)["items_acked"] == 0, json.dumps(stats(probe))  # before: 1, item0 deleted
        assert (Path(first["path"]) / "a.txt").read_bytes() == b"mine"
