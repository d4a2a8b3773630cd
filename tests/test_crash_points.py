"""Crash-point tests of the cache: every mutation of an operation sequence, crashed or failed.

Hypothesis draws programs of cache operations (fetch = reserve, stage, write, publish, or the
same in two steps with other operations between them, as a pipeline's threads interleave; ack =
evict and advance the position; restart = close keeping items and reopen with resume; drop =
close without keeping and reopen; retention keeps acknowledged items and evicts victims). Each
program runs once under :class:`crashfs.CrashFs` to number its mutations (writes, renames,
unlinks, fsyncs...), then once per mutation and fault kind: a crash (``kill -9``) before it, a
torn write, a short write, a failure (ENOSPC or EIO, in turn: see :data:`ERRORS`). After a fault
the program goes on where a real consumer would (a failed fetch is discarded, a failed ack is
retried later). Then a new owner opens the cache with ``resume=True`` and these must hold:

- the journal loads (a torn last line is dropped, nothing else is damaged);
- the cache is within its capacity on disk;
- nothing of ours is left as foreign bytes (no half-deleted or orphaned item);
- no acknowledged step is delivered again; every step not acknowledged is still to deliver;
- before closing (no crash): the ledger holds exactly the bytes of the published items on disk.

``CACHEPIPE_CRASH_EXAMPLES`` sets how many programs are drawn (default 6 per mode on tmpfs, a
third of that on disk; each explores every crash point of its program). The totals explored are printed (``pytest -s``).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from crashfs import KINDS, Crashed, CrashFs, Fault
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sampling import block_of

from cachepipe import fscalls, state
from cachepipe.cache import Cache
from cachepipe.catalog import Catalog
from cachepipe.plan import Plan, tick
from cachepipe.removal import tree_bytes
from cachepipe.retention import PlanFuture, make_policy

N_ITEMS = 4
EPOCHS = 2
PLAN_KEY = "k" * 300  # a long plan line: compacted journals sit near their compaction threshold
TOTALS = {"programs": 0, "crash points": 0, "faults injected": 0}


def catalog() -> Catalog:
    cat = Catalog(mode="folders")
    for i in range(N_ITEMS):
        tag = "e" * 32 if i == N_ITEMS - 1 else None  # the last item's publishes journal its version ("J", compacted "R")
        files = [["a", 40 + 30 * i, tag]] + ([["sub/b", 25, tag]] if i % 2 else [])
        cat.add(f"i{i}", files)
    return cat


CATALOG = catalog()
STEPS = [(e, i) for e in range(EPOCHS) for i in range(N_ITEMS)]
ITEM_BYTES = [CATALOG[i].size for i in range(N_ITEMS)]
PLAN = Plan(CATALOG.sizes, epochs=EPOCHS)  # listing order: step (e, i) reads item i


def capacity() -> int:
    # in whole blocks, as the cache counts (its tests' folders, on disk and tmpfs, have one
    # block): the state budget, the state folders, the lock file and a compacted journal, and
    # room for about three items (the largest: two files and a subfolder)
    block = block_of(tempfile.gettempdir())
    journal = Cache.journal_budget(CATALOG) + 64 + len(PLAN_KEY) + 80
    return -(-journal // block) * block + 4 * block + 3 * max(CATALOG.charge(i, block) for i in range(N_ITEMS))


@dataclass
class Model:
    """What a consumer knows: steps fetched (on disk), acknowledged for sure, maybe acknowledged."""

    root: Path
    retain: bool
    cache: Cache | None = None
    ready: list[int] = field(default_factory=list)  # step numbers published, not acked
    staged: list[tuple[int, Path]] = field(default_factory=list)  # step numbers staged, not yet published
    acked: set[int] = field(default_factory=set)  # ack returned
    maybe: set[int] = field(default_factory=set)  # ack called, outcome unknown (the crash hit it)
    consumed: set[int] = field(default_factory=set)
    future: PlanFuture | None = None

    def open(self) -> None:
        cache = self.cache = Cache(self.root, capacity())  # a failure here is left to abandon()
        cache.open()
        cursor, acked = cache.recover(CATALOG, resume=True, plan=PLAN_KEY)
        done = {n for n, (e, i) in enumerate(STEPS) if (e, i) < cursor or (e, f"i{i}") in acked}
        self.consumed = set(done)
        self.ready = []
        self.staged = []
        if self.retain:
            # the steps acked beyond the position are skipped, as a pass tells its PlanFuture
            # (passes._unread): no retained item's next use
            unread = [(e, CATALOG.names.index(name)) for e, name in acked]
            self.future = PlanFuture(PLAN, horizon=2, unread=unread)
            self.future.prepare(cursor[0])
            charges = [CATALOG.charge(i, cache.block) for i in range(N_ITEMS)]  # the ledger's bytes
            cache.use_retention(make_policy("auto", charges, self.future), CATALOG.names, tick(*cursor))

    def abandon(self, fs: CrashFs) -> None:
        """The process died: drop the cache object; the kernel closes its descriptors."""
        self.cache = None
        fs.close_all()

    # ---- operations ------------------------------------------------------------------
    def fetch(self) -> None:
        """Stage the next step's item and publish it at once."""
        if self.stage():
            self.publish()

    def stage(self) -> bool:
        """Reserve and stage the next step's item and write its files; True if it is staged (a
        pipeline publishes it later, from a download thread, while other events are journaled)."""
        cache = self.cache
        busy = self.consumed | set(self.ready) | {m for m, _ in self.staged}
        n = next((k for k in range(len(STEPS)) if k not in busy), len(STEPS))  # a failed step is tried again
        if n == len(STEPS):
            return False
        e, i = STEPS[n]
        item = CATALOG[i]
        if self.future is not None:
            self.future.prepare(e)
        if any(STEPS[r][1] == i for r in self.ready + [m for m, _ in self.staged]):
            return False  # an earlier epoch's copy is still out: the pipeline waits (one copy at a time)
        if not self.retain and cache.used + cache.charge(item) > cache.capacity and not cache._recovered:
            return False  # no room until an ack: the pipeline would wait here
        try:
            got = cache.acquire(item, tick(e, i), withdrawn=self._waits(n))
        except OSError:
            return False  # a drop or victim deletion met the fault; the fetch is tried again later
        if got is False or got is None:  # None: it would wait for an ack (see _waits)
            return False
        if got is not True:  # recovered or retained: on disk already
            self.ready.append(n)
            return False
        staged = None
        try:
            staged = Path(cache.stage(item))
            for f in item.files:
                with open(staged / f.rel, "wb") as fh:
                    fh.write(bytes([65 + i]) * f.size)
        except OSError:
            cache.discard(staged if staged is not None else cache.staging_root / "none", cache.charge(item), item.name)
            return False
        self.staged.append((n, staged))
        return True

    def publish(self) -> None:
        """Publish the earliest staged item (a failure discards it: its step is fetched again)."""
        if not self.staged:
            return
        n, staged = self.staged.pop(0)
        item = CATALOG[STEPS[n][1]]
        try:
            self.cache.publish(staged, item)
        except OSError:
            self.cache.discard(staged, self.cache.charge(item), item.name)
            return
        self.ready.append(n)

    def publish_all(self) -> None:
        """Publish every staged item by one call, as the download thread that publishes the run
        queued by the others does (:meth:`Cache.publish_many`): the intents by one write, then
        the renames. An item that failed is discarded (its step is fetched again)."""
        if not self.staged:
            return
        batch, self.staged = self.staged, []
        items = [CATALOG[STEPS[n][1]] for n, _ in batch]
        try:
            run = [(staged, item, self.cache.charge(item)) for (_, staged), item in zip(batch, items, strict=True)]
            got: list[str | OSError] = self.cache.publish_many(run)
        except OSError as exc:  # the intents were not journaled: nothing was published
            got = [exc] * len(batch)
        for (n, staged), item, path in zip(batch, items, got, strict=True):
            if isinstance(path, OSError):
                self.cache.discard(staged, self.cache.charge(item), item.name)
            else:
                self.ready.append(n)

    def _waits(self, n: int) -> Callable[[], bool]:
        """The ``withdrawn`` of step ``n``'s acquire, asked at each turn of its wait: where it waits
        a turn with a step out (ready or staged: a pipeline's consumer acks it, or the download
        ends), it is given up (the model is one thread: it acks later); with none out, no ack can
        ever come, and the wait is a stall (as the kill soak's was, a7bdd27): failed after a
        bound, not hung for ever."""
        turns = 0

        def withdrawn() -> bool:
            nonlocal turns
            turns += 1
            if turns > 1 and (self.ready or self.staged):
                return True
            assert turns < 200, f"step {STEPS[n]}: acquire waits for room with no step out to ack (a stall)"
            return False

        return withdrawn

    def ack(self, which: int) -> None:
        if not self.ready:
            return
        n = self.ready[which % len(self.ready)]
        e, i = STEPS[n]
        self.maybe.add(n)
        try:
            self.cache.evict(f"i{i}", e, tick(e, i))
        except OSError:
            self.maybe.discard(n)  # not recorded: still leased, acked again later
            return
        self.maybe.discard(n)
        self.acked.add(n)
        self.ready.remove(n)
        self.consumed.add(n)
        self._advance()

    def ack_all(self) -> None:
        """Every ready step acknowledged by one call (a consumer's ``ack_many``): all or none."""
        batch = list(self.ready)
        if not batch:
            return
        self.maybe |= set(batch)
        try:
            self.cache.evict_many([(f"i{STEPS[n][1]}", STEPS[n][0], tick(*STEPS[n])) for n in batch])
        except OSError:
            self.maybe -= set(batch)  # not recorded, none of them: still leased, acked again later
            return
        self.maybe -= set(batch)
        self.acked |= set(batch)
        self.ready = []
        self.consumed |= set(batch)
        self._advance()

    def _advance(self) -> None:
        first = next((k for k in range(len(STEPS)) if k not in self.consumed), len(STEPS))
        position = STEPS[first] if first < len(STEPS) else (EPOCHS, 0)
        self.cache.advance(*position)

    def restart(self, keep: bool) -> None:
        self.check_ledger()
        cache, self.cache = self.cache, None
        cache.close(keep=keep)
        self.open()

    def check_ledger(self) -> None:
        """Every byte of an item on disk is in the ledger, and every published item is on disk
        (in whole blocks, as the ledger charges items: the state folder is one)."""
        cache = self.cache
        block = cache.block
        on_disk = tree_bytes(self.root, block=block) - block - tree_bytes(cache.state_dir, block=block)
        published = sum(cache.record.published.values())
        assert on_disk == published, f"{on_disk} bytes of items on disk, {published} published in the ledger"


