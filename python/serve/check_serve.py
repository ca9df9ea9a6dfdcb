"""End to end through ``vllm serve``: a real vLLM server (OpenAI API, front-end, engine
core, worker) serving a tiny Qwen2-VL model (``tiny_model.py``), with vLLM's own ``shm``
multimodal cache and then with shmstore's, checking what an operator would see:

* the answers are the same, token for token and log-probability for log-probability
  (images first sent, then hits, and a request with two images); different images give
  different answers, so the check sees the pixels the worker got;
* with shmstore (``shmstore``), the instance's store holds each image once, vLLM counts
  the hits, ``/metrics`` shows the store, the log names it once, ``shmstore check`` (the
  command the package installs) finds the running instance's store sound, and it is gone
  after the server shuts down (Ctrl-C), with nothing left in its directory;
* with a store of a few images (``shmstore-small``: 4 MiB) and 16 clients at once, and
  vLLM's cache reset four times a second, items are evicted and deleted all the time,
  and every item in use deleted from the store by hand (``Store.delete``) at the same
  rate, yet every request gets the answer its images got alone, vLLM runs on, and the
  store is sound afterwards (``shmstore check``)
  (``vllm-small`` runs vLLM's own cache the same way, with the resets, on request);
* an instance whose store the operator named, SIGKILLed and started again with another
  size (``shmstore-restarted``), attaches the store it finds, says that its size is not
  the one asked for, and what it stored before is a hit; a third instance sharing the
  store gets hits too, and the store goes with the last of them to exit;
* an instance with spawned workers (``shmstore-killed``; the others fork them, vLLM's
  default) gives the same answers, and killed with SIGKILL, leaves its store behind,
  which ``shmstore stores`` lists with no live process and the instance's three dead; the
  next instance's start removes it. What vLLM itself left in /dev/shm (its message
  queues' segments, which nothing removes after a crash) is printed beside it, then
  removed, so that runs do not pile them up;
* with data parallelism (``shmstore-dp-2``: two engines, two API servers), where vLLM
  switches its own cache off, shmstore's is used: the same answers, each image stored
  once, and every image seen before is a hit, whichever API server gets the request
  (prompt updates travel with the item); ``shmstore-2-api`` (one engine, two API
  servers) on request. The data-parallel instance's store is named by the operator
  (``SHMSTORE_VLLM_STORE``), and is removed at shutdown all the same. ``vllm-dp-2`` runs
  vLLM alone the same way, beside it: its
  fallback (each API server a cache of its own, items sent in full) gives the same
  answers, and its hit count is printed;
* in a memory cgroup whose limit is below the store (``shmstore-memory-limit``: a
  container with ``--memory``; root only, skipped with the reason elsewhere), ``vllm
  serve`` stops at start with the store's message naming vLLM's setting, and the kernel
  kills nothing.

    python check_serve.py MODEL_DIR [--only vllm,vllm-dp-2,shmstore,shmstore-small,shmstore-restarted,shmstore-killed,shmstore-dp-2,shmstore-memory-limit]

Exit status 0 when every check holds. Prints one line per configuration, with the time
to first answer and the mean request latency (a tiny model on a CPU: the figures say
that the path works, not how fast it is on a GPU).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request

import numpy as np
from PIL import Image

import memcg
import shmstore

# (seed, width, height): three shapes, so the items differ in size as well as content.
IMAGES = {1: (224, 168), 2: (280, 280), 3: (112, 336), 4: (168, 224)}
# Each request: the images it carries. First sends, then hits, then two in one request.
REQUESTS = [[1], [2], [3], [1], [2], [3], [4, 1], [4]]


SCALE = 1  # image sides are multiplied by this (--scale)


def image_url(seed: int) -> str:
    w, h = (side * SCALE for side in IMAGES[seed])
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 300) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


class Server:
    """One ``vllm serve`` process group, its log in a temporary file."""

    def __init__(self, model: str, shm_dir: str, use_shmstore: bool, extra: list[str],
                 start_method: str = "fork", store_name: str | None = None,
                 cgroup: str | None = None, extra_env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        env = dict(os.environ)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE="1",
            SHMSTORE_VLLM_DIR=shm_dir,
            PYTHONUNBUFFERED="1",
            VLLM_WORKER_MULTIPROC_METHOD=start_method,
        )
        env.pop("SHMSTORE_VLLM_STORE", None)
        env.pop("SHMSTORE_VLLM_LAUNCHER", None)
        if store_name:
            env["SHMSTORE_VLLM_STORE"] = store_name  # named by the operator
        env.update(extra_env or {})
        if use_shmstore:
            env["SHMSTORE_VLLM"] = "1"
        else:
            env.pop("SHMSTORE_VLLM", None)
        # vLLM's ZMQ sockets between its processes go in a directory of their own:
        # vLLM leaves them behind even after a clean shutdown (7 per instance here), and
        # CI runs would pile them up in /tmp. Counted and removed when the server ends.
        self.rpc_dir = tempfile.mkdtemp(prefix="vllm-rpc-")
        self.rpc_left = 0
        env["VLLM_RPC_BASE_PATH"] = self.rpc_dir
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log")
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--port", str(self.port), "--host", "127.0.0.1",
            # shmstore: SHMSTORE_VLLM=1 is the one switch (vLLM's default cache type);
            # vLLM's own shared-memory cache needs its type.
            *([] if use_shmstore else ["--mm-processor-cache-type", "shm"]),
            "--mm-processor-cache-gb", "1",
            "--max-model-len", str(2048 * SCALE), "--dtype", "float32", "--enforce-eager",
            "--max-num-seqs", "4", "--limit-mm-per-prompt", '{"image": 2}', *extra,
        ]
        if cgroup:
            # In a memory cgroup from its first instruction, as in a container.
            cmd = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup, *cmd]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started = time.monotonic()

    def wait_ready(self, limit: float = 600) -> float:
        deadline = self.started + limit
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                http(self.url + "/health", timeout=5)
                return time.monotonic() - self.started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)  # polling a server that is loading: no event to wait on
        raise RuntimeError(f"vllm serve not ready after {limit:.0f} s:\n{self.tail()}")

    def chat(self, seeds: list[int]) -> tuple[list, float]:
        content = [{"type": "image_url", "image_url": {"url": image_url(s)}} for s in seeds]
        content.append({"type": "text", "text": "What is in the picture?"})
        body = {
            "model": self.model, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "messages": [{"role": "user", "content": content}],
        }
        t = time.monotonic()
        out = json.loads(http(self.url + "/v1/chat/completions", body))
        took = time.monotonic() - t
        steps = out["choices"][0]["logprobs"]["content"]
        answer = [(s["token"], s["logprob"], [(a["token"], a["logprob"]) for a in s["top_logprobs"]])
                  for s in steps]
        return answer, took

    def metric(self, name: str) -> float | None:
        text = http(self.url + "/metrics").decode()
        total = None
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, limit: float = 120) -> int:
        """Ctrl-C, as an operator stops it; then the whole group, if it lingers."""
        if self.proc.poll() is not None:
            self.remove_rpc_dir()
            return self.proc.returncode  # it stopped by itself (a failed start)
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise RuntimeError(f"vllm serve did not stop within {limit:.0f} s:\n{self.tail()}")
        finally:
            # Whatever the group left running (nothing, normally) goes too.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.remove_rpc_dir()

    def kill(self) -> int:
        """A crash: SIGKILL to every process of the instance at once."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            return self.proc.wait(60)
        finally:
            self.remove_rpc_dir()

    def remove_rpc_dir(self) -> None:
        """Counts what vLLM left in its RPC directory (``rpc_left``), and removes it."""
        if os.path.isdir(self.rpc_dir):
            self.rpc_left = len(os.listdir(self.rpc_dir))
            shutil.rmtree(self.rpc_dir, ignore_errors=True)

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        self.log.seek(0)
        return "".join(self.log.readlines()[-n:])

    def lines(self, needle: str) -> list[str]:
        self.log.flush()
        self.log.seek(0)
        return [line.rstrip() for line in self.log if needle in line]


