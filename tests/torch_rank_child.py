"""A "rank" of tests/test_node_torch.py: a ``StatefulDataLoader`` of two worker processes over
``CachePipeDataset(node=SOCKET)``, printing each sample as a JSON line.

Run by tests/zygote.py, which imports torch, torchdata and cachepipe's adapter once (about 3 s
a process on the CI machine) and forks a rank per :func:`main`; the rank's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, as torchrun sets them) come in ``cfg["env"]``.
``cfg``: ``url``, ``socket``, ``options`` (the dataset's), and optionally ``resume`` (a checkpoint
to load), ``checkpoint_at`` with ``checkpoint`` (save the loader's state after that sample),
``die_at`` (SIGKILL itself after that sample: mid-epoch, holding items; its workers die with it).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from cachepipe.torch import CachePipeDataset


def read(item: Any) -> list:
    info = torch.utils.data.get_worker_info()
    digest = hashlib.md5((item / "f").read_bytes()).hexdigest()
    return [info.id, item.cursor.epoch, item.name, digest]


def main(cfg: dict[str, Any]) -> int:
    os.environ.update(cfg["env"])
    ds = CachePipeDataset(cfg["url"], node=cfg["socket"], transform=read, job="train", **cfg["options"])
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
    return 0