OPS = st.lists(
    st.sampled_from(["fetch", "fetch", "stage", "publish", "publishall", "ack0", "ack1", "ackall", "restart", "drop"]),
    min_size=4,
    max_size=22,
)


def run(root: Path, program: list[str], retain: bool, fault: Fault | None) -> tuple[Model, CrashFs, bool]:
    """Run ``program`` under ``fault``; returns the model, the interposer and whether it crashed."""
    model = Model(root, retain)
    fs = CrashFs(fault)
    crashed = False
    with fs:
        try:
            model.open()
            for op in program:
                if op == "fetch":
                    model.fetch()
                elif op == "stage":
                    model.stage()
                elif op == "publish":
                    model.publish()
                elif op == "publishall":
                    model.publish_all()
                elif op == "ackall":
                    model.ack_all()
                elif op.startswith("ack"):
                    model.ack(int(op[3:]))
                elif op in ("restart", "drop"):
                    try:
                        model.restart(keep=op == "restart")
                    except OSError:
                        model.abandon(fs)  # a failed close: the next owner recovers, as after a crash
                        model.open()
            model.check_ledger()
            model.cache.close(keep=True)
            model.cache = None
        except Crashed:
            crashed = True
            model.abandon(fs)
        except OSError:
            if fault is None:
                raise
            model.abandon(fs)  # an open that met the fault: left to the next owner
    return model, fs, crashed