def drift(a: list, b: list) -> float | None:
    """The largest log-probability difference between two answers with the same tokens
    (chosen and top 3 at every step); None if the tokens differ."""
    if [(t, [c for c, _ in top]) for t, _, top in a] != [(t, [c for c, _ in top]) for t, _, top in b]:
        return None
    return max(max(abs(x[1] - y[1]), *(abs(p - q) for (_, p), (_, q) in zip(x[2], y[2])))
               for x, y in zip(a, b))


#: Configurations with more than one API server (front-end).
MULTI_FRONT_END = ("shmstore-2-api", "shmstore-dp-2")


#: The name an operator gives the data-parallel instance's store.
OPERATOR_NAMED = "mm-cache"


def stores(shm_dir: str) -> list[str]:
    """The stores in the run's own directory (every file there is one)."""
    return sorted(os.listdir(shm_dir))


#: Names vLLM's own shared memory takes in /dev/shm: Python's ``SharedMemory`` segments
#: (vLLM's message queues between engine core and workers, its ``shm`` cache's ring) and
#: ``multiprocessing``'s semaphores.
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-")


def left_in_dev_shm(before: set[str], shm_dir: str) -> list[tuple[str, int, int]]:
    """What an instance left in /dev/shm outside the run's store directory: (name, size,
    bytes in memory) for each file that was not there before it started. Those with
    vLLM's names are removed once counted."""
    left = []
    for name in sorted(set(os.listdir("/dev/shm")) - before - {os.path.basename(shm_dir)}):
        path = os.path.join("/dev/shm", name)
        try:
            st = os.stat(path)
            left.append((name, st.st_size, st.st_blocks * 512))
            if name.startswith(VLLM_SHM_PREFIXES):
                os.unlink(path)
        except OSError:
            pass  # gone meanwhile
    return left


