#!/usr/bin/env bash
# The allocator and table code over heap regions under miri (UB, data races, leaks).
# Covers the unit tests of alloc, table, client, id, layout, error and sync; the mapping
# itself (memfd, mmap) is out of miri's reach and is covered by the integration tests.
#
# Two passes: every test once (one seed), then the tests that start threads under 7 more
# seeds. A seed picks miri's thread schedule, weak-memory outcomes and addresses; a test
# with one thread gets nothing from the schedule or the weak memory, and the four slowest
# of those took 60 of the ~95 s a seed costs here, so all tests under 4 seeds took 300-460 s
# in CI where this takes ~150 s with more seeds where they count.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
rustup +nightly component list --installed | grep -q '^miri' || rustup +nightly component add miri rust-src
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/miri}
modules=(alloc:: table:: client:: id:: layout:: error:: sync::)
# The tests of those modules that start threads. The check below fails when a test that
# starts threads is missing here, so that a new one cannot lose its seeds unnoticed.
threaded=(
  alloc::tests::front::threads_allocate_and_free_concurrently
  table::tests::racing_creates_of_one_id_admit_exactly_one
  table::tests::pin_wait_wakes_on_seal_and_times_out
  table::tests::notify_and_nudge_wake_a_registered_sleeper
  sync::tests::wake_releases_a_waiter
)
python3 - "${threaded[@]}" <<'PY'
import re, sys
files = {"alloc::tests::front": "src/alloc/tests/front.rs",
         "alloc::tests::pages": "src/alloc/tests/pages.rs",
         "alloc::tests::slabs": "src/alloc/tests/slabs.rs", "table::tests": "src/table/tests.rs",
         "sync::tests": "src/sync.rs", "client::tests": "src/client.rs", "id::tests": "src/id.rs",
         "layout::tests": "src/layout.rs", "error::tests": "src/error.rs"}
found = set()
for module, path in files.items():
    src = open(path).read()
    tests = list(re.finditer(r"#\[test\]\s*(?:#\[[^\]]*\]\s*)*fn (\w+)", src))
    for i, m in enumerate(tests):
        end = tests[i + 1].start() if i + 1 < len(tests) else len(src)
        if re.search(r"thread::(spawn|scope)|\.spawn\(", src[m.end():end]):
            found.add(f"{module}::{m.group(1)}")
missing = found - set(sys.argv[1:])
stale = set(sys.argv[1:]) - found
if missing or stale:
    sys.exit(f"scripts/miri.sh: threaded tests not listed: {sorted(missing)}; listed but "
             f"not found or not threaded: {sorted(stale)}")
PY
echo "miri: every test, one seed"
MIRIFLAGS=${MIRIFLAGS:-} cargo +nightly miri test --lib -- "${modules[@]}"
echo "miri: the ${#threaded[@]} tests that start threads, seeds 1..7"
out=$(mktemp)
MIRIFLAGS=${MIRIFLAGS_SEEDS:-"-Zmiri-many-seeds=1..8"} \
  cargo +nightly miri test --lib -- --exact "${threaded[@]}" >"$out" 2>&1 ||
  { tail -60 "$out"; rm -f "$out"; exit 1; }
grep -E "^(Trying seed|test result)" "$out" || true
# An --exact name that matches nothing would pass silently: each must have run.
for t in "${threaded[@]}"; do
  grep -q "test $t " "$out" || { echo "miri: $t did not run" >&2; rm -f "$out"; exit 1; }
done
rm -f "$out"
