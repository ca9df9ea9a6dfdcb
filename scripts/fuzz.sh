#!/usr/bin/env bash
# Run one cargo-fuzz target: scripts/fuzz.sh TARGET SECONDS
# Targets: ops, hostile_open, hostile_region, decoders, item_header. Installs nightly and cargo-fuzz
# if missing. Crashes land in fuzz/artifacts/TARGET/; the corpus grows in fuzz/corpus/TARGET/.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: scripts/fuzz.sh TARGET SECONDS}
secs=${2:-60}
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
# The release the campaigns in docs/verification.md ran with: a newer one may need a newer
# compiler than the machine's stable Rust, which builds it.
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version 0.13.2 --locked
mkdir -p "fuzz/corpus/$target"
# -rss_limit_mb: the harness maps a small store per run; -timeout: a hang is a failure.
cargo +nightly fuzz run "$target" "fuzz/corpus/$target" -- \
  -max_total_time="$secs" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1
