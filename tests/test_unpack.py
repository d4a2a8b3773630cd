"""Archive extraction: formats, split volumes, checksums, and every kind of unsafe member (no network)."""

from __future__ import annotations

import errno
import hashlib
import io
import itertools
import os
import re
import stat
import tarfile
import threading
import warnings
import zipfile
from pathlib import Path

import pytest

from cachepipe.cache import tree_bytes
from cachepipe.unpack import (
    ArchiveError,
    ArchiveTooLargeError,
    ChecksumError,
    ConcatReader,
    UnsafeMemberError,
    archive_format,
    split_volume,
    unpack_in_place,
    unpack_item,
)

FILES = {"clips/a.mp4": os.urandom(5000), "clips/b.mp4": os.urandom(7000), "meta.json": b'{"x": 1}'}
LIMIT = 1 << 20


def tar_bytes(files: dict[str, bytes], mode: str = "w", extra: list[tarfile.TarInfo] = ()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.size else None)
    return buf.getvalue()


def zip_bytes(entries: list[tuple[zipfile.ZipInfo | str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Duplicate name", UserWarning)  # a test writes one on purpose
        for info, data in entries:
            zf.writestr(info, data)
    return buf.getvalue()


def media_clip(rng, size: int) -> bytes:
    """An MP4-like file: incompressible media data, then a small regular index (like an MP4's
    ``stsz`` table, 2% of the file), which gzip and zstd shrink: the archive comes out 1-2% smaller
    than its files, as real video clips do."""
    index = b"".join(b"stsz" + i.to_bytes(4, "big") for i in range(size // 400))
    return rng.randbytes(size - len(index)) + index


def archive_bytes(files: dict[str, bytes], fmt: str) -> bytes:
    """``files`` as a ``tar.gz``, ``tar.zst`` or ``zip`` archive."""
    if fmt == "tar.zst":
        zstandard = pytest.importorskip("zstandard")
        return zstandard.ZstdCompressor().compress(tar_bytes(files))
    if fmt == "zip":
        return zip_bytes(list(files.items()))
    return tar_bytes(files, {"tar.gz": "w:gz", "tar": "w"}[fmt])


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def special(name: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    return info


# ---- formats -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "filename"),
    [
        ("w", "x.tar"),
        ("w:gz", "x.tar.gz"),
        ("w:gz", "x.tgz"),
        ("w:bz2", "x.tar.bz2"),
        ("w:xz", "x.tar.xz"),
        ("w", "no-extension"),
        ("zst", "x.tar.zst"),
        ("zip", "x.zip"),
    ],
)
def test_every_format_extracts_by_content(tmp_path, mode, filename):
    if mode == "zst":
        zstandard = pytest.importorskip("zstandard")
        data = zstandard.ZstdCompressor().compress(tar_bytes(FILES))
    elif mode == "zip":
        data = zip_bytes(list(FILES.items()))
    else:
        data = tar_bytes(FILES, mode)
    archive = tmp_path / filename
    archive.write_bytes(data)
    result = unpack_item(archive, tmp_path / "out", limit_bytes=LIMIT)
    assert read_tree(tmp_path / "out") == FILES
    assert result.bytes == sum(len(b) for b in FILES.values())
    assert result.archives == [filename]


def test_names_of_split_volumes():
    assert split_volume("name.tar.gz-00") == ("name.tar.gz", "00")
    assert split_volume("20bn-something-something-v2-19") == ("20bn-something-something-v2", "19")
    assert split_volume("d/name.tar.gz.partab") == ("name.tar.gz", "ab")
    assert split_volume("x.tar.001") == ("x.tar", "001")
    assert split_volume("x.tar.gz-00.md5") is None and split_volume("shard-000001.tar") is None
    assert archive_format(b"plain text") is None


def test_concat_reader_reads_and_seeks_across_volumes(tmp_path):
    data = os.urandom(10_000)
    cuts = [0, 1, 4000, 4000, 9999, 10_000]  # includes an empty volume and a one-byte one
    paths = []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        paths.append(tmp_path / f"v-{i:02d}")
        paths[-1].write_bytes(data[a:b])
    with ConcatReader(paths) as reader:
        assert reader.read() == data
        assert all(
            m.hexdigest() == hashlib.md5(data[a:b]).hexdigest()
            for m, (a, b) in zip(reader.md5s, itertools.pairwise(cuts), strict=True)
        )
        reader.seek(3990)
        assert reader.read(20) == data[3990:4010] and not reader.hashed
        reader.seek(-5, io.SEEK_END)
        assert reader.read(100) == data[-5:]


# ---- split volumes and checksums ------------------------------------------------------------------
def volumes(data: bytes, names: list[str]) -> dict[str, bytes]:
    """``data`` cut into consecutive parts of (nearly) equal size, one per volume name."""
    step = len(data) // len(names) + 1
    return {name: data[i * step : (i + 1) * step] for i, name in enumerate(names)}


def md5_sidecar(name: str, part: bytes) -> str:
    """The text of ``<name>.md5`` as ``md5sum`` writes it."""
    return f"{hashlib.md5(part).hexdigest()} {name}\n"


def split_into(folder: Path, data: bytes, names: list[str], md5_folder: Path | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in volumes(data, names).items():
        (folder / name).write_bytes(part)
        if md5_folder is not None:
            md5_folder.mkdir(parents=True, exist_ok=True)
            (md5_folder / f"{name}.md5").write_text(md5_sidecar(name, part))


def test_split_volumes_with_md5_sidecars_in_another_folder(tmp_path):
    item = tmp_path / "item"
    names = [f"20bn-ss-v2-{i:02d}" for i in range(5)]
    split_into(item / "compressed", tar_bytes(FILES, "w:gz"), names, md5_folder=item / "md5")
    result = unpack_item(item, tmp_path / "out", limit_bytes=LIMIT)
    assert read_tree(tmp_path / "out") == FILES
    assert result.verified == [f"compressed/{n}" for n in names]


def test_partaa_volumes_and_an_md5sums_file(tmp_path):
    item = tmp_path / "item"
    data = tar_bytes(FILES, "w:xz")
    names = ["data.tar.xz.partaa", "data.tar.xz.partab", "data.tar.xz.partac"]
    split_into(item, data, names)
    sums = "".join(f"{hashlib.md5((item / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    (item / "md5sums").write_text(sums)
    (item / "README").write_text("not an archive")
    result = unpack_item(item, tmp_path / "out", limit_bytes=LIMIT)
    assert read_tree(tmp_path / "out") == FILES
    assert len(result.verified) == 3 and result.other == ["README"]


def test_md5_mismatch_fails_and_leaves_nothing(tmp_path):
    item = tmp_path / "item"
    names = [f"a.tar.gz-{i:02d}" for i in range(3)]
    split_into(item, tar_bytes(FILES, "w:gz"), names, md5_folder=item)
    damaged = bytearray((item / names[1]).read_bytes())
    damaged[10] ^= 0xFF
    (item / names[1]).write_bytes(bytes(damaged))
    with pytest.raises(ChecksumError, match=re.escape("a.tar.gz-01")):
        unpack_item(item, tmp_path / "out", limit_bytes=LIMIT)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_missing_volume_is_an_error(tmp_path):
    item = tmp_path / "item"
    split_into(item, tar_bytes(FILES), ["a.tar-00", "a.tar-01", "a.tar-02"])
    (item / "a.tar-01").unlink()
    with pytest.raises(ArchiveError, match=re.escape("missing before 'a.tar-02'")):
        unpack_item(item, tmp_path / "out", limit_bytes=LIMIT)


def test_not_an_archive_and_corrupt_archive(tmp_path):
    (tmp_path / "item").mkdir()
    (tmp_path / "item" / "notes.txt").write_text("hello")
    with pytest.raises(ArchiveError, match="no archive found"):
        unpack_item(tmp_path / "item", tmp_path / "out", limit_bytes=LIMIT)
    truncated = tmp_path / "t.tar.gz"
    truncated.write_bytes(tar_bytes(FILES, "w:gz")[:-2000])
    with pytest.raises(ArchiveError, match="is truncated or corrupt"):
        unpack_item(truncated, tmp_path / "out2", limit_bytes=LIMIT)
    assert list((tmp_path / "out2").iterdir()) == []


@pytest.mark.parametrize("fmt", ["tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst", "zip"])
def test_a_truncated_archive_is_called_truncated_not_too_large(tmp_path, fmt):
    # captions compress 200-fold: the reserve for the cut archive (1.25 times its size) is far below
    # the size its member declares, so the size check refused it first and blamed unpack_ratio (tar,
    # gz, xz); bz2 and zstd, which decode whole blocks, failed as corrupt, but without the item's name
    files = {"captions.txt": b"a person folds a towel\n" * 2000}
    whole = (
        tar_bytes(files, {"tar.bz2": "w:bz2", "tar.xz": "w:xz"}[fmt])
        if fmt in ("tar.bz2", "tar.xz")
        else archive_bytes(files, fmt)
    )
    cut = whole[: len(whole) * 2 // 3] if fmt != "tar" else whole[:5000]  # a tar: into the member's data
    staged = tmp_path / "5"  # staged under a number, listed as captions
    staged.mkdir()
    (staged / f"all.{fmt}").write_bytes(cut)
    with pytest.raises(ArchiveError) as caught:
        unpack_in_place(staged, name="captions", limit_bytes=int(1.25 * len(cut)), advice="raise unpack_ratio")
    message = str(caught.value)
    assert not isinstance(caught.value, ArchiveTooLargeError) and "unpack_ratio" not in message
    assert message.startswith(f"archive 'all.{fmt}' of item 'captions' is truncated or corrupt: "), message
    assert caught.value.__cause__ is not None and str(caught.value.__cause__) in message  # the reader's own words
    assert read_tree(staged) == {f"all.{fmt}": cut}  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["5"]


def test_a_stop_while_a_refused_member_is_read_ends_the_read(tmp_path):
    """The read that tells a truncated archive from a too large one must end at a stop: read
    through tarfile's extractfile (a buffered reader), the stop's InterruptedError was retried
    for ever, at full CPU, and a close or reload waited on it."""
    from cachepipe.unpack import _read_data

    path = tmp_path / "big.tar.gz"
    path.write_bytes(archive_bytes({"big.bin": os.urandom(12 << 20)}, "tar.gz"))  # incompressible: read as it goes
    stop = threading.Event()
    box: list[BaseException] = []

    def probe() -> None:
        with ConcatReader([path], stop) as reader, tarfile.open(fileobj=reader, mode="r|gz") as tar:
            member = tar.next()
            assert member is not None
            stop.set()  # as Pipeline.close sets it, while the member's data is being read
            try:
                _read_data(tar, member, None)  # the stream's own read sees the stop
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                box.append(exc)

    thread = threading.Thread(target=probe, name="test-probe", daemon=True)
    thread.start()
    thread.join(30)  # a guard, not a timing assertion: before, it never returned
    assert not thread.is_alive(), "the read of a refused member went on after the stop"
    assert box and isinstance(box[0], InterruptedError), box


def test_a_zip_member_that_fails_its_crc_is_called_corrupt(tmp_path):
    data = bytearray(zip_bytes([("a.bin", os.urandom(5000))]))
    data[2000] ^= 0xFF  # inside the member's data; the central directory is intact
    archive = tmp_path / "x.zip"
    archive.write_bytes(bytes(data))
    with pytest.raises(ArchiveError) as caught:
        unpack_item(archive, tmp_path / "out", limit_bytes=LIMIT, name="shard-0001")
    assert str(caught.value).startswith(
        "archive 'x.zip' of item 'shard-0001' is truncated or corrupt: BadZipFile: Bad CRC-32 for file 'a.bin'"
    )
    assert list((tmp_path / "out").iterdir()) == []


# ---- safety ----------------------------------------------------------------------------------------
TAR_CASES = {
    "dotdot": ({"../evil": b"x"}, [], "'..' path segment"),
    "nested dotdot": ({"a/../../evil": b"x"}, [], "'..' path segment"),
    "absolute": ({"/tmp/evil": b"x"}, [], "absolute path"),  # noqa: S108 - a member name to refuse; nothing is written there
    "control char": ({"a\nb": b"x"}, [], "control character"),
    "symlink absolute": ({}, [link("l", "/etc/passwd")], "absolute path"),
    "symlink outside": ({}, [link("d/l", "../../evil")], "outside the item"),
    # lexically inside ('d/../x' is 'x'), but d is a link to '.': tarfile's data filter, the second line, refuses it
    "symlink chain": ({}, [link("d", "."), link("d/e", "../x")], "outside the destination"),
    "hardlink outside": ({}, [link("h", "../evil", tarfile.LNKTYPE)], "outside the item"),
    "hardlink to nothing": ({}, [link("h", "ghost", tarfile.LNKTYPE)], "not a file extracted before"),
    "char device": ({}, [special("dev", tarfile.CHRTYPE)], "device file"),
    "block device": ({}, [special("dev", tarfile.BLKTYPE)], "device file"),
    "fifo": ({}, [special("fifo", tarfile.FIFOTYPE)], "FIFO"),
}


@pytest.mark.parametrize("case", list(TAR_CASES))
def test_unsafe_tar_members_are_refused_by_name(tmp_path, case):
    files, extra, reason = TAR_CASES[case]
    archive = tmp_path / "box" / "item.tar"
    archive.parent.mkdir()
    archive.write_bytes(tar_bytes({"ok.txt": b"fine", **files}, "w", extra))
    with pytest.raises(UnsafeMemberError, match=reason) as info:
        unpack_item(archive, tmp_path / "box" / "out", limit_bytes=LIMIT)
    assert info.value.member != "ok.txt" and info.value.archive == "item.tar"
    assert list((tmp_path / "box" / "out").iterdir()) == []  # undone: not even the safe member stays
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["box", "item.tar", "out"]


def test_links_inside_the_item_are_kept(tmp_path):
    archive = tmp_path / "item.tar"
    archive.write_bytes(tar_bytes({"d/f.txt": b"data"}, "w", [link("d/s", "f.txt"), link("h", "d/f.txt", tarfile.LNKTYPE)]))
    result = unpack_item(archive, tmp_path / "out", limit_bytes=LIMIT)
    assert os.readlink(tmp_path / "out" / "d" / "s") == "f.txt"
    assert (tmp_path / "out" / "h").read_bytes() == b"data"
    assert result.bytes == 8  # the hard link counts like the file it repeats (as tree_bytes does)


def test_tar_bomb_is_refused_before_the_member_is_written(tmp_path):
    archive = tmp_path / "bomb.tar.gz"
    archive.write_bytes(tar_bytes({"small": b"x" * 1000, "big": bytes(300_000)}, "w:gz"))
    assert archive.stat().st_size < 5000
    with pytest.raises(ArchiveTooLargeError, match=r"'big'.*over the limit of 100000 bytes"):
        unpack_item(archive, tmp_path / "out", limit_bytes=100_000)
    assert tree_bytes(tmp_path / "out") == 0


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_with_a_block_the_limit_counts_files_in_whole_blocks_and_a_block_per_folder(tmp_path, fmt):
    # as the cache's ledger measures the item after (footprint): the extraction's own folder,
    # a and a/b (made for a/b/x, not again for a/y or by a's own entry), two files of a block each
    files = {"a/b/x": b"1", "a/y": b"22", "a/": b""} if fmt == "zip" else {"a/b/x": b"1", "a/y": b"22"}
    archive = tmp_path / f"small.{fmt}"
    archive.write_bytes(zip_bytes(list(files.items())) if fmt == "zip" else tar_bytes(files))
    unpack_item(archive, tmp_path / "fits", limit_bytes=5 * 512, block=512)
    assert tree_bytes(tmp_path / "fits", block=512) + 512 == 5 * 512
    with pytest.raises(ArchiveTooLargeError) as caught:
        unpack_item(archive, tmp_path / "over", limit_bytes=5 * 512 - 1, block=512)
    assert "in whole blocks of 512 bytes" in str(caught.value) and "over the limit of 2559 bytes" in str(caught.value)
    assert list((tmp_path / "over").iterdir()) == []
    if fmt == "zip":  # the central directory's total, counted the same way
        assert "its files total 2560 bytes" in str(caught.value)
    unpack_item(archive, tmp_path / "bytes", limit_bytes=3)  # no block: the files' bytes alone


@pytest.mark.parametrize("fmt", ["tar.gz", "zip"])
def test_a_refusal_names_the_size_it_saw_and_what_to_raise(tmp_path, fmt):
    text = b"a person folds a towel\n" * 2000  # 46,000 bytes that compress a hundredfold
    archive = tmp_path / f"captions.{fmt}"
    archive.write_bytes(archive_bytes({"a.txt": text, "b.txt": text}, fmt))
    with pytest.raises(ArchiveTooLargeError) as caught:
        unpack_item(archive, tmp_path / "out", limit_bytes=10_000, advice="raise unpack_ratio")
    message = str(caught.value)
    assert (
        "'a.txt'" in message
        and "would bring the item to 46000 bytes" in message
        and "over the limit of 10000 bytes; raise unpack_ratio" in message
    )
    if fmt == "zip":  # the central directory tells the whole size before anything is written
        assert "its files total 92000 bytes" in message
    assert list((tmp_path / "out").iterdir()) == []


def test_member_count_limit(tmp_path):
    archive = tmp_path / "many.tar"
    archive.write_bytes(tar_bytes({f"f{i}": b"" for i in range(20)}))
    with pytest.raises(ArchiveTooLargeError, match="more than 10 members"):
        unpack_item(archive, tmp_path / "out", limit_bytes=LIMIT, max_members=10)


def zip_special(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = mode << 16
    return info


ZIP_CASES = {
    "dotdot": ([("../evil", b"x")], "'..' path segment"),
    "absolute": ([("/abs/evil", b"x")], "absolute path"),
    "duplicate": ([("a.txt", b"1"), ("a.txt", b"2")], "second entry with the same name"),
    "symlink outside": ([(zip_special("l", stat.S_IFLNK | 0o777), b"../../etc")], "outside the item"),
    "symlink absolute": ([(zip_special("l", stat.S_IFLNK | 0o777), b"/etc/passwd")], "absolute path"),
    "fifo": ([(zip_special("p", stat.S_IFIFO | 0o644), b"")], "FIFO"),
    "device": ([(zip_special("d", stat.S_IFCHR | 0o644), b"")], "device file"),
}


@pytest.mark.parametrize("case", list(ZIP_CASES))
def test_unsafe_zip_members_are_refused_by_name(tmp_path, case):
    entries, reason = ZIP_CASES[case]
    archive = tmp_path / "item.zip"
    archive.write_bytes(zip_bytes([("ok.txt", b"fine"), *entries]))
    with pytest.raises(UnsafeMemberError, match=reason):
        unpack_item(archive, tmp_path / "out", limit_bytes=LIMIT)
    assert list((tmp_path / "out").iterdir()) == []
    assert not (tmp_path.parent / "evil").exists()


def test_zip_bomb_is_refused_from_the_central_directory(tmp_path):
    archive = tmp_path / "bomb.zip"
    archive.write_bytes(zip_bytes([("a", b"x" * 10), ("zeros", bytes(2_000_000))]))
    assert archive.stat().st_size < 10_000
    with pytest.raises(ArchiveTooLargeError, match="'zeros'"):
        unpack_item(archive, tmp_path / "out", limit_bytes=1_000_000)
    assert list((tmp_path / "out").iterdir()) == []  # refused before the first member was written


def test_two_archives_of_one_item_may_not_overwrite_each_other(tmp_path):
    item = tmp_path / "item"
    item.mkdir()
    (item / "a.tar").write_bytes(tar_bytes({"same.txt": b"a"}))
    (item / "b.zip").write_bytes(zip_bytes([("same.txt", b"b")]))
    with pytest.raises(UnsafeMemberError, match=re.escape("collides with 'same.txt' extracted from 'a.tar'")):
        unpack_item(item, tmp_path / "out", limit_bytes=LIMIT)


# ---- unpack_in_place: the item replaced by its extraction --------------------------------------------
def test_a_folder_item_is_replaced_by_its_extraction_and_its_other_files(tmp_path):
    item = tmp_path / "item"
    split_into(item, tar_bytes(FILES, "w:gz"), ["x.tar.gz-00", "x.tar.gz-01"], md5_folder=item)
    (item / "notes" / "text.txt").parent.mkdir()
    (item / "notes" / "text.txt").write_bytes(b"caption")
    result = unpack_in_place(item, limit_bytes=LIMIT)
    assert read_tree(item) == {**FILES, "notes/text.txt": b"caption"}  # volumes and sidecars gone
    assert result.other == ["notes/text.txt"] and len(result.verified) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["item"]


def test_a_single_archive_file_becomes_a_folder_and_errors_name_the_archive(tmp_path):
    shard = tmp_path / "7"  # staged under a number, listed as shards/a.tar
    shard.write_bytes(tar_bytes(FILES))
    unpack_in_place(shard, name="shards/a.tar", limit_bytes=LIMIT)
    assert read_tree(shard) == FILES
    bad = tmp_path / "8"
    bad.write_bytes(tar_bytes({"../evil": b"x"}))
    with pytest.raises(UnsafeMemberError, match=re.escape("'../evil' in archive 'b.tar'")):
        unpack_in_place(bad, name="shards/b.tar", limit_bytes=LIMIT)
    assert bad.read_bytes() == tar_bytes({"../evil": b"x"})  # left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["7", "8"]


def test_an_item_with_no_archive_is_named_as_listed_not_by_its_staging_number(tmp_path):
    staged = tmp_path / "2"  # staged under a number, listed as item002
    staged.mkdir()
    (staged / "notes.txt").write_text("hello")
    with pytest.raises(ArchiveError) as caught:
        unpack_in_place(staged, name="item002", limit_bytes=LIMIT)
    assert str(caught.value).startswith("item 'item002': no archive found") and "'2'" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]


CLASH_CASES = {  # members in archive order -> what the error says
    "a file, then a member under it": ([("a", b"1"), ("a/b", b"2")], "member 'a/b' needs a folder 'a', but 'a' is a file; "),
    "a member under it, then the file": ([("a/b", b"2"), ("a", b"1")], "member 'a' is a file, but 'a' is a folder"),
}


@pytest.mark.parametrize("fmt", ["tar", "zip"])
@pytest.mark.parametrize("case", list(CLASH_CASES))
def test_members_whose_names_clash_fail_by_name_not_by_staging_path(tmp_path, fmt, case):
    entries, says = CLASH_CASES[case]
    staged = tmp_path / "3"  # staged under a number, listed as item002
    staged.mkdir()
    (staged / f"clash.{fmt}").write_bytes(tar_bytes(dict(entries)) if fmt == "tar" else zip_bytes(entries))
    with pytest.raises(ArchiveError) as caught:
        unpack_in_place(staged, name="item002", limit_bytes=LIMIT)
    message = str(caught.value)
    assert message.startswith(f"archive 'clash.{fmt}' of item 'item002': {says}"), message
    assert message.endswith("; rename one of the two") and str(tmp_path) not in message
    assert isinstance(caught.value.__cause__, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3"] and sorted(p.name for p in staged.iterdir()) == [f"clash.{fmt}"]


@pytest.mark.parametrize("fmt", ["tar", "zip"])
@pytest.mark.parametrize("limit", ["name", "path"])
def test_a_member_name_over_the_file_systems_limit_fails_by_name_and_names_the_limit(tmp_path, fmt, limit):
    if limit == "name":
        member, says = "d/" + "n" * 300, f"is 300 bytes; a name may be at most {os.pathconf(tmp_path, 'PC_NAME_MAX')} bytes"
    else:
        member, says = (
            "/".join(["n" * 200] * 30) + "/f",
            f"a path must be shorter than {os.pathconf(tmp_path, 'PC_PATH_MAX')} bytes",
        )
    staged, data = tmp_path / "4", tar_bytes({member: b"x"}) if fmt == "tar" else zip_bytes([(member, b"x")])
    staged.write_bytes(data)  # staged under a number, listed as shard-0001.tar
    with pytest.raises(ArchiveError) as caught:
        unpack_in_place(staged, name=f"shard-0001.{fmt}", limit_bytes=LIMIT)
    message = str(caught.value)
    assert message.startswith(f"archive 'shard-0001.{fmt}' of item 'shard-0001.{fmt}': member '{member[:40]}"), message
    assert says in message and str(tmp_path) not in message and len(message) < 600
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENAMETOOLONG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4"] and staged.read_bytes() == data  # left as it was


def test_a_file_of_the_item_may_not_take_the_path_of_an_extracted_member(tmp_path):
    item = tmp_path / "item"
    item.mkdir()
    (item / "a.tar").write_bytes(tar_bytes({"meta.json": b"{}"}))
    (item / "meta.json").write_bytes(b"mine")
    with pytest.raises(ArchiveError, match=re.escape("'meta.json' of the item collides with 'meta.json'")):
        unpack_in_place(item, limit_bytes=LIMIT)
    assert sorted(p.name for p in item.iterdir()) == ["a.tar", "meta.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["item"]


@pytest.mark.parametrize("mode", ["w", "w:gz", "w:bz2", "w:xz"])  # each decoder's buffered read must not retry it
def test_a_set_stop_event_interrupts_an_extraction_in_place_and_leaves_the_item_as_it_was(tmp_path, mode):
    shard, archive = tmp_path / "7", tar_bytes(FILES, mode)
    shard.write_bytes(archive)
    stop = threading.Event()
    stop.set()
    with pytest.raises(InterruptedError):
        unpack_in_place(shard, name="a.tar", limit_bytes=LIMIT, stop=stop)
    assert shard.read_bytes() == archive
    assert sorted(p.name for p in tmp_path.iterdir()) == ["7"]


def test_a_tars_memory_does_not_grow_with_its_members(tmp_path):
    """tarfile keeps the header of every member it reads, and the extraction kept each member's
    name and size: a webdataset shard of tens of thousands of small files took tens of MB while
    it was unpacked (2,000 members peaked at 1.3 MB, 20,000 at 12 MB, under tracemalloc; 500 and
    5,000 here)."""
    import tracemalloc

    def peak(members: int, run: str) -> int:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for i in range(members):
                info = tarfile.TarInfo(f"d{i // 1000}/{i:06d}.jpg")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
        shard = tmp_path / f"{members}.tar"
        shard.write_bytes(buf.getvalue())
        del buf
        tracemalloc.start()
        try:
            result = unpack_item(shard, tmp_path / run, limit_bytes=LIMIT, max_members=members)
            most = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert result.members == members
        return most

    peak(500, "warm")  # imports and caches, once
    few, many = peak(500, "few"), peak(5_000, "many")
    assert many < 2 * few, (few, many)