def check_recovery(root: Path, model: Model, where: str) -> None:
    cache = Cache(root, capacity())
    cache.open()
    try:
        assert not cache.rebuilt, f"{where}: the journal did not load"
        cursor, acked = cache.recover(CATALOG, resume=True, plan=PLAN_KEY)
        assert tree_bytes(root) <= cache.capacity, f"{where}: {tree_bytes(root)} bytes on disk over {cache.capacity}"
        assert cache.foreign == 0, f"{where}: {cache.foreign} bytes of ours left as foreign: {sorted(os.listdir(root))}"
        done = {n for n, (e, i) in enumerate(STEPS) if (e, i) < cursor or (e, f"i{i}") in acked}
        assert model.acked <= done, f"{where}: acknowledged steps {sorted(model.acked - done)} would be delivered again"
        undone = set(range(len(STEPS))) - model.acked - model.maybe
        assert not (undone & done), f"{where}: steps {sorted(undone & done)} were never acknowledged but count as consumed"
        on_disk = {p for p in os.listdir(root) if p != state_dir_name()}
        assert on_disk == set(cache.record.published), (
            f"{where}: items on disk {sorted(on_disk)}, reused {sorted(cache.record.published)}"
        )
    finally:
        cache.close(keep=True)


def state_dir_name() -> str:
    from cachepipe.cache import STATE_DIR

    return STATE_DIR


