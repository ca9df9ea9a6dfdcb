#!/usr/bin/env bash
# The test command: unit, integration (real processes) and doc tests.
# Needs only the Rust toolchain; later stages (loom, miri, fuzz) have their own scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --all-targets "$@"
cargo test --doc "$@"
