"""A consumer process for the soak tests: several threads take items from one resumed pipeline
and log every delivery and acknowledgement to an append-only file.

argv[1]: JSON {"url", "cache", "capacity", "log", "run", "epochs", "seed", "threads",
"options"[, "pipeline": {extra Pipeline options}][, "work_seconds": s]}.

Log lines (each one ``os.write`` on an ``O_APPEND`` file, so a kill leaves whole lines):
    "OPEN <run>"                          the pipeline is open
    "GOT <run> <epoch> <name> <md5>"      an item was handed out (before its content is used)
    "ACK <run> <epoch> <name>"            ``ack()`` returned; fsync'ed before the next step
    "FAIL <run> <error and its causes>"   the pipeline raised; the process exits with status 3
    "DONE <run>"                          every thread saw the end and the pipeline closed

The epoch of a delivery is read from the pipeline's frontier (``Pipeline._frontier``) by the
sequence number in the lease token: a test's read of cachepipe's bookkeeping, nothing is
changed. With ``ordered=False`` and eight consumers it is the only way to tell which epoch a
hand-out belongs to.

Also run by tests/zygote.py, which calls :func:`main` in a process it forked.
"""

import faulthandler
import hashlib
import json
import logging
import os
import signal
import sys
import threading

from cachepipe import Pipeline


class Run:
    """One run: its log and the failures of its threads."""

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.run = cfg["run"]
        self.fd = os.open(cfg["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.failures: list[BaseException] = []

    def note(self, line: str, durable: bool = False) -> None:
        os.write(self.fd, (line + "\n").encode("utf-8", "surrogateescape"))
        if durable:
            os.fsync(self.fd)

    def consume(self, pipe: Pipeline, stop: threading.Event) -> None:
        pause = threading.Event()
        run = self.run
        try:
            while not stop.is_set() and (item := pipe.get(timeout=120)) is not None:
                epoch = epoch_of(pipe, item)
                digest = hashlib.md5(b"".join((item / rel).read_bytes() for rel in sorted(item.files))).hexdigest()
                self.note(f"GOT {run} {epoch} {item.name} {digest}")
                pause.wait(self.cfg.get("work_seconds", 0))  # the "training step"
                pipe.ack(item)
                self.note(f"ACK {run} {epoch} {item.name}", durable=True)
        except RuntimeError:
            if not stop.is_set():  # closed by the main thread after another consumer failed: not a failure
                self.failures.append(sys.exc_info()[1])
                stop.set()
        except BaseException as exc:  # noqa: BLE001 - collected and reported by the child
            self.failures.append(exc)
            stop.set()
            try:
                pipe.close()  # wakes the other consumers (their get() raises RuntimeError)
            except BaseException as exc2:  # noqa: BLE001 - collected and reported by the child
                self.failures.append(exc2)


def epoch_of(pipe: Pipeline, item) -> int:
    seq = int(item.lease.rpartition("-")[2])
    with pipe._plan_lock:
        return pipe._frontier.step(seq).epoch


def describe(exc: BaseException) -> str:
    """The error and its causes, on one line: "Type(errno): message <- Type(errno): message"."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}({getattr(exc, 'errno', None)}): {exc}")
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(parts).replace("\n", " | ")


def main(cfg: dict) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every stack when a run stalls
    me = Run(cfg)
    options = {
        "epochs": cfg["epochs"],
        "shuffle": True,
        "seed": cfg["seed"],
        "rank": 0,
        "world_size": 1,
        "ordered": False,
        "retain": "auto",
        "resume": True,
        "auto_ack": False,
        "max_concurrency": 4,
        "part_size": "4KiB",
    }
    options.update(cfg.get("pipeline", {}))
    stop = threading.Event()
    try:
        with Pipeline(cfg["url"], cfg["cache"], cfg["capacity"], storage_options=cfg["options"], **options) as pipe:
            me.note(f"OPEN {me.run}")
            threads = [
                threading.Thread(target=me.consume, args=(pipe, stop), name=f"consumer-{i}") for i in range(cfg["threads"])
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    except BaseException as exc:  # noqa: BLE001 - collected and reported by the child
        me.failures.append(exc)
    if me.failures:
        first = me.failures[0]
        me.note(f"FAIL {me.run} {describe(first)}")
        import traceback

        for exc in me.failures:
            traceback.print_exception(exc)
        return 3
    me.note(f"DONE {me.run}")
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
