"""``cachepipe map`` across nodes: rank and world size from flags or the scheduler's environment
(pure, :mod:`cachepipe.map.share`), and three real ``cachepipe map`` processes sharing one
SRC/DST on the moto server, each item processed exactly once."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepipe.errors import ConfigError
from cachepipe.grouping import tree_order
from cachepipe.map import MapItem, map_items
from cachepipe.map.dstrange import bounded, dst_range
from cachepipe.map.remote import held_by_item
from cachepipe.map.share import Rank, resolve_rank, take_share
from cachepipe.map.uploader import DONE_MARKER

SCHEDULER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "JOB_COMPLETION_INDEX",
    "CACHEPIPE_WORLD_SIZE",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_ARRAY_TASK_MIN",
    "SLURM_ARRAY_TASK_STEP",
)


# ---- rank and world size: the pure resolution -------------------------------------------------------------
def test_nothing_set_is_rank_0_of_1():
    assert resolve_rank({}) == Rank(0, 1, "default: no rank given or found in the environment")
    assert resolve_rank({}, world_size=1).world_size == 1


def test_flags_come_first():
    env = {"RANK": "2", "WORLD_SIZE": "5", "JOB_COMPLETION_INDEX": "1", "SLURM_ARRAY_TASK_ID": "3"}
    assert resolve_rank(env, rank=1, world_size=3) == Rank(1, 3, "--rank/--world-size")


def test_rank_and_world_size_from_torchrun():
    assert resolve_rank({"RANK": "2", "WORLD_SIZE": "4"}) == Rank(2, 4, "RANK=2, WORLD_SIZE=4")
    # before a Kubernetes index or a Slurm array id
    env = {"RANK": "0", "WORLD_SIZE": "2", "JOB_COMPLETION_INDEX": "1", "CACHEPIPE_WORLD_SIZE": "2", "SLURM_ARRAY_TASK_ID": "1"}
    assert resolve_rank(env).source == "RANK=0, WORLD_SIZE=2"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, "RANK='1' is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "4"}, "WORLD_SIZE='4' is set but RANK is not"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x': expected an integer"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, r"rank 4 \(from RANK=4, WORLD_SIZE=4\): expected 0 <= rank < world size 4"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, r"rank -1 \(from RANK=-1, WORLD_SIZE=4\)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"world size 0 \(from RANK=0, WORLD_SIZE=0\): expected an integer >= 1"),
    ],
)
def test_bad_torchrun_variables_are_named(env, message):
    with pytest.raises(ConfigError, match=message):
        resolve_rank(env)


def test_kubernetes_index_needs_a_count():
    with pytest.raises(ConfigError, match=r"JOB_COMPLETION_INDEX='2' is set but the number of processes is not: give "):
        resolve_rank({"JOB_COMPLETION_INDEX": "2"})
    assert resolve_rank({"JOB_COMPLETION_INDEX": "2"}, world_size=3) == Rank(2, 3, "JOB_COMPLETION_INDEX=2, --world-size 3")
    assert resolve_rank({"JOB_COMPLETION_INDEX": "2", "CACHEPIPE_WORLD_SIZE": "3"}) == Rank(
        2, 3, "JOB_COMPLETION_INDEX=2, CACHEPIPE_WORLD_SIZE=3"
    )
    with pytest.raises(ConfigError, match=r"rank 3 \(from JOB_COMPLETION_INDEX=3, CACHEPIPE_WORLD_SIZE=3\)"):
        resolve_rank({"JOB_COMPLETION_INDEX": "3", "CACHEPIPE_WORLD_SIZE": "3"})
    with pytest.raises(ConfigError, match="--world-size 4 disagrees with CACHEPIPE_WORLD_SIZE='3'"):
        resolve_rank({"JOB_COMPLETION_INDEX": "1", "CACHEPIPE_WORLD_SIZE": "3"}, world_size=4)


def test_kubernetes_index_before_slurm():
    env = {"JOB_COMPLETION_INDEX": "1", "CACHEPIPE_WORLD_SIZE": "2", "SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"}
    assert resolve_rank(env).rank == 1


def test_srun_tasks_are_ranks_and_an_array_comes_first():
    assert resolve_rank({"SLURM_PROCID": "2", "SLURM_NTASKS": "3"}) == Rank(2, 3, "SLURM_PROCID=2, SLURM_NTASKS=3")
    # inside an array job each array task is one srun task (0 of 1): the array decides
    array = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert resolve_rank(array).rank == 1
    with pytest.raises(ConfigError, match="--world-size 4 disagrees with SLURM_PROCID=0, SLURM_NTASKS=3"):
        resolve_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "3"}, world_size=4)


def test_slurm_array_made_zero_based_with_its_min_and_step():
    assert resolve_rank({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}) == Rank(
        3, 4, "SLURM_ARRAY_TASK_ID=3, SLURM_ARRAY_TASK_COUNT=4"
    )
    one_based = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}  # --array=1-4
    assert resolve_rank(one_based) == Rank(3, 4, "SLURM_ARRAY_TASK_ID=4 (minus SLURM_ARRAY_TASK_MIN=1), SLURM_ARRAY_TASK_COUNT=4")
    stepped = {
        "SLURM_ARRAY_TASK_ID": "6",
        "SLURM_ARRAY_TASK_COUNT": "4",
        "SLURM_ARRAY_TASK_MIN": "0",
        "SLURM_ARRAY_TASK_STEP": "2",
    }
    assert resolve_rank(stepped).rank == 3  # --array=0-6:2
    with pytest.raises(ConfigError, match=r"rank 4 \(from SLURM_ARRAY_TASK_ID=4, SLURM_ARRAY_TASK_COUNT=4\)"):
        resolve_rank({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"})  # --array=1-4 without its MIN
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_ID='2' is set but the number of processes is not"):
        resolve_rank({"SLURM_ARRAY_TASK_ID": "2"})
    assert resolve_rank({"SLURM_ARRAY_TASK_ID": "2"}, world_size=3).rank == 2
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_ID=3 is not SLURM_ARRAY_TASK_MIN=0 plus a multiple"):
        resolve_rank({**stepped, "SLURM_ARRAY_TASK_ID": "3"})


@pytest.mark.parametrize(
    ("env", "rank", "world", "message"),
    [
        ({}, 1, None, "rank 1 is given without the number of processes: give --world-size"),
        ({}, None, 3, "--world-size 3 is given without a rank: give --rank"),
        ({}, 3, 3, r"rank 3 \(from --rank/--world-size\): expected 0 <= rank < world size 3"),
        ({}, "1", 3, "rank '1': expected an integer"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, None, 3, "--world-size 3 disagrees with RANK=1, WORLD_SIZE=2"),
        ({"CACHEPIPE_WORLD_SIZE": "3"}, None, None, "CACHEPIPE_WORLD_SIZE='3' is set but JOB_COMPLETION_INDEX is not"),
    ],
)
def test_inconsistent_values_are_refused(env, rank, world, message):
    with pytest.raises(ConfigError, match=message):
        resolve_rank(env, rank, world)


# ---- shares: pure ---------------------------------------------------------------------------------------------
def _items(sizes: list[int]) -> list[MapItem]:
    return [MapItem(f"item{i:03d}", f"item{i:03d}", (), {}, size) for i, size in enumerate(sizes)]


@pytest.mark.parametrize("world", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("kind", ["mixed", "equal", "empty", "one large"])
def test_shares_are_runs_of_the_listing_disjoint_covering_and_byte_balanced(world, kind):
    """Each share is a run of consecutive items (a rank's results lie together in DST, and it
    lists only that part of DST), the shares in rank order cover the listing, and each holds
    an equal part of the bytes within the largest item's size."""
    rng = random.Random(world)
    sizes = {
        "mixed": [rng.choice([0, 1, 10, 100, 5000]) + rng.randrange(1000) for _ in range(100)],
        "equal": [7] * 100,
        "empty": [0] * 100,
        "one large": [1] * 50 + [10_000] + [1] * 49,
    }[kind]
    items = _items(sizes)
    shares = [take_share(items, r, world) for r in range(world)]
    assert [mi.name for share in shares for mi in share] == [mi.name for mi in items]  # runs, in rank order, covering
    totals = [sum(mi.size for mi in share) for share in shares]
    largest, total = max(sizes), sum(sizes)
    assert all(abs(world * got - total) <= world * largest for got in totals), totals
    if kind in ("equal", "empty"):  # counts differ by at most one
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


