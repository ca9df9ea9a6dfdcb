//! Tensor item headers (`shmstore::item::decode`): workers decode headers of objects that
//! other processes wrote, so the decoder must treat them as hostile.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    shmstore::testing::fuzz_item_header(data);
});
