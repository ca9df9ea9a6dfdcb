//! Operation sequences against the model (the same `Op` and harness as tests/model.rs),
//! on a store that fails when full or, for odd-length sequences, one that evicts.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shmstore::testing::{Harness, Op};
use shmstore::WhenFull;

fuzz_target!(|ops: Vec<Op>| {
    let policy = if ops.len() % 2 == 0 { WhenFull::Fail } else { WhenFull::Evict };
    let mut h = Harness::with_policy(policy);
    for op in ops.iter().take(256) {
        if let Err(e) = h.apply(op) {
            panic!("model disagreement: {e}");
        }
    }
    if let Err(e) = h.drain() {
        panic!("{e}");
    }
});
