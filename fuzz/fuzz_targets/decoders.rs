//! Every decoder of bytes that came from shared memory: superblock validation, hold
//! records, block kinds, slot control words, table entries, id parsing.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    shmstore::testing::decode_everything(data);
});