def print_leftovers(r: dict, after: str) -> None:
    """Prints what vLLM itself left behind (and the check removed): its shared memory in
    /dev/shm (``dev_shm_left``) and its ZMQ sockets (``rpc_left``)."""
    if r.get("dev_shm_left"):
        mib = sum(size for _, size, _ in r["dev_shm_left"]) / (1 << 20)
        held = sum(used for _, _, used in r["dev_shm_left"]) / (1 << 20)
        print(f"  vLLM's own shared memory left in /dev/shm after {after}: "
              f"{len(r['dev_shm_left'])} files, {mib:.0f} MiB ({held:.1f} MiB in "
              f"memory): {', '.join(n for n, _, _ in r['dev_shm_left'])}; nothing "
              "of vLLM's removes them (this check does)")
    if r.get("rpc_left"):
        print(f"  vLLM's own ZMQ sockets left in its RPC directory (VLLM_RPC_BASE_PATH, /tmp "
              f"by default) after {after}: {r['rpc_left']}; nothing of vLLM's removes them "
              "(this check does)")


def shmstore_check(path: str) -> dict:
    """``shmstore check --json`` (the command the package installs) on a running
    instance's store: every invariant of its allocator and table, and its counters against
    a full scan. A look while some process is at work is inconclusive ("busy"); the
    instance is idle between requests, but vLLM's processes may still be finishing a step
    (the engine core drops a request's pins at its next step), so a busy answer is asked
    again, a few times, half a second apart."""
    cli = os.path.join(sysconfig.get_path("scripts"), "shmstore")
    verdict: dict = {}
    for _ in range(5):
        out = subprocess.run([cli, "check", path, "--json"], capture_output=True, text=True,
                             timeout=120)
        try:
            verdict = json.loads(out.stdout)
        except json.JSONDecodeError:
            return {"verdict": "error", "finding": out.stderr.strip()}
        if verdict["verdict"] != "busy":
            break
        time.sleep(0.5)
    return verdict


def run(config: str, model: str, shm_dir: str) -> dict:
    use = config.startswith("shmstore")
    killed = config == "shmstore-killed"
    extra = {
        "shmstore-2-api": ["--api-server-count", "2"],
        "shmstore-dp-2": ["--data-parallel-size", "2"],
        "vllm-dp-2": ["--data-parallel-size", "2"],
    }.get(config, [])
    # Workers forked (vLLM's default), and spawned in the instance that is killed; the
    # data-parallel instance's store is named by the operator (SHMSTORE_VLLM_STORE).
    # The single instance's workers keep no items for hits (SHMSTORE_VLLM_WORKER_KEEP=0):
    # every read goes to the store, as a worker's first read of an item does.
    server = Server(model, shm_dir, use, extra, "spawn" if killed else "fork",
                    OPERATOR_NAMED if config == "shmstore-dp-2" else None,
                    extra_env={"SHMSTORE_VLLM_WORKER_KEEP": "0"} if config == "shmstore" else None)
    result: dict = {"config": config}
    before = set(os.listdir("/dev/shm"))
    try:
        result["ready_s"] = server.wait_ready()
        answers, times = [], []
        # A killed instance only needs to have stored something.
        for seeds in REQUESTS[:2] if killed else REQUESTS:
            a, took = server.chat(seeds)
            answers.append(a)
            times.append(took)
        result["answers"] = answers
        result["first_ms"] = times[0] * 1e3
        result["mean_ms"] = sum(times) / len(times) * 1e3
        if not killed:  # requests 1-2: first sends (after the first); 3-5: hits
            result["send_ms"] = sum(times[1:3]) / 2 * 1e3
            result["hit_ms"] = sum(times[3:6]) / 3 * 1e3
        result["hits"] = server.metric("vllm:mm_cache_hits_total")
        result["queries"] = server.metric("vllm:mm_cache_queries_total")
        result["objects_metric"] = server.metric("shmstore_objects")
        found = stores(shm_dir)
        result["stores_running"] = found
        if use and len(found) == 1:
            st = shmstore.Store.open(os.path.join(shm_dir, found[0]), read_only=True).stats()
            result["objects"] = st["objects"]
            result["clients"] = st["clients"] - 1  # this process is one
            result["pins"] = st["pins"]
        if use and len(found) == 1:
            result["check"] = shmstore_check(os.path.join(shm_dir, found[0]))
        if config == "shmstore" and len(found) == 1:
            # Every item deleted behind vLLM's back (by hand, or another front-end's
            # reset): the front-end still holds pins from its recent sends, and its next
            # request must neither fail nor reach a worker that cannot find the item (a
            # miss in a worker stops vLLM; it did, before the engine core's gate).
            store = shmstore.Store.open(os.path.join(shm_dir, found[0]))
            sealed = [oid for oid, _, state, _ in store.list() if state == "sealed"]
            for oid in sealed:
                store.delete(oid)
            result["deleted"] = len(sealed)
            del store
            try:
                result["after_delete"], _ = server.chat(REQUESTS[0])
            except urllib.error.URLError as e:
                state = "running" if server.proc.poll() is None else "exited"
                result["after_delete"] = f"{e} (vllm serve {state})"
    finally:
        result["exit"] = server.kill() if killed else server.stop()
        result["stores_after"] = stores(shm_dir)
        if killed:
            # What an operator sees of the killed instance's store: `shmstore stores`. The
            # instance's other processes may still be exiting (only its first is waited
            # for), and a process counts as alive until the kernel closes its files: look
            # again, a quarter of a second apart, until none is (10 s at most).
            cli = os.path.join(sysconfig.get_path("scripts"), "shmstore")
            for _ in range(40):
                out = subprocess.run([cli, "stores", shm_dir, "--json"], capture_output=True,
                                     text=True, timeout=120)
                if out.returncode != 0:
                    result["listed"] = out.stderr
                    break
                result["listed"] = json.loads(out.stdout)
                if all(row.get("alive") == 0 for row in result["listed"]):
                    break
                time.sleep(0.25)
        result["dev_shm_left"] = left_in_dev_shm(before, shm_dir)
        result["rpc_left"] = server.rpc_left
        result["shmstore_lines"] = server.lines("shmstore:")
        result["log"] = server.tail()
        server.log.close()
    return result