ERRORS = ("enospc", "eio")
"""The failures: the cache, its journal and its deletions (``cachepipe/cache/``, ``state.py``,
``removal.py``, ``fscalls.py``) handle a failed call alike whether its errno is ENOSPC or EIO
(neither has an ``OSError`` subclass, and they branch on no errno but ENOENT, EEXIST, ENOTEMPTY,
ENOTDIR, EISDIR, EPERM, ELOOP, EINVAL, ENOSYS and EINTR): at one mutation the two take the same
path, so each mutation gets one of them, in turn."""


def explore(tmp_path: Path, program: list[str], retain: bool) -> None:
    base = tmp_path / f"p{TOTALS['programs']}"
    _model, counted, _ = run(base / "clean", program, retain, None)
    TOTALS["programs"] += 1
    for at in range(counted.count):
        for kind in KINDS:
            if not counted.applies(kind, at) or (kind in ERRORS and kind != ERRORS[at % len(ERRORS)]):
                continue
            root = base / f"{at}-{kind}"
            model, fs, _crashed = run(root, program, retain, Fault(at, kind))
            if fs.hit is not None:
                TOTALS["faults injected" if kind in ("enospc", "eio", "short") else "crash points"] += 1
            check_recovery(root, model, f"program {program}, {kind} at mutation {at} ({fs.hit})")


EXAMPLES = int(os.environ.get("CACHEPIPE_CRASH_EXAMPLES", "6"))
SHM = "/dev/shm"  # noqa: S108 - tmpfs on every Linux: the memory file system case


