#!/usr/bin/env bash
# The allocator and table code over heap regions under miri (UB, data races, leaks).
# Covers the unit tests of alloc, table, client, id, layout, error and sync; the mapping
# itself (memfd, mmap) is out of miri's reach and is covered by the integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
rustup +nightly component list --installed | grep -q '^miri' || rustup +nightly component add miri rust-src
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/miri}
# Many seeds: each run explores another thread interleaving and weak-memory outcome.
export MIRIFLAGS=${MIRIFLAGS:-"-Zmiri-many-seeds=0..4"}
cargo +nightly miri test --lib -- alloc:: table:: client:: id:: layout:: error:: sync::
