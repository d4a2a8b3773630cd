"""The daemon's batched hand-out and acknowledgement (``next`` with ``count``/``acks``, ``ack``
with ``items``), through :class:`cachepipe.client.Client`, against the daemon as a subprocess."""

from __future__ import annotations

import json

import pytest
from test_service import FILES, post, stats, wait_until, write_config

from cachepipe import UnknownItemError
from cachepipe.client import Client, ServiceError
from cachepipe.service.testing import DaemonProcess


def test_batches_of_items_and_acks_in_one_request_each(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(20, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config), Client("train", sock) as client:
        wait_until(lambda: stats(client)["items_ready"] == 20, what="every item ready")
        first = client.get_many(8, timeout=30)
        assert [i.name for i in first] == [f"item{n:03d}" for n in range(8)]
        assert all((i.path / "a.bin").stat().st_size == 1024 for i in first)
        second = client.get_many(8, timeout=30, ack=first)  # the first batch acknowledged by the same request
        assert [i.name for i in second] == [f"item{n:03d}" for n in range(8, 16)]
        assert not any(i.path.exists() for i in first) and stats(client)["items_acked"] == 8
        rest = client.get_many(100, timeout=30)  # no more than there is, without waiting for more
        assert [i.name for i in rest] == [f"item{n:03d}" for n in range(16, 20)]
        client.ack_many([*second, *rest])
        assert client.get_many(4, timeout=30) == []  # the end
        assert stats(client)["items_acked"] == 20


def test_a_batch_of_acks_is_all_or_nothing_and_of_one_pipeline(s3_source, s3_endpoint, tmp_path, short_dir):
    s3_source.folders(4, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}, "val": {}})
    with DaemonProcess(config), Client("train", sock) as train, Client("val", sock) as val:
        wait_until(lambda: stats(train)["items_ready"] == 4, what="every item ready")
        a, b = train.get_many(2, timeout=30)
        with pytest.raises(UnknownItemError):
            train.ack_many([a, b, str(tmp_path / "cache-train" / "nope")])
        other = val.get(timeout=30)
        with pytest.raises(ServiceError, match="one pipeline, not of train, val"):
            train.ack_many([a, other])
        with pytest.raises(ServiceError, match="sent with next of pipeline 'train' are items of pipeline 'val'"):
            train.get_many(1, timeout=30, ack=[other])
        assert a.path.exists() and b.path.exists() and other.path.exists()  # nothing was acknowledged
        assert stats(train)["items_acked"] == 0
        train.ack_many([a, b])
        val.ack(other)
        assert stats(train)["items_acked"] == 2
        with pytest.raises(ValueError, match="count 0: expected an integer from 1 to 1024"):
            train.get_many(0)
        with pytest.raises(ValueError, match="1025 items to acknowledge at once: at most 1024"):
            train.ack_many([a] * 1025)


def test_a_next_with_more_acks_than_a_batch_is_refused_naming_the_count_and_the_limit(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    # `acks` of a batched next had no cap, unlike `count` and an ack's `items` (1024 each).
    s3_source.folders(2, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config), Client("train", sock) as client:
        wait_until(lambda: stats(client)["items_ready"] == 2, what="every item ready")
        item = client.get_many(1, timeout=30)[0]
        acks = [{"path": str(item.path), "lease": item.lease}] * 1025
        body = json.dumps({"count": 1, "timeout": 0, "acks": acks}).encode()
        status, reply = post(sock, "/v1/pipelines/train/next", body)
        assert status == 400 and reply["message"] == "'acks' of 1025 items: expected at most 1024 per request", reply
        assert item.path.exists() and stats(client)["items_acked"] == 0  # nothing acknowledged, nothing taken
        assert [i.name for i in client.get_many(2, timeout=30, ack=[item])] == ["item001"]


def test_an_ack_of_more_items_than_a_batch_is_refused_naming_the_count_not_echoing_the_list(
    s3_source, s3_endpoint, tmp_path, short_dir
):
    # the message repeated the whole list, up to the 1 MiB body limit (found in review)
    s3_source.folders(1, FILES)
    sock = short_dir / "api.sock"
    config = write_config(tmp_path, sock, s3_endpoint, {"train": {}})
    with DaemonProcess(config), Client("train", sock) as client:
        item = client.get_many(1, timeout=30)[0]
        body = json.dumps({"items": [{"path": str(item.path), "lease": item.lease}] * 1025}).encode()
        status, reply = post(sock, "/v1/ack", body)
        assert status == 400 and reply["message"] == (
            '\'items\' of 1025 items: expected a list of 1 to 1024 objects {"path", "lease"}'
        ), reply
        assert item.path.exists()  # nothing acknowledged
