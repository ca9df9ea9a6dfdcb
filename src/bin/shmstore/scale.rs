//! `shmstore bench --scale`: how the store behaves as it grows, each figure beside its
//! floor measured in the same run.
//!
//! 1. create + seal, get (hit) and delete at 1k, 100k and 1M objects, beside the same
//!    operation at 1k objects and a random cache-line read in an array the size of the
//!    table (what one lookup in a table that size cannot beat);
//! 2. create and open at 1, 4 and 16 GiB (each skipped, with a message, when /dev/shm
//!    cannot hold it), beside `posix_fallocate` of a file of the same size in /dev/shm;
//!    the first 64 MiB put into the new store beside a warm one, the first 64 MiB read
//!    by a freshly attached process beside its second read (each timed with nothing of
//!    the object in the CPU caches, three rounds, medians), and a 1 MiB allocation with
//!    the heap full below its top beside a copy of the 1 MiB;
//! 3. page-table memory per attached process with the whole store mapped, with 4 KiB
//!    pages and (where the kernel has them free) 2 MiB huge pages, beside 8 bytes per page;
//!    with a 2 MiB hugetlbfs mounted, the first 64 MiB read of a fresh attach on huge pages;
//!    with a tmpfs mounted `huge=within_size`, both for transparent huge pages.

use crate::child::ids;
use crate::ipc::{median, percentile, CacheEmptier, Worker};
use crate::report::{ns, ratio, Report};
use shmstore::{HugePages, ObjectId, Store, StoreConfig};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

const GIB: u64 = 1 << 30;
/// How many times each create, first put and first read is timed (medians are shown).
const ROUNDS: usize = 3;
const MIB: u64 = 1 << 20;

/// Free bytes of the file system holding `dir`.
fn free_bytes(dir: &Path) -> u64 {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return 0;
    };
    // SAFETY: statvfs is plain old data; all-zero is a valid value to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    st.f_bavail as u64 * st.f_frsize as u64
}

/// This process's page-table memory (`VmPTE` in /proc/self/status), bytes.
pub fn vm_pte() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmPTE:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib << 10)
}

/// Removes files however the run ends.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

pub fn run(quick: bool, r: &mut Report, progress: &dyn Fn(&str)) -> Result<(), String> {
    objects(quick, r, progress)?;
    sizes(quick, r, progress)?;
    page_tables(r, progress)
}

// ---- 1. operations as the object count grows ------------------------------------------

/// Nanoseconds per random 64-byte read in an array of `lines` cache lines, each read
/// depending on the previous one (latency, not bandwidth).
fn random_line_read_ns(lines: usize) -> f64 {
    // A random cycle through all lines (Sattolo), so that the hardware cannot prefetch.
    let mut next: Vec<u64> = (0..lines as u64).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..lines).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        next.swap(i, (x % i as u64) as usize);
    }
    let mut table = vec![[0u64; 8]; lines];
    for (i, n) in next.iter().enumerate() {
        table[i][0] = *n;
    }
    let reads = 2_000_000usize;
    let mut at = 0usize;
    let t = Instant::now();
    for _ in 0..reads {
        at = table[at][0] as usize;
    }
    std::hint::black_box(at);
    t.elapsed().as_nanos() as f64 / reads as f64
}

