"""Tests of shmstore.ray on a real Ray cluster on one machine (run by scripts/ray.sh test).

``ray.cluster_utils.Cluster`` starts 3 raylets, standing in for 3 nodes: ``node0`` (the
head, where items are put: the source), ``node1`` and ``node2``. Each has a custom
resource of its name, which places ranks on it, and its own store name (the node id is
in it) in place of its own /dev/shm.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.join(here, "..", "tests_vllm")]
# Ray's workers are started by the raylets, which inherit this environment: they import
# the test actors (ranks.py) and the vLLM harness from here.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [here, os.path.join(here, "..", "tests_vllm"), os.environ.get("PYTHONPATH", "")]
)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from shmstore.ray import NodeStores  # noqa: E402

NODES = ("node0", "node1", "node2")


@pytest.fixture(scope="session")
def cluster() -> Iterator[dict[str, str]]:
    """The 3-node cluster; yields node name -> Ray node id."""
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node0": 100}},
    )
    for n in NODES[1:]:
        c.add_node(num_cpus=2, resources={n: 100})
    ray.init(address=c.address, namespace="shmstore-tests", log_to_driver=True)
    c.wait_for_nodes()
    ids = {}
    for n in ray.nodes():
        for name in NODES:
            if n["Alive"] and name in n["Resources"]:
                ids[name] = n["NodeID"]
    assert sorted(ids) == list(NODES), ids
    yield ids
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def nodes(cluster) -> Iterator[NodeStores]:
    """Fresh stores and bridges for one test (their counters start at zero)."""
    ns = NodeStores(f"shmstore-ray-test-{uuid.uuid4().hex[:8]}", 64 << 20, timeout=30.0)
    assert ns.source() == cluster["node0"]
    yield ns
    ns.shutdown()
    # Ray kills actors with SIGKILL: their stores are left for the next attach to
    # recover; nothing attaches them again, so remove them here.
    for f in os.listdir("/dev/shm"):
        if f.startswith(ns.name):
            os.unlink(f"/dev/shm/{f}")
