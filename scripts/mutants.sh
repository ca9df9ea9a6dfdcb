#!/usr/bin/env bash
# Mutation testing of one source file: scripts/mutants.sh FILE [JOBS]
# e.g. scripts/mutants.sh src/table/mod.rs 2
# cargo-mutants changes the file one small way at a time (an operator, a return value, a
# deleted `!`) and runs the tests that cover the core against each change; a "missed"
# mutant is a change no test noticed. Not a CI stage: one file of the table's size takes
# 15-45 minutes on 2 cores. What the runs found, and which misses are equivalent or caught
# only by loom: docs/verification.md, "Mutation testing". Installs cargo-mutants if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
file=${1:?usage: scripts/mutants.sh FILE [JOBS]}
jobs=${2:-1}
command -v cargo-mutants >/dev/null || cargo install cargo-mutants --version 27.1.0 --locked
out=target/mutants/$(echo "$file" | tr / _)
mkdir -p "$out"
# The unit tests and the integration tests that drive the table and the allocator in one
# process or a few (not the chaos run, the kill points or the CLI: minutes per mutant).
marker=$(mktemp)
status=0
cargo mutants -f "$file" -o "$out" --test-tool cargo -j "$jobs" -- \
  --lib --test model --test recovery --test fork --test capacity --test multiprocess --test sizing ||
  status=$?
# A test process killed at its timeout runs no destructor, so its store stays in
# /dev/shm; under a mutant of the size checks one left a 23 GiB creation file there, and
# every later build and test crawled for want of memory. Name what the run left (test
# stores, and hidden creation files), for removal by hand: this script removes nothing.
left=$(find /dev/shm -maxdepth 1 -newer "$marker" ! -path /dev/shm 2>/dev/null || true)
rm -f "$marker"
if [ -n "$left" ]; then
  echo "mutants.sh: files in /dev/shm made during the run (tests killed at their timeout leave theirs):"
  du -sh $left 2>/dev/null || echo "$left"
fi
exit "$status"