fn objects(quick: bool, r: &mut Report, progress: &dyn Fn(&str)) -> Result<(), String> {
    let counts: [(usize, &str, [&'static str; 4]); 3] = [
        (
            1_000,
            "1k",
            [
                "scale_create_1k_ns",
                "scale_get_1k_ns",
                "scale_delete_1k_ns",
                "line_read_1k_ns",
            ],
        ),
        (
            100_000,
            "100k",
            [
                "scale_create_100k_ns",
                "scale_get_100k_ns",
                "scale_delete_100k_ns",
                "line_read_100k_ns",
            ],
        ),
        (
            1_000_000,
            "1M",
            [
                "scale_create_1m_ns",
                "scale_get_1m_ns",
                "scale_delete_1m_ns",
                "line_read_1m_ns",
            ],
        ),
    ];
    let gets = if quick { 200_000 } else { 1_000_000 };
    let mut at_1k = [0.0f64; 3];
    for (n, label, keys) in counts {
        progress(&format!("scale: {label} objects"));
        let cfg = StoreConfig {
            max_objects: n as u64,
            populate_in_background: false,
            ..StoreConfig::with_capacity(256 * MIB)
        };
        let store = Store::create_anonymous(&cfg).map_err(err)?;
        // As a store that has run for a while is: its creator has rebuilt the heap and the
        // metadata as 2 MiB pages (the default), so lookups pay no 4 KiB TLB misses.
        store.prefault();
        let slots = store.stats().table_slots as usize;
        let ids = ids(&format!("scale{label}"), n);
        let data = [7u8; 64];
        let mut t_create = Vec::with_capacity(n);
        for id in &ids {
            let t = Instant::now();
            store.put(id, &data).map_err(err)?;
            t_create.push(t.elapsed().as_nanos() as u64);
        }
        // Random ids, laid out in the order they are read (so that reading the id itself
        // is not a cache miss of the benchmark's own).
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let order: Vec<ObjectId> = (0..gets)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ids[(x % n as u64) as usize]
            })
            .collect();
        let mut t_get = Vec::with_capacity(gets);
        for id in &order {
            let t = Instant::now();
            let v = store.try_get(id).map_err(err)?;
            drop(v);
            t_get.push(t.elapsed().as_nanos() as u64);
        }
        let mut t_delete = Vec::with_capacity(n);
        for id in &ids {
            let t = Instant::now();
            store.delete(id).map_err(err)?;
            t_delete.push(t.elapsed().as_nanos() as u64);
        }
        let figs = [
            r.fig(keys[0], percentile(&mut t_create, 50.0) as f64),
            r.fig(keys[1], percentile(&mut t_get, 50.0) as f64),
            r.fig(keys[2], percentile(&mut t_delete, 50.0) as f64),
        ];
        // A lookup must touch three random lines of a table this size (bucket word,
        // slot, pin-counter row): beyond the 1k figure, that is the floor.
        let floor = r.fig(keys[3], random_line_read_ns(slots));
        if n == 1_000 {
            at_1k = figs;
        }
        for (k, what) in ["create + seal 64 B", "get hit", "delete"]
            .iter()
            .enumerate()
        {
            let bound = at_1k[k] + 3.0 * floor;
            r.row(
                format!("{what} at {label} objects, p50"),
                ns(figs[k]),
                format!(
                    "at 1k {} + 3 random line reads in {} MiB ({} each) = {}",
                    ns(at_1k[k]),
                    (slots * 64) >> 20,
                    ns(floor),
                    ns(bound)
                ),
                ratio(figs[k], bound),
                "<= 1k + 3 line reads",
            );
        }
    }
    Ok(())
}

// ---- 2. create and open as the capacity grows ---------------------------------------------

/// `posix_fallocate` of a `size`-byte file in `dir`, timed alone, then removed.
fn fallocate_floor(dir: &Path, size: u64) -> Result<Duration, String> {
    let path = dir.join(format!("shmstore-bench-floor-{}", std::process::id()));
    let _cleanup = Cleanup(vec![path.clone()]);
    let f = std::fs::File::create(&path).map_err(err)?;
    let t = Instant::now();
    // SAFETY: a valid descriptor of a file we own; fallocate only allocates its blocks.
    let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, size as libc::off_t) };
    let took = t.elapsed();
    if rc != 0 {
        return Err(format!("posix_fallocate of {size} B: error {rc}"));
    }
    Ok(took)
}

