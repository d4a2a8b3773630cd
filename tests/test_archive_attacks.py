"""Archives from a hostile or broken bucket: cut, corrupt, or built to escape the item.

test_unpack.py covers each refusal by name; here, the archives that got through it: a tar cut at
a member's boundary or with a damaged header (tarfile ends there silently), a compressed tar whose
check (gzip's CRC) fails, links that leave the item through other links. Built with
tarfile/zipfile; the pipeline's side through the moto server.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile

import pytest
from test_pipeline_unpack import drain, leftovers, unpacking
from test_unpack import FILES, LIMIT, archive_bytes, link, read_tree, tar_bytes, zip_bytes

from cachepipe.unpack import ArchiveError, UnsafeMemberError, unpack_item

MANY = {f"m{i}.bin": os.urandom(3000) for i in range(6)}  # 512 + 3072 bytes each in a tar
STEP = 512 + 3072


def plain(files: dict[str, bytes] = MANY) -> bytes:
    return tar_bytes(files)


def damaged(data: bytes, at: int, value: int) -> bytes:
    out = bytearray(data)
    out[at] ^= value
    return bytes(out)


def gz_with_bad_crc() -> bytes:
    data = tar_bytes(MANY, "w:gz")
    return damaged(data, len(data) - 6, 0xFF)  # the CRC-32 of gzip's trailer


def gz_with_damaged_data() -> bytes:
    """A gzip whose deflate data decodes (random data: stored blocks) to other bytes: only its CRC tells."""
    data = tar_bytes(MANY, "w:gz")
    return damaged(data, len(data) // 2, 0x01)


def bad_sparse(headers: dict[str, str], data: bytes = b"x" * 10) -> bytes:
    """A tar whose second member is a GNU sparse file (PAX headers) with ``headers``: a map or a size
    that is no number, on which tarfile's ``int()`` raises a bare ValueError."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        first = tarfile.TarInfo("m0.bin")
        first.size = 2
        tar.addfile(first, io.BytesIO(b"ok"))
        info = tarfile.TarInfo("clip.bin")
        info.size = len(data)
        info.pax_headers = headers
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


