//! Copying bytes into an object: [`copy_into_object`], with non-temporal stores for
//! large copies.
//!
//! An object's bytes are written once by their producer and read by other processes (or a
//! GPU's DMA engine), never again by the producing core. Ordinary stores first read every
//! destination line into this core's cache (a read for ownership) and then evict the
//! producer's own working set to hold bytes it will not read. Non-temporal stores write
//! whole lines to memory directly: a third less memory traffic, and the caches stay with
//! the producer's other work (vLLM's front-end runs the tokenizer and the HTTP server).
//! Measured on the 2-core development VM (AMD EPYC, glibc 2.36, whose `memcpy` switches to
//! such stores only above 240 MiB): 19 GB/s against 13-14 GB/s for `memcpy` at 4-64 MiB
//! into memory not in cache (docs/benchmarks.md, "Large puts").
//!
//! Invariants:
//! * the destination holds exactly the source's bytes when the function returns;
//! * the streamed stores are fenced (`sfence`) before it returns: they are weakly
//!   ordered, and the seal that publishes the object (a release store) must not become
//!   visible before them;
//! * copies under [`STREAM_FROM`] bytes, targets other than x86-64, and Miri (which does
//!   not model these stores) use an ordinary copy.

/// Copies of this many bytes or more use non-temporal stores. Below it the destination
/// may still be in this core's cache (an object put where one was freed a moment ago, as
/// in a put/delete loop), and ordinary stores into cached lines beat streaming to memory:
/// with the threshold at 256 KiB, `shmstore bench`'s `put 1 MiB` row (same slot reused,
/// warm) fell from 0.9x to 0.59x `memcpy`; at 2 MiB it stays at 0.91x, while `put 16
/// MiB` and `put 64 MiB` run at 1.35x and 1.51x `memcpy`.
pub(crate) const STREAM_FROM: usize = 2 << 20;

/// Copies `src` into `dst` (same length), streaming large copies past the caches.
///
/// # Panics
/// If the lengths differ, as `copy_from_slice` does.
pub(crate) fn copy_into_object(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_into_object: lengths differ");
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if src.len() >= STREAM_FROM {
        stream(dst, src);
        return;
    }
    dst.copy_from_slice(src);
    written(src.len(), 0);
}

#[cfg(test)]
thread_local! {
    /// Bytes this thread's copies wrote with ordinary and with streaming stores.
    static WRITTEN: std::cell::Cell<[usize; 2]> = const { std::cell::Cell::new([0; 2]) };
}