fn sizes(quick: bool, r: &mut Report, progress: &dyn Fn(&str)) -> Result<(), String> {
    let dir = PathBuf::from("/dev/shm");
    let pid = std::process::id();
    let sizes: &[(u64, &str, [&'static str; 8])] = &[
        (
            GIB,
            "1 GiB",
            [
                "create_1g_s",
                "fallocate_1g_s",
                "open_1g_ms",
                "first_put_1g_ms",
                "warm_put_1g_ms",
                "first_read_1g_ms",
                "alloc_full_below_1g_ns",
                "alloc_in_holes_1g_ns",
            ],
        ),
        (
            4 * GIB,
            "4 GiB",
            [
                "create_4g_s",
                "fallocate_4g_s",
                "open_4g_ms",
                "first_put_4g_ms",
                "warm_put_4g_ms",
                "first_read_4g_ms",
                "alloc_full_below_4g_ns",
                "alloc_in_holes_4g_ns",
            ],
        ),
        (
            16 * GIB,
            "16 GiB",
            [
                "create_16g_s",
                "fallocate_16g_s",
                "open_16g_ms",
                "first_put_16g_ms",
                "warm_put_16g_ms",
                "first_read_16g_ms",
                "alloc_full_below_16g_ns",
                "alloc_in_holes_16g_ns",
            ],
        ),
    ];
    let object = vec![0x5au8; 64 * MIB as usize];
    for &(size, label, keys) in sizes {
        if quick && size > 4 * GIB {
            r.notes.push(format!(
                "{label}: skipped in --quick (run `shmstore bench --scale`)"
            ));
            continue;
        }
        // The floor file and then the store, one at a time, plus room to spare.
        let free = free_bytes(&dir);
        if free < size + size / 8 + GIB {
            r.notes.push(format!(
                "{label}: skipped: /dev/shm has {:.1} GiB free, this row needs {:.1} GiB \
                 (run the container with a larger --shm-size)",
                free as f64 / GIB as f64,
                (size + size / 8 + GIB) as f64 / GIB as f64
            ));
            continue;
        }
        progress(&format!("scale: create and open at {label}"));
        let name = format!("shmstore-bench-scale-{pid}");
        let path = dir.join(&name);
        let _cleanup = Cleanup(vec![path.clone()]);
        let cfg = StoreConfig {
            progress: false,
            ..StoreConfig::with_capacity(size)
        };
        // On a VM, allocating the same gigabytes takes up to 1.5x longer from one moment
        // to the next, and a 64 MiB copy 6 to 11 ms: the floor and the store are timed in
        // turns, three times each, and so are the first put, the warm one and a fresh
        // attach's reads into each new store; each row compares medians. Each round
        // starts with nothing of the previous one left (its store dropped, which stops
        // its zeroing thread, and removed).
        let mut t = [(); 7].map(|_| Vec::with_capacity(ROUNDS));
        let [floors, creates, first_puts, warm_puts, opens, first_reads, warm_reads] = &mut t;
        let id = ObjectId::of_key("scale-64m");
        let mut created = None;
        for _ in 0..ROUNDS {
            if let Some(old) = created.take() {
                drop::<Store>(old);
                std::fs::remove_file(&path).map_err(err)?;
            }
            floors.push(fallocate_floor(&dir, size)?.as_secs_f64());
            let t = Instant::now();
            let store = Store::create(&name, &cfg).map_err(err)?;
            creates.push(t.elapsed().as_secs_f64());
            // The first put into the new store (its pages not yet touched), then a warm
            // one into the same memory, each with nothing of either in the CPU caches
            // (see `CacheEmptier`, allocated after the store and freed before the next).
            let caches = CacheEmptier::new();
            caches.empty();
            let t = Instant::now();
            store.put(&id, &object).map_err(err)?;
            first_puts.push(t.elapsed().as_secs_f64() * 1e3);
            store.delete(&id).map_err(err)?;
            caches.empty();
            let t = Instant::now();
            store.put(&id, &object).map_err(err)?;
            warm_puts.push(t.elapsed().as_secs_f64() * 1e3);
            drop(caches);
            let (open_ms, first_read, warm_read) = fresh_attach_reads(&path, &id)?;
            opens.push(open_ms);
            first_reads.push(first_read);
            warm_reads.push(warm_read);
            created = Some(store);
        }
        let store = created.expect("at least one round");
        let floor = r.fig(keys[1], median(floors));
        let create = r.fig(keys[0], median(creates));
        let first_put = r.fig(keys[3], median(first_puts));
        let warm_put = r.fig(keys[4], median(warm_puts));
        let open_ms = r.fig(keys[2], median(opens));
        let first_read = r.fig(keys[5], median(first_reads));
        let warm_read = median(warm_reads);
        r.row(
            format!("create a {label} store"),
            format!("{create:.2} s (median of {ROUNDS})"),
            format!("posix_fallocate alone {floor:.2} s, timed in turns with it"),
            ratio(create, floor),
            "<= 1.5x fallocate",
        );
        r.row(
            format!("open it from a new process ({label})"),
            format!("{open_ms:.2} ms (median of {ROUNDS})"),
            "-".into(),
            "-".into(),
            "<= 20 ms",
        );
        r.row(
            format!("first 64 MiB put after create ({label})"),
            format!("{first_put:.1} ms (median of {ROUNDS})"),
            format!("warm put {warm_put:.1} ms"),
            ratio(first_put, warm_put),
            "<= 1.2x warm",
        );
        r.row(
            format!("first 64 MiB read, fresh attach ({label})"),
            format!("{first_read:.1} ms (median of {ROUNDS})"),
            format!("second read {warm_read:.1} ms"),
            ratio(first_read, warm_read),
            "<= 1.5x warm",
        );
        alloc_full_below(&store, label, keys[6], r)?;
        let (o, c) = crate::bench::alloc_in_holes_ns(&store, 1000)?;
        let o = r.fig(keys[7], o);
        r.row(
            format!("alloc + free 1 MiB, heap in 64 KiB holes ({label}), p50"),
            ns(o),
            format!("memcpy of the 1 MiB {}", ns(c)),
            ratio(o, c),
            "-",
        );
        drop(store);
    }
    Ok(())
}

/// Allocating 1 MiB in a store whose heap is full below its top 64 MiB (filled with
/// 64 MiB blocks): best fit searches from where the free space begins, so this costs the
/// same at any capacity. Beside a copy of the 1 MiB, which is what it is allocated for.
fn alloc_full_below(
    store: &Store,
    label: &str,
    key: &'static str,
    r: &mut Report,
) -> Result<(), String> {
    let cap = store.stats().capacity;
    let mut blocks = Vec::new();
    // (Raw blocks are not objects: `used` does not count them.)
    let mut taken = store.stats().used;
    while taken + 128 * MIB <= cap {
        match store.raw_alloc(64 * MIB) {
            Ok(b) => blocks.push(b),
            Err(_) => break,
        }
        taken += 64 * MIB;
    }
    let (o, c) = crate::bench::alloc_beside_copy(store, 1000)?;
    for b in blocks {
        store.raw_free(b).map_err(err)?;
    }
    let o = r.fig(key, o);
    r.row(
        format!("alloc + free 1 MiB, store full below its top ({label}), p50"),
        ns(o),
        format!("memcpy of the 1 MiB {}", ns(c)),
        ratio(o, c),
        "-",
    );
    Ok(())
}

/// A fresh process opens the store at `path` (as vLLM's workers do) and reads object `id`
/// twice: (open, first read, second read), in ms.
fn fresh_attach_reads(path: &Path, id: &ObjectId) -> Result<(f64, f64, f64), String> {
    let mut w = Worker::spawn(
        "fresh-attach",
        &[path.display().to_string(), id.to_string()],
    )
    .map_err(err)?;
    let v = w.recv_numbers()?;
    w.finish();
    match v[..] {
        [open, first, second, ..] => Ok((open, first, second)),
        _ => Err(format!("fresh-attach reported {v:?}, expected 3 numbers")),
    }
}

// ---- 3. page tables -----------------------------------------------------------------------

/// Page-table bytes per GiB this process pays with the whole store mapped and populated:
/// an anonymous store, or with `dir` a named one there.
fn pte_per_gib(cfg: &StoreConfig, dir: Option<&Path>) -> Result<f64, String> {
    let mut cleanup = Cleanup(Vec::new());
    let store = match dir {
        None => Store::create_anonymous(cfg).map_err(err)?,
        Some(dir) => {
            let name = format!("shmstore-bench-pte-{}", std::process::id());
            cleanup.0.push(dir.join(&name));
            let cfg = StoreConfig {
                dir: dir.to_path_buf(),
                ..cfg.clone()
            };
            Store::create(&name, &cfg).map_err(err)?
        }
    };
    let before = vm_pte();
    store.prefault();
    let after = vm_pte();
    drop(store);
    drop(cleanup);
    Ok(after.saturating_sub(before) as f64 / (cfg.capacity as f64 / GIB as f64))
}

fn page_tables(r: &mut Report, progress: &dyn Fn(&str)) -> Result<(), String> {
    progress("scale: page tables");
    let base = StoreConfig {
        populate_in_background: false,
        progress: false,
        huge_pages: HugePages::Off,
        ..StoreConfig::with_capacity(GIB)
    };
    let small = r.fig("pte_per_gib_4k_bytes", pte_per_gib(&base, None)?);
    r.row(
        "page tables per process, whole store touched, 4 KiB pages (HugePages::Off)",
        format!("{:.2} MiB per GiB", small / MIB as f64),
        "8 B per 4 KiB page: 2 MiB per GiB".into(),
        ratio(small, 2.0 * MIB as f64),
        "-",
    );
    // The default: the creator rebuilds the heap as 2 MiB pages where the kernel lets it.
    let auto = StoreConfig {
        huge_pages: HugePages::Auto,
        ..base.clone()
    };
    let rebuilt = r.fig("pte_per_gib_auto_bytes", pte_per_gib(&auto, None)?);
    r.row(
        "page tables per process, whole store touched, default (2 MiB pages rebuilt by the creator)",
        format!("{:.1} KiB per GiB", rebuilt / 1024.0),
        "8 B per 2 MiB page: 4 KiB per GiB".into(),
        ratio(rebuilt, 4096.0),
        "-",
    );
    progress("scale: first read, /dev/shm");
    first_read_row(
        r,
        PathBuf::from("/dev/shm"),
        HugePages::Off,
        "first_read_4k_ms",
        "first 64 MiB read, fresh attach, /dev/shm, 4 KiB pages (HugePages::Off)",
    )?;
    first_read_row(
        r,
        PathBuf::from("/dev/shm"),
        HugePages::Auto,
        "first_read_auto_ms",
        "first 64 MiB read, fresh attach, /dev/shm, default (2 MiB pages rebuilt)",
    )?;
    transparent_huge_pages(r, progress)?;
    // Huge pages, if the administrator reserved some (scripts/hugepages.sh does).
    let (free, page) = HugePages::free_pages().unwrap_or((0, 0));
    let pages = free.saturating_sub(8);
    if page != 2 * MIB || pages < 16 {
        r.notes.push(format!(
            "huge pages: skipped: {free} free of {} KiB (reserve some with \
             scripts/hugepages.sh or `sysctl -w vm.nr_hugepages=N`)",
            page >> 10
        ));
        return Ok(());
    }
    let huge = StoreConfig {
        huge_pages: HugePages::Hugetlb,
        max_objects: 1024,
        ..StoreConfig::with_capacity((pages * page).min(GIB) - 8 * MIB)
    };
    let big = r.fig("pte_per_gib_2m_bytes", pte_per_gib(&huge, None)?);
    r.row(
        "page tables per process, whole store touched, 2 MiB huge pages",
        format!("{:.1} KiB per GiB", big / 1024.0),
        "8 B per 2 MiB page: 4 KiB per GiB".into(),
        ratio(big, 4096.0),
        "-",
    );
    let mount = mount_where(|fs, opts| fs == "hugetlbfs" && opts.contains("pagesize=2M"));
    let need = FIRST_READ_STORE + 8 * MIB;
    let Some(mount) = mount.filter(|_| pages * page >= need) else {
        r.notes.push(format!(
            "first read on huge pages: skipped: needs a 2 MiB hugetlbfs mount and {} MiB \
             of free huge pages ({} MiB free; scripts/hugepages.sh with \
             SHMSTORE_HUGE_PAGES=48 sets both up)",
            need / MIB,
            pages * page / MIB
        ));
        return Ok(());
    };
    progress("scale: first read on huge pages");
    first_read_row(
        r,
        mount,
        HugePages::Hugetlb,
        "first_read_huge_ms",
        "first 64 MiB read, fresh attach, 2 MiB huge pages",
    )
}

/// The mount point of the first file system in /proc/mounts for which `pick(fstype,
/// options)` holds.
fn mount_where(pick: impl Fn(&str, &str) -> bool) -> Option<PathBuf> {
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 3 && pick(f[2], f[3]))
        .map(|f| PathBuf::from(f[1]))
}

/// The page-table and first-read rows for a store in a tmpfs with transparent huge pages
/// (`SHMSTORE_THP_DIR`, else the first tmpfs mounted `huge=within_size` or `huge=always`):
/// nothing reserved, 2 MiB pages wherever the kernel finds them free.
fn transparent_huge_pages(r: &mut Report, progress: &dyn Fn(&str)) -> Result<(), String> {
    let dir = std::env::var_os("SHMSTORE_THP_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            mount_where(|fs, opts| {
                fs == "tmpfs"
                    && opts
                        .split(',')
                        .any(|o| o == "huge=within_size" || o == "huge=always")
            })
        });
    let capacity = 512 * MIB;
    let Some(dir) = dir.filter(|d| free_bytes(d) >= capacity + 32 * MIB) else {
        r.notes.push(
            "transparent huge pages: skipped: no tmpfs mounted with huge=within_size and \
             544 MiB free (scripts/hugepages.sh mounts one at /tmp/shmstore-thp)"
                .into(),
        );
        return Ok(());
    };
    progress("scale: transparent huge pages");
    let cfg = StoreConfig {
        populate_in_background: false,
        progress: false,
        ..StoreConfig::with_capacity(capacity)
    };
    let thp = r.fig("pte_per_gib_thp_bytes", pte_per_gib(&cfg, Some(&dir))?);
    r.row(
        "page tables per process, whole store touched, transparent huge pages",
        format!("{:.1} KiB per GiB", thp / 1024.0),
        "8 B per 2 MiB page: 4 KiB per GiB".into(),
        ratio(thp, 4096.0),
        "-",
    );
    first_read_row(
        r,
        dir,
        HugePages::Off,
        "first_read_thp_ms",
        "first 64 MiB read, fresh attach, transparent huge pages",
    )
}

