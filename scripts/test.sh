#!/usr/bin/env bash
# The test command: unit, integration (real processes: multi-process, crash recovery, a
# 20 s chaos run), property and doc tests, then the Python package's pytest suite
# (scripts/python.sh builds it into python/.venv, installing maturin, numpy and pytest from
# PyPI the first time). Later stages (loom, miri, fuzz) have their own scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --all-targets "$@"
cargo test --doc "$@"
scripts/python.sh test
