//! Unit tests of the allocator, one file per layer: [`front`] (entry points, refused
//! frees, usage and audit, threads), [`pages`] (page runs, best fit, the summary) and
//! [`slabs`] (size-class slabs, the sweep's slab repairs). The concurrent protocols are
//! model-checked in `loom_models`.

mod front;
mod pages;
mod slabs;

/// A xorshift64 generator from a nonzero seed: the tests' pseudo-random numbers, the
/// same on every run.
pub(super) fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}
