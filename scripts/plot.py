#!/usr/bin/env python3
"""Figures from `shmstore bench --json` and the chaos test's timeline.

    scripts/python.sh plot --bench bench.json [--chaos chaos-timeline.jsonl] [--out docs/img]

Writes PNG files (each figure shows shmstore beside the floor or peer measured in the same
run, as the benchmark's table does):

- latency.png     get (hit), create + seal, seal -> wake beside their floors, log scale
- put.png         put throughput against memcpy, by size
- handoff.png     engine -> 2 workers against the same bytes over unix sockets, by size
- chaos.png       the chaos test's kills, recoveries and bytes reclaimed over time

Keys are documented in docs/benchmarks.md. The chaos timeline is written by
`cargo test --test chaos` (target/tmp/chaos-timeline.jsonl, or $SHMSTORE_CHAOS_TIMELINE).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

OURS = "#1f6fb4"
FLOOR = "#9a9a9a"


def _need(bench: dict[str, Any], *keys: str) -> list[float]:
    missing = [k for k in keys if bench.get(k) is None]
    if missing:
        sys.exit(f"plot.py: the bench JSON lacks {', '.join(missing)} (run `shmstore bench --json`)")
    return [float(bench[k]) for k in keys]


def _machine(bench: dict[str, Any]) -> str:
    return f"{bench.get('cpu', '?')}, {bench.get('cores', '?')} cores, kernel {bench.get('kernel', '?')}"


def _ns(v: float) -> str:
    return f"{v:.0f} ns" if v < 1e3 else f"{v / 1e3:.3g} us" if v < 1e6 else f"{v / 1e6:.3g} ms"


def _bars(
    ax: Any,
    labels: list[str],
    ours: list[float],
    floor: list[float],
    floor_names: list[str],
    fmt: Any = "{:.3g}".format,
) -> None:
    x = range(len(labels))
    w = 0.38
    b1 = ax.bar([i - w / 2 for i in x], ours, w, color=OURS, label="shmstore")
    b2 = ax.bar([i + w / 2 for i in x], floor, w, color=FLOOR, label="floor / peer, same run")
    ax.set_xticks(list(x), labels)
    for bars, values in ((b1, ours), (b2, floor)):
        ax.bar_label(bars, labels=[fmt(v) for v in values], padding=2, fontsize=8)
    for i, name in enumerate(floor_names):
        ax.annotate(name, (i + w / 2, floor[i]), textcoords="offset points", xytext=(0, 12),
                    ha="center", fontsize=7, color="#555555")


def latency(bench: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    get, rtt, cs4k, wake_us, fwake_us = _need(
        bench, "get_hit_p50_ns", "socket_rtt_p50_ns", "create_seal_4k_p50_ns",
        "seal_wake_p50_us", "futex_wake_p50_us",
    )
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    _bars(
        ax,
        ["get (hit), other process", "create + write + seal 4 KiB", "seal -> wake, other process"],
        [get, cs4k, wake_us * 1e3],
        [rtt, 2 * rtt, fwake_us * 1e3],
        ["socket round trip", "2 socket round trips", "bare futex wake"],
        fmt=_ns,
    )
    ax.set_yscale("log")
    ax.set_ylabel("ns, p50 (log scale)")
    ax.set_ylim(top=ax.get_ylim()[1] * 4)
    ax.set_title("Operation latency beside its floor", fontsize=11)
    ax.legend(loc="upper left", fontsize=8)
    fig.text(0.01, 0.01, _machine(bench), fontsize=7, color="#555555")
    return _save(fig, out / "latency.png")


def put(bench: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    sizes = ["1m", "16m", "64m"]
    ours = _need(bench, *[f"put_gbps_{s}" for s in sizes])
    floor = _need(bench, *[f"memcpy_gbps_{s}" for s in sizes])
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    _bars(ax, ["1 MiB", "16 MiB", "64 MiB"], ours, floor, ["memcpy"] * 3, fmt="{:.3g} GB/s".format)
    ax.set_ylabel("GB/s")
    ax.set_ylim(0, max(ours + floor) * 1.3)
    ax.set_title("put (create + copy + seal) against memcpy into a warm buffer", fontsize=11)
    ax.legend(loc="upper right", fontsize=8)
    fig.text(0.01, 0.01, _machine(bench), fontsize=7, color="#555555")
    return _save(fig, out / "put.png")


def handoff(bench: dict[str, Any], out: pathlib.Path) -> pathlib.Path:
    ours = _need(bench, "e2e_16m_ms", "e2e_64m_ms")
    peer = _need(bench, "socket_16m_ms", "socket_64m_ms")
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    _bars(ax, ["16 MiB item", "64 MiB item"], ours, peer, ["unix sockets"] * 2, fmt="{:.3g} ms".format)
    ax.set_ylim(0, max(ours + peer) * 1.3)
    ax.set_ylabel("ms per item, every byte read by 2 workers")
    ax.set_title("Engine -> 2 worker processes", fontsize=11)
    ax.legend(loc="upper left", fontsize=8)
    fig.text(0.01, 0.01, _machine(bench), fontsize=7, color="#555555")
    return _save(fig, out / "handoff.png")


def chaos(lines: list[dict[str, Any]], out: pathlib.Path) -> pathlib.Path:
    t = [r["t_s"] for r in lines]
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    ax.step(t, [r["kills"] for r in lines], where="post", color="#c0392b", label="workers SIGKILLed")
    ax.step(t, [r["recovered_clients"] for r in lines], where="post", color=OURS,
            label="dead clients recovered by live ones (killed workers and their forked children)")
    ax.set_xlabel("seconds into the run")
    ax.set_ylabel("count")
    right = ax.twinx()
    right.step(t, [r["reclaimed_bytes"] / 2**20 for r in lines], where="post", color="#27ae60",
               lw=1.2, label="MiB reclaimed from the dead (right axis)")
    right.set_ylabel("MiB reclaimed")
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize=8)
    ax.set_title("Chaos: random SIGKILLs, recovery without a daemon", fontsize=11)
    return _save(fig, out / "chaos.png")


def _save(fig: Any, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", type=pathlib.Path, help="output of `shmstore bench --json`")
    ap.add_argument("--chaos", type=pathlib.Path, help="the chaos test's timeline (JSON lines)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/img"))
    args = ap.parse_args()
    if not args.bench and not args.chaos:
        ap.error("give --bench, --chaos or both")
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.bench:
        bench = json.loads(args.bench.read_text())
        written += [latency(bench, args.out), put(bench, args.out), handoff(bench, args.out)]
    if args.chaos:
        rows = [json.loads(line) for line in args.chaos.read_text().splitlines() if line.strip()]
        if not rows:
            sys.exit(f"plot.py: {args.chaos} holds no samples")
        written.append(chaos(rows, args.out))
    for p in written:
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
