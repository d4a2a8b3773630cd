"""partition="fixed" (the node-local shuffle) through real Pipelines over the moto S3 server:
each rank keeps its items for the run, reads them in a new order every epoch, and a cache that
holds its share downloads each of them once."""

from __future__ import annotations

import pytest

from cachepipe import ConfigError, Pipeline, PipelineConfig

N, SIZE, WORLD, EPOCHS = 20, 2000, 2, 3


def run(s3_source, cache_dir, capacity="1MiB", **options):
    """(names per epoch, stats) of one rank's run."""
    opts = {"storage_options": s3_source.options, "epochs": EPOCHS, "shuffle": True, "seed": 3, "world_size": WORLD}
    with Pipeline(s3_source.url, cache_dir, capacity, **{**opts, **options}) as pipe:
        seen = [p.name for p in pipe]
        stats = pipe.stats()
    per = len(seen) // EPOCHS
    return [seen[e * per : (e + 1) * per] for e in range(EPOCHS)], stats


def test_fixed_keeps_each_rank_on_its_items_in_a_new_order_each_epoch(s3_source, tmp_path):
    data = s3_source.folders(N, {"f": SIZE})
    shares = []
    for rank in range(WORLD):
        epochs, _ = run(s3_source, tmp_path / f"r{rank}", rank=rank, partition="fixed")
        assert len({frozenset(e) for e in epochs}) == 1, "the same items every epoch"
        assert len({tuple(e) for e in epochs}) == EPOCHS, "read in a new order every epoch"
        shares.append(set(epochs[0]))
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(data)  # disjoint, covering


def test_epoch_partition_moves_items_between_ranks(s3_source, tmp_path):
    s3_source.folders(N, {"f": SIZE})
    epochs, _ = run(s3_source, tmp_path / "r0", rank=0, partition="epoch")
    assert len({frozenset(e) for e in epochs}) > 1  # the default re-splits every epoch


@pytest.mark.parametrize("balance", ["bytes", "count"])
def test_a_cache_holding_its_share_downloads_it_once_with_fixed(s3_source, tmp_path, balance):
    from sampling import block_of, charge

    s3_source.folders(N, {"f": SIZE})
    share = N // WORLD * SIZE
    # the share in what its items take on the disk (file and folder in whole blocks), plus the
    # state (5 blocks here, 8 allowed): the share and about an item more, of 20
    capacity = N // WORLD * charge(tmp_path, [SIZE], 1) + 8 * block_of(tmp_path)
    downloaded = {}
    for partition in ("fixed", "epoch"):
        epochs, stats = run(
            s3_source, tmp_path / partition, capacity, rank=0, retain="auto", partition=partition, balance=balance
        )
        assert sum(len(e) for e in epochs) == stats.items_acked
        downloaded[partition] = stats.bytes_downloaded
    assert downloaded["fixed"] == share  # every item of the share once, nothing after epoch 1
    assert downloaded["epoch"] > share  # items new to this rank in epochs 2 and 3 are downloaded


def test_resume_with_another_partition_is_refused(s3_source, tmp_path):
    s3_source.folders(6, {"f": 100})
    opts = {"storage_options": s3_source.options, "epochs": 2, "shuffle": True, "rank": 0, "world_size": 2}
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", keep_on_close=True, partition="fixed", **opts) as pipe:
        items = iter(pipe)
        next(items)
        next(items)  # acknowledges the first (auto_ack)
    with pytest.raises(ConfigError, match="another plan: partition 'fixed' there, 'epoch' here"):
        Pipeline(s3_source.url, tmp_path / "c", "1MiB", resume=True, partition="epoch", **opts).open()
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", resume=True, partition="fixed", **opts) as pipe:
        assert len(list(pipe)) == 5  # 3 items a rank and epoch, one consumed before


def test_options_are_validated_with_what_is_accepted():
    base = {"source": "s3://b/p/", "cache_dir": "/tmp/c", "capacity": "1GiB"}  # noqa: S108 - never opened
    assert PipelineConfig(**base).partition == "epoch" and PipelineConfig(**base).balance == "bytes"
    for option, bad in (("partition", "node"), ("balance", "items")):
        with pytest.raises(ValueError, match=option) as info:
            PipelineConfig(**base, **{option: bad})
        assert "'epoch' or 'fixed'" in str(info.value) or "'bytes' or 'count'" in str(info.value)


def test_a_streamed_pass_resumes_with_the_partition_it_ran_with(s3_source, tmp_path):
    # one rank, one epoch in listing order: the pass starts while the listing streams
    s3_source.folders(4, {"f": 100})
    opts = {"storage_options": s3_source.options, "rank": 0, "world_size": 1, "partition": "fixed", "balance": "count"}
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", keep_on_close=True, **opts) as pipe:
        items = iter(pipe)
        next(items)
        next(items)
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", resume=True, **opts) as pipe:
        assert [p.name for p in pipe] == ["item001", "item002", "item003"]