#: ``shmstore-small`` / ``vllm-small``: a cache of a few images (``--mm-processor-cache-gb``),
#: 24 images of 112 to 336 pixels a side (0.07 to 0.54 MiB each as vLLM 0.32's processor
#: hands them over, one byte per value; 6.5 MiB in all), sent once each, then 96 requests
#: (a third of them with two images, the first images a little likelier, as popular
#: images are) from 16 clients at once.
SMALL_CACHE_GB = 0.004
LOAD_SEEDS = list(range(100, 124))
_sides = np.random.default_rng(0).choice([112, 168, 224, 280, 336], (len(LOAD_SEEDS), 2))
IMAGES.update({s: (int(w), int(h)) for s, (w, h) in zip(LOAD_SEEDS, _sides)})
LOAD_CLIENTS, LOAD_REQUESTS = 16, 96


def load_requests() -> list[list[int]]:
    rng = np.random.default_rng(1)
    weights = 1.0 / np.arange(1, len(LOAD_SEEDS) + 1) ** 0.3
    weights /= weights.sum()
    return [[int(s) for s in rng.choice(LOAD_SEEDS, 2 if rng.random() < 1 / 3 else 1,
                                        replace=False, p=weights)]
            for _ in range(LOAD_REQUESTS)]


def run_under_load(config: str, model: str, shm_dir: str) -> dict:
    """A cache far smaller than what the clients send, under concurrent requests: items
    are evicted while other requests for them are on their way, and puts find the store
    full; meanwhile vLLM's cache is reset (``POST /reset_mm_cache``, a development
    endpoint) every quarter of a second. Every request must get its answer, the answer
    it got alone."""
    use = config.startswith("shmstore")
    before = set(os.listdir("/dev/shm"))
    server = Server(model, shm_dir, use, ["--mm-processor-cache-gb", str(SMALL_CACHE_GB)],
                    extra_env={"VLLM_SERVER_DEV_MODE": "1"})
    result: dict = {"config": config}
    try:
        result["ready_s"] = server.wait_ready()
        result["alone"] = {s: server.chat([s])[0] for s in LOAD_SEEDS}

        def ask(seeds: list[int]):
            # A request refused by the engine core's gate (an item evicted before the
            # engine core admitted the request: the window of recent sends is a
            # quarter of this tiny store, a few images) ends with HTTP 500 and vLLM's
            # retryable warning in the log; as vLLM asks of clients, it is sent again,
            # once (twice with shmstore, whose items are also deleted by hand: a
            # request's item can be deleted again on its second way to the engine
            # core). Counted, and checked against the warnings.
            tries: list[str] = []
            for _ in range(3 if use else 2):
                try:
                    return seeds, server.chat(seeds)[0], tries
                except urllib.error.HTTPError as e:
                    tries.append(f"{e}: {e.read()[:300]!r}")
                    if e.code != 500:
                        break
                except (urllib.error.URLError, OSError) as e:
                    tries.append(str(e))
                    break
            return seeds, RuntimeError("; ".join(tries)), tries

        resets: list[str | None] = []
        hand_deleted: list[int] = []
        loading = threading.Event()

        def reset() -> None:
            # Front-end and engine core clear their caches (vLLM warns that requests
            # are in flight): the items of requests on their way or admitted must stay.
            # With shmstore, every item some process pins (a request on its way, one
            # the engine core admitted, one a worker keeps) is also deleted by hand,
            # Store.delete, which spares nothing: the workers of an admitted request
            # must still read its items (before session 24 such a miss stopped vLLM).
            found = stores(shm_dir) if use else []
            store = shmstore.Store.open(os.path.join(shm_dir, found[0])) if found else None
            while not loading.wait(0.25):
                try:
                    http(server.url + "/reset_mm_cache", {})
                    resets.append(None)
                except (urllib.error.URLError, OSError) as e:
                    resets.append(str(e))
                if store is not None:
                    n = 0
                    for oid, _, state, pins in store.list():
                        if state == "sealed" and pins > 0:
                            try:
                                store.delete(oid)
                                n += 1
                            except shmstore.NotFound:
                                pass  # evicted or deleted meanwhile
                    hand_deleted.append(n)
            del store  # detach before the server stops: the last one out removes the store

        resetter = threading.Thread(target=reset)
        started = time.monotonic()
        resetter.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(LOAD_CLIENTS) as pool:
                result["loaded"] = list(pool.map(ask, load_requests()))
        finally:
            loading.set()
            resetter.join()
        result["load_s"] = time.monotonic() - started
        result["resets"] = resets
        result["hand_deleted"] = sum(hand_deleted)
        result["retried"] = sum(1 for _, a, tries in result["loaded"]
                                if tries and not isinstance(a, Exception))
        result["loaded"] = [(seeds, a) for seeds, a, _ in result["loaded"]]
        result["retryable"] = len(server.lines("returning a retryable response"))
        result["hits"] = result["queries"] = None
        try:
            result["hits"] = server.metric("vllm:mm_cache_hits_total")
            result["queries"] = server.metric("vllm:mm_cache_queries_total")
            result["running"] = server.proc.poll() is None
        except (urllib.error.URLError, OSError):
            result["running"] = False  # exited, or on its way out
        found = stores(shm_dir)
        if use and len(found) == 1:
            result["stats"] = shmstore.Store.open(os.path.join(shm_dir, found[0]),
                                                  read_only=True).stats()
            result["check"] = shmstore_check(os.path.join(shm_dir, found[0]))
    finally:
        result["exit"] = server.stop()
        result["stores_after"] = stores(shm_dir)
        result["dev_shm_left"] = left_in_dev_shm(before, shm_dir)
        result["rpc_left"] = server.rpc_left
        result["log"] = server.tail()
        server.log.close()
    return result


