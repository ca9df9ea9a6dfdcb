//! `open` of arbitrary file bytes, and of forged files whose superblock passes the checksum
//! but whose fields are arbitrary: an error, or a store that keeps working.
#![no_main]
use libfuzzer_sys::fuzz_target;
use shmstore::testing::{forged_store_bytes, open_bytes};

#[derive(Debug, arbitrary::Arbitrary)]
enum Input {
    Raw(Vec<u8>),
    Forged { offset: u8, patch: Vec<u8>, file_len: u32 },
}

fuzz_target!(|input: Input| {
    match input {
        Input::Raw(bytes) => {
            open_bytes(&bytes);
        }
        Input::Forged { offset, patch, file_len } => {
            open_bytes(&forged_store_bytes(offset, &patch, file_len));
        }
    }
});