/// Measures [`first_read_in`] and reports it as row `what`, figure `key`.
fn first_read_row(
    r: &mut Report,
    dir: PathBuf,
    huge_pages: HugePages,
    key: &'static str,
    what: &str,
) -> Result<(), String> {
    let (first, warm) = first_read_in(dir, huge_pages)?;
    r.fig(key, first);
    r.row(
        what,
        format!("{first:.1} ms (median of {ROUNDS})"),
        format!("second read {warm:.1} ms"),
        ratio(first, warm),
        "<= 1.5x warm",
    );
    Ok(())
}

/// Capacity of the stores of the first-read rows on huge pages: room for one 64 MiB object.
const FIRST_READ_STORE: u64 = 72 * MIB;

/// A store in `dir` holding one 64 MiB object, read twice by a freshly attached process:
/// (first read, second read) in ms. On huge pages that process maps 32 entries where
/// 4 KiB pages take 16 384 (1 024 faults with the kernel's 64 KiB fault-around), which on
/// a VM is the whole gap to a warm read.
fn first_read_in(dir: PathBuf, huge_pages: HugePages) -> Result<(f64, f64), String> {
    let name = format!("shmstore-bench-scale-{}", std::process::id());
    let path = dir.join(&name);
    let _cleanup = Cleanup(vec![path.clone()]);
    let cfg = StoreConfig {
        huge_pages,
        max_objects: 1024,
        progress: false,
        dir,
        ..StoreConfig::with_capacity(FIRST_READ_STORE)
    };
    let store = Store::create(&name, &cfg).map_err(err)?;
    let id = ObjectId::of_key("scale-64m-huge");
    store
        .put(&id, &vec![0x5au8; 64 * MIB as usize])
        .map_err(err)?;
    if huge_pages == HugePages::Auto {
        // Finish the creator's rebuild (its background thread may still be at it) so the
        // row measures 2 MiB pages, as a worker attached to a running store finds them.
        store.prefault();
    }
    // A new process each round: each one's first read is a first read.
    let (mut firsts, mut warms) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let (_, first, warm) = fresh_attach_reads(&path, &id)?;
        firsts.push(first);
        warms.push(warm);
    }
    Ok((median(&mut firsts), median(&mut warms)))
}
