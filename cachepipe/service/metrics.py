"""Prometheus metrics of the daemon, in a registry of its own (not prometheus_client's global one).

Pipeline figures are read from :meth:`cachepipe.Pipeline.stats` at scrape time, so nothing is
counted twice; the daemon adds what only it sees (API requests, marker acks, reloads).
A pipeline rebuilt by a reload starts its counters again from zero, which Prometheus treats as
a counter reset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..pipeline import Stats

__all__ = ["CONTENT_TYPE", "Metrics", "Snapshot"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Stats field -> (metric name, kind, help). Counters are exported with the "_total" suffix.
_STATS: dict[str, tuple[str, str, str]] = {
    "items_listed": ("cachepipe_items_listed", "gauge", "Items in the listing of the pipeline's source."),
    "items_ready": ("cachepipe_items_ready", "gauge", "Items downloaded and waiting for a consumer."),
    "items_handed": ("cachepipe_items_handed", "counter", "Items handed to consumers, counting re-deliveries."),
    "items_acked": ("cachepipe_items_acked", "counter", "Items acknowledged (and evicted)."),
    "items_released": ("cachepipe_items_released", "counter", "Items given back by consumers."),
    "items_failed": ("cachepipe_items_failed", "counter", "Items that could not be downloaded."),
    "items_skipped": ("cachepipe_items_skipped", "counter", "Items skipped (oversize or failed with on_error=skip)."),
    "items_reused": ("cachepipe_items_reused", "counter", "Items found in the cache at start and reused."),
    "items_redelivered": ("cachepipe_items_redelivered", "counter", "Leases that expired; their items were handed out again."),
    "bytes_listed": ("cachepipe_bytes_listed", "gauge", "Bytes in the listing of the pipeline's source."),
    "bytes_downloaded": ("cachepipe_bytes_downloaded", "counter", "Bytes downloaded from the store."),
    "bytes_in_cache": ("cachepipe_cache_bytes", "gauge", "Bytes accounted under the cache directory."),
    "capacity": ("cachepipe_cache_capacity_bytes", "gauge", "Hard cap on bytes under the cache directory."),
    "requests": ("cachepipe_store_requests", "counter", "Requests sent to the store."),
    "retries": ("cachepipe_store_retries", "counter", "Store requests retried after a transient error."),
    "hedges": ("cachepipe_store_hedges", "counter", "Parts requested a second time because their first request ran late."),
    "disk_errors": ("cachepipe_disk_errors", "counter", "Local disk errors (a full disk, EIO) writing items; each is retried."),
    "disk_pauses": ("cachepipe_disk_pauses", "counter", "Pauses of the downloads while the disk is short of min_free."),
    "consumer_wait_seconds": ("cachepipe_consumer_wait_seconds", "counter", "Seconds consumers waited for an item."),
    "producer_wait_seconds": ("cachepipe_producer_wait_seconds", "counter", "Seconds the producer waited for space."),
    "download_threads": ("cachepipe_download_threads", "gauge", "Download threads the producer runs at most now."),
}


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One pipeline as the daemon sees it at scrape time."""

    name: str
    up: bool
    stats: Stats | None  # None: the pipeline never opened
    waiting: int = 0  # requests blocked in next


def leased(stats: Stats) -> int:
    """Items handed out and not yet acknowledged, released or expired."""
    return max(stats.items_handed - stats.items_acked - stats.items_released - stats.items_redelivered, 0)


class _PipelineCollector(Collector):
    def __init__(self, snapshots: Callable[[], Iterable[Snapshot]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        snaps = list(self._snapshots())
        up = GaugeMetricFamily("cachepipe_pipeline_up", "1 when the pipeline is open and serving.", labels=["pipeline"])
        lease = GaugeMetricFamily("cachepipe_items_leased", "Items handed out and not yet acknowledged.", labels=["pipeline"])
        waiting = GaugeMetricFamily(
            "cachepipe_consumers_waiting",
            "Consumers blocked in next right now (above 0 for long: they starve).",
            labels=["pipeline"],
        )
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for field, (name, kind, doc) in _STATS.items():
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            families[field] = cls(name, doc, labels=["pipeline"])
        for snap in snaps:
            up.add_metric([snap.name], 1.0 if snap.up else 0.0)
            waiting.add_metric([snap.name], snap.waiting)
            if snap.stats is None:
                continue
            lease.add_metric([snap.name], leased(snap.stats))
            for field, value in dataclasses.asdict(snap.stats).items():
                if field in families:
                    families[field].add_metric([snap.name], float(value))
        yield up
        yield lease
        yield waiting
        yield from families.values()


class Metrics:
    """The daemon's registry: pipeline figures plus the daemon's own counters.

    Args:
        snapshots: called at each scrape; returns a :class:`Snapshot` per pipeline.
    """

    def __init__(self, snapshots: Callable[[], Iterable[Snapshot]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "cachepipe_api_requests",
            "API requests answered, by route and HTTP status.",
            ["route", "code"],
            registry=self.registry,
        )
        self.marker_acks = Counter(
            "cachepipe_marker_acks",
            "Items acknowledged by a .done marker or by deleting them.",
            ["pipeline", "kind"],
            registry=self.registry,
        )
        self.markers_refused = Counter(
            "cachepipe_markers_refused",
            "Item .done markers that held another lease than the item's (from before a restart or a reload, or expired); "
            "they acknowledged nothing.",
            ["pipeline"],
            registry=self.registry,
        )
        self.reloads = Counter(
            "cachepipe_reloads", "Configuration reloads (SIGHUP), by result.", ["result"], registry=self.registry
        )
        self.registry.register(_PipelineCollector(snapshots))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