def crash_programs(examples: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``examples`` programs drawn, and three given, for each of the two retention modes."""

    given_programs = [
        ["fetch", "fetch", "fetch", "ackall", "fetch", "fetch", "ackall", "restart", "fetch", "ackall"],
        # compactions between a stage and its publish:
        ["stage", "fetch", "ack0", "publish", "stage", "ackall", "fetch", "publish", "drop", "fetch"],
        # runs of publishes (one journal write of intents, then the renames), with acks between
        ["stage", "stage", "fetch", "publishall", "ack0", "stage", "stage", "publishall", "ackall", "drop", "fetch"],
    ]

    def wrap(test: Callable[..., None]) -> Callable[..., None]:
        for program in given_programs:
            test = example(program=program)(test)
        test = given(program=OPS)(test)
        test = settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)(test)
        return pytest.mark.parametrize("retain", [False, True], ids=["retain-none", "retain-auto"])(test)

    return wrap


@crash_programs(EXAMPLES)
def test_every_crash_point_recovers_on_tmpfs(retain, program):
    """On tmpfs the cache stages and publishes through the calls that keep the interpreter's
    lock (``fscalls.HOLDING``), which CrashFs wraps too."""
    base = Path(tempfile.mkdtemp(dir=SHM))
    try:
        explore(base, program, retain)
    finally:
        shutil.rmtree(base)


@crash_programs(max(1, EXAMPLES // 3))
def test_every_crash_point_recovers_on_disk(tmp_path_factory, retain, program):
    """The same on a local disk (``fscalls.HOLDING`` while its calls are quick), with a third of
    the programs drawn: its calls are the same code as tmpfs's and far slower (in one suite run
    49 s against tmpfs's 7 s, most of it in the longest programs drawn)."""
    explore(tmp_path_factory.mktemp("crash"), program, retain)


def test_the_calls_that_keep_the_lock_are_mutations_too():
    """A cache on tmpfs, opened before CrashFs is entered: its stage and publish (a folder made,
    a rename) are counted, and a fault there fails them as on disk."""
    base = Path(tempfile.mkdtemp(dir=SHM))
    try:
        cache = Cache(base / "c", capacity())
        cache.open()
        cache.recover(CATALOG, resume=False)
        assert cache.file_calls is fscalls.HOLDING
        item = CATALOG[0]
        assert cache.acquire(item) is True
        with CrashFs() as fs:
            staged = Path(cache.stage(item))
            (staged / "a").write_bytes(b"A" * item.files[0].size)
            cache.publish(staged, item)
        # stage, the intent, the publish (its "P" rides on the next event)
        assert [name for _n, name, _arg in fs.log] == ["mkdir", "write", "rename"]
        assert cache.acquire(CATALOG[1]) is True
        with CrashFs(Fault(0, "eio")), pytest.raises(OSError) as failed:  # noqa: PT011 - its errno is checked
            cache.stage(CATALOG[1])
        assert failed.value.errno == errno.EIO
        cache.close()
    finally:
        shutil.rmtree(base)


def test_zz_report_totals(capsys):
    """Print what the exploration covered (``pytest -s tests/test_crash_points.py``)."""
    with capsys.disabled():
        print(f"\ncrash-point exploration: {TOTALS}")
    if TOTALS["programs"]:
        assert TOTALS["crash points"] > 0 and TOTALS["faults injected"] > 0


# ---- one test per finding of the crash-safety review (each failed on the code before its fix) ----


def _published_and_acked(root: Path) -> state.Replay:
    return state.load(root / ".cachepipe" / "journal")


def test_compaction_keeps_the_event_that_triggered_it(tmp_path):
    """Finding 2: the rewritten journal holds the publish or ack whose append made it compact."""
    model = Model(tmp_path, retain=False)
    with CrashFs():
        model.open()
        for _ in range(40):  # enough events for several compactions
            model.fetch()
            replay = _published_and_acked(tmp_path)
            on_disk = {p for p in os.listdir(tmp_path) if p != ".cachepipe"}
            assert on_disk <= replay.published | replay.publishing, f"published but not journaled: {on_disk}"
            model.ack(0)
            replay = _published_and_acked(tmp_path)
            for n in model.acked:
                e, i = STEPS[n]
                assert (e, i) < replay.cursor or (e, f"i{i}") in replay.acked, f"ack of step {(e, i)} lost from the journal"
        model.cache.close(keep=True)


def test_position_never_moves_backwards(tmp_path):
    """Finding 3: consumers acking in parallel report positions out of order."""
    cache = Cache(tmp_path, capacity())
    cache.open()
    try:
        cache.recover(CATALOG, resume=True, plan=PLAN_KEY)
        cache.advance(0, 3)
        cache.advance(0, 2)  # a slower thread's earlier position
    finally:
        cache.close(keep=True)  # writes the position (deferred to the next event or the close)
    assert _published_and_acked(tmp_path).cursor == (0, 3)


def test_torn_append_is_cut_back_and_the_next_event_lands_whole(tmp_path):
    """Finding 4b: a short write to the journal (disk full) leaves no partial line."""
    journal = state.Journal(tmp_path / "journal")
    journal.rewrite(state.Replay())
    with CrashFs(Fault(0, "short")), pytest.raises(OSError) as failed:  # noqa: PT011 - its errno is checked below
        journal.append("A", "0 item_00261")
    assert failed.value.errno == errno.ENOSPC
    journal.append("A", "0 item_00262")
    journal.close()
    assert (tmp_path / "journal").read_bytes().endswith(b"C 0 0\nA 0 item_00262\n")
    assert state.load(tmp_path / "journal").acked == {(0, "item_00262")}


def test_a_full_disk_at_the_publish_record_does_not_orphan_the_item(tmp_path):
    """Finding 4c: ENOSPC on the write that carries a "P" record (deferred: it rides in front of
    the next publish's "I"): the item it names is published all the same (its "I" line is
    durable), counted in the ledger, and reused after a restart; the publish whose intent met
    the full disk fails and is discarded."""
    _model, counted, _ = run(tmp_path / "count", ["fetch", "fetch"], False, None)
    carrier = next(n for n, call, arg in counted.log if call == "write" and arg.endswith("b'P i0\\nI i1\\n'"))
    model = Model(tmp_path / "real", retain=False)
    with CrashFs(Fault(carrier, "enospc")) as fs:
        model.open()
        model.fetch()
        model.fetch()
        assert fs.hit is not None and fs.hit[1].endswith("b'P i0\\nI i1\\n'"), fs.log
    assert model.ready == [0]
    model.check_ledger()
    model.cache.close(keep=True)
    check_recovery(tmp_path / "real", model, "after ENOSPC at the publish record")


def test_a_publish_costs_one_journal_write(tmp_path):
    """A publish journals its intent ("I") by one write before the rename; its record ("P"),
    which recovery can do without (the intent covers it), is written in front of the next
    event instead of by a write of its own, and closing writes the last one."""
    _model, fs, crashed = run(tmp_path, ["fetch", "fetch"], False, None)
    assert not crashed
    events = [arg.split(": ", 1)[1] for _n, call, arg in fs.log if call == "write" and ("b'I " in arg or "b'P " in arg)]
    assert events == ["b'I i0\\n'", "b'P i0\\nI i1\\n'", "b'P i1\\n'"], fs.log
    assert _published_and_acked(tmp_path).published == {"i0", "i1"}


def test_a_run_of_publishes_costs_one_journal_write(tmp_path):
    """Items published together (:meth:`Cache.publish_many`) journal their intents by one write,
    and their records ride in front of the next event."""
    _model, fs, crashed = run(tmp_path, ["stage", "stage", "stage", "publishall"], False, None)
    assert not crashed
    events = [arg.split(": ", 1)[1] for _n, call, arg in fs.log if call == "write" and ("b'I " in arg or "b'P " in arg)]
    assert events == ["b'I i0\\nI i1\\nI i2\\n'", "b'P i0\\nP i1\\nP i2\\n'"], fs.log
    assert _published_and_acked(tmp_path).published == {"i0", "i1", "i2"}


def test_an_item_in_the_way_fails_alone_in_a_run_of_publishes(tmp_path):
    """Something not ours in the place of one item of a run: that item's rename is refused and
    its intent withdrawn ("D"), the others are published; after a restart the foreign folder is
    still there, counted as foreign, and the others are reused."""
    model = Model(tmp_path, retain=False)
    model.open()
    assert model.stage() and model.stage() and model.stage()
    (tmp_path / "i1").mkdir()
    (tmp_path / "i1" / "mine").write_bytes(b"m")
    staged = [(path, CATALOG[STEPS[n][1]], model.cache.charge(CATALOG[STEPS[n][1]])) for n, path in model.staged]
    got = model.cache.publish_many(staged)
    assert [type(g) for g in got] == [str, FileExistsError, str], got
    assert "i1" in str(got[1]) and "not managed by cachepipe" in str(got[1])
    assert set(model.cache.record.published) == {"i0", "i2"}
    model.cache.close(keep=True)
    cache = Cache(tmp_path, capacity())
    cache.open()
    try:
        cache.recover(CATALOG, resume=True, plan=PLAN_KEY)
        assert set(cache.record.published) == {"i0", "i2"} and cache.foreign == 2 * cache.block  # i1 and its 1-byte file
    finally:
        cache.close(keep=True)
    assert (tmp_path / "i1" / "mine").read_bytes() == b"m"


def test_a_full_disk_at_the_ack_record_keeps_the_lease(tmp_path):
    """Finding 4a: an ack whose journal write fails raises and changes nothing: the consumer
    still holds the item and acks it again once there is room."""
    from cachepipe import Pipeline

    src = tmp_path / "src"
    for i in range(3):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "f").write_bytes(b"x" * 100)
    with Pipeline(src.as_uri(), tmp_path / "cache", "1MiB") as pipe:
        item = pipe.get(timeout=30)
        with CrashFs(Fault(0, "enospc")) as fs, pytest.raises(OSError):  # noqa: PT011 - the injected fault; the test is about where it hit
            pipe.ack(item)
        assert fs.hit is not None and "A 0 item0" in fs.hit[1]
        assert item.path.exists()
        pipe.ack(item)  # still leased: this ack is recorded
        assert not item.path.exists()
        assert [pipe.get(timeout=30).name for _ in range(2)] == ["item1", "item2"]


