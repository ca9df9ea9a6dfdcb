"""shmstore.prometheus and `shmstore metrics`, read back by prometheus_client's parsers."""

import os
import subprocess

import pytest

import shmstore

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.openmetrics import exposition as om_exposition  # noqa: E402
from prometheus_client.openmetrics.parser import (  # noqa: E402
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import shmstore.prometheus  # noqa: E402
from conftest import shmstore_command  # noqa: E402

def _samples(families):
    """{(sample name, frozenset(labels)): value} and {family name: type}."""
    values, types = {}, {}
    for f in families:
        types[f.name] = f.type
        for s in f.samples:
            values[(s.name, frozenset(s.labels.items()))] = s.value
    return values, types


def _activity(store):
    # The creator's rebuild of 2 MiB pages, finished now: its count must not move between
    # the scrapes these tests compare.
    store.prefault()
    a = shmstore.key_id("a")
    store.put(a, b"x" * 3000)
    view = store.get(a, 1.0)
    assert store.try_get("missing") is None
    return view


def test_the_collector_reports_the_store_through_the_text_parser(store_name, store):
    view = _activity(store)
    registry = CollectorRegistry()
    collector = shmstore.prometheus.register(store, registry)
    assert collector.name == store_name
    values, types = _samples(text_string_to_metric_families(generate_latest(registry).decode()))
    label = ("store", store_name)
    one = lambda n: values[(n, frozenset([label]))]  # noqa: E731
    assert one("shmstore_capacity_bytes") == store.stats()["capacity"]
    assert one("shmstore_objects") == 1
    assert one("shmstore_pins") == 1
    assert one("shmstore_creates_total") == 1
    assert one("shmstore_written_bytes_total") == 3000
    assert one("shmstore_largest_free_block_bytes") == store.largest_free()
    assert one("shmstore_huge_page_bytes") == store.stats()["huge_page_bytes"]
    gets = lambda r: values[("shmstore_gets_total", frozenset([label, ("result", r)]))]  # noqa: E731
    assert (gets("hit"), gets("miss"), gets("wait")) == (1, 1, 0)
    assert values[("shmstore_clients", frozenset([label, ("state", "alive")]))] == 1
    assert types["shmstore_gets"] == "counter"
    assert types["shmstore_used_bytes"] == "gauge"
    # Every scrape reads afresh.
    del view
    store.delete("a")
    values, _ = _samples(text_string_to_metric_families(generate_latest(registry).decode()))
    assert one("shmstore_objects") == 0
    assert one("shmstore_deletes_total") == 1
    registry.unregister(collector)
    assert b"shmstore_" not in generate_latest(registry)


def test_the_collector_is_valid_openmetrics(store):
    _activity(store)
    registry = CollectorRegistry()
    shmstore.prometheus.register(store, registry, name="cache")
    text = om_exposition.generate_latest(registry).decode()
    _, types = _samples(parse_openmetrics(text))  # strict: units, _total, # EOF
    assert types["shmstore_written_bytes"] == "counter"


def test_the_command_line_exporter_parses_and_matches_the_collector(store_name, store):
    _activity(store)
    out = subprocess.run(
        [shmstore_command(), "metrics", store_name], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    cli_values, cli_types = _samples(parse_openmetrics(out))
    registry = CollectorRegistry()
    shmstore.prometheus.register(store, registry)
    py_values, py_types = _samples(parse_openmetrics(om_exposition.generate_latest(registry).decode()))
    # The same families, types and series, so one dashboard reads either exporter.
    assert cli_types == py_types
    assert cli_values.keys() == py_values.keys()
    # The exporter attaches too, and does not count itself among the clients.
    assert cli_values == py_values


def test_a_registry_does_not_keep_a_store_alive(store_name):
    import gc

    store = shmstore.Store.create(store_name, 1 << 20, remove_when_unused=True)
    registry = CollectorRegistry()
    collector = shmstore.prometheus.register(store, registry)
    assert b"shmstore_objects" in generate_latest(registry)
    del store
    gc.collect()
    assert collector.store is None
    assert not os.path.exists(f"/dev/shm/{store_name}"), "the last client left"
    assert b"shmstore_" not in generate_latest(registry)
