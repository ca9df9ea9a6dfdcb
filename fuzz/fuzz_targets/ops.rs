//! Operation sequences against the model (the same `Op` and harness as tests/model.rs).
#![no_main]
use libfuzzer_sys::fuzz_target;
use shmstore::testing::{Harness, Op};

fuzz_target!(|ops: Vec<Op>| {
    let mut h = Harness::new();
    for op in ops.iter().take(256) {
        if let Err(e) = h.apply(op) {
            panic!("model disagreement: {e}");
        }
    }
    if let Err(e) = h.drain() {
        panic!("{e}");
    }
});
