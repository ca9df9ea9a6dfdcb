//! Page runs: the lower layer of the allocator.
//!
//! The heap is cut into 4 KiB pages with one bit each in the page bitmap. An allocation
//! of `n` pages finds a run of `n` clear bits and claims it word by word, in ascending
//! order, with CAS. If a word turns out to be taken, the words already claimed are rolled
//! back and the search moves past the conflict. Freeing clears the bits, so neighbouring
//! free runs coalesce by construction: there is no free list to fragment and no merge
//! step to race.
//!
//! Placement: runs under 1 MiB go first fit from a low-water mark (a hint: the lowest
//! page that may be free); runs of 1 MiB and more go best fit within a 1 GiB window,
//! where classes' empty current slabs count as free and give way (retired just before
//! the run is claimed).
//!
//! The page summary holds one bit per bitmap word (256 KiB of heap), set while that word
//! holds a taken page: a claim that takes a page in an empty word sets it, and a free
//! that leaves a word empty clears it. Best fit reads it to pass over the words that
//! hold taken pages 64 at a time (a run of 1 MiB or more holds a whole empty word), so
//! its search costs one load per 16 MiB of a heap cut into small holes. Both are
//! single-word RMWs made after the page word's own, so each lands after the page change
//! it reports: a bit can be clear on a word with taken pages (a free that emptied the
//! word raced with a claim that refilled it), which only costs a search a load, and is
//! set on an empty word only for a moment while a free is finishing, or for good if the
//! freer died there; the leak sweep owed for that death clears it again
//! ([`repair_summary`](Allocator::repair_summary)). A second level, one bit per summary
//! word (16 MiB of heap), is set while that summary word is all ones, so the search passes
//! over 1 GiB of taken words per load: the claim that fills a summary word sets it and
//! then looks again (clearing it if a free emptied a word meanwhile), and a free that
//! takes a summary word from full clears it, both with AcqRel RMWs, so the look sees the
//! free whenever the free's clear came first.
//!
//! Invariants: a set bit is a page some block owns (a page run, or a slab's pages); a
//! claimer owns exactly the bits its CASes set, and gives back exactly those on rollback
//! or free. The low-water mark is only a hint: frees lower it, a claim raises it past the
//! taken pages below its run, and a free racing with that may leave it too high, which
//! costs fit quality (every search also runs from page 0 before giving up), never memory.
//! Claims in flight are counted (begun, ended), so that a search that found no room can
//! tell a full heap from one where other processes' claims were moving under it.

use super::slab::IdleSlab;
use super::*;

/// The page-bitmap words that pages `[first, end)` cover, in ascending order, each with
/// the mask of those pages' bits in it.
fn word_masks(first: u64, end: u64) -> impl Iterator<Item = (usize, u64)> {
    let mut p = first;
    std::iter::from_fn(move || {
        (p < end).then(|| {
            let w = p / 64;
            let mask = range_mask(p % 64, (end - w * 64).min(64));
            p = (w + 1) * 64;
            (w as usize, mask)
        })
    })
}

