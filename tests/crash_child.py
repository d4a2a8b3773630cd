"""A consumer process for crash tests: resumes the pass, prints what it gets and acks.

argv[1]: JSON {"url", "cache", "capacity", "options"[, "wait_ready": n][, "work_seconds": s][, "hold_after_acks": n]}.
Prints "OPEN", then per item "GOT <name> <md5 of every file, in order>" and, once ack() returned, "ACKED <name>";
"DONE" at the end. With "hold_after_acks", the item taken after that many acks is held unacked: "HOLDING <name>",
then a line read from stdin (a test kills the child there, or writes a line to let it go on).

Also run by tests/zygote.py, which calls :func:`main` in a process it forked.
"""

import hashlib
import json
import sys
import threading

from cachepipe import Pipeline


def main(cfg: dict) -> int:
    with Pipeline(
        cfg["url"],
        cfg["cache"],
        cfg["capacity"],
        storage_options=cfg["options"],
        resume=True,
        auto_ack=False,
        keep_on_close=True,
        max_concurrency=4,
        part_size="4KiB",
    ) as pipe:
        print("OPEN", flush=True)
        pause = threading.Event()
        while cfg.get("wait_ready") and pipe.stats().items_ready < cfg["wait_ready"]:
            pause.wait(0.01)  # a test wants this many items published before consuming
        acks = 0
        while (item := pipe.get(timeout=120)) is not None:
            digest = hashlib.md5(b"".join((item / rel).read_bytes() for rel in sorted(item.files))).hexdigest()
            print("GOT", item.name, digest, flush=True)
            if acks == cfg.get("hold_after_acks"):
                print("HOLDING", item.name, flush=True)
                sys.stdin.readline()
            pause.wait(cfg.get("work_seconds", 0))  # the "training step"
            pipe.ack(item)
            acks += 1
            print("ACKED", item.name, flush=True)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
