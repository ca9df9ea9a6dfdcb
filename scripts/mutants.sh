#!/usr/bin/env bash
# Mutation testing of one source file: scripts/mutants.sh FILE [JOBS [CARGO-MUTANTS ARGS...]]
# e.g. scripts/mutants.sh src/table/mod.rs 2
#      scripts/mutants.sh src/region/mod.rs 2 --re 'in check_name'   (only the mutants named so)
#      scripts/mutants.sh python/shmstore/vllm/gate.py 1 --tests python/tests_vllm/test_vllm_gate.py
# A file of the Python package goes to scripts/mutants_py.py instead (one job; its own
# arguments: --tests, --re, --list), run in python/.venv-vllm (scripts/vllm.sh makes it).
# cargo-mutants changes the file one small way at a time (an operator, a return value, a
# deleted `!`) and runs the tests that cover the core against each change; a "missed"
# mutant is a change no test noticed. Not a CI stage: one file of the table's size takes
# 15-45 minutes on 2 cores. What the runs found, and which misses are equivalent or caught
# only by loom: docs/verification.md, "Mutation testing". Installs cargo-mutants if missing.
#
# The run gets a /dev/shm of its own: a tmpfs of SHMSTORE_MUTANTS_SHM (default 6G a job: a
# 4 GiB sizing test needs 5 GiB free, and each job may run one) in a
# private mount namespace, gone with everything in it when the run ends. A test process
# killed at its timeout runs no destructor, so its store stays behind; under a mutant of
# the size checks one left a 23 GiB creation file in the machine's /dev/shm, and every
# later build and test crawled for want of memory. With the cap, such a mutant meets a
# full /dev/shm instead. Where no mount namespace can be made (no root, user namespaces
# off), the run uses the machine's /dev/shm and names what it left there.
set -euo pipefail
cd "$(dirname "$0")/.."
file=${1:?usage: scripts/mutants.sh FILE [JOBS]}
jobs=${2:-1}
shift $(($# < 2 ? $# : 2))
shm_cap=${SHMSTORE_MUTANTS_SHM:-$((6 * jobs))G}
case "$file" in
  *.py)
    [ "$jobs" = 1 ] || { echo "mutants.sh: a Python file runs one job at a time" >&2; exit 2; }
    [ -x python/.venv-vllm/bin/python ] || scripts/vllm.sh
    run=(python3 scripts/mutants_py.py "$file" "$@") ;;
  *)
    command -v cargo-mutants >/dev/null || cargo install cargo-mutants --version 27.1.0 --locked
    out=target/mutants/$(echo "$file" | tr / _)
    mkdir -p "$out" ;;
esac
# The unit tests and the integration tests that drive the table and the allocator in one
# process or a few (not the chaos run, the kill points or the CLI: minutes per mutant), the
# typed errors for foreign and undersized files, and the huge-page tests, with huge pages
# and the mounts they use made ready (64 pages a job: jobs run at once, and a test that
# finds too few free skips, which would hide a mutant).
# SHMSTORE_MUTANTS_TESTS replaces that list (e.g. "--lib" for a file only unit tests use).
SHMSTORE_HUGE_PAGES=$((64 * jobs)) scripts/hugepages.sh
tests="--lib --test model --test recovery --test fork --test capacity --test multiprocess
  --test sizing --test open_errors --test huge_pages"
# shellcheck disable=SC2086 # the test list is words
[[ "$file" == *.py ]] || run=(cargo mutants -f "$file" -o "$out" --test-tool cargo -j "$jobs" "$@" --
  ${SHMSTORE_MUTANTS_TESTS:-$tests})
inside="mount -t tmpfs -o size=$shm_cap shmstore-mutants /dev/shm && exec \"\$@\""
for flags in -m -Urm; do
  if unshare "$flags" sh -c "mount -t tmpfs -o size=1M probe /dev/shm" 2>/dev/null; then
    echo "mutants.sh: the run's /dev/shm is a private tmpfs of $shm_cap (unshare $flags)"
    exec unshare "$flags" sh -c "$inside" mutants "${run[@]}"
  fi
done
echo "mutants.sh: no private mount namespace here; the run uses the machine's /dev/shm"
marker=$(mktemp)
status=0
"${run[@]}" || status=$?
# Name what the run left (test stores, and hidden creation files), for removal by hand:
# this script removes nothing of the machine's.
left=$(find /dev/shm -maxdepth 1 -newer "$marker" ! -path /dev/shm 2>/dev/null || true)
rm -f "$marker"
if [ -n "$left" ]; then
  echo "mutants.sh: files in /dev/shm made during the run (tests killed at their timeout leave theirs):"
  du -sh $left 2>/dev/null || echo "$left"
fi
exit "$status"
