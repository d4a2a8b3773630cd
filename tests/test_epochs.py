"""Epochs, seeded shuffle, rank/worker shares and resume by position, through Pipeline."""

from __future__ import annotations

import pytest

from cachepipe import Pipeline


def names(pipe):
    return [p.name for p in pipe]


def test_epochs_shuffle_deterministic_and_new_order_each_epoch(s3_source, tmp_path):
    data = s3_source.folders(12, {"f": 100})
    opts = {"storage_options": s3_source.options, "epochs": 3, "shuffle": True, "seed": 7, "rank": 0, "world_size": 1}
    with Pipeline(s3_source.url, tmp_path / "a", "1MiB", **opts) as pipe:
        first = names(pipe)
        stats = pipe.stats()
    with Pipeline(s3_source.url, tmp_path / "b", "1MiB", **opts) as pipe:
        assert names(pipe) == first  # same seed, same order
    epochs = [first[i * 12 : (i + 1) * 12] for i in range(3)]
    assert all(sorted(e) == sorted(data) for e in epochs)  # every item once per epoch
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != sorted(data)
    assert stats.items_acked == 36 and stats.bytes_downloaded == 36 * 100  # retain="none": refetched


def test_ranks_and_workers_split_each_epoch_disjointly(s3_source, tmp_path):
    data = s3_source.folders(10, {"f": 100})
    seen = []
    for rank in range(2):
        for worker in range(2):
            with Pipeline(
                s3_source.url,
                tmp_path / f"c{rank}{worker}",
                "1MiB",
                storage_options=s3_source.options,
                epochs=2,
                shuffle=True,
                seed=1,
                rank=rank,
                world_size=2,
                worker=worker,
                num_workers=2,
            ) as pipe:
                seen.append(names(pipe))
    for epoch in range(2):
        # each share is ordered by epoch, so split every share's list at its epoch boundary
        per_epoch = [share[: len(share) // 2] if epoch == 0 else share[len(share) // 2 :] for share in seen]
        flat = [n for share in per_epoch for n in share]
        assert sorted(flat) == sorted(data), f"epoch {epoch}: every item exactly once across ranks and workers"


def test_rank_from_torchrun_environment(s3_source, tmp_path, monkeypatch):
    s3_source.folders(6, {"f": 10})
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", storage_options=s3_source.options) as pipe:
        assert len(names(pipe)) == 2
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="RANK"):
        Pipeline(s3_source.url, tmp_path / "d", "1MiB", storage_options=s3_source.options).open()


def test_state_dict_resumes_mid_epoch(s3_source, tmp_path):
    s3_source.folders(8, {"f": 10})
    opts = {"storage_options": s3_source.options, "epochs": 2, "shuffle": True, "seed": 3, "rank": 0, "world_size": 1}
    with Pipeline(s3_source.url, tmp_path / "full", "1MiB", **opts) as pipe:
        full = names(pipe)
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", **opts) as pipe:
        it = iter(pipe)
        got = [next(it).name for _ in range(11)]  # 10 acked, the 11th in hand
        it.close()
        state = pipe.state_dict()
    assert state["epoch"] == 1 and state["index"] == 2
    again = Pipeline(s3_source.url, tmp_path / "c2", "1MiB", **opts)
    again.load_state_dict(state)
    with again:
        rest = names(again)
    assert got[:10] + rest == full
    other = Pipeline(s3_source.url, tmp_path / "c3", "1MiB", **{**opts, "seed": 4})
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        other.open()


def test_journal_resume_continues_the_epoch_position(s3_source, tmp_path):
    s3_source.folders(6, {"f": 10})
    opts = {
        "storage_options": s3_source.options,
        "epochs": 2,
        "shuffle": True,
        "seed": 9,
        "rank": 0,
        "world_size": 1,
        "resume": True,
    }
    with Pipeline(s3_source.url, tmp_path / "full", "1MiB", **{**opts, "resume": False}) as pipe:
        full = names(pipe)
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", **opts) as pipe:
        it = iter(pipe)
        for _ in range(8):
            next(it)
        it.close()  # 7 acked; the 8th was given back
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", **opts) as pipe:
        assert names(pipe) == full[7:]


def test_retain_auto_downloads_nothing_after_epoch_one_when_the_data_fits(s3_source, tmp_path):
    data = s3_source.folders(10, {"f": 1000})
    with Pipeline(
        s3_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=s3_source.options,
        epochs=3,
        shuffle=True,
        seed=2,
        rank=0,
        world_size=1,
        retain="auto",
    ) as pipe:
        seen = names(pipe)
        stats = pipe.stats()
    assert sorted(seen) == sorted(list(data) * 3)
    assert stats.bytes_downloaded == 10 * 1000 and stats.items_acked == 30


def test_retain_auto_beats_none_at_half_capacity_and_keeps_the_cap(s3_source, tmp_path):
    from sampling import Sampler, block_of, charge

    s3_source.folders(20, {"f": 2000})
    block = block_of(tmp_path)
    capacity = 10 * charge(tmp_path, [2000], 1) + 8 * block  # half the data in whole blocks, plus the state
    downloaded = {}
    for retain in ("none", "auto"):
        cache = tmp_path / retain
        with Sampler(cache, block=block) as sampler:
            with Pipeline(
                s3_source.url,
                cache,
                capacity,
                storage_options=s3_source.options,
                epochs=3,
                shuffle=True,
                seed=4,
                rank=0,
                world_size=1,
                retain=retain,
            ) as pipe:
                assert len(names(pipe)) == 60
                downloaded[retain] = pipe.stats().bytes_downloaded
        assert sampler.peak <= capacity
    assert downloaded["none"] == 60 * 2000
    assert downloaded["auto"] < downloaded["none"]


def _probe(path):
    (path / "meta.json").write_text('{"frames": 3}')  # 13 bytes beside the item's own
    if path.joinpath("f").stat().st_size == 999:
        raise ValueError("cannot decode")


def test_prepare_runs_before_hand_out_and_counts_against_the_cap(s3_source, tmp_path):
    from sampling import Sampler, block_of, charge

    data = s3_source.folders(8, {"f": 1000})
    s3_source.put("item008/f", b"x" * 999)  # the hook fails on this one
    block = block_of(tmp_path)
    # three items prepared (f, meta.json and their folder, in whole blocks: the item's charge and
    # prepare_reserve rounded up to a block), and the state
    capacity = 3 * charge(tmp_path, [1000, 13], 1) + 8 * block
    with Sampler(tmp_path / "c", block=block) as sampler:
        with Pipeline(
            s3_source.url,
            tmp_path / "c",
            capacity,
            storage_options=s3_source.options,
            prepare=_probe,
            prepare_reserve=100,
            on_error="skip",
        ) as pipe:
            seen = []
            for path in pipe:
                assert (path / "meta.json").read_text() == '{"frames": 3}'
                seen.append(path.name)
            stats = pipe.stats()
    assert seen == sorted(data) and stats.items_failed == 1 and stats.items_skipped == 1
    assert sampler.peak <= capacity


def test_prepare_that_outgrows_its_reserve_fails_the_item(s3_source, tmp_path):
    from sampling import charge

    s3_source.folders(1, {"f": 1000})
    reserved = charge(tmp_path, [1000], 1)  # the item's file and folder in whole blocks; meta.json takes one more
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", storage_options=s3_source.options, prepare=_probe) as pipe:
        with pytest.raises(Exception, match=rf"more than the {reserved} reserved \(1000 listed"):
            list(pipe)
    with pytest.raises(ValueError, match="retain"):
        Pipeline(s3_source.url, tmp_path / "d", "1MiB", prepare=_probe, retain="auto")


def test_oversize_item_skipped_in_a_shuffled_pass_with_retention(s3_source, tmp_path):
    data = s3_source.folders(6, {"f": 1000})
    s3_source.put("big/f", b"x" * 300_000)  # first in the catalog, beyond the capacity: the plan maps around it
    with Pipeline(
        s3_source.url,
        tmp_path / "c",
        200_000,
        storage_options=s3_source.options,
        epochs=2,
        shuffle=True,
        seed=3,
        rank=0,
        world_size=1,
        retain="auto",
        on_oversize="skip",
    ) as pipe:
        seen = names(pipe)
        stats = pipe.stats()
    assert sorted(seen) == sorted(list(data) * 2)
    assert stats.items_skipped == 1 and stats.items_listed == 7 and stats.bytes_downloaded == 6 * 1000


def test_a_pipeline_started_at_an_epoch_reads_that_epoch_as_a_pipeline_from_the_start_does(s3_source, tmp_path):
    s3_source.folders(12, {"f": 100})
    opts = {"storage_options": s3_source.options, "shuffle": True, "seed": 7, "rank": 0, "world_size": 1}
    with Pipeline(s3_source.url, tmp_path / "all", "1MiB", epochs=3, **opts) as pipe:
        every = names(pipe)
    with Pipeline(s3_source.url, tmp_path / "one", "1MiB", epochs=2, start_epoch=1, **opts) as pipe:
        assert pipe.state_dict()["epoch"] == 1 and pipe.state_dict()["index"] == 0  # before any item
        assert names(pipe) == every[12:24]  # epoch 1 alone, in its own order
    with Pipeline(s3_source.url, tmp_path / "two", "1MiB", epochs=3, start_epoch=1, **opts) as pipe:
        got = []
        for item in pipe:
            got.append(item.name)
            if len(got) == 5:
                state = pipe.state_dict()
                break
    for start in (0, 2):  # a loaded state wins over start_epoch, given or not
        pipe = Pipeline(s3_source.url, tmp_path / "two", "1MiB", epochs=3, start_epoch=start, **opts)
        pipe.load_state_dict(state)
        with pipe:
            assert got[:4] + names(pipe) == every[12:]


@pytest.mark.parametrize(("epochs", "start"), [(1, 1), (3, 3), (2, -1)])
def test_a_start_epoch_outside_the_plan_is_refused_naming_both(tmp_path, epochs, start):
    with pytest.raises(ValueError, match="start_epoch") as error:
        Pipeline("memory://x", tmp_path / "c", "1MiB", epochs=epochs, start_epoch=start)
    assert str(start) in str(error.value)


def test_a_start_epoch_with_endless_epochs_starts_there(s3_source, tmp_path):
    s3_source.folders(4, {"f": 100})
    opts = {"storage_options": s3_source.options, "shuffle": True, "seed": 3, "rank": 0, "world_size": 1}
    with Pipeline(s3_source.url, tmp_path / "a", "1MiB", epochs=6, **opts) as pipe:
        every = names(pipe)
    with Pipeline(s3_source.url, tmp_path / "b", "1MiB", epochs=None, start_epoch=5, **opts) as pipe:
        assert [pipe.get().name for _ in range(4)] == every[20:24]


def test_retained_items_kept_on_close_are_all_reused_by_the_next_owner_with_the_first_step_s(s3_source, tmp_path):
    """An earlier owner's retained items become retained items of the next at its first
    unconsumed step: the one that step reads too (it was dropped, as not read "after" the step,
    and downloaded again)."""
    data = s3_source.folders(6, {"f": 1000})
    opts = {"storage_options": s3_source.options, "epochs": 2, "shuffle": True, "seed": 2, "rank": 0, "world_size": 1}
    opts |= {"retain": "auto", "keep_on_close": True, "auto_ack": False}  # epoch 1 is the last: no read after it
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", **opts) as pipe:
        while pipe.state_dict()["epoch"] == 0:  # epoch 0 alone; epoch 1's first items are fetched ahead
            pipe.ack(pipe.get(timeout=30))
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", start_epoch=1, **opts) as pipe:
        got = []
        while pipe.state_dict()["epoch"] == 1:
            item = pipe.get(timeout=30)
            got.append(item.name)
            pipe.ack(item)
        stats = pipe.stats()
    assert sorted(got) == sorted(data)
    assert stats.bytes_downloaded == 0 and stats.items_reused >= 6


def test_a_retained_item_whose_next_read_was_acked_before_a_restart_is_evicted_for_room(s3_source, tmp_path):
    """A step acknowledged beyond the journal's position (acks out of order, or a position not
    yet journaled when the process died) is skipped by the resumed pass: it is no retained item's
    next use. It was: the item kept it as its key, and once the fetcher passed that step Belady
    never evicted it ("do no harm"), so a download that needed its room waited for ever (the
    kill soak stalled so, 0 hand-outs after a reopen)."""
    from sampling import block_of

    block = block_of(tmp_path)
    sizes = {"item000": 5 * block, "item001": 11 * block, "item002": 11 * block}  # a folder each: 6, 12, 12 blocks
    s3_source.put_many({f"{name}/f": bytes(size) for name, size in sizes.items()})
    opts = {"storage_options": s3_source.options, "epochs": 2, "shuffle": True, "seed": 2, "rank": 0, "world_size": 1}
    with Pipeline(s3_source.url, tmp_path / "ref", "1MiB", **opts) as pipe:
        assert names(pipe) == ["item000", "item002", "item001", "item001", "item002", "item000"]  # the seed's order
    # room for 21 blocks of items beside the state's 6 (on 4 KiB blocks): item000 and one of the
    # others, not both others (item001 would be downloaded in the first run: checked below)
    capacity = (21 + 6) * block
    opts |= {"retain": "auto", "keep_on_close": True, "auto_ack": False, "ordered": False, "resume": True}
    with Pipeline(s3_source.url, tmp_path / "c", capacity, **opts) as pipe:
        got = {item.name: item for item in (pipe.get(timeout=30), pipe.get(timeout=30))}
        # step 1 acknowledged, step 0 not: the position stays at step 0; item002 is kept for epoch 1
        # (item000, pinned, is read after it there and is more than the prefetch reserve, a quarter of
        # the room: the fetcher waits for its ack rather than evict item002)
        pipe.ack(got["item002"])
    assert pipe.stats().bytes_downloaded == sizes["item000"] + sizes["item002"]  # item001 never fitted beside them
    with Pipeline(s3_source.url, tmp_path / "c", capacity, **opts) as pipe:
        seen = []
        for _ in range(5):  # step 1 of epoch 0 is not delivered again
            item = pipe.get(timeout=30)
            seen.append(item.name)
            pipe.ack(item)
        assert pipe.get(timeout=30) is None
    assert sorted(seen) == ["item000", "item000", "item001", "item001", "item002"]
