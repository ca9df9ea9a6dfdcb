//! A valid, populated store whose metadata is scribbled over with arbitrary bytes, then
//! used: every operation must return an error or work; never crash, hang or read outside
//! the region.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shmstore::testing::scribble_and_exercise;

fuzz_target!(|writes: Vec<(u32, Vec<u8>)>| {
    let writes: Vec<_> = writes.into_iter().take(16).collect();
    let _ = scribble_and_exercise(&writes);
});
