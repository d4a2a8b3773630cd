"""A rerun of ``cachepipe map`` with another command onto the same ``DST``.

Before, an item's completion marker recorded the version of its input but not the command that
made its outputs: a user who fixed a bug in their command and ran it again onto the same ``DST``
was told that every item was "already done", and kept the old command's outputs, silently. The
marker now records a digest of the command (and of ``unpack``); an item done by another command
is run again, and the summary, the log and ``--dry-run`` say how many and which first. A marker
of an earlier cachepipe (no command recorded) still counts as done.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading

import pytest
from test_map import bucket, cli, storage_args

from cachepipe.errors import ConfigError
from cachepipe.map import map_items, plan_items
from cachepipe.map.cli import main
from cachepipe.map.plan import command_digest, function_name
from cachepipe.map.remote import held_by_item, verdict
from cachepipe.map.uploader import (
    DONE_MARKER,
    MARKER_LIMIT,
    DestinationDeniedError,
    marker_body,
    marker_command,
    marker_version,
)
from cachepipe.stores import open_store
from cachepipe.stores.fsspec import FsspecStore


def writes(text: str) -> list[str]:
    """A command whose one output, ``g``, holds ``text`` and the input's ``f``."""
    return ["sh", "-c", f'{{ printf {text}; cat f; }} > "$CACHEPIPE_OUT/g"']


A, B = writes("A"), writes("B")


def s3_options(tmp_path, s3_source) -> dict:
    """``map_items``' options for a run over the moto source into a 1 MiB cache."""
    return {
        "cache_dir": tmp_path / "cache",
        "capacity": "1MiB",
        "storage_options": s3_source.options,
        "progress": False,
        "out_ratio": 2,
    }


def outputs(s3_client, prefix: str) -> dict[str, bytes]:
    return {k: v for k, v in bucket(s3_client, prefix).items() if not k.endswith(DONE_MARKER)}


def markers(s3_client, prefix: str) -> dict[str, dict]:
    return {k.split("/")[0]: json.loads(v) for k, v in bucket(s3_client, prefix).items() if k.endswith(DONE_MARKER)}


# ---- end to end, against the moto server -----------------------------------------------------------------------
def test_a_rerun_with_another_command_runs_every_item_again_and_says_so(s3_source, s3_client, tmp_path):
    data = s3_source.folders(3, {"f": 100})
    dst = "s3://data/out/"
    base = [s3_source.url, dst, "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--out-ratio", "2", "--no-progress"]
    base += storage_args(s3_source.options)
    first = cli(*base, "--", *A)
    assert first.returncode == 0 and "3 done, 0 failed, 0 already done; " in first.stderr, first.stderr
    assert outputs(s3_client, "out/") == {f"{n}/g": b"A" + data[n]["f"] for n in data}

    fixed = cli(*base, "--", *B)
    assert fixed.returncode == 0, fixed.stderr
    summary = fixed.stderr.strip().splitlines()[-1]
    assert summary.startswith(
        "cachepipe map: 3 done, 0 failed, 0 already done; 3 run again, done before by another command (first: item000); "
    ), summary
    assert "3 item(s) were done by another command (first: item000): running them again" in fixed.stderr  # the log's warning
    assert outputs(s3_client, "out/") == {f"{n}/g": b"B" + data[n]["f"] for n in data}
    digest = command_digest(B, None, False)
    assert {m["command"] for m in markers(s3_client, "out/").values()} == {digest}

    same = cli(*base, "--", *B)  # the fixed command again: nothing to do
    assert same.returncode == 0 and "0 done, 0 failed, 3 already done; 0 B in" in same.stderr, same.stderr
    assert "another command" not in same.stderr


def test_a_rerun_with_the_same_command_skips_every_item_and_the_marker_records_it(s3_source, s3_client, tmp_path):
    s3_source.folders(2, {"f": 100})
    options = s3_options(tmp_path, s3_source)
    assert map_items(A, s3_source.url, "s3://data/out/", **options).items_done == 2
    again = map_items(list(A), s3_source.url, "s3://data/out/", **options)  # the same arguments, in a new list
    assert (again.items_done, again.items_skipped) == (0, 2)
    head = bucket(s3_client, "out/")[f"item000/{DONE_MARKER}"][:MARKER_LIMIT]
    assert json.loads(head)["command"] == command_digest(A, None, False)
    assert marker_command(head) == command_digest(A, None, False) and marker_version(head) is not None
    assert again.command_changed == []