def test_kill_during_close_leaves_no_broken_item(tmp_path):
    """Finding 5: a crash at any point of a close that deletes items leaves each item whole (and
    reused) or gone, never half-deleted and counted as foreign forever."""
    program = ["fetch", "fetch", "fetch", "drop"]
    _model, counted, _ = run(tmp_path / "clean", program, False, None)
    closing = [n for n, call, arg in counted.log if call in ("rename", "unlink", "rmdir") and "/staging/" not in arg]
    assert closing, counted.log
    for at in closing:
        root = tmp_path / f"crash{at}"
        model, fs, crashed = run(root, program, False, Fault(at, "crash"))
        assert crashed
        check_recovery(root, model, f"crash at mutation {at} ({fs.hit})")


def _leftovers(tmp_path: Path) -> tuple[Path, Path]:
    """A source of 20 items of 100 KiB, and a cache of 5.5 items' worth that a first pass left
    with items 2-6 published (items 0 and 1 acked, keep_on_close=True)."""
    from waiting import wait_until

    from cachepipe import Pipeline

    src, cache = tmp_path / "src", tmp_path / "cache"
    for i in range(20):
        (src / f"item{i:02}").mkdir(parents=True)
        (src / f"item{i:02}" / "f").write_bytes(bytes([i]) * (100 * 1024))
    with Pipeline(src.as_uri(), cache, 560 * 1024, keep_on_close=True) as pipe:
        for _ in range(2):
            pipe.ack(pipe.get(timeout=30))
        wait_until(lambda: pipe.stats().items_ready == 5)
    assert sorted(p.name for p in cache.iterdir() if p.name != ".cachepipe") == [f"item{i:02}" for i in range(2, 7)]
    return src, cache


