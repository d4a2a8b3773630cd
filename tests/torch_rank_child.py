"""A "rank" of tests/test_node_torch.py and tests/test_torch.py: a DataLoader of two worker
processes over a ``CachePipeDataset``, printing what it yields.

Run by tests/zygote.py, which imports torch, torchdata, cachepipe's adapter (and the source's
backend) once (about 3 s a process on the CI machine) and forks a rank per :func:`main`; the
rank's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_PORT``..., as torchrun sets
them) come in ``cfg["env"]``. ``cfg["kind"]``:

- ``"node"``: ``CachePipeDataset(url, node=socket, job="train", **options)`` in a
  ``StatefulDataLoader``; prints each sample ``[worker, epoch, name, md5]`` as a JSON line.
  Optionally ``resume`` (a checkpoint to load), ``checkpoint_at`` with ``checkpoint`` (save the
  loader's state after that sample), ``die_at`` (SIGKILL itself after that sample: mid-epoch,
  holding items; its workers die with it).
- ``"node-dist"``: under ``torch.distributed`` (gloo), ``node_ranks=[rank]``, a plain
  DataLoader; prints each sample ``[worker, epoch, name, ""]`` as a JSON line.
- ``"direct"``: ``CachePipeDataset(url, cache, "1MiB", storage_options=options, epochs=2,
  shuffle=True, seed=5, **extra)``, under ``torch.distributed`` if ``dist`` (``"explicit"``: the
  rank and world size given to ``init_process_group``, not in the environment, as ``mp.spawn``),
  its DataLoader workers started by ``context`` (default: fork); prints the JSON list of its
  samples ``[name, md5]``. ``made_before``: a dataset made before ``init_process_group``
  (``CachePipeDataset(url, cache, "1MiB")``), read after it; prints the last line of its error,
  or the JSON list of its samples.
- ``"orphans"``: per-process, ``CachePipeDataset(src, cache, "1MiB")`` over a local source, rank 0
  of 1, in a DataLoader of two workers; ``all``: prints the JSON list of its samples (names);
  else prints the JSON list of its workers' pids after the first sample, and waits to be killed,
  each worker's samples after its first made while the file ``hold`` exists (up to 120 s), each
  such worker touching ``hold + "-PID"`` as it begins to wait.
- ``"equal"``: ``CachePipeDataset(url, cache, "1MiB", **extra)`` in a ``StatefulDataLoader`` of
  ``batch_size``; prints the JSON list of its batches of ``[worker, name]``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from cachepipe.torch import CachePipeDataset

# A rank's DataLoader workers started by forkserver ("context": "forkserver") are forked from a
# server that imports these once: by default it preloads only __main__ (tests/zygote.py, which
# imports none of them), and each worker imported torch, cachepipe and s3fs itself (~4 s each)
PRELOAD = ["__main__", "torch", "torchdata.stateful_dataloader", "cachepipe.torch", "s3fs", __name__]
multiprocessing.set_forkserver_preload(PRELOAD)


def read_node(item: Any) -> list:
    info = torch.utils.data.get_worker_info()
    digest = hashlib.md5((item / "f").read_bytes()).hexdigest()
    return [info.id, item.cursor.epoch, item.name, digest]


def read_node_dist(item: Any) -> list:
    return [torch.utils.data.get_worker_info().id, item.cursor.epoch, item.name, ""]


def read_direct(path: Any) -> tuple[str, str]:
    return path.name, hashlib.md5((path / "f").read_bytes()).hexdigest()


def node(cfg: dict[str, Any]) -> None:
    ds = CachePipeDataset(cfg["url"], node=cfg["socket"], transform=read_node, job="train", **cfg["options"])
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    if cfg.get("resume"):
        with open(cfg["resume"], "rb") as f:
            loader.load_state_dict(pickle.load(f))  # noqa: S301 - the test's own checkpoint
    for n, sample in enumerate(loader, 1):
        print(json.dumps(sample), flush=True)
        if n == cfg.get("checkpoint_at"):
            with open(cfg["checkpoint"], "wb") as f:
                pickle.dump(loader.state_dict(), f)
            print("checkpoint", flush=True)
        if n == cfg.get("die_at"):
            os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch, holding items; its workers die with it


def node_dist(cfg: dict[str, Any]) -> None:
    dist.init_process_group("gloo")
    ds = CachePipeDataset(
        cfg["url"], node=cfg["socket"], transform=read_node_dist, job="train", node_ranks=[dist.get_rank()], **cfg["options"]
    )
    for sample in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
        print(json.dumps(sample), flush=True)
    dist.destroy_process_group()


def direct(cfg: dict[str, Any]) -> None:
    if cfg.get("dist") == "explicit":  # as mp.spawn: the rank given to init_process_group, no RANK/WORLD_SIZE
        rank, world = int(os.environ.pop("RANK")), int(os.environ.pop("WORLD_SIZE"))
    made = None
    if cfg.get("made_before"):  # the dataset made before init_process_group: its pass's error printed
        made = CachePipeDataset(cfg["url"], cfg["cache"], "1MiB", transform=read_direct, storage_options=cfg["options"])
    if cfg.get("dist") == "explicit":
        dist.init_process_group("gloo", rank=rank, world_size=world)
    elif cfg.get("dist"):
        dist.init_process_group("gloo")
    if made is not None:
        try:
            loader = torch.utils.data.DataLoader(made, batch_size=None, num_workers=2, multiprocessing_context=cfg.get("context"))
            read = list(loader)
        except Exception as exc:  # noqa: BLE001 - printed for the test to read
            print(json.dumps(str(exc).strip().splitlines()[-1]), flush=True)
        else:
            print(json.dumps([list(x) for x in read]), flush=True)
        dist.destroy_process_group()
        return
    ds = CachePipeDataset(
        cfg["url"],
        cfg["cache"],
        "1MiB",
        transform=read_direct,
        storage_options=cfg["options"],
        epochs=2,
        shuffle=True,
        seed=5,
        **cfg.get("extra", {}),
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=cfg.get("context"))
    print(json.dumps([list(x) for x in loader]), flush=True)
    if cfg.get("dist"):
        dist.destroy_process_group()


def read_equal(path: Any) -> list:
    info = torch.utils.data.get_worker_info()
    return [info.id, path.name]


def keep(batch: list) -> list:
    return batch


def equal(cfg: dict[str, Any]) -> None:
    """``"equal"``: a StatefulDataLoader (2 workers, ``batch_size``, batches kept as lists) over
    ``CachePipeDataset(url, cache, "1MiB", **extra)``; prints the JSON list of its batches of
    ``[worker, name]``."""
    ds = CachePipeDataset(cfg["url"], cfg["cache"], "1MiB", transform=read_equal, storage_options=cfg["options"], **cfg["extra"])
    loader = StatefulDataLoader(ds, batch_size=cfg["batch_size"], num_workers=2, collate_fn=keep)
    print(json.dumps(list(loader)), flush=True)


def read_held(hold: str, path: Any) -> str:
    """orphans()'s transform: while the file ``hold`` exists, a worker's samples after its first wait."""
    marker = f"{hold}-{os.getpid()}"
    if os.path.exists(marker + "-first"):  # a later sample: waits while the hold file is there
        Path(marker).touch()
        deadline = time.monotonic() + 120
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
    Path(marker + "-first").touch()
    return str(path.name)


def orphans(cfg: dict[str, Any]) -> None:
    ds = CachePipeDataset(cfg["src"], cfg["cache"], "1MiB", transform=functools.partial(read_held, cfg["hold"]))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    if cfg.get("all"):
        print(json.dumps(list(loader)), flush=True)
        return
    it = iter(loader)
    next(it)
    print(json.dumps([w.pid for w in it._workers]), flush=True)  # type: ignore[attr-defined]
    threading.Event().wait()  # until killed


def main(cfg: dict[str, Any]) -> int:
    os.environ.update(cfg["env"])
    kinds = {"node": node, "node-dist": node_dist, "direct": direct, "equal": equal, "orphans": orphans}
    kinds[cfg["kind"]](cfg)
    return 0