def test_a_marker_of_an_earlier_cachepipe_counts_as_done_and_one_of_another_command_does_not(s3_source, s3_client, tmp_path):
    """item000's marker is an earlier cachepipe's (its input's version, no command), item001's
    this one's for command A, item002 has none: a run of command B does item001 and item002."""
    data = s3_source.folders(3, {"f": 100})
    store = open_store(s3_source.url, s3_source.options)
    try:
        [old, _, _] = plan_items(store.list(), "folders", False)
    finally:
        store.close()
    earlier = {"version": old.version, "item": "item000", "bytes": 4, "finished": 0.0, "files": {"g": 4}}
    s3_client.put_object(Bucket="data", Key="out/item000/g", Body=b"old!")
    s3_client.put_object(Bucket="data", Key=f"out/item000/{DONE_MARKER}", Body=json.dumps(earlier, indent=0).encode())
    s3_client.put_object(Bucket="data", Key="out/item001/g", Body=b"A")
    body = marker_body("item001", {"g": 1}, None, command_digest(A, None, False))
    s3_client.put_object(Bucket="data", Key=f"out/item001/{DONE_MARKER}", Body=body)
    options = s3_options(tmp_path, s3_source)
    result = map_items(B, s3_source.url, "s3://data/out/", **options)
    assert result.ok and (result.items_done, result.items_skipped) == (2, 1), result.failed
    assert result.command_changed == ["item001"]
    assert outputs(s3_client, "out/") == {
        "item000/g": b"old!",
        "item001/g": b"B" + data["item001"]["f"],
        "item002/g": b"B" + data["item002"]["f"],
    }


def test_an_empty_marker_made_by_hand_counts_as_done(s3_source, s3_client, tmp_path):
    """S3 refuses a range of an empty object (416 InvalidRange): the head of such a marker is
    empty, it records nothing, and it counts as done, as one an earlier cachepipe wrote."""
    s3_source.folders(2, {"f": 100})
    s3_client.put_object(Bucket="data", Key=f"out/item000/{DONE_MARKER}", Body=b"")
    options = s3_options(tmp_path, s3_source)
    result = map_items(A, s3_source.url, "s3://data/out/", **options)
    assert result.ok and (result.items_done, result.items_skipped) == (1, 1), result.failed


def test_dry_run_says_which_items_another_command_did(s3_source, s3_client, tmp_path, capsys, caplog):
    s3_source.folders(3, {"f": 100})
    options = s3_options(tmp_path, s3_source)
    assert map_items(A, s3_source.url, "s3://data/out/", **options).items_done == 2 + 1
    s3_client.delete_object(Bucket="data", Key=f"out/item002/{DONE_MARKER}")  # not done: runs, without the note
    before = bucket(s3_client, "out/")
    args = [
        s3_source.url,
        "s3://data/out/",
        "--cache",
        str(tmp_path / "cache"),
        "--capacity",
        "1MiB",
        "--out-ratio",
        "2",
        "--dry-run",
    ]
    assert main([*args, *storage_args(s3_source.options), "--", *B]) == 0
    out = capsys.readouterr().out.splitlines()
    note = " (done before by another command: its outputs would be replaced, those not written again deleted)"
    assert out[:4] == [
        f"would run: item000 -> s3://data/out/item000/{note}",
        f"would run: item001 -> s3://data/out/item001/{note}",
        "would run: item002 -> s3://data/out/item002/",
        "3 items to run (2 done before by another command, first: item000), 0 already done, of 3 listed",
    ]
    assert bucket(s3_client, "out/") == before  # nothing written
    assert "2 item(s) were done by another command (first: item000): a run would do them again" in caplog.text
    assert main([*args, *storage_args(s3_source.options), "--", *A]) == 0  # the command the items were done with
    assert capsys.readouterr().out.splitlines()[:2] == [
        "would run: item002 -> s3://data/out/item002/",
        "1 items to run, 2 already done, of 3 listed",
    ]


