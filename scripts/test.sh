#!/usr/bin/env bash
# The test command: unit, integration (real processes: multi-process, crash recovery, a
# 20 s chaos run, a process killed at every kill point of 22 operations, alone and with a
# rival reading), property and doc
# tests, then the Python package's pytest suite (scripts/python.sh builds it into
# python/.venv, installing maturin, numpy and pytest from PyPI the first time). Later stages (loom, miri, fuzz) have their own scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --all-targets "$@"
# A process killed at every write of each operation (the `kill-points` feature builds the
# library once more, with the crash hook; tests/kill_points.rs); then the same kills while
# another process reads, pins and checks the same objects throughout (the rival mode).
cargo test --features kill-points --test kill_points "$@"
SHMSTORE_KILL_POINTS_RIVAL=1 cargo test --features kill-points --test kill_points "$@"
cargo test --doc "$@"
scripts/python.sh test
