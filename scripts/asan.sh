#!/usr/bin/env bash
# The multi-process, open-error, model and crash-recovery tests under AddressSanitizer. Child processes
# are re-executions of the same instrumented test binary, so they are checked too.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/asan}
# handle_segv=0: one test proves that a write to a read-only view dies of SIGSEGV.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:handle_segv=0}
RUSTFLAGS="-Zsanitizer=address" cargo +nightly test --target "$(rustc -vV | sed -n 's/^host: //p')" \
  --test multiprocess --test open_errors --test model --test recovery