def test_a_new_pass_is_not_blocked_by_its_own_leftovers(tmp_path):
    """Finding 1: leftovers of an earlier pass that fill the cache are dropped as the plan needs
    room for an earlier item, instead of waiting forever for acks that cannot come."""
    from cachepipe import Pipeline

    src, cache = _leftovers(tmp_path)
    with Pipeline(src.as_uri(), cache, 560 * 1024) as pipe:  # resume=False: a new pass from item 0
        got = []
        for _ in range(20):
            item = pipe.get(timeout=20)
            got.append(item.name)
            pipe.ack(item)
        assert got == [f"item{i:02}" for i in range(20)]


def test_a_smaller_capacity_trims_leftovers_at_open(tmp_path):
    """Finding 7 (last part): reopened with a smaller capacity, the cache is under it at once."""
    from cachepipe import Pipeline

    src, cache = _leftovers(tmp_path)
    with Pipeline(src.as_uri(), cache, 300 * 1024, keep_on_close=True) as pipe:
        assert tree_bytes(cache) <= 300 * 1024
        assert pipe.get(timeout=20).name == "item00"


def test_compaction_keeps_an_item_acked_and_kept_for_a_later_step(tmp_path):
    """An item acked in one epoch and kept by retention is both acked and published: the
    compacted journal must replay it as published (found by the multi-epoch kill soak)."""
    journal = state.Journal(tmp_path / "journal")
    journal.rewrite(state.Replay(0, {"kept"}, set(), {(3, "kept")}, (3, 7), "plan"))
    journal.close()
    replay = state.load(tmp_path / "journal")
    assert replay.published == {"kept"} and replay.acked == {(3, "kept")}