# ---- three cachepipe map processes over one SRC/DST ------------------------------------------------------------
PROCESS = r"""
import os, sys
name, out = os.environ["CACHEPIPE_NAME"], os.environ["CACHEPIPE_OUT"]
data = open("in.bin", "rb").read()
open(os.path.join(out, "size.txt"), "w").write(str(len(data)))
with open(os.path.join(sys.argv[1], name + ".log"), "a") as fh:  # one line per time the item is processed
    fh.write(sys.argv[2] + "\n")
"""

SHARE = re.compile(r"rank (\d) of 3 \((.*)\): (\d+) of (\d+) items, (\d+) bytes")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCHEDULER_VARIABLES}
    return {**env, **extra}


def _run_together(runs: list[tuple[list[str], dict[str, str]]]) -> list[subprocess.CompletedProcess]:
    """Start every ``(argv, env)`` at once, then wait for each (60 s); their output, captured."""
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv, env in runs]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def test_three_processes_share_one_source_each_item_once(s3_source, s3_client, tmp_path):
    rng = random.Random(17)
    sizes = {f"item{i:02d}": 500 + rng.randrange(8000) for i in range(14)}
    for name, size in sizes.items():
        s3_source.put(f"{name}/in.bin", rng.randbytes(size))
    script, logs = tmp_path / "process.py", tmp_path / "logs"
    script.write_text(PROCESS)
    logs.mkdir()

    def command(rank: int, *extra: str) -> list[str]:
        options = [a for k, v in s3_source.options.items() for a in ("-o", f"{k}={v}")]
        return [
            sys.executable,
            "-m",
            "cachepipe.map",
            s3_source.url,
            "s3://data/out/",
            "--cache",
            str(tmp_path / f"cache{rank}"),
            "--capacity",
            "1MiB",
            "--jobs",
            "2",
            "--no-progress",
            *options,
            *extra,
            "--",
            sys.executable,
            str(script),
            str(logs),
            str(rank),
        ]

    # --dry-run with the rank from torchrun's variables: disjoint shares that cover the listing
    # (the three at once: each only lists and prints)
    planned: dict[int, list[str]] = {}
    dry_runs = _run_together([(command(rank, "--dry-run"), _clean_env(RANK=str(rank), WORLD_SIZE="3")) for rank in range(3)])
    for rank, dry in enumerate(dry_runs):
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.splitlines()[0].startswith(f"rank {rank} of 3 (RANK={rank}, WORLD_SIZE=3): ")
        planned[rank] = [line.split()[2] for line in dry.stdout.splitlines() if line.startswith("would run: ")]
        assert f"{len(planned[rank])} items to run, 0 already done, of {len(planned[rank])} in this share" in dry.stdout
    assert sorted(n for names in planned.values() for n in names) == sorted(sizes)

    # three processes at once, ranks from --rank/--world-size
    procs = [
        subprocess.Popen(
            command(rank, "--rank", str(rank), "--world-size", "3"),
            env=_clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode == 0, err

    logged = {path.stem: path.read_text().split() for path in logs.iterdir()}
    assert sorted(logged) == sorted(sizes)
    assert all(len(lines) == 1 for lines in logged.values()), logged  # no item processed twice
    shares: dict[int, tuple[int, int]] = {}
    for rank, err in enumerate(errs):
        mine = sorted(name for name, lines in logged.items() if lines == [str(rank)])
        assert mine == sorted(planned[rank])  # the run takes the share the dry run showed
        m = SHARE.search(err)
        assert m is not None, err
        assert (int(m[1]), m[2], int(m[4])) == (rank, "--rank/--world-size", len(sizes))
        shares[rank] = (int(m[3]), int(m[5]))
        assert shares[rank] == (len(mine), sum(sizes[n] for n in mine))
        assert f"{len(mine)} done, 0 failed, 0 already done" in err
    share_bytes = [b for _, b in shares.values()]
    assert max(share_bytes) - min(share_bytes) <= 2 * max(sizes.values())  # runs of the listing, each within an item of a third

    keys = [
        o["Key"]
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket="data", Prefix="out/")
        for o in page.get("Contents", [])
    ]
    assert sorted(keys) == sorted(f"out/{n}/{f}" for n in sizes for f in ("size.txt", DONE_MARKER))

    # a rerun with the same ranks (from a Slurm array of ids 1-3, the three at once) does nothing
    reruns = _run_together(
        [
            (command(rank), _clean_env(SLURM_ARRAY_TASK_ID=str(rank + 1), SLURM_ARRAY_TASK_MIN="1", SLURM_ARRAY_TASK_COUNT="3"))
            for rank in range(3)
        ]
    )
    for rank, rerun in enumerate(reruns):
        assert rerun.returncode == 0, rerun.stderr
        assert f"0 done, 0 failed, {shares[rank][0]} already done" in rerun.stderr
        assert f"rank {rank} of 3 (SLURM_ARRAY_TASK_ID={rank + 1} (minus SLURM_ARRAY_TASK_MIN=1)" in rerun.stderr
    assert {path.stem: path.read_text().split() for path in logs.iterdir()} == logged


def test_kubernetes_index_without_a_count_is_refused_by_the_command(tmp_path):
    options = ["--cache", str(tmp_path), "--capacity", "1MiB"]
    proc = subprocess.run(
        [sys.executable, "-m", "cachepipe.map", "s3://data/video/", "s3://data/out/", *options, "--", "true"],
        env=_clean_env(JOB_COMPLETION_INDEX="2"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "JOB_COMPLETION_INDEX='2' is set but the number of processes is not: give --world-size" in proc.stderr
    assert "CACHEPIPE_WORLD_SIZE" in proc.stderr


def test_map_items_names_a_rank_out_of_range(tmp_path):
    with pytest.raises(ConfigError, match=r"rank 3 \(from --rank/--world-size\): expected 0 <= rank < world size 3"):
        map_items(["true"], "s3://data/video/", "s3://data/out/", cache_dir=tmp_path, capacity="1MiB", rank=3, world_size=3)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--rank", "3", "--world-size", "3"], r"rank 3 \(from --rank/--world-size\): expected 0 <= rank < world size 3"),
        (["--rank", "-1", "--world-size", "3"], r"rank -1 \(from --rank/--world-size\)"),
        (["--rank", "0", "--world-size", "0"], r"world size 0 \(from --rank/--world-size\): expected an integer >= 1"),
        (["--rank", "1"], "rank 1 is given without the number of processes: give --world-size"),
    ],
)
def test_a_rank_or_world_size_flag_the_run_refuses_is_a_usage_error(tmp_path, capsys, monkeypatch, flags, said):
    """A value an option refuses exits 2, naming it (as --jobs 0 does); these exited 1."""
    for name in SCHEDULER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    from cachepipe.map.cli import main

    sized = ["--cache", str(tmp_path / "cache"), "--capacity", "1MiB"]
    assert main(["s3://data/video/", "s3://data/out/", *sized, *flags, "--", "true"]) == 2
    assert re.search(said, capsys.readouterr().err)


# ---- a manifest: every rank plans from one listing ------------------------------------------------------
MARK = ["sh", "-c", 'echo "$CACHEPIPE_ITEM" > "$CACHEPIPE_OUT/name.txt"']


def _marked(s3_client, prefix: str) -> list[str]:
    """The items DST holds a completion marker of, in order."""
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket="data", Prefix=prefix)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return sorted(k[len(prefix) :].split("/")[0] for k in keys if k.endswith(f"/{DONE_MARKER}"))


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "listing"])
def test_ranks_that_plan_from_one_manifest_do_each_item_once_while_src_grows(s3_source, s3_client, tmp_path, manifest):
    """Rank 1 runs, objects are added to SRC, then rank 0 runs (pods scheduled minutes apart):
    with each rank's own listing, the shares come from two listings and an item falls to no rank
    (what docs/map.md warns of); with one manifest, each item of it is done by exactly one rank."""
    from cachepipe.manifest import index

    for i in range(6):
        s3_source.put(f"item{i:02d}/in.bin", b"x" * 1000)
    where = "s3://data/manifests/video.gz"
    index(s3_source.url, where, storage_options=s3_source.options)
    common = {"storage_options": s3_source.options, "world_size": 2, "progress": False}
    if manifest:
        common["manifest"] = where

    first = map_items(MARK, s3_source.url, "s3://data/out/", cache_dir=tmp_path / "c1", capacity="1MiB", rank=1, **common)
    s3_source.put("early/in.bin", b"y" * 1000)  # written after rank 1 listed; first in order, it shifts rank 0's share
    second = map_items(MARK, s3_source.url, "s3://data/out/", cache_dir=tmp_path / "c0", capacity="1MiB", rank=0, **common)

    done = _marked(s3_client, "out/")
    if manifest:
        assert (first.items_listed, second.items_listed) == (6, 6)
        assert (first.items_done, second.items_done) == (3, 3)
        assert done == [f"item{i:02d}" for i in range(6)]  # every item of the manifest, once; the new one not
    else:  # the hazard the manifest removes: shares of two listings, some items twice and some by no rank
        assert (first.items_listed, second.items_listed) == (6, 7)
        assert "item02" not in done  # rank 1's listing gave it to rank 0 (items 0-2 of 6), rank 0's to rank 1 (3 of 7)


