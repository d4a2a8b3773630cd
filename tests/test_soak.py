"""Soak tests (issue #18): a resumed multi-epoch pass consumed by eight threads, killed with
SIGKILL at random moments and restarted; and the same on a small shared disk that another
writer keeps filling and freeing.

Each run of tests/soak_child.py logs every hand-out ("GOT run epoch name md5") and, once
``ack()`` returned, every acknowledgement ("ACK run epoch name", fsync'ed) to one append-only
file. From that log alone the tests check, across all runs:

- no (epoch, item) is handed out again after its acknowledgement was logged;
- every (epoch, item) of the plan is handed out at least once, with the right content;
- the bytes under the cache directory never exceed the capacity (tests/sampling.py);
- after the last run closes cleanly: no staging leftovers, no items, nothing outside the cache.

Defaults keep both tests within about a minute on two cores (they run on every submission).
For a longer run by hand::

    CACHEPIPE_SOAK_KILLS=200 CACHEPIPE_SOAK_EPOCHS=300 CACHEPIPE_SOAK_SEED=7 \\
        python -m pytest -s -p no:cacheprovider tests/test_soak.py

``CACHEPIPE_SOAK_KILLS``: kills per test (default 16 and 8); ``CACHEPIPE_SOAK_EPOCHS``: epochs
of the kill soak (default 30; the full-disk soak runs half of it, at least 3);
``CACHEPIPE_SOAK_SEED``: the seed of the data, the kill moments and the other writer (default 18).
``pytest -s`` shows the figures of each soak.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import operator
import os
import random
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

from sampling import Sampler
from test_disk_faults import tmpfs
from waiting import wait_until
from zygote import Zygote

from cachepipe import state as journal_state

HERE = Path(__file__).parent
KIB = 1024
# the child imports the cachepipe of this work tree, not whichever one the environment installed
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
STALL_SECONDS = 60.0  # a run that hands out nothing for this long is stuck, not slow


def _knob(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else default


# ---- the dataset --------------------------------------------------------------------------
def make_source(root: Path, n_items: int, rng: random.Random, big: tuple[int, int]) -> dict[str, str]:
    """``n_items`` folders ``s000..`` under ``root`` (a ``file://`` source), each with a
    ``a.bin`` of ``big`` KiB (min, max) and a small ``sub/b.txt``; returns {name: md5}."""
    digests = {}
    for i in range(n_items):
        name = f"s{i:03d}"
        files = {"a.bin": rng.randbytes(rng.randint(*big) * KIB), "sub/b.txt": rng.randbytes(rng.randint(10, 900))}
        for rel, body in files.items():
            path = root / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)
        digests[name] = hashlib.md5(b"".join(files[rel] for rel in sorted(files))).hexdigest()
    return digests


def snapshot(root: Path) -> dict[str, int]:
    """{relative path: size} of every file under ``root``."""
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}


# ---- a child run ----------------------------------------------------------------------
class Run:
    """One run of tests/soak_child.py, forked by ``zygote`` if given (its imports done once), else
    a process of its own; its stderr goes to a file beside the log."""

    def __init__(self, cfg: dict, run: int, workdir: Path, zygote: Zygote | None = None) -> None:
        self.run = run
        self.stderr_path = workdir / f"child-{run}.stderr"
        with open(self.stderr_path, "wb") as err, open(os.devnull, "rb") as nothing, open(os.devnull, "wb") as out:
            self.proc = (
                zygote.spawn({**cfg, "run": run}, stdin=nothing, stdout=out, stderr=err)
                if zygote is not None
                else subprocess.Popen(
                    [sys.executable, str(HERE / "soak_child.py"), json.dumps({**cfg, "run": run})],
                    stdout=out,
                    stderr=err,
                    env=CHILD_ENV,
                )
            )

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(60)

    def stacks(self) -> str:
        """Every thread's stack of a stuck run (faulthandler on SIGUSR1), then kill it."""
        if self.proc.poll() is None:
            size = self.stderr_path.stat().st_size
            self.proc.send_signal(signal.SIGUSR1)
            with contextlib.suppress(AssertionError):
                wait_until(lambda: self.stderr_path.stat().st_size > size and "Thread" in self.stderr()[size:], 5, "a stack dump")
            self.kill()
        return self.stderr()[-6000:]


class Log:
    """The append-only log of every run, read incrementally (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[list[str]] = []
        self._offset = 0
        self._partial = b""

    def refresh(self) -> list[list[str]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return self.lines
        self._offset += len(data)
        data = self._partial + data
        *whole, self._partial = data.split(b"\n")
        self.lines += [line.decode("utf-8", "replace").split(" ") for line in whole]
        return self.lines

    def of(self, run: int, kind: str) -> list[list[str]]:
        return [line for line in self.lines if line[0] == kind and line[1] == str(run)]


def drive(
    cfg: dict, log: Log, workdir: Path, run: int, rng: random.Random, most: int, zygote: Zygote | None = None
) -> tuple[Run, str]:
    """Start run ``run``; after ``1..most`` more hand-outs and a random instant, kill it.

    Returns the run and how it ended: "killed", "done" or "failed" (it stopped by itself first).
    Raises AssertionError with every thread's stack if it hands out nothing for STALL_SECONDS.
    """
    child = Run(cfg, run, workdir, zygote)
    target = rng.randint(1, most)

    def reached() -> bool:
        log.refresh()
        if child.proc.poll() is not None:
            return True
        got = len(log.of(run, "GOT"))
        return got >= target

    try:
        wait_until(reached, STALL_SECONDS, f"run {run}: {target} hand-outs")
    except AssertionError:
        got = len(log.of(run, "GOT"))
        raise AssertionError(
            f"run {run} stalled: {got} of {target} hand-outs in {STALL_SECONDS} s, "
            f"log tail {log.lines[-5:]}; stacks:\n{child.stacks()}"
        ) from None
    if child.proc.poll() is None:
        threading.Event().wait(rng.random() * 0.03)  # a random instant: mid-download, mid-ack, mid-journal write
    if child.proc.poll() is None:
        child.kill()
        return child, "killed"
    log.refresh()
    return child, ("done" if log.of(run, "DONE") else "failed")


def finish(cfg: dict, log: Log, workdir: Path, run: int, zygote: Zygote | None = None) -> Run:
    """A last run, left to end by itself (stack dump and failure if it stalls)."""
    child = Run(cfg, run, workdir, zygote)
    progress = [-1]

    def ended_or_stuck() -> bool:
        log.refresh()
        return child.proc.poll() is not None

    while True:
        try:
            wait_until(ended_or_stuck, STALL_SECONDS, "the last run's end")
            break
        except AssertionError:
            now = len(log.of(run, "GOT"))
            if now == progress[0]:
                raise AssertionError(
                    f"last run {run} stalled after {now} hand-outs; log tail {log.lines[-5:]}; stacks:\n{child.stacks()}"
                ) from None
            progress[0] = now  # slow but moving: wait another stretch (bounded by the plan's length)
    child.proc.wait()
    log.refresh()
    return child


class Tally:
    """Every hand-out and acknowledgement of the log, in log order."""

    def __init__(self, lines: list[list[str]], digests: dict[str, str]) -> None:
        self.deliveries: Counter = Counter()
        self.acked: set[tuple[int, str]] = set()
        self.came_back: list[str] = []  # (epoch, item) handed out again after its ack was logged
        self.corrupt: list[str] = []
        self.stray_acks: list[str] = []  # an ACK whose GOT is not in the same run
        taken: set[tuple[str, int, str]] = set()
        for line in lines:
            kind = line[0]
            if kind == "GOT":
                run, key = line[1], (int(line[2]), line[3])
                if key in self.acked:
                    self.came_back.append(f"run {run}: epoch {key[0]} {key[1]}")
                self.deliveries[key] += 1
                taken.add((run, *key))
                if line[4] != digests.get(key[1]):
                    self.corrupt.append(f"run {run}: epoch {key[0]} {key[1]}")
            elif kind == "ACK":
                run, key = line[1], (int(line[2]), line[3])
                if (run, *key) not in taken:
                    self.stray_acks.append(f"run {run}: epoch {key[0]} {key[1]}")
                self.acked.add(key)

    @property
    def redelivered(self) -> int:
        return sum(n - 1 for n in self.deliveries.values())


def in_hand(log: Log, run: int) -> int:
    """Items of ``run`` handed out and not acknowledged (as logged) when it ended."""
    got = {(line[2], line[3]) for line in log.of(run, "GOT")}
    return len(got - {(line[2], line[3]) for line in log.of(run, "ACK")})


def journal_error(cache: Path, names: dict[str, str]) -> str | None:
    """Why the journal a run left would not load, or loads names that are not items (a line torn
    by a short write and glued to the next); None if it is sound."""
    try:
        replay = journal_state.load(cache / ".cachepipe" / "journal")
    except journal_state.StateCorrupt as exc:
        return str(exc)
    strange = sorted((replay.published | replay.publishing | {n for _e, n in replay.acked}) - set(names))
    return f"the journal names items that do not exist: {strange[:5]}" if strange else None


def check_clean_end(cache: Path, digests: dict[str, str]) -> None:
    """After a clean close (keep_on_close=False): only the state files are left."""
    left = sorted(snapshot(cache))
    allowed = {".cachepipe/lock", ".cachepipe/journal", ".cachepipe/catalog", ".cachepipe/held"}
    assert [p for p in left if p not in allowed] == [], f"left in the cache after a clean close: {left[:10]}"
    assert not (cache / ".cachepipe" / "staging").exists() or not any((cache / ".cachepipe" / "staging").iterdir())
    items = [p.name for p in cache.iterdir() if p.name in digests]
    assert items == [], f"items (folders) left after a clean close: {items[:10]}"


# ---- 1. kills across many epochs, eight consumers ----------------------------------------
def test_multi_epoch_eight_thread_kill_soak(tmp_path):
    seed = _knob("CACHEPIPE_SOAK_SEED", 18)
    kills, epochs = _knob("CACHEPIPE_SOAK_KILLS", 16), _knob("CACHEPIPE_SOAK_EPOCHS", 30)
    rng = random.Random(seed)
    n_items = 24
    digests = make_source(tmp_path / "src", n_items, rng, (1, 6))
    source_before = snapshot(tmp_path / "src")
    cache = tmp_path / "cache"
    # about a third of the data: retention keeps some, evicts the rest by the plan
    capacity = 48 * KIB
    log = Log(tmp_path / "soak.log")
    cfg = {
        "url": f"file://{tmp_path / 'src'}",
        "cache": str(cache),
        "capacity": capacity,
        "log": str(log.path),
        "epochs": epochs,
        "seed": seed,
        "threads": 8,
        "options": {},
        "work_seconds": 0.001,
    }
    ends: Counter = Counter()
    held_at_kill = []
    with Zygote("soak_child", cfg["url"], env=CHILD_ENV) as zygote, Sampler(cache) as sampler:
        run = 0
        for run in range(kills):
            child, how = drive(cfg, log, tmp_path, run, rng, most=3 * n_items, zygote=zygote)
            ends[how] += 1
            if how == "killed":
                held_at_kill.append(in_hand(log, run))
            assert how != "failed", (
                f"seed {seed}, run {run} failed by itself: {' '.join(functools.reduce(operator.iadd, log.of(run, 'FAIL'), [])[2:])}\n{child.stderr()[-4000:]}"  # noqa: E501 - kept whole
            )
            assert "Traceback" not in child.stderr(), child.stderr()
            assert journal_error(cache, digests) is None, f"after run {run} ({how}): {journal_error(cache, digests)}"
            if how == "done":
                break  # the plan ended before the kills did
        last = finish(cfg, log, tmp_path, run + 1, zygote)
    stderr = last.stderr()
    tally = Tally(log.lines, digests)
    plan = {(e, name) for e in range(epochs) for name in digests}
    print(
        f"\nkill soak (seed {seed}): {ends['killed']} kills ({sum(1 for n in held_at_kill if n)} with items in hand, "
        f"{sum(held_at_kill)} items in hand in all), {run + 2} runs, {epochs} epochs x {n_items} items = {len(plan)} steps, "
        f"{sum(tally.deliveries.values())} deliveries, {tally.redelivered} re-deliveries of unacknowledged steps, "
        f"{len(tally.came_back)} re-deliveries of acknowledged steps, peak cache {sampler.peak} of {capacity} bytes "
        f"({sampler.samples} samples)"
    )
    assert last.proc.returncode == 0 and log.of(run + 1, "DONE"), f"last run: {log.of(run + 1, 'FAIL')}\n{stderr[-4000:]}"
    assert "rebuilding" not in stderr, stderr[-2000:]  # the journal was readable at every restart
    assert tally.came_back == [], f"acknowledged, then handed out again: {tally.came_back[:10]}"
    assert tally.corrupt == [], tally.corrupt[:10]
    assert tally.stray_acks == [], tally.stray_acks[:10]
    missing = sorted(plan - set(tally.deliveries))
    assert missing == [], f"{len(missing)} steps never handed out, e.g. {missing[:10]}"
    assert set(tally.deliveries) <= plan, sorted(set(tally.deliveries) - plan)[:10]
    assert sampler.peak <= capacity, f"cache reached {sampler.peak} bytes, capacity {capacity}"
    assert sampler.samples > 100
    check_clean_end(cache, digests)
    assert snapshot(tmp_path / "src") == source_before  # the source is read, never written
    ours = {"src", "cache", "soak.log", *(f"child-{r}.stderr" for r in range(run + 2))}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ours) == []


# ---- 2. a full shared disk, another writer, kills ---------------------------------------
class OtherWriter:
    """Another tenant of the cache's filesystem: fills it with files of random sizes until it is
    full (or a random amount), then frees a random share of them, over and over, until stopped.
    Paced by random short waits (it is the fault, not a measurement)."""

    def __init__(self, folder: Path, seed: int) -> None:
        self.folder = folder
        self.rng = random.Random(seed)
        self.files: list[Path] = []
        self.full = 0  # times it met ENOSPC
        self.written = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-other-writer")
        self._n = 0

    def __enter__(self) -> OtherWriter:
        self.folder.mkdir()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.free_all()

    def free_all(self) -> None:
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files.clear()

    def _run(self) -> None:
        rng = self.rng
        while not self._stop.is_set():
            goal = rng.choice([10**9, rng.randint(16, 256) * KIB])  # up to full, or a slice
            added = 0
            while added < goal and not self._stop.is_set():
                size = rng.randint(1, 64) * KIB
                path = self.folder / f"t{self._n}"
                self._n += 1
                try:
                    with open(path, "wb") as fh:
                        fh.write(b"t" * size)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    path.unlink(missing_ok=True)
                    self.full += 1
                    break
                self.files.append(path)
                added += size
                self.written += size
            self.peak = max(self.peak, sum(p.stat().st_size for p in self.files))
            self._stop.wait(rng.random() * 0.05)  # hold the space a moment
            rng.shuffle(self.files)
            keep = rng.randint(0, len(self.files))
            for path in self.files[keep:]:
                path.unlink()
            del self.files[keep:]
            self._stop.wait(rng.random() * 0.05)


def test_full_shared_disk_soak_with_kills(tmp_path):
    seed = _knob("CACHEPIPE_SOAK_SEED", 18)
    kills = _knob("CACHEPIPE_SOAK_KILLS", 8)
    epochs = max(3, _knob("CACHEPIPE_SOAK_EPOCHS", 30) // 2)
    rng = random.Random(seed + 1)
    n_items = 16
    digests = make_source(tmp_path / "src", n_items, rng, (4, 24))
    with tmpfs(tmp_path / "disk", "512k") as disk:
        cache = disk / "cache"
        capacity = 320 * KIB  # fits the disk alone; the other writer takes the rest and more
        log = Log(tmp_path / "soak.log")
        cfg = {
            "url": f"file://{tmp_path / 'src'}",
            "cache": str(cache),
            "capacity": capacity,
            "log": str(log.path),
            "epochs": epochs,
            "seed": seed,
            "threads": 8,
            "options": {},
            "work_seconds": 0.001,
            "pipeline": {"retries": 1000, "retry_backoff": 0.005, "retry_backoff_max": 0.05},
        }
        ends: Counter = Counter()
        failures: list[str] = []
        torn: list[str] = []  # journals that would not load after a run
        runs = 0
        with Zygote("soak_child", cfg["url"], env=CHILD_ENV) as zygote, Sampler(cache) as sampler:
            with OtherWriter(disk / "tenant", seed) as writer:
                # every run is killed or fails by itself; a bounded number of runs
                while ends["killed"] < kills and runs < 2 * kills:
                    child, how = drive(cfg, log, tmp_path, runs, rng, most=2 * n_items, zygote=zygote)
                    runs += 1
                    ends[how] += 1
                    if (error := journal_error(cache, digests)) is not None:
                        torn.append(f"after run {runs - 1} ({how}): {error}")
                    if how == "failed":
                        failures.append(
                            " ".join(log.of(runs - 1, "FAIL")[0][2:]) if log.of(runs - 1, "FAIL") else child.stderr()[-2000:]
                        )
                    if how == "done":
                        break
            # the other writer is gone and its files freed: the pass must complete
            last = finish(cfg, log, tmp_path, runs, zygote)
        stderr = last.stderr()
        tally = Tally(log.lines, digests)
        plan = {(e, name) for e in range(epochs) for name in digests}
        rebuilt = [r for r in range(runs + 1) if "rebuilding the cache state" in (tmp_path / f"child-{r}.stderr").read_text()]
        print(
            f"\nfull-disk soak (seed {seed}): {runs + 1} runs: {ends['killed']} killed, {ends['failed']} failed by "
            f"themselves, {ends['done']} done early; other writer met a full disk {writer.full} times, wrote "
            f"{writer.written // KIB} KiB; {sum(tally.deliveries.values())} deliveries of {len(plan)} steps, "
            f"{tally.redelivered} re-deliveries, {len(tally.came_back)} of acknowledged steps; journal rebuilt at "
            f"runs {rebuilt}; peak cache {sampler.peak} of {capacity} bytes ({sampler.samples} samples)"
        )
        for failure, times in Counter(f.replace(str(tmp_path), "<tmp>") for f in failures).items():
            print(f"  failed by itself ({times}x): {failure[:300]}")
        unclear = [f for f in failures if "ENOSPC" not in f and "No space left" not in f and "(28)" not in f]
        assert unclear == [], f"failures that do not name the full disk (ENOSPC): {unclear[:3]}"
        assert last.proc.returncode == 0 and log.of(runs, "DONE"), f"last run: {log.of(runs, 'FAIL')}\n{stderr[-4000:]}"
        assert torn == [], f"the journal did not load: {torn[:3]}"
        assert rebuilt == [], f"the journal did not load after runs {[r - 1 for r in rebuilt]} (torn or corrupt)"
        assert tally.came_back == [], f"acknowledged, then handed out again: {tally.came_back[:10]}"
        assert tally.corrupt == [], tally.corrupt[:10]
        missing = sorted(plan - set(tally.deliveries))
        assert missing == [], f"{len(missing)} steps never handed out, e.g. {missing[:10]}"
        assert sampler.peak <= capacity, f"cache reached {sampler.peak} bytes, capacity {capacity}"
        check_clean_end(cache, digests)  # nothing stranded: every published item was handed out or freed
        assert sorted(p.name for p in disk.iterdir()) == ["cache", "tenant"]