/// Counts bytes written by ordinary and by streaming stores (tests only: a byte written
/// twice, or a large copy not streamed, leaves the result right and costs only time).
#[inline(always)]
fn written(_ordinary: usize, _streamed: usize) {
    #[cfg(test)]
    WRITTEN.with(|w| {
        let [o, s] = w.get();
        w.set([o + _ordinary, s + _streamed]);
    });
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
fn stream(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LINE: usize = 64;
    // The head, up to the first 64-byte boundary of the destination, and the tail after
    // the last whole line: ordinary copies (objects start 64-byte aligned, so usually
    // there is no head).
    let head = dst.as_ptr().align_offset(LINE).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let lines = (dst.len() - head) / LINE;
    let body = head + lines * LINE;
    let d = dst[head..body].as_mut_ptr();
    let s = src[head..body].as_ptr();
    for i in 0..lines {
        // SAFETY: `i * LINE + 64 <= body - head`, the length of both sub-slices, so every
        // load reads inside `src` and every store writes inside `dst`; `d + i * LINE` is
        // 64-byte aligned (`head` aligned it), which `_mm_stream_si128` needs (16 bytes);
        // the loads are unaligned loads. `dst` and `src` cannot overlap (`&mut` and `&`).
        // SSE2 is part of the x86-64 baseline, so the instructions exist.
        unsafe {
            let from = s.add(i * LINE).cast::<__m128i>();
            let to = d.add(i * LINE).cast::<__m128i>();
            let a = _mm_loadu_si128(from);
            let b = _mm_loadu_si128(from.add(1));
            let c = _mm_loadu_si128(from.add(2));
            let e = _mm_loadu_si128(from.add(3));
            _mm_stream_si128(to, a);
            _mm_stream_si128(to.add(1), b);
            _mm_stream_si128(to.add(2), c);
            _mm_stream_si128(to.add(3), e);
        }
    }
    dst[body..].copy_from_slice(&src[body..]);
    written(head + (dst.len() - body), body - head);
    // Orders the streamed stores before every later store of this thread, the seal's
    // release store included (module invariants).
    // SAFETY: SSE is part of the x86-64 baseline; the fence has no memory operands.
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn every_length_and_misalignment_around_the_streaming_threshold_copies_exactly() {
        // Destinations at every offset of a line, lengths just under, at and over the
        // threshold, and with every tail length: head, body and tail all exercised.
        let mut buf = vec![0u8; STREAM_FROM + 4 * 64 + 64];
        for offset in [0usize, 1, 15, 16, 33, 63] {
            for len in [
                STREAM_FROM - 1,
                STREAM_FROM,
                STREAM_FROM + 1,
                STREAM_FROM + 63,
                STREAM_FROM + 64 + 17,
            ] {
                let src = pattern(len, (offset + len) as u8);
                buf.fill(0xAA);
                // Align the base so that `offset` is the destination's offset in a line.
                let base = buf.as_ptr().align_offset(64);
                let dst = &mut buf[base + offset..base + offset + len];
                copy_into_object(dst, &src);
                assert_eq!(
                    &buf[base + offset..base + offset + len],
                    &src[..],
                    "offset {offset}, len {len}"
                );
                assert!(
                    buf[..base + offset].iter().all(|&b| b == 0xAA),
                    "wrote before the destination"
                );
                assert!(
                    buf[base + offset + len..].iter().all(|&b| b == 0xAA),
                    "wrote after the destination"
                );
            }
        }
    }

    #[test]
    fn small_copies_are_plain_copies() {
        let src = pattern(1000, 7);
        let mut dst = vec![0u8; 1000];
        copy_into_object(&mut dst, &src);
        assert_eq!(dst, src);
    }

    /// What each copy wrote, by kind of store: `[ordinary, streamed]`.
    fn stores_of(dst: &mut [u8], src: &[u8]) -> [usize; 2] {
        WRITTEN.with(|w| w.set([0; 2]));
        copy_into_object(dst, src);
        WRITTEN.with(|w| w.get())
    }

    /// Each byte is written once, and every whole destination line of a copy of
    /// [`STREAM_FROM`] bytes or more is streamed: the head before the first line boundary
    /// and the tail after the last whole line are the only ordinary stores. Smaller copies
    /// are ordinary throughout.
    #[test]
    fn large_copies_stream_every_whole_line_once_and_small_ones_none() {
        let mut buf = vec![0u8; STREAM_FROM + 3 * 64];
        let base = buf.as_ptr().align_offset(64);
        for (offset, len) in [
            (0, STREAM_FROM),
            (5, STREAM_FROM + 100),
            (63, STREAM_FROM + 1),
        ] {
            let src = pattern(len, 3);
            let dst = &mut buf[base + offset..base + offset + len];
            let head = (64 - offset) % 64;
            let lines = (len - head) / 64;
            let expected = if cfg!(all(target_arch = "x86_64", not(miri))) {
                [len - lines * 64, lines * 64]
            } else {
                [len, 0]
            };
            assert_eq!(stores_of(dst, &src), expected, "offset {offset}, len {len}");
            assert_eq!(&buf[base + offset..base + offset + len], &src[..]);
        }
        let src = pattern(STREAM_FROM - 1, 4);
        let mut dst = vec![0u8; STREAM_FROM - 1];
        assert_eq!(stores_of(&mut dst, &src), [STREAM_FROM - 1, 0]);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn different_lengths_panic() {
        copy_into_object(&mut [0u8; 3], &[1, 2]);
    }
}
