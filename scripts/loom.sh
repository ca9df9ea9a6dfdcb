#!/usr/bin/env bash
# Loom models of the lock-free protocols (src/loom_models.rs).
#
#   scripts/loom.sh               all models, LOOM_MAX_PREEMPTIONS=2 (what CI runs)
#   scripts/loom.sh 3             the deeper run
#   scripts/loom.sh --mutations   run each model with its deliberate bug and check that it fails
set -euo pipefail
cd "$(dirname "$0")/.."
export LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-2}
# A separate target dir keeps loom builds from invalidating the normal ones.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/loom}

if [ "${1:-}" != "--mutations" ]; then
  [ -n "${1:-}" ] && export LOOM_MAX_PREEMPTIONS=$1
  echo "loom: LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS"
  RUSTFLAGS="--cfg loom" cargo test --release --lib loom_ -- --test-threads=2
  exit 0
fi

# mutation -> the model that must catch it
mutations=(
  "seal_relaxed:loom_seal_wakes_blocked_get_and_publishes_payload"
  "lost_wakeup:loom_seal_wakes_blocked_get_and_publishes_payload"
  "no_gen_bump:loom_lookup_races_delete_and_reuse"
  "bucket_no_version:loom_create_races_delete_and_recreate"
  "no_rollback:loom_page_runs_claim_and_roll_back"
  "summary_stale_read:loom_page_summary_follows_racing_frees"
  "group_no_recheck:loom_summary_group_mark_races_a_free"
  "group_relaxed:loom_summary_group_mark_races_a_free"
  "pin_acqrel:loom_pin_races_delete_frees_once"
  "evict_pinned:loom_eviction_races_pin"
  "evict_pinned:loom_neighbour_eviction_races_pin"
  "evict_pinned:loom_delete_unpinned_races_pin"
  "full_without_retry:loom_full_only_when_no_run_is_free"
  "inherit_unlocked:loom_moving_into_a_dead_slot_races_its_recovery"
  "free_relaxed:loom_page_run_hand_off"
  "slab_free_relaxed:loom_slab_block_hand_off"
  "slot_release_relaxed:loom_table_slot_hand_off"
  "adopt_by_reread:loom_adopt_races_last_unpin_of_deleted_object"
  "adopt_by_reread:loom_draining_get_races_last_unpin_of_deleted_object"
  "draining_takes_aborted:loom_draining_get_races_abort"
)
# One build: under cfg(loom) the mutation is read from the environment when a model runs
# (crate::sync::mutation), so each mutation is a run of the same test binary.
RUSTFLAGS="--cfg loom" cargo test --release --lib --no-run >/tmp/loom-mutation-build.log 2>&1 || {
  cat /tmp/loom-mutation-build.log; exit 1; }
failed=0
for m in "${mutations[@]}"; do
  name=${m%%:*}; model=${m#*:}
  if SHMSTORE_MUTATION=$name RUSTFLAGS="--cfg loom" \
      cargo test --release --lib "$model" -- --exact "loom_models::$model" >/tmp/loom-mutation-$name.log 2>&1; then
    echo "MUTATION NOT CAUGHT: $name passed $model (log: /tmp/loom-mutation-$name.log)"
    failed=1
  elif grep -q "panicked at" /tmp/loom-mutation-$name.log; then
    why=$(grep -m1 -A1 "panicked at" /tmp/loom-mutation-$name.log | tail -1 | cut -c1-120 || true)
    echo "caught: $name by $model (${why})"
  else
    # A failure that is not a model's panic (a build error, a missing model) is not a catch.
    tail -20 /tmp/loom-mutation-$name.log
    echo "MUTATION RUN FAILED WITHOUT A MODEL FAILURE: $name ($model)"
    failed=1
  fi
done
exit $failed