def test_a_manifest_of_another_source_or_items_mode_is_refused_before_anything_runs(s3_source, tmp_path):
    from cachepipe.manifest import index

    s3_source.put("a/in.bin", b"x")
    s3_source.put("b.bin", b"x")
    local = tmp_path / "files.gz"
    index(s3_source.url, local, items="files", storage_options=s3_source.options)
    run = {"cache_dir": tmp_path / "c", "capacity": "1MiB", "storage_options": s3_source.options, "manifest": local}
    with pytest.raises(ConfigError, match=r"lists items='files', this map run has items='folders': use items='files'"):
        map_items(MARK, s3_source.url, "s3://data/out/", **run)
    with pytest.raises(ConfigError, match=r"lists source 's3://data/video/', this map run's source is 's3://data/other/'"):
        map_items(MARK, "s3://data/other/", "s3://data/out/", items="files", **run)
    with pytest.raises(FileNotFoundError, match=r"none.gz': no such file; write it with `cachepipe index SRC -o "):
        map_items(MARK, s3_source.url, "s3://data/out/", **{**run, "manifest": tmp_path / "none.gz"})
    with pytest.raises(FileNotFoundError, match=r"s3://data/manifests/none.gz"):
        map_items(MARK, s3_source.url, "s3://data/out/", **{**run, "manifest": "s3://data/manifests/none.gz"})
    assert not (tmp_path / "c").exists()  # refused before the cache was touched


