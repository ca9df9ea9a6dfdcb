"""shmstore across machines: one store per node, and each item crosses to a node once,
through Ray's object store (``pip install shmstore[ray]``; design in docs/multinode.md).

A process can only map the store of its own machine. With Ray, every node runs one store
and one *bridge*: a Ray actor named after the node (``shmstore-bridge:<store>:<node id>``,
namespace ``shmstore``). Items are put on their *source* node (by default Ray's head
node, where ``vllm serve`` runs). A process on another node asks for an item by key::

    import ray, shmstore.ray

    nodes = shmstore.ray.NodeStores("mm-cache", 4 << 30)   # picklable: pass it to actors

    # on the source node (the driver): put once
    shmstore.put_item(nodes.store(), mm_hash, {"pixel_values": pixels})

    # in any Ray worker, on any node: zero-copy arrays from this node's store
    item = nodes.get_item(mm_hash, timeout=30)

On a miss, the rank's node bridge fetches the item once from the source node's bridge:
the source bridge puts the item's bytes into Ray's object store, Ray moves them between
nodes, and the local bridge copies them into its node's store (create, then seal). The
local object exists, unsealed, before the bytes arrive: every other rank of the node that
asks meanwhile blocks on its seal (the store's futex) and does not fetch again. So an item
crosses to each node once, however many ranks the node runs, and each rank maps it
zero-copy.

Prefetch: ``nodes.prefetch(keys)`` starts that fetch on every node where the store is in
use (its bridge runs) before any rank asks; vLLM's engine core does it for each request's
new items as the request arrives, so that the workers' first reads, a step later, are
hits::

    shmstore.put_item(nodes.store(), mm_hash, {"pixel_values": pixels})
    nodes.prefetch([mm_hash])       # returns at once; ranks ask for mm_hash later

Failures:

* the source no longer holds the item: the get raises ``ItemsMissing`` naming every
  missing key (a ``NotFound``), and the caller resends (vLLM's miss path does);
* a bridge dies mid-fetch: Ray restarts it; ranks waiting on the unsealed object get
  ``CreatorDied`` (the store notices its creator died), the object is reclaimed as any
  dead process's is, and a retry fetches again through the restarted bridge.

Store names: the source node's store is ``name``; another node's is
``name-node-<node id prefix>``, so that several Ray "nodes" on one machine (tests,
``ray.cluster_utils.Cluster``) do not share one store by accident.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import _native
from .items import get_item as _get_item

logger = logging.getLogger("shmstore.ray")

#: The Ray namespace the bridges are named in.
NAMESPACE = "shmstore"
#: Items up to this size travel in the source bridge's reply (Ray inlines replies up to
#: 100 KiB); larger ones as an object in Ray's object store, pulled by the fetching node.
INLINE_BYTES = 96 << 10
#: How long ``NodeStores.prefetch`` trusts its list of running bridges, in seconds.
BRIDGE_LIST_TTL = 5.0
_HEAD_RESOURCE = "node:__internal_head__"


class ItemsMissing(_native.NotFound):
    """Items the source node no longer holds (evicted or deleted) when a node fetched
    them. ``keys`` lists every one of them, so that the caller can resend them all."""

    def __init__(self, keys: Sequence[str | bytes], source: str) -> None:
        self.keys = list(keys)
        self.source = source
        shown = ", ".join(str(k) for k in self.keys[:4]) + (" ..." if len(self.keys) > 4 else "")
        super().__init__(
            f"{len(self.keys)} item(s) not in the store of their source node "
            f"{source[:12]} (evicted or deleted there): {shown}; put them again"
        )


class FetchFailed(_native.ShmstoreError):
    """A node could not take a fetched item into its store (full of pinned items, or too
    small); ``keys`` lists them."""

    def __init__(self, keys: Sequence[str | bytes], node: str, why: str) -> None:
        self.keys = list(keys)
        super().__init__(f"node {node[:12]} could not store {len(self.keys)} fetched item(s): {why}")


@dataclasses.dataclass(frozen=True)
class NodeStores:
    """One store per Ray node and the bridges between them. A small picklable value:
    build it once and pass it to every actor and task that reads or writes items.

    ``name`` is the source node's store; ``capacity`` the size of each node's store
    (created by the first process of the node that needs it, evicting the least
    recently used items when full, removed when its last process leaves).
    ``source_node`` is the Ray node id items are put on (None: Ray's head node).
    ``timeout`` bounds every wait for an item's seal, in seconds.

    >>> nodes = NodeStores("mm-cache", 1 << 30)          # doctest: +SKIP
    >>> nodes.get("some-key", timeout=10).nbytes         # doctest: +SKIP
    """

    name: str
    capacity: int
    source_node: str | None = None
    timeout: float = 60.0
    max_objects: int = 0
    #: Bridges outlive the process that started them (until ``shutdown``); otherwise
    #: each bridge lives as long as its first caller (Ray's owner rule).
    detached: bool = False
    #: Attach this node's store read-only in this process (readers such as vLLM's
    #: workers: a write to a tensor over it faults instead of changing the node's copy).
    #: The node's bridge, which writes fetched items, always attaches read-write.
    read_only: bool = False
    #: Fetches also find an item deleted at the source while a process there still pins
    #: it (``Store.get_draining``). vLLM's engine core pins the items of every request it
    #: admits, so an item deleted by hand meanwhile still reaches workers on other nodes.
    #: Off by default: a deleted key is then gone for other nodes at once.
    fetch_draining: bool = False

    # -- where things are ------------------------------------------------------------

    def this_node(self) -> str:
        """The Ray node id of this process."""
        return str(ray.get_runtime_context().get_node_id())

    def source(self) -> str:
        """The node items are put on: ``source_node``, or Ray's head node."""
        if self.source_node:
            return self.source_node
        return _head_node()

    def store_name(self, node: str | None = None) -> str:
        """The store's name on ``node`` (default: this process's node)."""
        node = node or self.this_node()
        if node == self.source():
            return self.name
        return f"{self.name}-node-{node[:12]}"

    # -- this node's store --------------------------------------------------------------

    def store(self) -> _native.Store:
        """This node's store, attached once per process (created if this process is
        the node's first)."""
        key = (self.name, os.getpid(), self.read_only)
        s = _attached.get(key)
        if s is None:
            name = self.store_name()
            if self.read_only:
                if self.this_node() != self.source():
                    ray.get(self.bridge().ready.remote())  # the bridge creates the store
                s = _native.Store.open(name, read_only=True, populate_in_background=True)
            else:
                s = _open_or_create(name, self.capacity, self.max_objects)
            _attached[key] = s
        return s

    def bridge(self, node: str | None = None) -> Any:
        """The bridge actor of ``node`` (default: this one), started if it is not running."""
        node = node or self.this_node()
        # Ray collects an actor that is not detached once the handles its creator made
        # are gone (one found by name does not count): each process keeps the handles
        # it made, and starts each bridge once, under a lock (bridges call this from
        # many threads).
        key = (self.name, node, os.getpid())
        with _handles_lock:
            handle = _handles.get(key)
            if handle is None:
                handle = _handles[key] = self._start_bridge(node)
        return handle

    def _call(self, node: str, method: str, *args: Any) -> Any:
        """Calls ``method`` of ``node``'s bridge and waits for the answer. A bridge dies
        for good with the process that started it (Ray's owner rule; a vLLM worker that
        exits, a bridge killed while it owned another node's bridge): then the handle is
        dropped, the bridge started again, and the call made once more."""
        for attempt in range(2):
            try:
                return ray.get(getattr(self.bridge(node), method).remote(*args))
            except ray.exceptions.ActorDiedError:
                if attempt:
                    raise
                with _handles_lock:
                    _handles.pop((self.name, node, os.getpid()), None)
        raise AssertionError("unreachable")

    def _start_bridge(self, node: str) -> Any:
        return Bridge.options(
            name=f"shmstore-bridge:{self.name}:{node}",
            namespace=NAMESPACE,
            get_if_exists=True,
            lifetime="detached" if self.detached else None,
            max_restarts=-1,
            # A call that meets a bridge restarting waits for the new one (fetch and
            # serve can run twice: a second fetch finds the object already there).
            max_task_retries=3,
            max_concurrency=64,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(self, node)

    def start_bridges(self) -> dict[str, Any]:
        """Starts a bridge on every alive node now, owned by this process (it is then
        the one whose exit stops them, unless ``detached``). Returns node id -> bridge."""
        bridges = {n["NodeID"]: self.bridge(n["NodeID"]) for n in ray.nodes() if n["Alive"]}
        ray.get([b.ready.remote() for b in bridges.values()])
        return bridges

    # -- reading --------------------------------------------------------------------

    def ensure_local(self, keys: Iterable[str | bytes], *, source: str | None = None) -> None:
        """Brings ``keys`` into this node's store, fetching the ones it lacks from the
        ``source`` node (default: ``source()``) in one round trip. Returns once each one
        is sealed here or being written here (a ``get`` then waits for its seal; one
        being written already, by a prefetch or another rank's fetch, costs no call).
        Raises ``ItemsMissing`` with every key the source lacks. A no-op on the source
        node."""
        source = source or self.source()
        if self.this_node() == source:
            return
        store = self.store()
        need = [k for k in keys if not _here(store, k)]
        if not need:
            return
        missing, failed, why = self._call(self.this_node(), "fetch", need, source)
        if failed:
            raise FetchFailed(failed, self.this_node(), why)
        if missing:
            raise ItemsMissing(missing, source)

    def get(
        self, key: str | bytes, timeout: float | None = None, *, source: str | None = None
    ) -> memoryview:
        """The item's bytes from this node's store (zero-copy, pinned while the view
        lives), fetched from ``source`` first if this node lacks it."""
        return self._read(key, timeout, source, lambda s, t: s.get(key, t, wait_if_absent=False))

    def get_item(
        self,
        key: str | bytes,
        timeout: float | None = None,
        *,
        as_torch: bool = False,
        source: str | None = None,
    ) -> dict[str, Any]:
        """Like ``shmstore.get_item`` on this node's store, fetching the item first if
        this node lacks it."""
        return self._read(
            key, timeout, source,
            lambda s, t: _get_item(s, key, t, as_torch=as_torch, wait_if_absent=False),
        )

    def read_private(
        self, keys: Sequence[str | bytes], *, source: str | None = None
    ) -> list[memoryview | None]:
        """Each item's bytes straight from ``source``'s bridge (default: ``source()``)
        into this process's memory, past this node's store: one copy, not shared, not
        kept; None where the source lacks the item. For a reader whose node store cannot
        take an item now (full of pinned items: ``FetchFailed``) or lost its copy (the
        node's bridge killed mid-fetch: ``CreatorDied``), and must not fail."""
        served = self._call(source or self.source(), "serve", list(keys), self.fetch_draining)
        refs = [s[2][0] for s in served if s is not None and not isinstance(s[2], bytes)]
        fetched = iter(ray.get(refs)) if refs else iter(())
        out: list[memoryview | None] = []
        for s in served:
            if s is None:
                out.append(None)
            else:
                out.append(memoryview(s[2] if isinstance(s[2], bytes) else next(fetched)))
        return out

    def _read(self, key, timeout, source, read):
        timeout = self.timeout if timeout is None else timeout
        source = source or self.source()
        # Twice at most: the item can be evicted here between the fetch and the read.
        for attempt in range(2):
            self.ensure_local([key], source=source)
            try:
                return read(self.store(), timeout)
            except _native.NotFound:
                if attempt == 1 or self.this_node() == source:
                    raise ItemsMissing([key], source) from None
        raise AssertionError("unreachable")

    # -- prefetching ---------------------------------------------------------------------

    def prefetch(
        self,
        keys: Iterable[str | bytes],
        *,
        to: Iterable[str] | None = None,
        source: str | None = None,
    ) -> list[Any]:
        """Starts bringing ``keys`` into the stores of other nodes now, before their ranks
        ask: each target node's bridge fetches them from ``source`` (default:
        ``source()``) as on a miss, one call per node for all the keys. Returns at once,
        with one Ray ref per call; waiting on them is optional (each resolves once that
        node's objects exist there, as ``ensure_local`` does).

        ``to`` lists the target node ids (their bridges are started if need be);
        default: every node whose bridge of this store is running, that is every node
        where a process has read through this store (a vLLM worker starts its node's
        bridge when it starts), found through Ray's named-actor list at most every
        ``BRIDGE_LIST_TTL`` seconds. The source node is never a target.

        A rank that asks while its node's prefetch is on the way waits for the same
        object's seal (or joins the bridge's fetch in flight): still one fetch per node.
        Errors (a bridge dying, items the source lacks) are not raised here; the ranks'
        own reads report them as usual.

        >>> refs = nodes.prefetch([mm_hash])   # doctest: +SKIP
        """
        source = source or self.source()
        keys = list(dict.fromkeys(keys))
        _reap_prefetches()
        if not keys:
            return []
        if to is None:
            targets = {n: h for n, h in self._running_bridges().items() if n != source}
        else:
            targets = {n: self.bridge(n) for n in dict.fromkeys(to) if n != source}
        refs = [h.prefetch.remote(keys, source) for h in targets.values()]
        with _handles_lock:
            _prefetches.extend((self.name, r) for r in refs)
        return refs

    def _running_bridges(self) -> dict[str, Any]:
        """Node id -> handle of every running bridge of this store, from Ray's list of
        named actors (one call to Ray's control store), kept ``BRIDGE_LIST_TTL`` s."""
        now = time.monotonic()
        key = (self.name, os.getpid())
        with _handles_lock:
            cached = _bridge_lists.get(key)
        if cached is not None and now - cached[0] < BRIDGE_LIST_TTL:
            return cached[1]
        prefix = f"shmstore-bridge:{self.name}:"
        known = cached[1] if cached is not None else {}
        found = {}
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == NAMESPACE and a["name"].startswith(prefix):
                node = a["name"][len(prefix):]
                with _handles_lock:
                    handle = _handles.get((self.name, node, os.getpid())) or known.get(node)
                # A handle looked up once is kept while the bridge stays listed (a
                # restarted bridge keeps its actor id; one that died for good is
                # dropped from the list with its handle by ``_reap_prefetches``).
                found[node] = handle or ray.get_actor(a["name"], namespace=NAMESPACE)
        with _handles_lock:
            _bridge_lists[key] = (now, found)
        return found

    # -- observing and stopping ----------------------------------------------------------

    def bridge_stats(self) -> dict[str, dict[str, int]]:
        """Each running bridge's counters, by node id: ``fetch_calls`` (ranks' asks,
        begun), ``prefetch_calls`` (``prefetch``'s) and ``fetches_done`` (both);
        ``fetched`` items and ``fetched_bytes`` (what crossed to this node); ``served``
        and ``served_bytes`` (what left it); ``missing`` (keys its source lacked);
        ``transfer_errors``; ``unsealed`` (objects it created whose bytes are on the way
        now); ``pid``. A restarted bridge counts from zero."""
        out = {}
        for node in _alive_nodes():
            handle = self._existing_bridge(node)
            if handle is None:
                continue
            try:
                out[node] = ray.get(handle.stats.remote())
            except ray.exceptions.ActorDiedError:
                pass  # dead for good (its name not released yet)
        return out

    def shutdown(self) -> None:
        """Stops every bridge (the node stores go when their last process leaves)."""
        for node in _alive_nodes():
            handle = self._existing_bridge(node)
            if handle is not None:
                ray.kill(handle, no_restart=True)
        for store in [k for k in _attached if k[0] == self.name and k[1] == os.getpid()]:
            del _attached[store]
        for handle_key in [k for k in _handles if k[0] == self.name]:
            del _handles[handle_key]
        _bridge_lists.pop((self.name, os.getpid()), None)

    def _existing_bridge(self, node: str) -> Any:
        try:
            return ray.get_actor(f"shmstore-bridge:{self.name}:{node}", namespace=NAMESPACE)
        except ValueError:
            return None


_attached: dict[tuple[str, int, bool], _native.Store] = {}
_handles: dict[tuple[str, str, int], Any] = {}
_handles_lock = threading.Lock()
#: (store name, pid) -> (when listed, node id -> bridge handle): ``_running_bridges``.
_bridge_lists: dict[tuple[str, int], tuple[float, dict[str, Any]]] = {}
#: Prefetch calls not yet seen to finish: (store name, ref).
_prefetches: list[tuple[str, Any]] = []


def _reap_prefetches() -> None:
    """Collects the answers of finished prefetch calls (so that Ray does not report
    them as unhandled errors), and forgets the bridge list of a store one of whose
    bridges died (the next prefetch lists them again)."""
    with _handles_lock:
        pending = _prefetches[:]
    if not pending:
        return
    done, _ = ray.wait([r for _, r in pending], num_returns=len(pending), timeout=0)
    finished = set(done)
    for name, ref in pending:
        if ref not in finished:
            continue
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError as e:
            logger.debug("shmstore: a prefetch failed: %s", e)
            with _handles_lock:
                _bridge_lists.pop((name, os.getpid()), None)
    with _handles_lock:
        _prefetches[:] = [p for p in _prefetches if p[1] not in finished]


def _here(store: _native.Store, key: str | bytes) -> bool:
    """Is ``key`` sealed in ``store``, or being written there by a live process (a
    prefetch or another rank's fetch; a read then waits for its seal)?"""
    try:
        store.get(key, 0.0, wait_if_absent=False)
    except _native.Timeout:
        return True  # created, not sealed yet
    except (_native.NotFound, _native.CreatorDied):
        return False  # absent, or its writer died: fetch (again)
    return True


def _open_or_create(name: str, capacity: int, max_objects: int) -> _native.Store:
    for _ in range(3):
        try:
            return _native.Store.open(name, populate_in_background=True)
        except _native.StoreNotFound:
            pass
        try:
            return _native.Store.create(
                name, capacity, max_objects=max_objects, evict=True, remove_when_unused=True
            )
        except _native.StoreExists:
            pass
    return _native.Store.open(name, populate_in_background=True)


def _head_node() -> str:
    """Ray's head node (asked once per process: the head lives as long as the cluster)."""
    global _head
    if _head is None:
        for n in ray.nodes():
            if n["Alive"] and _HEAD_RESOURCE in n["Resources"]:
                _head = str(n["NodeID"])
                break
        else:
            raise RuntimeError("no alive Ray head node; pass NodeStores(source_node=...)")
    return _head


_head: str | None = None


def _alive_nodes() -> list[str]:
    return [str(n["NodeID"]) for n in ray.nodes() if n["Alive"]]


class _Inflight:
    """A fetch of one key in progress in a bridge: set once the local object exists (or
    the fetch failed, then ``error`` says how)."""

    def __init__(self) -> None:
        self.created = threading.Event()
        self.error: str | None = None  # "missing" | "failed"


class _Bridge:
    """One node's bridge (a Ray actor; see the module doc). Threads: Ray runs calls
    concurrently (``max_concurrency``); each fetch hands its transfers to a thread of
    its own and returns as soon as the local objects exist."""

    def __init__(self, nodes: NodeStores, node: str) -> None:
        self.nodes = nodes = dataclasses.replace(nodes, read_only=False)  # it writes
        self.node = node
        self.store = nodes.store()
        self.lock = threading.Lock()
        self.inflight: dict[str | bytes, _Inflight] = {}
        self.counts = {
            "fetch_calls": 0, "prefetch_calls": 0, "fetched": 0, "fetched_bytes": 0, "served": 0,
            "served_bytes": 0, "missing": 0, "transfer_errors": 0, "fetches_done": 0,
        }
        self.unsealed = 0  # objects created here whose bytes are on the way
        self.hold = threading.Event()  # tests: transfers wait while it is clear
        self.hold.set()

    def ready(self) -> str:
        return self.node

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {**self.counts, "unsealed": self.unsealed, "pid": os.getpid()}

    # -- the source side ---------------------------------------------------------------

    def serve(
        self, keys: Sequence[str | bytes], draining: bool = False
    ) -> list[tuple[int, bytes, Any] | None]:
        """Each key's ``(length, meta, bytes or [object ref])``, or None where this
        node's store lacks it (with ``draining``, an item deleted while a process pins it
        counts as held: ``NodeStores.fetch_draining``). An item of up to
        ``INLINE_BYTES`` comes in the reply (Ray inlines small replies); a larger one as a
        ref to a copy in Ray's object store, which Ray moves to whichever node gets it and
        frees once that node drops it."""
        out: list[tuple[int, bytes, Any] | None] = []
        for k in keys:
            v = self.store.get_draining(k) if draining else self.store.try_get(k)
            if v is None:
                out.append(None)
                continue
            if v.nbytes <= INLINE_BYTES:
                payload: Any = v.tobytes()
            else:
                payload = [ray.put(np.frombuffer(v, dtype=np.uint8))]
            out.append((v.nbytes, bytes(cast(_native.View, v.obj).meta), payload))
            with self.lock:
                self.counts["served"] += 1
                self.counts["served_bytes"] += v.nbytes
        return out

    # -- the fetching side ---------------------------------------------------------------

    def fetch(self, keys: Sequence[str | bytes], source: str) -> tuple[list, list, str]:
        """Brings ``keys`` from ``source``'s bridge into this node's store. Returns once
        each one exists here (sealed, or being written by this bridge): ``(missing at
        the source, not storable here, why)``. A key another call is fetching already
        is waited for, not fetched again."""
        return self._fetch(keys, source, "fetch_calls", wait_for_others=True)

    def prefetch(self, keys: Sequence[str | bytes], source: str) -> tuple[list, list, str]:
        """``fetch`` asked for ahead of the ranks (``NodeStores.prefetch``): the same
        work, counted apart (``prefetch_calls``; a rank's own asks stay ``fetch_calls``),
        and it does not wait for keys another call is fetching already."""
        return self._fetch(keys, source, "prefetch_calls", wait_for_others=False)

    def _fetch(
        self, keys: Sequence[str | bytes], source: str, counter: str, *, wait_for_others: bool
    ) -> tuple[list, list, str]:
        mine: list[tuple[str | bytes, _Inflight]] = []
        theirs: list[tuple[str | bytes, _Inflight]] = []
        with self.lock:
            self.counts[counter] += 1
            for k in dict.fromkeys(keys):
                f = self.inflight.get(k)
                if f is None:
                    f = self.inflight[k] = _Inflight()
                    mine.append((k, f))
                else:
                    theirs.append((k, f))
        missing: list = []
        failed: list = []
        why = ""
        jobs = []
        try:
            todo = [(k, f) for k, f in mine if not self.store.contains(k)]
            if todo:
                served = self.nodes._call(
                    source, "serve", [k for k, _ in todo], self.nodes.fetch_draining)
                for (k, f), s in zip(todo, served):
                    if s is None:
                        f.error = "missing"
                        missing.append(k)
                        continue
                    length, meta, payload = s
                    try:
                        c = self.store.create_object(k, length, meta or None)
                    except _native.AlreadyExists:
                        continue  # written here by someone else: readers wait for its seal
                    except (_native.Full, _native.TableFull, _native.TooLarge) as e:
                        f.error = "failed"
                        failed.append(k)
                        why = str(e)
                        continue
                    if isinstance(payload, bytes):  # a small item: its bytes came along
                        self._write(c, payload)
                    else:
                        jobs.append((k, c, payload[0]))
        finally:
            with self.lock:
                self.counts["missing"] += len(missing)
                self.unsealed += len(jobs)
                writing = {k for k, _, _ in jobs}
                for k, f in mine:
                    if k not in writing:
                        self.inflight.pop(k, None)
                    f.created.set()
        if jobs:
            threading.Thread(target=self._transfer, args=(jobs,), daemon=True).start()
        for k, f in theirs if wait_for_others else ():
            f.created.wait(self.nodes.timeout)
            if f.error == "missing":
                missing.append(k)
            elif f.error == "failed":
                failed.append(k)
                why = why or "see the bridge's log"
        with self.lock:
            self.counts["fetches_done"] += 1
        return missing, failed, why

    def _transfer(self, jobs: list[tuple[str | bytes, Any, Any]]) -> None:
        self.hold.wait()
        try:
            arrays = ray.get([ref for _, _, ref in jobs])
        except Exception as e:  # noqa: BLE001 - the source died or lost the object
            logger.warning("shmstore: fetching %d item(s) failed: %s", len(jobs), e)
            arrays = [None] * len(jobs)
        for (k, c, _), a in zip(jobs, arrays):
            try:
                self._write(c, a)
            finally:
                with self.lock:
                    self.inflight.pop(k, None)
                    self.unsealed -= 1
        del arrays

    def _write(self, c: Any, data: Any) -> None:
        """Copies ``data`` into the local object and seals it (aborts it on failure:
        readers then see the item absent, a miss)."""
        try:
            if data is None:
                raise RuntimeError("no bytes")
            mv = memoryview(data)
            if mv.nbytes != len(c):
                raise ValueError(f"{mv.nbytes} bytes came for an object of {len(c)}")
            c.write(mv)  # without the GIL, streamed past the cache when large
            c.seal()
            with self.lock:
                self.counts["fetched"] += 1
                self.counts["fetched_bytes"] += len(c)
        except Exception:  # noqa: BLE001
            c.abort()
            with self.lock:
                self.counts["transfer_errors"] += 1

    # -- tests ------------------------------------------------------------------------

    def hold_transfers(self, hold: bool) -> None:
        """Tests: transfers wait (the local objects stay unsealed) until released."""
        if hold:
            self.hold.clear()
        else:
            self.hold.set()


#: The bridge as a Ray actor class (see ``NodeStores.bridge``).
Bridge = ray.remote(_Bridge)

__all__ = ["Bridge", "FetchFailed", "ItemsMissing", "NAMESPACE", "NodeStores"]