def test_dry_run_says_what_a_run_would_delete(s3_source, s3_client, tmp_path, capsys):
    """An item to run again whose marker is in DST has, at its upload, what it does not write
    again deleted. Before, the dry run named the items done by another command but not one whose
    input changed, nor how many objects, nor which: a user could not see that a run may delete.
    item000 is done by A, item001 has objects but no marker (kept: not counted), item002 is done
    by A from an input rewritten since."""
    s3_source.folders(3, {"f": 100})
    options = {**s3_options(tmp_path, s3_source), "out_ratio": 3}
    assert map_items(named("A"), s3_source.url, "s3://data/out/", **options).items_done == 3
    s3_client.delete_object(Bucket="data", Key=f"out/item001/{DONE_MARKER}")
    s3_source.put("item002/f", b"rewritten")
    before = bucket(s3_client, "out/")
    args = [s3_source.url, "s3://data/out/", "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--out-ratio", "3"]
    args += ["--dry-run", *storage_args(s3_source.options)]
    replaced = " its outputs would be replaced, those not written again deleted)"

    assert main([*args, "--", *named("A")]) == 0  # the same command: item002 only, for its input
    assert capsys.readouterr().out.splitlines()[:4] == [
        "would run: item001 -> s3://data/out/item001/",
        f"would run: item002 -> s3://data/out/item002/ (done before from another version of its input:{replaced}",
        "2 items to run, 1 already done, of 3 listed",
        (
            "1 items would have earlier outputs replaced: up to 3 objects in DST deleted (their markers included), those the "
            "run does not write again (first: s3://data/out/item002/A.txt, s3://data/out/item002/p/A.bin, "
            f"s3://data/out/item002/{DONE_MARKER})"
        ),
    ]

    assert main([*args, "--", *named("B")]) == 0  # another command: item000 and item002
    assert capsys.readouterr().out.splitlines()[4] == (
        "2 items would have earlier outputs replaced: up to 6 objects in DST deleted (their markers included), those the "
        "run does not write again (first: s3://data/out/item000/A.txt, s3://data/out/item000/p/A.bin, "
        "s3://data/out/item002/A.txt, ...)"
    )
    plan = map_items(named("B"), s3_source.url, "s3://data/out/", dry_run=True, **options)
    assert plan.held == {n: sorted(k for k in before if k.startswith(f"{n}/")) for n in ("item000", "item002")}
    assert bucket(s3_client, "out/") == before  # nothing written or deleted

    run = map_items(named("B"), s3_source.url, "s3://data/out/", **options)
    assert run.items_done == 3 and run.held == plan.held
    gone = set(before) - set(bucket(s3_client, "out/"))
    assert gone == {f"{n}/{rel}" for n in ("item000", "item002") for rel in ("A.txt", "p/A.bin")}  # of those it named


def test_a_source_without_etags_reruns_an_item_done_by_another_command_too(tmp_path):
    """Items of a local source have no version: their markers were checked with a HEAD alone,
    which cannot tell the command; each is read now."""
    for name in ("a", "b"):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "f").write_bytes(name.encode())
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "progress": False, "out_ratio": 2}
    assert map_items(A, src, dst, **options).items_done == 2
    result = map_items(B, src, dst, **options)
    assert (result.items_done, result.items_skipped) == (2, 0)
    assert (tmp_path / "dst" / "a" / "g").read_bytes() == b"Ba"
    assert result.command_changed == ["a", "b"]
    assert map_items(B, src, dst, **options).items_skipped == 2


# ---- what an earlier attempt left: DST/<item>/ holds exactly this attempt's outputs and marker ----------------
def named(tag: str) -> list[str]:
    """A command whose outputs are named by ``tag``: ``p/<tag>.bin`` (the input's ``f``) and ``<tag>.txt``."""
    out = '"$CACHEPIPE_OUT"'
    return ["sh", "-c", f"mkdir -p {out}/p && cat f > {out}/p/{tag}.bin && printf {tag} > {out}/{tag}.txt"]


def produced(tag: str, names) -> set[str]:
    """The keys under DST that a run of ``named(tag)`` leaves for the items ``names``: outputs and marker."""
    return {f"{n}/{rel}" for n in names for rel in (f"p/{tag}.bin", f"{tag}.txt", DONE_MARKER)}


def leave(dst: str, options: dict, tmp_path, keys) -> None:
    """Put ``keys`` under ``dst`` through the store, as an attempt killed mid-upload leaves them (no marker)."""
    local = tmp_path / "left.bin"
    local.write_bytes(b"left by a killed attempt")
    store = open_store(dst, options)
    try:
        for key in keys:
            store.put(local, key)
    finally:
        store.close()


def test_a_rerun_with_a_command_that_writes_other_names_leaves_only_its_outputs(s3_source, s3_client, tmp_path):
    """Before, DST/<item>/ held the first command's outputs beside the second's, and the second's
    marker: a consumer that lists the prefix (most do) read both."""
    data = s3_source.folders(3, {"f": 100})
    base = [s3_source.url, "s3://data/out/", "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--out-ratio", "3"]
    base += ["--no-progress", *storage_args(s3_source.options)]
    assert cli(*base, "--", *named("A")).returncode == 0
    assert set(bucket(s3_client, "out/")) == produced("A", data)
    rerun = cli(*base, "--", *named("B"))
    assert rerun.returncode == 0 and "3 done, 0 failed, 0 already done; 3 run again" in rerun.stderr, rerun.stderr
    held = bucket(s3_client, "out/")
    assert set(held) == produced("B", data)
    assert {n: set(m["files"]) for n, m in markers(s3_client, "out/").items()} == {n: {"p/B.bin", "B.txt"} for n in data}
    assert all(held[f"{n}/p/B.bin"] == data[n]["f"] for n in data)