#: ``shmstore-restarted``: the store's name (the operator's), and the two instances' sizes.
RESTARTED_NAME, RESTARTED_GB = "mm-cache-restarted", (0.5, 1)


def run_restarted(model: str, shm_dir: str) -> dict:
    """An instance whose store the operator named (``SHMSTORE_VLLM_STORE``) is killed
    with SIGKILL, and started again with another ``--mm-processor-cache-gb``: the new
    instance attaches the store it finds, says that its size is not the one asked for,
    and what the first instance stored is still there (vLLM clears its cache at start,
    and this must not delete the store's items). A third instance then shares the store
    with the second (both running): what the first stored is a hit there too; the store
    stays while one of them uses it, and goes with the last."""
    result: dict = {}
    before = set(os.listdir("/dev/shm"))
    first = Server(model, shm_dir, True, ["--mm-processor-cache-gb", str(RESTARTED_GB[0])],
                   store_name=RESTARTED_NAME)
    try:
        first.wait_ready()
        result["before"] = [first.chat([s])[0] for s in (1, 2)]
    finally:
        result["killed_exit"] = first.kill()
        first.log.close()
        # What vLLM left (its store's name aside: that stays, on purpose).
        result["dev_shm_left"] = left_in_dev_shm(before, shm_dir)
        result["rpc_left"] = first.rpc_left
    result["after_kill"] = stores(shm_dir)
    second = Server(model, shm_dir, True, ["--mm-processor-cache-gb", str(RESTARTED_GB[1])],
                    store_name=RESTARTED_NAME)
    third = None
    try:
        result["ready_s"] = second.wait_ready()
        result["after"] = second.chat([1])[0]
        result["hits"] = second.metric("vllm:mm_cache_hits_total")
        result["queries"] = second.metric("vllm:mm_cache_queries_total")
        third = Server(model, shm_dir, True,
                       ["--mm-processor-cache-gb", str(RESTARTED_GB[0])], store_name=RESTARTED_NAME)
        third.wait_ready()
        result["shared"] = third.chat([2])[0]
        result["shared_hits"] = third.metric("vllm:mm_cache_hits_total")
        result["shared_queries"] = third.metric("vllm:mm_cache_queries_total")
    finally:
        result["exit"] = second.stop()
        result["stores_after_one"] = stores(shm_dir)
        result["said"] = second.lines("already exists, with")
        result["left_to_other"] = second.lines("still in use by another process")
        result["log"] = second.tail()
        second.log.close()
        if third is not None:
            result["third_exit"] = third.stop()
            result["third_said"] = third.lines("already exists, with")
            result["log"] += third.tail()
            third.log.close()
        result["stores_after"] = stores(shm_dir)
    return result


#: ``shmstore-memory-limit``: the memory limit of the cgroup vLLM runs in, and the store
#: it asks for (``--mm-processor-cache-gb``), in GiB. The limit leaves vLLM itself (a tiny
#: model on the CPU, 1 GiB of KV cache) several GiB.
MEMORY_LIMIT_GIB, STORE_OVER_LIMIT_GIB = 10, 16


