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

import pytest
from test_map import bucket, cli, storage_args

from cachepipe.map import map_items, plan_items
from cachepipe.map.cli import main
from cachepipe.map.plan import command_digest, function_name
from cachepipe.map.remote import verdict
from cachepipe.map.uploader import DONE_MARKER, MARKER_LIMIT, marker_body, marker_command, marker_version
from cachepipe.stores import open_store


def writes(text: str) -> list[str]:
    """A command whose one output, ``g``, holds ``text`` and the input's ``f``."""
    return ["sh", "-c", f'{{ printf {text}; cat f; }} > "$CACHEPIPE_OUT/g"']


A, B = writes("A"), writes("B")


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
    options = {
        "cache_dir": tmp_path / "cache",
        "capacity": "1MiB",
        "storage_options": s3_source.options,
        "progress": False,
        "out_ratio": 2,
    }
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
    options = {
        "cache_dir": tmp_path / "cache",
        "capacity": "1MiB",
        "storage_options": s3_source.options,
        "progress": False,
        "out_ratio": 2,
    }
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
    options = {
        "cache_dir": tmp_path / "cache",
        "capacity": "1MiB",
        "storage_options": s3_source.options,
        "progress": False,
        "out_ratio": 2,
    }
    result = map_items(A, s3_source.url, "s3://data/out/", **options)
    assert result.ok and (result.items_done, result.items_skipped) == (1, 1), result.failed


def test_dry_run_says_which_items_another_command_did(s3_source, s3_client, tmp_path, capsys, caplog):
    s3_source.folders(3, {"f": 100})
    options = {
        "cache_dir": tmp_path / "cache",
        "capacity": "1MiB",
        "storage_options": s3_source.options,
        "progress": False,
        "out_ratio": 2,
    }
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
    note = " (done before by another command: its outputs would be overwritten)"
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


# ---- the pure parts --------------------------------------------------------------------------------------------
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