def test_the_journal_keeps_item_versions_through_compaction_and_reads_older_journals_without_them(tmp_path):
    """An intent with a version ("J") and a compacted publish record ("R") give the item's
    version; "I" and "P" (an older journal's, or an item without ETags) give none, and a later
    "I" forgets an earlier publish's version; a "J" without a name is damage."""
    path = tmp_path / "journal"
    path.write_bytes(b"N 1\nJ 00aa11bb22cc33dd a b\nP a b\nI old\nP old\nJ 1111222233334444 again\nA 0 again\nI again\n")
    replay = state.load(path)
    assert replay.published == {"a b", "old"} and replay.publishing == {"again"}
    assert replay.versions == {"a b": "00aa11bb22cc33dd"}
    journal = state.Journal(path)
    journal.rewrite(replay)
    journal.close()
    assert b"R 00aa11bb22cc33dd a b\nP old\nI again\n" in path.read_bytes()
    assert state.load(path).versions == replay.versions
    path.write_bytes(b"N 1\nJ 00aa11bb22cc33dd\n")
    with pytest.raises(state.StateCorrupt, match="J event without a name"):
        state.load(path)


def test_a_full_disk_at_open_raises_enospc_and_leaves_the_items(tmp_path):
    """Recovery's first journal rewrite meets a full disk: open fails with that error, and
    closing after it deletes nothing (nothing was recorded yet; the next open decides)."""
    model = Model(tmp_path, retain=False)
    with CrashFs():
        model.open()
        model.fetch()
        model.cache.close(keep=True)
    cache = Cache(tmp_path, capacity())
    cache.open()
    # mutation 0 removes the note of the folder's size the close left (.cachepipe/held); 1 writes the journal
    with CrashFs(Fault(1, "enospc")) as fs, pytest.raises(OSError, match="No space left") as failed:
        cache.recover(CATALOG, resume=True, plan=PLAN_KEY)
    assert fs.hit is not None and fs.log[0][1:] == ("unlink", str(tmp_path / ".cachepipe" / "held"))
    assert failed.value.errno == errno.ENOSPC
    cache.close(keep=False)
    assert (tmp_path / "i0" / "a").exists()
    check_recovery(tmp_path, Model(tmp_path, retain=False), "after a failed open")


def test_an_ack_deletes_a_small_item_where_it_is(tmp_path):
    """Items under REAP_MIN_BYTES (every item here: folders, one with a subfolder) are deleted in
    place when acknowledged: the only renames are the publishes' (staging to the item's path),
    none moves an item aside. The crash points above cover what a crash in the middle leaves."""
    _model, fs, crashed = run(tmp_path, ["fetch", "fetch", "ackall"], False, None)
    assert not crashed
    renames = [arg for _n, call, arg in fs.log if call == "rename"]
    assert len(renames) == 2, fs.log
    assert all("/.cachepipe/staging/" in arg for arg in renames), renames
    assert [arg.rpartition("/")[2] for _n, call, arg in fs.log if call == "rmdir"][:3] == ["i0", "sub", "i1"], fs.log