def test_objects_of_an_attempt_without_a_marker_are_kept_where_not_written_again(s3_source, s3_client, tmp_path):
    """Objects under an item and no marker: an attempt killed mid-upload (under names the next
    attempt does not write: a split at random points, a timestamp in a name), or one running now
    in another process (a second run onto the same DST; ranks whose shares overlap). Deleting
    them, as the first version of this change did, deleted the outputs that the other process's
    marker then listed. They are kept; those written again are replaced; what is under no item
    of SRC (a file beside the items, an item gone from SRC) is kept too."""
    data = s3_source.folders(2, {"f": 100})
    dst = "s3://data/out/"
    killed = ["item000/p/1732969.bin", "item000/part-3.txt", "item000/p/A.bin", "item001/x/y/z.bin"]
    leave(dst, s3_source.options, tmp_path, [*killed, "README", "item0000/gone.bin", "item001x"])
    base = [s3_source.url, dst, "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--out-ratio", "3"]
    run = cli(*base, "--no-progress", *storage_args(s3_source.options), "--", *named("A"))
    assert run.returncode == 0 and "2 done, 0 failed, 0 already done" in run.stderr, run.stderr
    held = bucket(s3_client, "out/")
    assert set(held) == produced("A", data) | {"README", "item0000/gone.bin", "item001x"} | set(killed)
    assert held["item000/p/A.bin"] == data["item000"]["f"]  # rewritten by this attempt


def test_a_local_destination_keeps_only_the_outputs_and_no_empty_folder(tmp_path):
    """On a local DST: a killed attempt's files are kept (no marker: see above), but for the
    temporary file of an upload that this attempt writes again; once the item has a marker,
    a rerun by another command deletes what the item holds that it does not write, and the
    folders that held only that."""
    for name in ("a", "b"):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "f").write_bytes(name.encode() * 10)
    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    leave(str(dst), {}, tmp_path, ["a/old/deeper/x.bin", "a/p/7.bin", "a/p/A.bin.cachepipe.tmp", "b/A.txt", "keep/me"])
    base = [src, str(dst), "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--out-ratio", "3", "--no-progress"]

    def tree() -> set[str]:
        for folder, dirs, files in os.walk(dst):
            assert dirs or files, f"{folder} was left empty"
        return {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()}

    first = cli(*base, "--", *named("A"))
    assert first.returncode == 0, first.stderr
    assert tree() == produced("A", "ab") | {"keep/me", "a/old/deeper/x.bin", "a/p/7.bin"}
    rerun = cli(*base, "--", *named("B"))
    assert rerun.returncode == 0 and "2 run again" in rerun.stderr, rerun.stderr
    assert tree() == produced("B", "ab") | {"keep/me"}
    assert (dst / "a" / "p" / "B.bin").read_bytes() == b"a" * 10


def test_a_source_under_the_destination_is_never_deleted_from(tmp_path):
    """SRC ``dst/in/`` holds an item named ``in``: its file is ``dst/in/in/f``, under the
    item's folder ``dst/in/`` in DST's listing. The source is not the item's to delete."""
    dst = tmp_path / "dst"
    (dst / "in" / "in").mkdir(parents=True)
    (dst / "in" / "in" / "f").write_bytes(b"the dataset")
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "progress": False, "out_ratio": 3}
    result = map_items(named("A"), str(dst / "in"), str(dst), **options)
    assert result.ok and result.items_done == 1, result.failed
    assert (dst / "in" / "in" / "f").read_bytes() == b"the dataset"


class DeleteDeniedDest(FsspecStore):
    """A destination whose credentials may write but not delete (no ``s3:DeleteObject``)."""

    def delete(self, keys, within=""):
        raise PermissionError(f"access denied to {keys[0]} (AccessDenied)")