def test_the_command_plans_from_a_manifest_given_by_flag(s3_source, s3_client, tmp_path):
    from cachepipe.manifest import index

    for name in ("a", "b", "c"):
        s3_source.put(f"{name}/in.bin", b"x" * 100)
    local = tmp_path / "m.gz"
    index(s3_source.url, local, storage_options=s3_source.options)
    s3_source.put("d/in.bin", b"x" * 100)  # not in the manifest
    options = [a for k, v in s3_source.options.items() for a in ("-o", f"{k}={v}")]
    flags = ["--cache", str(tmp_path / "c"), "--capacity", "1MiB", "--no-progress", "--manifest", str(local), "-v"]
    proc = subprocess.run(
        [sys.executable, "-m", "cachepipe.map", s3_source.url, "s3://data/out/", *flags, *options, "--", *MARK],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"planning from manifest {local}: 3 items of s3://data/video/ listed at " in proc.stderr
    assert _marked(s3_client, "out/") == ["a", "b", "c"]


def _map_from(manifest, source, tmp_path, **options):
    """``MARK`` mapped over ``source`` into s3://data/out/, planned from ``manifest``."""
    return map_items(
        MARK,
        source.url,
        "s3://data/out/",
        cache_dir=tmp_path / "c",
        capacity="1MiB",
        storage_options=source.options,
        manifest=manifest,
        progress=False,
        **options,
    )


def test_an_object_rewritten_after_the_manifest_fails_its_item_and_the_others_are_done(s3_source, s3_client, tmp_path):
    from cachepipe.manifest import index

    for name in ("a", "b", "c"):
        s3_source.put(f"{name}/in.bin", b"x" * 100)
    local = tmp_path / "m.gz"
    index(s3_source.url, local, storage_options=s3_source.options)
    s3_source.put("b/in.bin", b"y" * 100)  # the same size, another ETag
    result = _map_from(local, s3_source, tmp_path)
    assert result.items_done == 2
    assert [f.name for f in result.failed] == ["b"]
    assert "changed since it was listed" in result.failed[0].error and "a manifest indexed again" in result.failed[0].error
    assert _marked(s3_client, "out/") == ["a", "c"]


@pytest.mark.parametrize("items", ["folders", "files"])
def test_a_manifest_whose_entries_are_not_in_key_order_plans_as_a_listing_of_src_would(s3_source, s3_client, tmp_path, items):
    """A manifest holds a catalog's items in the order they were added: write_manifest of a
    Catalog built with add (as benchmarks/bench_manifest.py writes one: video.mp4 before
    text.txt), which a Pipeline plans from. map planned from its entries in that order, and the
    grouping of a listing refused them: "listing out of order", the manifest not named, nothing
    done. They are planned in key order, as a listing of SRC gives them."""
    from cachepipe import Pipeline
    from cachepipe.catalog import Catalog
    from cachepipe.manifest import write_manifest

    names = ["b", "a"] if items == "folders" else ["b/video.mp4", "a/video.mp4", "a/text.txt"]
    catalog = Catalog(mode=items)
    for name in names:
        rels = ["video.mp4", "text.txt"] if items == "folders" else [""]
        for rel in rels:
            s3_source.put(f"{name}/{rel}" if rel else name, b"x" * 1000)
        catalog.add(name, [(rel, 1000, None) for rel in rels])
    local = tmp_path / "m.gz"
    write_manifest(local, s3_source.url, items, catalog)
    with Pipeline(s3_source.url, tmp_path / "p", "1MiB", items=items, manifest=local, storage_options=s3_source.options) as pipe:
        assert sorted(c.name for c in pipe) == sorted(names)  # a manifest a pipeline plans from

    result = _map_from(local, s3_source, tmp_path, items=items)
    assert result.items_done == len(names), result.failed  # before: ValueError: listing out of order
    assert result.planned == sorted(names)


def test_a_manifest_that_lists_an_object_twice_is_refused_naming_it(s3_source, tmp_path):
    from cachepipe.catalog import Catalog
    from cachepipe.manifest import write_manifest

    s3_source.put("a/x", b"x")
    catalog = Catalog(mode="folders")
    catalog.add("a", [("x", 1, None), ("x", 1, None)])
    local = tmp_path / "m.gz"
    write_manifest(local, s3_source.url, "folders", catalog)
    run = {"cache_dir": tmp_path / "c", "capacity": "1MiB", "storage_options": s3_source.options, "manifest": local}
    with pytest.raises(ConfigError, match=r"m.gz': item 'a' \(entry 1\) lists a file twice \('a/x'\): each file once; "):
        map_items(MARK, s3_source.url, "s3://data/out/", **run)  # before: ValueError: listing out of order: 'a/x' after 'a/x'


# ---- the part of DST a rank lists: pure --------------------------------------------------------------------------
_SEGMENT = st.text(alphabet=" -.0a", min_size=1, max_size=3)
_NAME = st.lists(_SEGMENT, min_size=1, max_size=3).map("/".join)  # nested names, as files mode makes: a, a/b


def _after_in_key_order(keys: list[str], start_after: str | None) -> list[str]:
    """A store listing in key order (S3, OBS, moto), after ``start_after`` (ListObjectsV2's ``StartAfter``)."""
    return sorted(k for k in keys if start_after is None or k > start_after)


def _after_folder_by_folder(keys: list[str], start_after: str | None) -> list[str]:
    """A store listing folder by folder, after ``start_after`` as SeaweedFS 4.48 reads it (measured by
    test_s3_week's test_seaweedfs_start_after_is_after_in_its_order_passing_a_folder_named_whole): the
    keys after it in its order, and none under ``start_after/`` (a folder of that name is passed whole)."""
    listed = sorted(keys, key=tree_order)
    if start_after is None:
        return listed
    return [k for k in listed if tree_order(k) > tree_order(start_after) and not k.startswith(start_after + "/")]


@settings(max_examples=400, deadline=None)
@given(
    names=st.lists(_NAME, min_size=1, max_size=8, unique=True),
    picks=st.lists(st.booleans(), min_size=8, max_size=8),
    under=st.lists(st.tuples(st.integers(0, 7), st.lists(_SEGMENT, min_size=0, max_size=2)), max_size=12),
    loose=st.lists(_NAME, max_size=6),
)
def test_a_rank_lists_every_key_of_its_items_in_either_order_a_store_lists_in(names, picks, under, loose):
    """A rank lists DST after ``dst_range``'s key and stops past its items' keys: in key order
    (after the key as S3 reads it) and folder by folder (as SeaweedFS reads it), with names that
    sort around ``/`` and nested ones, every key under a wanted item's folder is listed (a
    brute-force filter), and the keys each item holds (held_by_item, among every name) are a full
    listing's. From the start (a store without ``start_after``) too."""
    wanted = [name for name, pick in zip(names, picks, strict=False) if pick] or names[:1]
    keys = {f"{names[i % len(names)]}/{'/'.join(rel)}" for i, rel in under} | {f"{n}/{DONE_MARKER}" for n in wanted}
    keys |= set(loose)  # beside the items (in no folder of theirs, or one of an item no longer in SRC)
    within = dst_range(wanted)
    theirs = {k for k in keys if any(k.startswith(n + "/") for n in wanted)}  # brute force
    for order in (_after_in_key_order, _after_folder_by_folder):
        full = order(list(keys), None)
        for start_after in (within.start_after, None):
            listed = list(bounded(order(list(keys), start_after), within))
            assert theirs <= set(listed), (order.__name__, start_after, theirs - set(listed))
            assert held_by_item(listed, names, wanted) == held_by_item(full, names, wanted)


@pytest.mark.parametrize(
    ("wanted", "start_after"),
    [
        (["item20", "item21", "item39"], "item2"),  # item20's own prefix (item2/ is no folder of theirs); not item2/
        (["item21", "item39"], "item20"),  # item20's keys come after it (S3), or are passed with it (SeaweedFS): not the rank's
        (["x/item5", "x/item6"], "x/item4"),
        (["a", "a b"], "`"),  # a b first in key order, a folder by folder: no prefix of either is below both, but ` is
        (["a b", "b"], "a a"),
        (["a/b", "a/b c"], "a/a"),  # a holds them: never a
        (["0", "1"], None),  # below 0: / (a folder's separator) or nothing: listed from DST's first key
    ],
)
def test_a_rank_lists_after_a_key_below_its_items_in_both_orders_and_no_folder_of_theirs(wanted, start_after):
    assert dst_range(wanted).start_after == start_after


def test_a_listing_stops_at_the_first_key_past_the_items_in_every_order_it_may_be_in():
    within = dst_range(["item1", "item2"])
    keys = ["item1/a", "item2/.d", "item2/b", "item3/a", "item4/a"]
    assert list(bounded(iter(keys), within)) == keys[:3]
    # folder by folder, "item2 x/a" comes after item2's keys ("/" below every character): past
    # them, and it shows the listing is not in key order
    assert list(bounded(iter(["item2/a", "item2/b", "item2 x/a", "item3/a"]), within)) == ["item2/a", "item2/b"]
    # in key order it comes before them: past them folder by folder, not in key order, and both
    # orders are possible still (item1/a, item2 x/a is in both): listed on, until a key past both
    assert list(bounded(iter(["item1/a", "item2 x/a", "item2/b", "item3/a"]), within)) == ["item1/a", "item2 x/a", "item2/b"]
    # a listing in neither order is read to its end
    neither = ["item1/a", "item0/b", "item3/a", "item2/c"]
    assert list(bounded(iter(neither), within)) == neither


# ---- the part of DST a rank lists: on the moto server ------------------------------------------------------------
def test_each_rank_lists_about_its_share_of_dst_and_decides_as_one_rank_does(fault_proxy, s3_source, s3_client, tmp_path):
    """Three ranks over 60 items, whose outputs (and most markers) DST holds, listed 5 keys a
    request: each rank listed the whole of DST (36 requests each, as one rank's). Each lists
    after a key below its share and stops past it: about a third of the requests, and the
    decisions of a single rank (done, to run, done by another command with what it holds)."""
    from conftest import via

    from cachepipe.stores import open_store

    names = [f"item{i:02d}" for i in range(60)]
    for name in names:
        s3_source.put(f"{name}/f", b"x")
    keys = {"out/item5/x": b"", "out/item2 x/y": b""}  # beside the items: item5 and item2 x are none
    for i, name in enumerate(names):
        keys |= {f"out/{name}/a": b"", f"out/{name}/b": b""}
        if i % 10 == 3:  # done by another command: run again, what it holds handed to its upload
            keys[f"out/{name}/{DONE_MARKER}"] = b'{"command": "00ff"}'
        elif i % 10 != 7:  # done (an empty marker, made by hand); 7: an attempt that did not finish
            keys[f"out/{name}/{DONE_MARKER}"] = b""
    for key, body in keys.items():
        s3_client.put_object(Bucket="data", Key=key, Body=body)
    proxy, endpoint = fault_proxy

    def run(rank: int, world_size: int) -> tuple[Any, list[str]]:
        before = len(proxy.requests)
        dst = open_store("s3://data/out/", via(s3_source, endpoint))
        dst.list_page_size = 5  # type: ignore[attr-defined]
        try:
            result = map_items(
                ["true"],
                s3_source.url,
                "s3://data/out/",
                cache_dir=tmp_path / f"cache{rank}",
                capacity="1MiB",
                storage_options=s3_source.options,
                dest_store=dst,
                rank=rank,
                world_size=world_size,
                dry_run=True,
                progress=False,
            )
        finally:
            dst.close()
        lines = [head.split("\r\n", 1)[0] for head in proxy.requests[before:]]
        return result, [line for line in lines if line.startswith("GET ") and "max-keys=" in line]

    one, whole = run(0, 1)
    assert len(whole) == -(-len(keys) // 5) == 36
    ranks = [run(rank, 3) for rank in range(3)]
    for _, listing in ranks:
        assert len(listing) <= 36 // 3 + 2, "\n".join(listing)  # its share's keys (12 pages), and the page past them
    assert sum(result.items_skipped for result, _ in ranks) == one.items_skipped == 48
    assert sorted(n for result, _ in ranks for n in result.planned) == sorted(one.planned)
    assert sorted(n for result, _ in ranks for n in result.command_changed) == sorted(one.command_changed)
    held = {name: keys for result, _ in ranks for name, keys in result.held.items()}
    assert held == one.held and len(held) == 6 and held["item13"] == ["item13/.cachepipe-done", "item13/a", "item13/b"]
    assert "start-after=item" in ranks[1][1][0].replace("%2F", "/").replace("out/", "")
