"""shmstore's figures in ``prometheus_client``'s registry.

``register(store)`` adds a collector to a registry (the default ``REGISTRY`` unless one
is given). Every scrape reads ``store.stats()`` afresh: per-client counters added up when
read, so collecting costs O(clients) and nothing on the hot path is shared between
processes. vLLM serves its ``/metrics`` from the default registry, so the figures of the
store its shmstore plugin opened appear there (the plugin registers it).

The names, types and labels are those of ``shmstore metrics NAME`` (the command-line
exporter), listed in docs/metrics.md::

    import shmstore, shmstore.prometheus
    from prometheus_client import generate_latest

    store = shmstore.Store.create("mm-cache", 1 << 30)
    shmstore.prometheus.register(store)
    print(generate_latest().decode())   # shmstore_capacity_bytes{store="mm-cache"} 1.073741824e+09 ...

Needs ``prometheus_client`` (``pip install shmstore[prometheus]``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "shmstore.prometheus needs prometheus_client: pip install 'shmstore[prometheus]'"
    ) from e

from ._native import Store

__all__ = ["StoreCollector", "register"]


class StoreCollector(Collector):
    """Collects one store's figures at every scrape, labelled ``store=<name>``.

    Holds the store weakly: a registry never keeps a store attached (nor its file alive,
    for stores created with ``remove_when_unused``); once the store is gone, the collector
    reports nothing.
    """

    def __init__(self, store: Store, name: str | None = None) -> None:
        self._store = weakref.ref(store)
        if name is None:
            name = os.path.basename(store.path) if store.path else "anonymous"
        self.name = name

    @property
    def store(self) -> Store | None:
        """The store, or None once it was dropped."""
        return self._store()

    def collect(self) -> Iterator[Metric]:
        store = self._store()
        if store is None:
            return
        st = store.stats()
        label = [self.name]

        def gauge(name: str, doc: str, value: float, unit: str = "") -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["store"], unit=unit)
            g.add_metric(label, value)
            return g

        def counter(name: str, doc: str, value: float, unit: str = "") -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["store"], unit=unit)
            c.add_metric(label, value)
            return c

        yield gauge("shmstore_capacity_bytes", "Bytes the store can hold.", st["capacity"], "bytes")
        yield gauge(
            "shmstore_used_bytes",
            "Bytes allocated to objects, including ones being created.",
            st["used"],
            "bytes",
        )
        yield gauge("shmstore_free_bytes", "Bytes free.", st["free"], "bytes")
        yield gauge(
            "shmstore_largest_free_block_bytes",
            "The largest object that fits without eviction.",
            store.largest_free(),
            "bytes",
        )
        yield gauge(
            "shmstore_huge_page_bytes",
            "Heap bytes the store's creator rebuilt as 2 MiB pages.",
            st["huge_page_bytes"],
            "bytes",
        )
        yield gauge("shmstore_objects", "Sealed objects.", st["objects"])
        yield gauge("shmstore_objects_creating", "Objects created and not yet sealed.", st["creating"])
        yield gauge("shmstore_pins", "Views held on objects, over all processes.", st["pins"])
        yield counter("shmstore_creates", "Objects created.", st["creates"])
        yield counter("shmstore_written_bytes", "Bytes of objects created.", st["bytes_created"], "bytes")
        gets = CounterMetricFamily(
            "shmstore_gets",
            "Gets: hit (sealed at once), wait (blocked until sealed), miss.",
            labels=["store", "result"],
        )
        for result, key in (("hit", "gets_hit"), ("wait", "gets_waited"), ("miss", "gets_missed")):
            gets.add_metric([self.name, result], st[key])
        yield gets
        yield counter("shmstore_deletes", "Objects deleted.", st["deletes"])
        yield counter("shmstore_evictions", "Objects evicted to make room.", st["evictions"])
        yield counter("shmstore_evicted_bytes", "Bytes of objects evicted to make room.",
                      st["bytes_evicted"], "bytes")
        yield counter(
            "shmstore_full_events",
            "Allocations refused because the store was full.",
            st["full_events"],
        )
        yield counter(
            "shmstore_recovered_clients",
            "Dead processes whose pins, creations and allocations were reclaimed.",
            st["recovered_clients"],
        )
        yield counter(
            "shmstore_reclaimed_bytes",
            "Bytes reclaimed from dead processes.",
            st["reclaimed_bytes"],
            "bytes",
        )
        clients = GaugeMetricFamily(
            "shmstore_clients",
            "Attached processes, alive and dead (not yet recovered).",
            labels=["store", "state"],
        )
        clients.add_metric([self.name, "alive"], st["clients"])
        clients.add_metric([self.name, "dead"], st["dead_clients"])
        yield clients


def register(
    store: Store, registry: CollectorRegistry | None = None, *, name: str | None = None
) -> StoreCollector:
    """Adds ``store``'s collector to ``registry`` (default: prometheus_client's ``REGISTRY``).

    ``name`` labels the series (default: the store's file name). Returns the collector;
    ``registry.unregister(collector)`` removes it.
    """
    collector = StoreCollector(store, name)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