def test_a_destination_that_refuses_deletes_stops_the_run_naming_the_permission(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_bytes(b"x")
    dst = tmp_path / "dst"
    leave(str(dst), {}, tmp_path, ["a/left.bin"])
    (dst / "a" / DONE_MARKER).write_bytes(marker_body("a", {"left.bin": 24}, None, "0" * 16))  # another command's
    with pytest.raises(DestinationDeniedError, match=rf"deleting a/{DONE_MARKER}, what an earlier attempt left.*s3:DeleteObject"):
        map_items(
            named("A"),
            str(tmp_path / "src"),
            str(dst),
            cache_dir=tmp_path / "cache",
            capacity="1MiB",
            out_ratio=3,
            progress=False,
            dest_store=DeleteDeniedDest(str(dst), {}),
        )
    assert marker_command((dst / "a" / DONE_MARKER).read_bytes()) == "0" * 16  # the old marker: nothing written


class CountingDest(FsspecStore):
    """An S3 destination that records its requests: listing pages, GETs, deletes, puts."""

    def __init__(self, url: str, options: dict) -> None:
        super().__init__(url, options)
        self.calls: list[tuple[str, object]] = []
        self._calls_lock = threading.Lock()

    def _note(self, call: str, what: object) -> None:
        with self._calls_lock:
            self.calls.append((call, what))

    def _list_s3_page(self, bucket, prefix, token, keys, after):
        self._note("list", prefix)
        return super()._list_s3_page(bucket, prefix, token, keys, after)

    def get(self, key, out, start, end, *, etag=None):
        self._note("get", key)
        return super().get(key, out, start, end, etag=etag)

    def put(self, local_path, key):
        self._note("put", key)
        super().put(local_path, key)

    def delete(self, keys, within=""):
        self._note("delete", tuple(keys))
        super().delete(keys, within)

    def take(self) -> dict[str, list]:
        with self._calls_lock:
            calls, self.calls = self.calls, []
        by: dict[str, list] = {"list": [], "get": [], "put": [], "delete": []}
        for call, what in calls:
            by[call].append(what)
        return by


def test_an_item_done_is_left_alone_and_a_fresh_destination_costs_one_listing(s3_source, s3_client, tmp_path):
    """The requests to DST per run: one listing of DST (a page per 1,000 keys); a GET of each
    marker it lists (none on a fresh DST, where it was one per item); deletes only for an item
    that runs, has a marker and holds what it does not write. An item skipped as done is neither
    read beyond its marker's head nor deleted from; one without a marker is not deleted from."""
    data = s3_source.folders(3, {"f": 100})
    dest = CountingDest("s3://data/out/", s3_source.options)
    options = {**s3_options(tmp_path, s3_source), "out_ratio": 3, "dest_store": dest}
    try:
        assert map_items(named("A"), s3_source.url, "s3://data/out/", **options).items_done == 3
        fresh = dest.take()
        assert (fresh["list"], fresh["get"], fresh["delete"]) == (["out/"], [], [])  # no GET per item
        assert set(fresh["put"]) == produced("A", data)

        again = map_items(named("A"), s3_source.url, "s3://data/out/", **options)
        assert (again.items_done, again.items_skipped) == (0, 3)
        skipped = dest.take()
        assert skipped == {"list": ["out/"], "get": sorted(f"{n}/{DONE_MARKER}" for n in data), "put": [], "delete": []}

        s3_client.delete_object(Bucket="data", Key=f"out/item002/{DONE_MARKER}")  # as if killed before its marker
        s3_client.put_object(Bucket="data", Key="out/item002/p/left.bin", Body=b"left")
        resumed = map_items(named("A"), s3_source.url, "s3://data/out/", **options)
        assert (resumed.items_done, resumed.items_skipped) == (1, 2)
        calls = dest.take()
        assert sorted(calls["get"]) == [f"item000/{DONE_MARKER}", f"item001/{DONE_MARKER}"]
        assert calls["delete"] == []  # no marker: what it holds may be another process's, being written
        assert set(calls["put"]) == produced("A", ["item002"])

        rerun = map_items(named("B"), s3_source.url, "s3://data/out/", **options)  # every item has A's marker
        assert rerun.items_done == 3
        deletes = dest.take()["delete"]
        assert sorted(deletes) == sorted(  # per item: the old marker alone, then the rest in one request
            [(f"{n}/{DONE_MARKER}",) for n in data]
            + [(f"{n}/A.txt", f"{n}/p/A.bin") for n in ["item000", "item001"]]
            + [("item002/A.txt", "item002/p/A.bin", "item002/p/left.bin")]
        )
    finally:
        dest.close()
    assert set(bucket(s3_client, "out/")) == produced("B", data)


class Crashed(BaseException):
    """The simulated process died (a BaseException: no handler of the uploader's takes it)."""


class CrashingDest(FsspecStore):
    """A local destination whose process dies before its step ``at``: each put, and the delete of
    each key (a batch delete is not atomic: S3 may have done part of it), is one step."""

    def __init__(self, url: str, at: int | None) -> None:
        super().__init__(url, {})
        self.at, self.steps = at, 0

    def _step(self) -> None:
        if self.steps == self.at:
            raise Crashed(f"killed before step {self.at}")
        self.steps += 1

    def put(self, local_path, key):
        self._step()
        super().put(local_path, key)

    def delete(self, keys, within=""):
        for key in keys:
            self._step()
            super().delete([key], within)


def attempt(dest, work, outputs: dict[str, bytes], version: str) -> None:
    """One attempt of item ``it``: its outputs ``outputs`` uploaded by an :class:`Uploader` told
    what ``DST`` holds as a run's listing tells it."""
    from cachepipe.map.uploader import Uploader

    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    for rel, body in outputs.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(body)
    held = held_by_item([o.key for o in dest.list()], {"it"}, {"it"})
    uploader = Uploader(dest, 1, 0, 0.0, 0.0, threading.Event(), command="c" * 16, held=held)
    try:
        uploader.upload_item("it", out, work, version=version)
    finally:
        uploader.close()


def test_a_crash_at_any_step_leaves_no_marker_that_lists_what_is_not_there(tmp_path):
    """The item was done by another attempt (its marker lists ``p/A.bin`` and ``A.txt``), and a
    killed attempt left ``p/9.bin``. The new attempt writes ``p/B.bin`` and ``A.txt`` (other
    bytes). Killed before each of its steps in turn: a marker there is the old one, listing the
    old attempt's files as they were, or the new one, listing exactly what ``DST/it/`` holds;
    the next attempt then leaves exactly its outputs and marker."""
    old = {"p/A.bin": b"old A", "A.txt": b"old text"}
    new = {"p/B.bin": b"new B, longer", "A.txt": b"new text, longer"}
    dst = tmp_path / "dst"

    def arrange() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        for rel, body in {**old, "p/9.bin": b"killed"}.items():
            (dst / "it" / rel).parent.mkdir(parents=True, exist_ok=True)
            (dst / "it" / rel).write_bytes(body)
        (dst / "it" / DONE_MARKER).write_bytes(marker_body("it", {k: len(v) for k, v in old.items()}, "a" * 16, "c" * 16))

    def held() -> dict[str, bytes]:
        return {p.relative_to(dst / "it").as_posix(): p.read_bytes() for p in (dst / "it").rglob("*") if p.is_file()}

    arrange()
    counted = CrashingDest(str(dst), None)
    attempt(counted, tmp_path, new, "b" * 16)
    assert held() == {**new, DONE_MARKER: held()[DONE_MARKER]}
    for at in range(counted.steps):
        arrange()
        with pytest.raises(Crashed):
            attempt(CrashingDest(str(dst), at), tmp_path, new, "b" * 16)
        found = held()
        if DONE_MARKER in found:
            marker = json.loads(found.pop(DONE_MARKER))
            made = {"a" * 16: old, "b" * 16: new}[marker["version"]]  # the attempt that wrote it
            assert {rel: found.get(rel) for rel in marker["files"]} == made, f"killed before step {at}: {found}"
        attempt(CrashingDest(str(dst), None), tmp_path, new, "b" * 16)  # the rerun
        found = held()
        assert json.loads(found.pop(DONE_MARKER))["files"] == {k: len(v) for k, v in new.items()}
        assert found == new, f"killed before step {at}"
        assert [p.name for p in (dst / "it").iterdir() if p.is_dir()] == ["p"]


def test_on_a_local_destination_the_marker_is_published_after_its_outputs_are_on_disk(tmp_path, monkeypatch):
    """The renames that publish the outputs reach the disk with their folders' ``fsync``: each
    output's folder is synced before the marker's rename, and the marker's folder after it, so
    that after a power cut a marker there means that its outputs are there too."""
    calls: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def synced(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def renamed(src, dst, **kwargs):
        calls.append(("rename", os.fspath(dst)))
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", renamed)
    dst = tmp_path / "dst"
    attempt(CrashingDest(str(dst), None), tmp_path, {"p/q/B.bin": b"b", "A.txt": b"a", "p/C.bin": b"c"}, "b" * 16)
    folders = {str(dst / "it"), str(dst / "it" / "p"), str(dst / "it" / "p" / "q")}
    marker = calls.index(("rename", str(dst / "it" / DONE_MARKER)))
    assert {path for call, path in calls[:marker] if call == "fsync"} >= folders
    assert ("fsync", str(dst / "it")) in calls[marker:]
    assert [path for call, path in calls[:marker] if call == "fsync" and path in folders].count(str(dst / "it" / "p")) == 1


# ---- the pure parts --------------------------------------------------------------------------------------------
def test_a_key_of_dst_is_the_item_s_whose_folder_is_the_longest_that_holds_it():
    names = {"a", "a/b", "c.tar", "d"}
    keys = ["a/x", "a/b/y", "a/b", "a/bz/w", "c.tar/out/1", "c.tarx/2", "README", "e/f", "d/g"]
    assert held_by_item(keys, names, {"a", "a/b", "c.tar"}) == {
        "a": ["a/x", "a/b", "a/bz/w"],  # "a/b" the object, not the folder: a's (an output named b)
        "a/b": ["a/b/y"],
        "c.tar": ["c.tar/out/1"],
    }
    assert held_by_item(keys, names, {"a"}) == {"a": ["a/x", "a/b", "a/bz/w"]}  # never another item's, run or not


def test_the_command_digest_changes_with_the_command_and_unpack_only():
    digest = command_digest(A, None, False)
    assert digest == command_digest(tuple(A), None, False) and len(digest) == 16
    assert digest != command_digest(B, None, False)
    assert digest != command_digest(A, None, True)  # the command sees the extracted files
    spaced = [*A[:2], A[2].replace("; ", ";  ")]  # a trivially different command is another command
    assert digest != command_digest(spaced, None, False)
    assert command_digest(None, None, True) != command_digest(None, "m.f", True) != command_digest(["m.f"], None, True)


def _transform(item: str, out: str) -> None:
    """A stand-in ``fn``."""


class _Callable:
    def __call__(self, item: str, out: str) -> None:
        """A callable object."""


def test_a_function_is_named_by_its_module_and_qualified_name():
    assert function_name(_transform) == f"{__name__}._transform"
    assert function_name(functools.partial(_transform, "x")) == f"{__name__}._transform"
    assert function_name(_Callable()) == f"{__name__}._Callable"


@pytest.mark.parametrize(
    ("head", "version", "expected"),
    [
        (None, "v1", "missing"),
        (b'{\n"version": "00aa",\n"command": "cc01",\n"item": "x"}', "00aa", "done"),
        (b'{\n"version": "00aa",\n"command": "cc02",\n"item": "x"}', "00aa", "command"),
        (b'{\n"version": "00aa",\n"command": "cc02",\n"item": "x"}', "00bb", "command"),
        (b'{\n"version": "00aa",\n"command": "cc01",\n"item": "x"}', "00bb", "input"),
        (b'{\n"command": "cc01",\n"item": "x"}', None, "done"),
        (b'{\n"command": "cc02",\n"item": "x"}', None, "command"),
        (b'{\n"version": "00aa",\n"item": "x"}', "00aa", "done"),  # an earlier cachepipe's: no command
        (b'{\n"item": "x", "files": {"command": 1}}', None, "done"),
        (b"{}", "00aa", "done"),
    ],
)
def test_the_verdict_on_a_marker(head, version, expected):
    assert verdict(head, version, "cc01") == expected


def test_a_marker_s_head_holds_its_version_then_its_command():
    body = marker_body("x", {"a": 1}, "00aa", "cc01")
    record = json.loads(body)
    assert list(record)[:3] == ["version", "command", "item"] and record["files"] == {"a": 1}
    assert (marker_version(body), marker_command(body)) == ("00aa", "cc01")
    assert (marker_version(marker_body("x", {}, None, "cc01")), marker_command(marker_body("x", {}, None, "cc01"))) == (
        None,
        "cc01",
    )
    assert marker_command(marker_body("x", {}, "00aa", None)) is None


def test_a_destination_that_is_the_source_through_a_link_is_refused_and_the_dataset_kept(tmp_path):
    """DST spelled as a link to SRC (or SRC as a link to DST) is SRC itself: its listing is the
    dataset's, every input file under an item to run would be "left by an earlier attempt" and
    deleted before the upload. Refused, as DST spelled as SRC is."""
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_bytes(b"the dataset")
    (tmp_path / "link").symlink_to(tmp_path / "src")
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "progress": False, "out_ratio": 3}
    for src, dst in ((tmp_path / "src", tmp_path / "link"), (tmp_path / "link", tmp_path / "src")):
        with pytest.raises(ConfigError, match="is the source itself"):
            map_items(named("A"), str(src), str(dst), **options)
        assert (tmp_path / "src" / "a" / "f").read_bytes() == b"the dataset"


def test_the_listings_of_src_and_dst_that_fail_at_page_n_continue_from_there(request, fault_proxy, s3_client, tmp_path, caplog):
    """``cachepipe map`` listed SRC whole, and DST, again from their first page after a transient
    error on a page: a failure at page N cost N more requests (a bucket of millions of keys under
    SlowDowns: the square of its listing). Each continues after the last item it read whole
    (SRC: item031, read in part when its page 20 failed, listed again from its first key; DST:
    after the last key read). A dry run: every item planned, the 20 items that hold objects in
    DST (no marker: an attempt that did not finish) all found."""
    from conftest import via
    from test_streaming import _fail_once, _listing_request, _paged_store, _requests_resumed

    proxy, endpoint = fault_proxy
    src, source = _paged_store(request, "s3", endpoint, 5)
    src_keys = [f"item{i // 3:03d}/{'abc'[i % 3]}" for i in range(150)]
    source.put_many(dict.fromkeys(src_keys, b"x"))
    dst_keys = [f"item{i // 2:03d}/{'xy'[i % 2]}" for i in range(40)]  # under items 0 to 19
    for key in dst_keys:
        s3_client.put_object(Bucket="data", Key=f"out/{key}", Body=b"")
    dst = open_store("s3://data/out/", via(source, endpoint))
    dst.list_page_size = 5  # type: ignore[attr-defined]
    listed = _fail_once(proxy, {"prefix=video": 20, "prefix=out": 5})
    try:
        with caplog.at_level("INFO", logger="cachepipe.map"):
            result = map_items(
                ["true"],
                source.url,
                "s3://data/out/",
                cache_dir=tmp_path / "cache",
                capacity="1MiB",
                store=src,
                dest_store=dst,
                dry_run=True,
                progress=False,
                retry_backoff=0,
            )
    finally:
        src.close()
        dst.close()
    assert result.planned == [f"item{i:03d}" for i in range(50)]
    assert "20 item(s) to run hold objects in DST but no marker" in caplog.text
    lines = [head.split("\r\n", 1)[0] for head in proxy.requests if _listing_request(head)]
    assert proxy.injected["503"] == 0 and listed == {"prefix=video": 32, "prefix=out": 9}
    assert sum("prefix=video" in line for line in lines) == _requests_resumed(src_keys, "folders", 5, 20) == 32
    assert sum("prefix=out" in line for line in lines) == _requests_resumed(dst_keys, "files", 5, 5) == 9


def test_only_rank_0_removes_what_killed_uploads_left_in_a_local_destination(tmp_path):
    """Every rank walked the whole of a local DST for killed uploads' temporary files (on NFS
    shared by 64 ranks, 64 walks of it at start); rank 0 alone does now, and the others list
    only their part of it. Rank 1 of 2 leaves a temporary file under rank 0's item (before:
    removed by it); rank 0 removes it."""
    for name in ("a", "b"):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "f").write_bytes(name.encode() * 10)
    dst = tmp_path / "dst"
    leave(str(dst), {}, tmp_path, ["a/stale.bin.cachepipe.tmp"])
    options = {"capacity": "1MiB", "progress": False, "out_ratio": 3, "world_size": 2}
    second = map_items(named("A"), str(tmp_path / "src"), str(dst), cache_dir=tmp_path / "c1", rank=1, **options)
    assert second.ok and second.items_done == 1, second.failed
    assert (dst / "a" / "stale.bin.cachepipe.tmp").exists()  # rank 0's item: rank 1 neither walks nor lists there
    first = map_items(named("A"), str(tmp_path / "src"), str(dst), cache_dir=tmp_path / "c0", rank=0, **options)
    assert first.ok and first.items_done == 1, first.failed
    assert not (dst / "a" / "stale.bin.cachepipe.tmp").exists()


def test_a_store_object_given_to_map_serves_run_after_run_and_stays_open(tmp_path):
    """``map(store=)``: the run's pipeline aborted the store given to it as it closed (its
    PlannedSource aborted the real store), so a second run given the same object failed each
    item with StoreClosedError. Now the pipeline aborts only its view of it; the store is the
    caller's, open after the runs."""
    for name in ("a", "b"):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "f").write_bytes(name.encode() * 10)
    store = open_store(str(tmp_path / "src"))
    options = {"capacity": "1MiB", "progress": False, "out_ratio": 3, "store": store}
    try:
        for run in ("1", "2"):
            dst = str(tmp_path / f"dst{run}")
            result = map_items(named("A"), str(tmp_path / "src"), dst, cache_dir=tmp_path / f"c{run}", **options)
            assert result.ok and result.items_done == 2, result.failed  # before: the second run's items failed
        assert [o.key for o in store.list()] == ["a/f", "b/f"]
    finally:
        store.close()
