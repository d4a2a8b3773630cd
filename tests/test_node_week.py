"""Node mode under what a multi-GPU job does in a week: resumes under other settings, ranks
killed and restarted, the daemon restarted under them (a daemon with a jobs section, the moto
server; the DataLoaders in this process or ranks forked as tests/test_node_torch.py does)."""

from __future__ import annotations

import pytest
from test_node_torch import KIB, write_config

pytest.importorskip("torch", reason="PyTorch is not installed")

from cachepipe.client import Client
from cachepipe.service.testing import DaemonProcess

ELASTIC = ({"world_size": 2, "node_ranks": [0]}, {"world_size": 1})  # saved by rank 0 of 2, resumed as rank 0 of 1


@pytest.mark.parametrize(("saved", "resumed"), [ELASTIC, ({"seed": 3}, {"seed": 4})])
def test_a_state_resumed_under_another_plan_of_a_job_of_the_same_name_is_refused(s3_source, tmp_path, short_dir, saved, resumed):
    """Before, a state saved by rank 0 of 2 and loaded into rank 0 of 1 (an elastic restart on
    fewer GPUs) of a job named with ``job=``, once the daemon had forgotten the job (restarted, or
    ``delete-job``), resumed its position in the new plan: items read before the checkpoint were
    read again and others never (12 items: 13 yielded, 2 twice, 1 never). The state names the
    job's plan layout now, and a resume under another is refused, naming the field."""
    from cachepipe.torch import CachePipeDataset

    s3_source.folders(12, {"f": 2 * KIB})
    sock = short_dir / "api.sock"
    base = {"node": str(sock), "job": "train", "rank": 0, "transform": lambda item: item.name, "shuffle": True}
    with DaemonProcess(write_config(tmp_path, sock, s3_source.url, s3_source.options)):
        first = CachePipeDataset(s3_source.url, **{"world_size": 1, "seed": 3, **saved}, **base)
        it = iter(first)
        head = [next(it) for _ in range(3)]
        state = first.state_dict()
        it.close()
        with Client(socket=sock) as client:
            client.delete_job("train")  # as a daemon restart forgets it
        again = CachePipeDataset(s3_source.url, **{"world_size": 1, "seed": 3, **resumed}, **base)
        again.load_state_dict(state)
        key = next(iter(resumed))
        refused = f"saved with {key}={saved.get(key, 3)!r}, job 'train' plans with {key}={resumed[key]!r}"
        with pytest.raises(ValueError, match=refused):
            list(again)
        same = CachePipeDataset(s3_source.url, **{"world_size": 1, "seed": 3, **saved}, **base)  # as saved: resumes
        with Client(socket=sock) as client:
            client.delete_job("train")
        # as saved, by a later version whose plan names a field this one does not know: resumes
        # (before: StopIteration looking for the field that differs, a RuntimeError out of the pass)
        same.load_state_dict({**state, "plan": {**state["plan"], "a_later_field": 1}})
        rest = list(same)
    world = {**saved}.get("world_size", 1)
    assert len(head + rest) == len(set(head + rest)) == 12 // world  # the share, each item once