def run_memory_limited(model: str, shm_dir: str) -> dict:
    """``vllm serve`` with shmstore in a memory cgroup whose limit is below the store, as
    in a container with ``--memory``: the start must fail with the store's message, and
    the kernel must kill nothing (without the store's check it would kill the process
    reserving the store, leaving nothing in the log)."""
    try:
        cg = memcg.child_memory_cgroup(MEMORY_LIMIT_GIB << 30, "shmstore-serve")
    except memcg.Unavailable as e:
        return {"skipped": str(e)}
    server = Server(model, shm_dir, True, ["--mm-processor-cache-gb", str(STORE_OVER_LIMIT_GIB)],
                    cgroup=cg)
    result: dict = {}
    try:
        try:
            result["exit"] = server.proc.wait(300)
        except subprocess.TimeoutExpired:
            result["exit"] = None  # it went on without its cache, or hangs
        result["took_s"] = time.monotonic() - server.started
    finally:
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.proc.wait()
        server.remove_rpc_dir()
        result["oom_kills"] = memcg.oom_kills(cg)
        result["said"] = server.lines("the memory limit of this process's cgroup")
        result["stores_after"] = stores(shm_dir)
        result["log"] = server.tail()
        server.log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                os.rmdir(cg)
                break
            except OSError:
                # The group's last processes are still exiting: no event tells when.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--only", default="vllm,vllm-dp-2,shmstore,shmstore-small,shmstore-restarted,"
                    "shmstore-killed,shmstore-dp-2,shmstore-memory-limit",
                    help="configurations, comma-separated, in order (also: shmstore-2-api, "
                    "vllm-small); "
                    "shmstore-killed is SIGKILLed and the next one must remove its store")
    ap.add_argument("--verbose", action="store_true", help="print the plugin's log lines")
    ap.add_argument("--scale", type=int, default=1,
                    help="multiply the images' sides (4: 896x672 to 1120x1120 pixels)")
    args = ap.parse_args()
    global SCALE
    SCALE = args.scale
    configs = args.only.split(",")
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            failures.append(what)

    def logged_and_failed(r: dict) -> bool:
        """Prints the server's log when asked or when a check failed; whether one did."""
        if args.verbose or failures:
            print(r["log"])
        return bool(failures)

    # A directory of its own: leftovers are this run's, and no other store is touched.
    distinct = len({s for req in REQUESTS for s in req})
    items = sum(len(req) for req in REQUESTS)
    with tempfile.TemporaryDirectory(prefix="shmstore-serve-", dir="/dev/shm") as shm_dir:
        results: dict[str, dict] = {}
        left_by_crash: list[str] = []
        for config in configs:
            if config == "shmstore-memory-limit":
                r = run_memory_limited(os.path.abspath(args.model), shm_dir)
                if "skipped" in r:
                    print(f"{config}: skipped: {r['skipped']}")
                    continue
                print(f"{config}: a {STORE_OVER_LIMIT_GIB} GiB store in a container limited to "
                      f"{MEMORY_LIMIT_GIB} GiB: vllm serve exited with {r['exit']} after "
                      f"{r['took_s']:.1f} s")
                check(r["exit"] not in (None, 0), "vllm serve stops at start")
                check(bool(r["said"]) and any(f"--mm-processor-cache-gb={STORE_OVER_LIMIT_GIB}"
                                              in line for line in r["said"]),
                      "its log says the store does not fit under the memory limit, and names "
                      "vLLM's setting")
                check(r["oom_kills"] == 0, f"the kernel killed nothing ({r['oom_kills']} OOM kills)")
                check(r["stores_after"] == [], f"nothing is left in the store directory "
                      f"({r['stores_after']})")
                if logged_and_failed(r):
                    break
                continue
            if config == "shmstore-restarted":
                r = run_restarted(os.path.abspath(args.model), shm_dir)
                print(f"{config}: SIGKILLed with its store named {RESTARTED_NAME} "
                      f"({RESTARTED_GB[0]:g} GiB), started again asking for "
                      f"{RESTARTED_GB[1]:g} GiB, ready in {r['ready_s']:.1f} s; vLLM counts "
                      f"{r['hits'] or 0:.0f} hits of {r['queries'] or 0:.0f} items; a third "
                      "instance shares the store")
                print_leftovers(r, "the first instance's SIGKILL")
                check(r["after_kill"] == [RESTARTED_NAME],
                      f"the store the operator named outlives the killed instance "
                      f"({r['after_kill']})")
                said = (len(r["said"]) == 1 and f"--mm-processor-cache-gb={RESTARTED_GB[1]:g}"
                        in r["said"][0] and "512.0 MiB" in r["said"][0])
                check(said, "the new instance says, once, that the store it attached has "
                      "another size than it asks for" + ("" if said else f" (said: {r['said']})"))
                d = drift(r["before"][0], r["after"])
                check(r["hits"] == 1 and r["queries"] == 1 and d is not None and d <= 1e-3,
                      "an image the killed instance stored is a hit in the new one, with the "
                      "same answer (vLLM's cache clear at start left it)")
                d = drift(r["before"][1], r["shared"])
                check(r["shared_hits"] == 1 and r["shared_queries"] == 1 and d is not None
                      and d <= 1e-3 and not r["third_said"],
                      "a third instance sharing the store (its size as asked, no warning) gets "
                      "the killed instance's other image as a hit, with the same answer "
                      f"(vLLM counts {r['shared_hits'] or 0:.0f} hits of {r['shared_queries'] or 0:.0f})")
                check(r["exit"] == 0 and r["third_exit"] == 0,
                      f"both exit cleanly on Ctrl-C (status {r['exit']}, {r['third_exit']})")
                check(r["stores_after_one"] == [RESTARTED_NAME] and len(r["left_to_other"]) == 1,
                      "the first of them to exit leaves the store to the other, and says so")
                check(r["stores_after"] == [],
                      f"the last removes it: nothing is left in the store directory "
                      f"({r['stores_after']})")
                if logged_and_failed(r):
                    break
                continue
            if config in ("shmstore-small", "vllm-small"):
                r = run_under_load(config, os.path.abspath(args.model), shm_dir)
                st = r.get("stats")
                print(f"{config}: a {SMALL_CACHE_GB * 1024:.0f} MiB cache; {len(LOAD_SEEDS)} "
                      f"images sent once each, then {LOAD_REQUESTS} requests from "
                      f"{LOAD_CLIENTS} clients at once in {r['load_s']:.1f} s; vLLM counts "
                      f"{r['hits'] or 0:.0f} hits of {r['queries'] or 0:.0f} items"
                      + ("" if r["running"] else " (vllm serve has exited)")
                      + (f"; the store took {st['creates']} items, "
                         f"{st['bytes_created'] / max(1, st['creates']) / (1 << 20):.2f} MiB "
                         f"each on average, and evicted {st['evictions']} "
                         f"({st['bytes_evicted'] / (1 << 20):.0f} MiB); no room for "
                         f"{st['full_events']} (sent inline)" if st else "")
                      + (f"; {r['hand_deleted']} items in use deleted by hand" if r["hand_deleted"] else "")
                      + f"; {r['retried']} sent again after vLLM's retryable miss")
                print_leftovers(r, "shutdown")
                failed = [(seeds, str(a)[:700]) for seeds, a in r["loaded"]
                          if isinstance(a, Exception)]
                check(not failed and r["running"],
                      "every request under load gets an answer, and vllm serve runs on"
                      + (f" ({len(failed)} failed: {failed[:2]})" if failed else ""))
                bad_resets = [e for e in r["resets"] if e is not None]
                check(len(r["resets"]) >= 2 and not bad_resets,
                      f"vLLM's cache was reset {len(r['resets'])} times meanwhile"
                      + (f" ({len(bad_resets)} failed: {bad_resets[:2]})" if bad_resets else ""))
                if config == "shmstore-small":
                    check(r["hand_deleted"] > 0,
                          f"{r['hand_deleted']} items in use were deleted by hand meanwhile "
                          "(Store.delete)")
                check(r["retried"] <= r["retryable"],
                      f"a request that had to be sent again was one vLLM refused as "
                      f"retryable ({r['retried']} sent again, {r['retryable']} retryable "
                      f"misses in vLLM's log)")
                alone = r["alone"]
                check(len({repr(a) for a in alone.values()}) == len(alone),
                      f"the {len(alone)} images give {len(alone)} different answers")
                wrong: list[list[int]] = []
                pairs: dict[tuple[int, ...], list] = {}
                for seeds, a in r["loaded"]:
                    if isinstance(a, Exception):
                        continue
                    if len(seeds) == 1:
                        d = drift(alone[seeds[0]], a)
                        if d is None or d > 1e-3:
                            wrong.append(seeds)
                    else:
                        pairs.setdefault(tuple(seeds), []).append(a)
                for two, got in pairs.items():
                    drifts = [drift(got[0], a) for a in got]
                    if any(d is None or d > 1e-3 for d in drifts):
                        wrong.append(list(two))
                check(not wrong, "under load each image gets the answer it got alone, and each "
                      "pair of images the same answer every time"
                      + (f" (not: {wrong[:5]})" if wrong else ""))
                check((r["hits"] or 0) > 0, "some requests are hits")
                if config == "shmstore-small":
                    check(st is not None and st["evictions"] > 0,
                          "the store was too small for the images, and evicted")
                    v = r.get("check", {})
                    check(v.get("verdict") == "sound",
                          "after the load, `shmstore check` finds the running instance's "
                          f"store sound ({v.get('verdict')}"
                          + (f": {v.get('finding')})" if v.get("finding") else ")"))
                check(r["exit"] == 0, f"vllm serve exits cleanly on Ctrl-C (status {r['exit']})")
                check(r["stores_after"] == [],
                      f"nothing is left in the store directory ({r['stores_after']})")
                if logged_and_failed(r):
                    break
                continue
            r = run(config, os.path.abspath(args.model), shm_dir)
            results[config] = r
            print(f"{config}: ready in {r['ready_s']:.1f} s; first request "
                  f"{r['first_ms']:.0f} ms, mean {r['mean_ms']:.0f} ms over "
                  f"{len(r['answers'])} requests; vLLM counts {r['hits']} hits of "
                  f"{r['queries']} items")
            if "hit_ms" in r:
                print(f"  first sends {r['send_ms']:.0f} ms, hits {r['hit_ms']:.0f} ms per "
                      "request (means)")
            print_leftovers(r, "SIGKILL" if config == "shmstore-killed" else "shutdown")
            if args.verbose:
                print("\n".join(r["shmstore_lines"]))
            answers = r["answers"]
            baseline = results.get("vllm", {}).get("answers")
            check(answers[0] != answers[1], "different images give different answers")
            if config != "vllm" and baseline is not None:
                check(answers == baseline[:len(answers)],
                      "the same answers as vLLM's own cache, log-probabilities included")
            if left_by_crash:
                # The previous instance was killed: this one's start removes its store.
                check(not set(left_by_crash) & set(r["stores_running"] + r["stores_after"])
                      and any("left by crashed vLLM instances" in line and
                              all(n in line for n in left_by_crash)
                              for line in r["shmstore_lines"]),
                      f"the killed instance's store {left_by_crash} is removed at this start")
                left_by_crash = []
            if config == "shmstore-killed":
                left_by_crash = r["stores_after"]
                check(len(left_by_crash) == 1 and r["stores_after"] == r["stores_running"],
                      f"a killed instance leaves its store behind ({left_by_crash})")
                listed = r.get("listed")
                row = (listed[0] if isinstance(listed, list) and len(listed) == 1
                       and listed[0].get("name") in left_by_crash else None)
                check(row is not None and row.get("alive") == 0 and row.get("dead", 0) >= 3,
                      "`shmstore stores` lists it with no live process and the instance's "
                      f"front-end, engine core and worker dead ({listed})")
                if failures:
                    print(r["log"])
                    break
                continue
            # Exactly, unless vLLM's prefix cache served part of the prompt the second time
            # (large images fill whole KV blocks): then the sums run in another order.
            again = [drift(answers[i], answers[i + 3]) for i in range(3)]
            check(all(d is not None and d <= 1e-3 for d in again),
                  f"an image sent again gets the same answer (largest log-probability "
                  f"difference: {again})")
            if config.startswith("shmstore"):
                # With several front-ends too: an image another front-end stored comes
                # with its prompt updates, so whichever front-end gets the request
                # skips the HF processor for it.
                check(r["queries"] == items and r["hits"] == items - distinct,
                      f"vLLM counts {items - distinct} hits of {items} items"
                      + (" across the front-ends" if config in MULTI_FRONT_END else ""))
            if config == "shmstore":
                check(r["objects_metric"] == distinct,
                      f"vLLM's /metrics shows the store's objects (shmstore_objects "
                      f"{r['objects_metric']})")
            if config == "shmstore":
                # The front-end's window of recent sends pins each image once; the engine
                # core's gate pins a request's items until it drops the request, which
                # it does at its next step, so the last request's may still be pinned.
                # A gate that kept its pins would hold every image it ever admitted.
                most = distinct + len(REQUESTS[-1])
                check(distinct <= r.get("pins", -1) <= most,
                      f"once the requests are done, the engine core holds at most the last "
                      f"one's items ({r.get('pins')} pins, {distinct} to {most} expected)")
            if "after_delete" in r:
                same = r["deleted"] == distinct and r["after_delete"] == answers[0]
                check(same, f"with all {r['deleted']} items deleted by hand, the next request "
                      "gets the same answer, no error"
                      + ("" if same else f" (got: {str(r['after_delete'])[:300]})"))
            if config.startswith("shmstore"):
                # Each API server writes, each engine core admits (its gate pins each
                # request's items), each worker reads.
                processes = {"shmstore-dp-2": 6, "shmstore-2-api": 4}.get(config, 3)
                check(r.get("clients") == processes,
                      f"the front-ends, engine cores and workers attached themselves "
                      f"({processes} processes: found {r.get('clients')})")
                check(bool(r["stores_running"]) and r.get("objects") == distinct,
                      f"the instance's one store holds each of the {distinct} images once "
                      f"(found {r['stores_running']}, {r.get('objects')} objects)")
                v = r.get("check", {})
                check(v.get("verdict") == "sound",
                      "`shmstore check` finds the running instance's store sound "
                      f"({v.get('verdict')}"
                      + (f": {v.get('finding')})" if v.get("finding") else ")"))
                named = [line for line in r["shmstore_lines"] if "multimodal cache in" in line]
                check(len(named) == 1 and r["stores_running"][0] in named[0],
                      "the log names the store, once")
                if config == "shmstore-dp-2":
                    check(r["stores_running"] == [OPERATOR_NAMED],
                          f"the store has the name the operator gave it ({OPERATOR_NAMED})")
                check(any("removed this instance's store(s) at exit" in line
                          for line in r["shmstore_lines"]), "the log says the store was removed")
            check(r["exit"] == 0, f"vllm serve exits cleanly on Ctrl-C (status {r['exit']})")
            check(r["stores_after"] == [],
                  f"nothing is left in the store directory after shutdown ({r['stores_after']})")
            if failures:
                print(r["log"])
                break
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