SPARSE_01 = {"GNU.sparse.major": "0", "GNU.sparse.minor": "1", "GNU.sparse.size": "10"}
BROKEN_TARS = {
    "cut at a member's boundary": lambda: plain()[: 2 * STEP],
    "cut inside a header": lambda: plain()[: 2 * STEP + 100],
    "a damaged header": lambda: damaged(plain(), 2 * STEP + 148, 0x55),  # the third header's checksum
    "a header zeroed": lambda: plain()[: 2 * STEP] + bytes(512) + plain()[2 * STEP + 512 :],
    "tar.gz cut in half": lambda: tar_bytes(MANY, "w:gz")[: len(tar_bytes(MANY, "w:gz")) // 2],
    "tar.gz cut in its trailer": lambda: tar_bytes(MANY, "w:gz")[:-4],
    "tar.gz with a bad CRC": gz_with_bad_crc,
    "tar.gz with damaged data": gz_with_damaged_data,
    "tar.bz2 cut in its trailer": lambda: tar_bytes(MANY, "w:bz2")[:-4],
    "tar.xz cut in its trailer": lambda: tar_bytes(MANY, "w:xz")[:-4],
    "a GNU sparse map of no numbers": lambda: bad_sparse({**SPARSE_01, "GNU.sparse.map": "a,b"}),
    "a GNU sparse size of no number": lambda: bad_sparse({**SPARSE_01, "GNU.sparse.map": "0,5", "GNU.sparse.size": "q"}),
    "a GNU sparse 1.0 map of no numbers": lambda: bad_sparse(
        {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": "10"}, b"1\nzz\n3\n".ljust(512, b"\0")
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_TARS))
def test_a_cut_or_damaged_tar_fails_as_such_and_leaves_nothing(tmp_path, case):
    """tarfile ends an archive silently at a header that is missing, cut or invalid after the
    first, and its stream reader checks no gzip CRC: such an archive was extracted in part (2 of 6
    members for a tar cut at a boundary, 3 of 6 for a tar.gz cut in half) or with wrong bytes,
    and handed out as whole."""
    archive = tmp_path / "all.tar"
    archive.write_bytes(BROKEN_TARS[case]())
    with pytest.raises(ArchiveError) as caught:
        unpack_item(archive, tmp_path / "out", limit_bytes=LIMIT, name="clip")
    assert str(caught.value).startswith("archive 'all.tar' of item 'clip' is truncated or corrupt: "), str(caught.value)
    if "sparse" in case:  # was a bare ValueError of tarfile's; now where, and after which member
        assert "bad header at byte 3072 of the tar (the member after 'm0.bin'): ValueError: " in str(caught.value)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("fmt", ["tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst"])
def test_whole_tars_still_extract_with_their_padding(tmp_path, fmt):
    """The end of the archive is read to its end: its zero padding (tarfile pads to 10 KiB, GNU
    tar to its blocking factor) and the compression's trailer pass."""
    if fmt in ("tar.bz2", "tar.xz"):
        data = tar_bytes(FILES, {"tar.bz2": "w:bz2", "tar.xz": "w:xz"}[fmt])
    else:
        data = archive_bytes(FILES, fmt)
    (tmp_path / "a").write_bytes(data + (bytes(20480) if fmt == "tar" else b""))
    result = unpack_item(tmp_path / "a", tmp_path / "out", limit_bytes=LIMIT)
    assert read_tree(tmp_path / "out") == FILES and result.members == len(FILES)


def test_a_tar_with_another_appended_is_refused_not_half_extracted(tmp_path):
    """`cat a.tar b.tar` extracts as a.tar alone (tar stops at the first end-of-archive blocks):
    b's members were dropped without a word."""
    (tmp_path / "a").write_bytes(plain({"a.bin": b"a"}) + plain({"b.bin": b"b"}))
    with pytest.raises(ArchiveError, match="after its end-of-archive"):
        unpack_item(tmp_path / "a", tmp_path / "out", limit_bytes=LIMIT)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_cut_tar_fails_its_item_and_the_pass_goes_on(s3_source, tmp_path):
    s3_source.put("cut/frames.tar", plain()[: 2 * STEP])
    s3_source.put("crc/frames.tar.gz", gz_with_bad_crc())
    s3_source.put("good/frames.tar", plain())
    s3_source.put("sparse/frames.tar", bad_sparse({**SPARSE_01, "GNU.sparse.map": "a,b"}))  # was a bare ValueError
    cache = tmp_path / "c"
    with unpacking(s3_source, cache, "1MiB", on_error="skip") as pipe:
        delivered, _ = drain(pipe)
        assert leftovers(cache) == []
    assert sorted(delivered) == ["good"] and delivered["good"] == MANY
    stats = pipe.stats()
    assert stats.items_failed == 3, stats


# ---- links that leave the item through other links ---------------------------------------------
def zip_link(name: str, target: str) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info, target.encode()


ESCAPES = {
    # 'e' is checked while 'g' is no link yet (inside, lexically and by realpath); then 'g' -> '.'
    "tar, the link it goes through made after it": (
        "a.tar",
        lambda: tar_bytes({}, "w", [link("e", "g/g/../../secret"), link("g", ".")]),
        "e",
    ),
    "zip, the link it goes through made after it": (
        "a.zip",
        lambda: zip_bytes([zip_link("e", "g/g/../../secret"), zip_link("g", ".")]),
        "e",
    ),
    # 'd/d/e' is the item's 'e': '../../secret' leaves it; lexically, from 'd/d', it stays inside
    "zip, made through a link": ("a.zip", lambda: zip_bytes([zip_link("d", "."), zip_link("d/d/e", "../../secret")]), "d/d/e"),
}


@pytest.mark.parametrize("case", list(ESCAPES))
def test_a_link_that_leaves_the_item_through_other_links_is_refused(tmp_path, case):
    """Each link's target was checked alone, lexically (and by tarfile's filter with the links
    made so far): a link through a link made later, or a zip link made through a link, pointed
    out of the item (here at a file beside the cache), and the item was handed out with it."""
    filename, build, member = ESCAPES[case]
    (tmp_path / "secret").write_text("not the item's")
    box = tmp_path / "cache" / "item"
    box.mkdir(parents=True)
    (box / filename).write_bytes(build())
    with pytest.raises(UnsafeMemberError, match="outside the item") as caught:
        unpack_item(box / filename, tmp_path / "cache" / "out", limit_bytes=LIMIT)
    assert caught.value.member == member and caught.value.archive == filename
    assert list((tmp_path / "cache" / "out").iterdir()) == []


def test_links_through_links_inside_the_item_are_kept(tmp_path):
    """As in a root file system's archive: 'lib' -> 'usr/lib', 'so' -> 'lib/x.so'; and a link
    that goes out and back in by the item's own name ('../out/...') is refused: the item is
    renamed after its extraction."""
    tar = tar_bytes({"usr/lib/x.so": b"elf"}, "w", [link("lib", "usr/lib"), link("so", "lib/x.so"), link("up", "lib/..")])
    (tmp_path / "a.tar").write_bytes(tar)
    unpack_item(tmp_path / "a.tar", tmp_path / "out", limit_bytes=LIMIT)
    assert (tmp_path / "out" / "so").read_bytes() == b"elf" and os.readlink(tmp_path / "out" / "so") == "lib/x.so"
    (tmp_path / "b.zip").write_bytes(zip_bytes([zip_link("d", "."), zip_link("d/d/e", "../out2/x")]))
    with pytest.raises(UnsafeMemberError, match="outside the item"):
        unpack_item(tmp_path / "b.zip", tmp_path / "out2", limit_bytes=LIMIT)


def test_a_hard_link_over_a_file_of_the_archive_replaces_it_and_the_members_after_it_are_extracted(tmp_path):
    """A tar may name a path twice, the later member replacing the earlier (GNU tar unlinks it
    first). A hard link onto a path already extracted failed in ``os.link`` (EEXIST), and
    tarfile's fallback looked for the target in the archive: this whole archive failed as
    "truncated or corrupt" (StreamError: seeking backwards is not allowed). Where that search
    finds nothing (the unpack keeps no headers), tarfile drops its error (``errorlevel`` 1)
    after reading the rest of the stream (h-review2's reading, not reproduced here)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("x", b"1"), ("y", b"2")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        tar.addfile(link("y", "x", tarfile.LNKTYPE))
        info = tarfile.TarInfo("z")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"3"))
    (tmp_path / "a.tar").write_bytes(buf.getvalue())
    unpack_item(tmp_path / "a.tar", tmp_path / "out", limit_bytes=LIMIT)
    assert read_tree(tmp_path / "out") == {"x": b"1", "y": b"1", "z": b"3"}
    assert os.stat(tmp_path / "out" / "y").st_ino == os.stat(tmp_path / "out" / "x").st_ino