impl Allocator<'_> {
    pub(super) fn cursor(&self) -> &AtomicU64 {
        &self.hints[CLASSES as usize].0
    }

    /// Page-run claims begun (see [`alloc_pages`](Self::alloc_pages)).
    pub(super) fn claims_begun(&self) -> &AtomicU64 {
        &self.hints[CLASSES as usize + 1].0
    }

    /// Page-run claims ended, by success or rollback.
    pub(super) fn claims_ended(&self) -> &AtomicU64 {
        &self.hints[CLASSES as usize + 2].0
    }

    /// Index of the first clear page bit in `[p, end)`.
    pub(super) fn next_free(&self, mut p: u64, end: u64) -> Option<u64> {
        while p < end {
            let w = (p / 64) as usize;
            let bits = !self.pages[w].load(Ordering::Relaxed) & range_mask(p % 64, 64);
            if bits != 0 {
                let q = (w as u64) * 64 + bits.trailing_zeros() as u64;
                return (q < end).then_some(q);
            }
            p = (w as u64 + 1) * 64;
        }
        None
    }

    /// Index of the first set page bit in `[p, end)`.
    pub(super) fn next_used(&self, mut p: u64, end: u64) -> Option<u64> {
        while p < end {
            let w = (p / 64) as usize;
            let hi = (end - (w as u64) * 64).min(64);
            let bits = self.pages[w].load(Ordering::Relaxed) & range_mask(p % 64, hi);
            if bits != 0 {
                return Some((w as u64) * 64 + bits.trailing_zeros() as u64);
            }
            p = (w as u64 + 1) * 64;
        }
        None
    }

    /// Index of the last set page bit in `[lo, p)`.
    pub(super) fn prev_used(&self, lo: u64, mut p: u64) -> Option<u64> {
        while p > lo {
            let w = ((p - 1) / 64) as usize;
            let from = lo.saturating_sub(w as u64 * 64);
            let bits = self.pages[w].load(Ordering::Relaxed) & range_mask(from, p - w as u64 * 64);
            if bits != 0 {
                return Some(w as u64 * 64 + 63 - bits.leading_zeros() as u64);
            }
            p = w as u64 * 64;
        }
        None
    }

    /// The run of free pages around `[first, end)` (which the caller found free): how far
    /// the free pages reach below `first` and from `end` on, as `[start, stop)`. A racy
    /// look (claims and frees go on), for planning only; clamped to the heap.
    pub(crate) fn free_extent(&self, first: u64, end: u64) -> (u64, u64) {
        let (first, end) = (first.min(self.npages), end.min(self.npages));
        let start = self.prev_used(0, first).map_or(0, |p| p + 1);
        let stop = self.next_used(end, self.npages).unwrap_or(self.npages);
        (start, stop)
    }

    /// Claims `[first, first + n)` word by word in ascending order. On conflict, rolls back
    /// and returns the page index that was found taken. Counted in the claims-begun /
    /// claims-ended counters, so that a searcher can tell whether bits it skipped may
    /// have been a claim in flight.
    pub(super) fn claim_run(&self, first: u64, n: u64) -> std::result::Result<(), u64> {
        self.claims_begun().fetch_add(1, Ordering::AcqRel);
        let r = self.claim_run_uncounted(first, n);
        self.claims_ended().fetch_add(1, Ordering::AcqRel);
        r
    }

    pub(super) fn claim_run_uncounted(&self, first: u64, n: u64) -> std::result::Result<(), u64> {
        for (w, mask) in word_masks(first, first + n) {
            let mut cur = self.pages[w].load(Ordering::Relaxed);
            loop {
                if cur & mask != 0 {
                    let taken = (w as u64) * 64 + (cur & mask).trailing_zeros() as u64;
                    if !crate::sync::mutation("no_rollback") {
                        self.release_range(first, (w as u64 * 64).max(first));
                    }
                    return Err(taken);
                }
                match self.pages[w].compare_exchange_weak(
                    cur,
                    cur | mask,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        if cur == 0 {
                            self.mark_occupied(w);
                        }
                        break;
                    }
                    Err(now) => cur = now,
                }
            }
        }
        Ok(())
    }

    /// Clears bits `[first, end)` that this thread set (rollback of a partial claim).
    pub(super) fn release_range(&self, first: u64, end: u64) {
        for (w, mask) in word_masks(first, end) {
            // (The mutation decides from a load before the RMW: two frees in one word
            // then each see the other's pages, and neither clears the bit.)
            let seen = crate::sync::mutation("summary_stale_read")
                .then(|| self.pages[w].load(Ordering::Relaxed));
            let before = self.pages[w].fetch_and(!mask, page_free());
            if seen.unwrap_or(before) & !mask == 0 {
                self.mark_empty(w);
            }
        }
    }

    /// Sets page word `w`'s summary bit: it holds a taken page (our claim just made it
    /// non-empty). If that fills its summary word, marks the summary word full too.
    fn mark_occupied(&self, w: usize) {
        let (g, bit) = (w / 64, 1u64 << (w % 64));
        let before = self.summary[g].fetch_or(bit, Ordering::Relaxed);
        if before != u64::MAX && before | bit == u64::MAX {
            // A free may have emptied a word of this group and cleared the group's bit
            // just before we set it: look again after setting it. (Our AcqRel RMW then
            // reads that free's Release clear, so the look sees its word's change.)
            self.groups[g / 64].fetch_or(1 << (g % 64), group_mark());
            if self.summary[g].load(Ordering::Relaxed) != u64::MAX
                && !crate::sync::mutation("group_no_recheck")
            {
                self.groups[g / 64].fetch_and(!(1 << (g % 64)), group_mark());
            }
        }
    }

    /// Clears page word `w`'s summary bit: our free just left it empty. If its summary word
    /// was full, clears that group's bit too. Clearing is always safe: a clear bit only
    /// means "look".
    fn mark_empty(&self, w: usize) {
        let (g, bit) = (w / 64, 1u64 << (w % 64));
        let before = self.summary[g].fetch_and(!bit, Ordering::Relaxed);
        if before == u64::MAX {
            self.groups[g / 64].fetch_and(!(1 << (g % 64)), group_mark());
        }
    }

    /// Whether page word `w` may have no taken page: its summary bit is clear.
    pub(super) fn maybe_empty(&self, w: usize) -> bool {
        self.summary[w / 64].load(Ordering::Relaxed) >> (w % 64) & 1 == 0
    }

    /// Whether summary word `g` is marked full (every page word of its 16 MiB holds a
    /// taken page).
    pub(super) fn group_full(&self, g: usize) -> bool {
        self.groups[g / 64].load(Ordering::Relaxed) >> (g % 64) & 1 == 1
    }

    /// The first summary word in `[g, end)` not marked full, or `end`.
    pub(super) fn next_open_group(&self, g: usize, end: usize) -> usize {
        if g >= end {
            return end;
        }
        let mut x = g / 64;
        let mut bits = !self.groups[x].load(Ordering::Relaxed) & range_mask(g as u64 % 64, 64);
        loop {
            if bits != 0 {
                return (x * 64 + bits.trailing_zeros() as usize).min(end);
            }
            x += 1;
            if x * 64 >= end {
                return end;
            }
            bits = !self.groups[x].load(Ordering::Relaxed);
        }
    }

    /// The first page word in `[w, end)` that may have no taken page (its summary bit is
    /// clear), or `end`: summary words marked full are passed over 64 at a time.
    pub(super) fn next_maybe_empty(&self, w: usize, end: usize) -> usize {
        if w >= end {
            return end;
        }
        let groups_end = end.div_ceil(64);
        let mut g = w / 64;
        let mut bits = !self.summary[g].load(Ordering::Relaxed) & range_mask(w as u64 % 64, 64);
        loop {
            if bits != 0 {
                return (g * 64 + bits.trailing_zeros() as usize).min(end);
            }
            g = self.next_open_group(g + 1, groups_end);
            if g >= groups_end {
                return end;
            }
            bits = !self.summary[g].load(Ordering::Relaxed);
        }
    }

    /// Clears the summary bit of every empty page word, then the group bit of every
    /// summary word that is not full. A freer killed between emptying a word and clearing
    /// its bits leaves the word hidden from best fit; the leak sweep owed for its death
    /// calls this. Safe at any time (see [`mark_empty`](Self::mark_empty)). Returns the
    /// number of bits cleared.
    pub(crate) fn repair_summary(&self) -> u64 {
        let mut cleared = 0;
        for (w, word) in self.pages.iter().enumerate() {
            if !self.maybe_empty(w) && word.load(Ordering::Relaxed) == 0 {
                self.mark_empty(w);
                cleared += 1;
            }
        }
        for (g, word) in self.summary.iter().enumerate() {
            if self.group_full(g) && word.load(Ordering::Relaxed) != u64::MAX {
                self.groups[g / 64].fetch_and(!(1 << (g % 64)), group_mark());
                cleared += 1;
            }
        }
        cleared
    }

    /// What hides free space from best fit, for audits (where no free is in progress and
    /// no freer died): an empty page word whose summary bit is set, or a summary word
    /// marked full that is not.
    pub(super) fn summary_hides(&self) -> Option<String> {
        if let Some(w) = (0..self.pages.len())
            .find(|&w| !self.maybe_empty(w) && self.pages[w].load(Ordering::Relaxed) == 0)
        {
            return Some(format!(
                "page word {w} is empty but the page summary says it holds taken pages"
            ));
        }
        (0..self.summary.len())
            .find(|&g| self.group_full(g) && self.summary[g].load(Ordering::Relaxed) != u64::MAX)
            .map(|g| format!("summary word {g} is marked full but is not"))
    }

    /// Finds and claims `n` pages whose first index is a multiple of `align`.
    ///
    /// Runs of [`BEST_FIT_PAGES`] or more use best fit (the smallest free run that holds
    /// them, lowest address on ties): a pass over the page bitmap from the low-water
    /// mark, cheap beside copying 1 MiB (see [`best_run`](Self::best_run)), and it keeps
    /// the large runs whole. Smaller runs use address-ordered first fit from the
    /// low-water mark, which reuses recently freed (cache-warm) memory first. Both raise
    /// the mark past the taken pages below the run they claim.
    ///
    /// A searcher cannot tell a page another process has claimed for good from one it
    /// holds for a moment in a claim that is about to roll back, so a search can come up
    /// empty while space exists. `None` ("full") is therefore only returned after a
    /// search during which no page-run claim began, ended or was in flight (at most
    /// [`FULL_RETRIES`] searches; a claimer killed mid-claim leaves its claim "in flight"
    /// for good, which costs later full searches their retries, nothing else).
    pub(super) fn alloc_pages(&self, n: u64, align: u64) -> Option<u64> {
        if n == 0 || n > self.npages {
            return None;
        }
        for _ in 0..FULL_RETRIES {
            let ended_before = self.claims_ended().load(Ordering::Acquire);
            if let Some(p) = self.search_and_claim(n, align) {
                return Some(p);
            }
            // Every bit this search read was loaded before these counters (a claim whose
            // bits we saw had counted itself as begun first: its CAS released that).
            fence(Ordering::Acquire);
            let begun = self.claims_begun().load(Ordering::Acquire);
            let ended = self.claims_ended().load(Ordering::Acquire);
            let quiet = begun == ended && ended == ended_before;
            if quiet || crate::sync::mutation("full_without_retry") {
                return None;
            }
            crate::sync::spin_hint();
        }
        None
    }

    /// One search of [`alloc_pages`](Self::alloc_pages).
    pub(super) fn search_and_claim(&self, n: u64, align: u64) -> Option<u64> {
        let hint_word = self.cursor();
        let hint = hint_word.load(Ordering::Relaxed).min(self.npages);
        if n >= BEST_FIT_PAGES && align == 1 {
            for _ in 0..4 {
                // From the low-water mark (below it everything is taken), then from page
                // 0 (the mark can be stale).
                // Empty slabs kept as their class's current slab count as free space
                // here, and give way to the run: left in place, they would split the
                // free space into holes no large object fits once they are retired.
                let idle = self.idle_slabs();
                let idle = idle.as_slice();
                // (The low-water mark counts them as taken: search from the lowest.)
                let from = idle.first().map_or(hint, |x| hint.min(x.first_page()));
                let (p, above_mark) = match self.best_run(n, from, idle) {
                    Some(p) => (p, p >= hint),
                    None => (self.best_run(n, 0, idle)?, false),
                };
                self.retire_idle_within(p, n, idle);
                if self.claim_run(p, n).is_ok() {
                    if above_mark {
                        // Raise the low-water mark past the pages below the run that are
                        // taken, as first fit does: a store filled with large objects is
                        // then searched from where its free space begins, not from its
                        // first page (one word per 256 KiB below the run, once).
                        let mark = self.next_free(hint, p).unwrap_or(p + n);
                        if mark > hint {
                            self.raise_mark(hint, mark);
                        }
                    }
                    return Some(p);
                }
            }
        }
        // First fit from the hint, then (the hint may be stale) from page 0.
        for (pass, lo) in [(0, hint), (1, 0)] {
            let mut p = lo;
            let mut first_free = None;
            while let Some(f) = self.next_free(p, self.npages) {
                first_free.get_or_insert(f);
                let cand = f.div_ceil(align) * align;
                if cand + n > self.npages {
                    break;
                }
                if let Some(u) = self.next_used(cand, cand + n) {
                    p = u + 1;
                    continue;
                }
                match self.claim_run(cand, n) {
                    Ok(()) => {
                        if let (0, Some(f0)) = (pass, first_free) {
                            // Raise the low-water mark past pages that were taken.
                            self.raise_mark(hint, if f0 == cand { cand + n } else { f0 });
                        }
                        return Some(cand);
                    }
                    Err(taken) => p = taken + 1,
                }
            }
        }
        None
    }

    /// The start of the smallest free run of at least `n` pages at or after page `from`,
    /// among the runs that start within [`FIT_WINDOW`] pages of the first one that fits
    /// (lowest address on ties). One pass over the page bitmap: `n` is at least 127
    /// pages, so a run that fits holds a whole free word, and a word with taken pages can
    /// only end a run (its free low pages) or start one (its free high pages); the runs
    /// inside it are too short to matter. So the words the page summary marks as holding
    /// taken pages are passed over 64 at a time (4096 at a time where its second level
    /// marks a summary word full), free words 8 at a time, and the words read are those
    /// at the edges of the empty ones.
    pub(super) fn best_run(&self, n: u64, from: u64, idle: &[IdleSlab]) -> Option<u64> {
        debug_assert!(n >= 127, "best fit serves runs of BEST_FIT_PAGES or more");
        let words = self.npages.div_ceil(64) as usize;
        // The next idle slab at or after word `w` (they are sorted by address).
        let mut next_idle = 0;
        let mut stop = words;
        let mut best: Option<(u64, u64)> = None;
        let mut start: Option<u64> = None;
        // A free run `[s, e)` ended: keep it if it fits better. True on an exact fit.
        let mut consider = |s: u64, e: u64, stop: &mut usize| {
            let len = e - s;
            if len < n {
                return false;
            }
            if best.is_none() {
                *stop = (s.saturating_add(FIT_WINDOW).div_ceil(64) as usize).min(words);
            }
            if best.is_none_or(|(_, l)| len < l) {
                best = Some((s, len));
            }
            len == n
        };
        let first = (from / 64) as usize;
        let mut w = first;
        while w < stop {
            while next_idle < idle.len() && idle[next_idle].word() < w {
                next_idle += 1;
            }
            let base = w as u64 * 64;
            let mut used = self.pages[w].load(Ordering::Relaxed);
            for slab in idle[next_idle..].iter().take_while(|x| x.word() == w) {
                used &= !slab.mask();
            }
            if w == first {
                used |= range_mask(0, from % 64); // before `from`: not ours to search
            }
            if used != 0 {
                // The word's free low pages end the run in progress; its free high pages
                // start the next one.
                if let Some(s) = start.take() {
                    if consider(s, base + used.trailing_zeros() as u64, &mut stop) {
                        break;
                    }
                }
                let high_free = used.leading_zeros() as u64;
                if high_free > 0 {
                    start = Some(base + 64 - high_free);
                }
            } else {
                start.get_or_insert(base);
            }
            w += 1;
            let idle_word = idle[next_idle..]
                .iter()
                .map(IdleSlab::word)
                .find(|&x| x >= w)
                .unwrap_or(usize::MAX);
            // A word that holds an idle slab is never skipped: its bits read taken but
            // are not.
            let bound = stop.min(idle_word);
            if used == 0 {
                // Inside a free run: skip the free words that follow, 8 at a time.
                while w + 8 <= bound
                    && self.pages[w..w + 8]
                        .iter()
                        .all(|x| x.load(Ordering::Relaxed) == 0)
                {
                    w += 8;
                }
            } else {
                // This word holds a taken page, so a run in progress ended in it, and the
                // one its free high pages may start is under 64 pages so far. The words up
                // to the next one the summary says may be empty each hold a taken page
                // too, so a run that starts in or reaches them ends in them, under 127
                // pages: jump to the word before that one, whose free high pages may
                // start a run.
                let next = self.next_maybe_empty(w, bound);
                if next > w {
                    start = None;
                    w = next - 1;
                }
            }
        }
        // A run still open reaches the end of the heap: the bits of its last word past
        // the end are not pages, so the run is cut at the end here (a run that starts
        // among them is empty). Nothing else needs them masked: a run ended inside the
        // word by a taken page ends below them.
        if let Some(s) = start {
            consider(s, (w as u64 * 64).min(self.npages), &mut stop);
        }
        best.map(|(f, _)| f)
    }

    /// Moves the low-water mark from `seen` up to `page`, unless it changed since it was
    /// read as `seen` (one CAS). A free racing with this may leave the mark too high:
    /// that costs fit quality (every search also runs from page 0 before giving up),
    /// never memory.
    pub(super) fn raise_mark(&self, seen: u64, page: u64) {
        let _ = self
            .cursor()
            .compare_exchange(seen, page, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Lowers the first-fit low-water mark to `page`.
    pub(super) fn lower_hint(&self, page: u64) {
        let h = self.cursor();
        let mut cur = h.load(Ordering::Relaxed);
        while page < cur {
            match h.compare_exchange_weak(cur, page, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
    }

    pub(super) fn free_pages(&self, first: u64, n: u64) -> Result<()> {
        // Check first so that a bad free changes nothing.
        let end = first + n;
        for (w, mask) in word_masks(first, end) {
            if self.pages[w].load(Ordering::Relaxed) & mask != mask {
                return Err(corrupted(format!(
                    "freeing pages {first}..{end} that are not all allocated"
                )));
            }
        }
        self.release_range(first, end);
        self.lower_hint(first);
        Ok(())
    }

    // ----- slabs -----------------------------------------------------------------------

    /// Frees pages `[first, first + n)` that the leak sweep proved belong to no one.
    pub(crate) fn free_leaked_pages(&self, first: u64, n: u64) -> Result<()> {
        if first.checked_add(n).is_none_or(|end| end > self.npages) || n == 0 {
            return Err(corrupted(format!("leaked run {first}+{n} out of bounds")));
        }
        self.free_pages(first, n)
    }
}
