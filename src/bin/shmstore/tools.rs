//! `shmstore stores [DIR]` and `shmstore stat | ls | check | rm | recover NAME`: find,
//! inspect, verify, repair and remove stores. All but `recover` attach read-only (the
//! kernel forbids them to write payloads) and change nothing; none prefaults.

use serde::Serialize;
use shmstore::{AttachOptions, ObjectState, Store};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A store name, or a path if it contains a '/'.
pub fn resolve(name: &str) -> PathBuf {
    if name.contains('/') {
        PathBuf::from(name)
    } else {
        PathBuf::from("/dev/shm").join(name)
    }
}

pub fn attach(name: &str) -> Result<Store, String> {
    attach_with(name, true)
}

fn attach_with(name: &str, read_only: bool) -> Result<Store, String> {
    Store::open_with(resolve(name), &tool_options(read_only)).map_err(|e| e.to_string())
}

/// How the tools attach: nothing prefaulted, no spinning, and no recovery on attach
/// (`recover` wants the report of what it reclaimed; the others only look).
fn tool_options(read_only: bool) -> AttachOptions {
    AttachOptions {
        prefault: false,
        read_only,
        get_spin: Duration::ZERO,
        recover_on_attach: false,
        ..Default::default()
    }
}

fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

pub fn stat(name: &str, json: bool) -> Result<(), String> {
    let s = attach(name)?;
    let st = s.stats();
    // A tool can afford the table scan the hot-path counters avoid.
    let pinned = s.pinned_objects();
    // This tool is attached too; do not count it.
    let others = st.clients.saturating_sub(1);
    if json {
        let out = StatJson {
            capacity: st.capacity,
            used: st.used,
            free: st.free,
            largest_free: s.largest_free(),
            objects: st.objects,
            creating: st.creating,
            draining: st.draining,
            pinned,
            pins: st.pins,
            clients_alive: others,
            clients_dead: st.dead_clients,
            clients_recovered: st.recovered_clients,
            bytes_reclaimed: st.reclaimed_bytes,
            sweep_pending: st.sweep_pending,
            evictions: st.evictions,
            bytes_evicted: st.bytes_evicted,
            table_slots: st.table_slots,
            page_size: st.page_size,
            huge_pages: st.huge_pages,
            huge_page_bytes: st.huge_page_bytes,
            max_clients: st.max_clients,
            creates: st.creates,
            bytes_created: st.bytes_created,
            deletes: st.deletes,
            gets_hit: st.gets_hit,
            gets_waited: st.gets_waited,
            gets_missed: st.gets_missed,
            full_events: st.full_events,
        };
        println!("{}", to_json(&out)?);
        return Ok(());
    }
    let rows = [
        ("store", resolve(name).display().to_string()),
        ("capacity", human(st.capacity)),
        (
            "used",
            format!(
                "{} ({:.1}%)",
                human(st.used),
                100.0 * st.used as f64 / st.capacity.max(1) as f64
            ),
        ),
        ("free", human(st.free)),
        ("largest free block", human(s.largest_free())),
        ("objects (sealed)", st.objects.to_string()),
        ("being created", st.creating.to_string()),
        ("deleted, draining", st.draining.to_string()),
        ("pinned objects", format!("{} ({} pins)", pinned, st.pins)),
        (
            "created",
            format!("{} objects, {}", st.creates, human(st.bytes_created)),
        ),
        ("deleted", st.deletes.to_string()),
        (
            "gets",
            format!(
                "{} hit, {} waited for a seal, {} missed",
                st.gets_hit, st.gets_waited, st.gets_missed
            ),
        ),
        ("store full", format!("{} times", st.full_events)),
        ("clients alive", others.to_string()),
        ("clients dead", st.dead_clients.to_string()),
        ("clients recovered", st.recovered_clients.to_string()),
        ("bytes reclaimed", human(st.reclaimed_bytes)),
        (
            "leak sweep",
            if st.sweep_pending {
                "pending"
            } else {
                "none owed"
            }
            .to_string(),
        ),
        (
            "evictions",
            format!("{} objects, {}", st.evictions, human(st.bytes_evicted)),
        ),
        ("table slots", st.table_slots.to_string()),
        ("client slots", st.max_clients.to_string()),
        (
            "page size",
            if st.huge_page_bytes > 0 && st.page_size <= 4096 {
                format!(
                    "{} ({} of the heap rebuilt as 2 MiB pages so far)",
                    human(st.page_size),
                    human(st.huge_page_bytes)
                )
            } else if st.huge_pages {
                format!("{} (transparent huge pages)", human(st.page_size))
            } else {
                human(st.page_size)
            },
        ),
    ];
    for (k, v) in rows {
        println!("{k:<20} {v}");
    }
    if st.dead_clients > 0 {
        println!(
            "\n{} dead client(s) still hold their slots; live processes reclaim them on their \
             next maintenance, or now with `shmstore recover {name}`.",
            st.dead_clients
        );
    }
    if others == 0 && st.dead_clients > 0 {
        println!(
            "No live process is attached: this store was left by a crashed run. Reuse it \
             (`shmstore recover {name}`, or just attach) or remove it (`shmstore rm {name}`)."
        );
    }
    Ok(())
}

/// `shmstore stores [DIR]`: every store in a directory (default /dev/shm), with its size,
/// use and processes, and the ones no live process is attached to (their memory stays
/// taken until someone removes or reuses them). Other files are passed over; hidden ones
/// (a creation in progress, or left by a killed creator) too: the next create there
/// sweeps those.
pub fn stores(dir: Option<&str>, json: bool) -> Result<(), String> {
    let dir = PathBuf::from(dir.unwrap_or("/dev/shm"));
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("reading {}: {e}", dir.display()))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    paths.sort();
    let rows: Vec<StoreRow> = paths.iter().filter_map(|p| store_row(p)).collect();
    if json {
        println!("{}", to_json(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no store in {}", dir.display());
        return Ok(());
    }
    println!(
        "{:<40} {:>10} {:>18} {:>9}  processes",
        "store", "capacity", "used", "objects"
    );
    let mut unused = (0, 0u64);
    for r in &rows {
        let Some(st) = &r.stats else {
            println!("{:<40} {}", r.name, r.problem.as_deref().unwrap_or(""));
            continue;
        };
        let who = if st.alive == 0 {
            unused = (unused.0 + 1, unused.1 + st.capacity);
            if st.dead > 0 {
                format!("none alive, {} dead: left by a crash", st.dead)
            } else {
                "none: unused".to_owned()
            }
        } else if st.dead > 0 {
            format!("{} alive, {} dead", st.alive, st.dead)
        } else {
            format!("{} alive", st.alive)
        };
        println!(
            "{:<40} {:>10} {:>18} {:>9}  {who}",
            r.name,
            human(st.capacity),
            format!(
                "{} ({:.0}%)",
                human(st.used),
                100.0 * st.used as f64 / st.capacity.max(1) as f64
            ),
            st.objects
        );
    }
    if unused.0 > 0 {
        println!(
            "\n{} store(s) that no live process uses hold {} of memory (a crashed run's, or \
             kept on purpose): attaching reuses one, with what it holds; `shmstore rm NAME` \
             frees it.",
            unused.0,
            human(unused.1)
        );
    }
    Ok(())
}

/// One line of `shmstore stores`: `None` for a file that is not a store.
fn store_row(path: &std::path::Path) -> Option<StoreRow> {
    let name = path.file_name()?.to_string_lossy().into_owned();
    let (stats, problem) = match Store::open_with(path, &tool_options(true)) {
        Ok(s) => {
            let st = s.stats();
            let stats = StoreFigures {
                capacity: st.capacity,
                used: st.used,
                objects: st.objects,
                // This tool is attached too; do not count it.
                alive: st.clients.saturating_sub(1),
                dead: st.dead_clients,
            };
            (Some(stats), None)
        }
        Err(shmstore::Error::NotAStore { .. }) => return None,
        Err(shmstore::Error::VersionMismatch { found, .. }) => (
            None,
            Some(format!(
                "a store of layout version {found} (another shmstore version): `shmstore rm \
                 {name}` removes it once no process uses it"
            )),
        ),
        Err(e) => (None, Some(e.to_string())),
    };
    Some(StoreRow {
        name,
        path: path.display().to_string(),
        stats,
        problem,
    })
}

pub fn ls(name: &str, json: bool, limit: Option<u64>) -> Result<(), String> {
    let s = attach(name)?;
    // Streamed: each object is printed as its slot is read (a store of millions of
    // objects lists at once, in constant memory). A reader that goes away (`| head`)
    // just ends the listing.
    match list_to(&mut std::io::stdout().lock(), &s, name, json, limit) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.to_string()),
        _ => Ok(()),
    }
}

fn list_to(
    out: &mut impl Write,
    s: &Store,
    name: &str,
    json: bool,
    limit: Option<u64>,
) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(out);
    let state = |st: ObjectState| match st {
        ObjectState::Creating => "creating",
        ObjectState::Sealed => "sealed",
        ObjectState::Draining => "draining",
    };
    let objects = s.objects().take(limit.map_or(usize::MAX, |n| n as usize));
    let mut shown = 0u64;
    if json {
        write!(out, "[")?;
        for o in objects {
            if shown > 0 {
                write!(out, ",")?;
            }
            let entry = ObjectJson {
                id: o.id.to_string(),
                len: o.len,
                meta_len: o.meta_len,
                state: state(o.state),
                pins: o.pins,
            };
            serde_json::to_writer(&mut out, &entry)?;
            shown += 1;
        }
        writeln!(out, "]")?;
        return out.flush();
    }
    writeln!(
        out,
        "{:<64}  {:>12}  {:>6}  {:<8}  {:>5}",
        "id", "size", "meta", "state", "pins"
    )?;
    for o in objects {
        writeln!(
            out,
            "{}  {:>12}  {:>6}  {:<8}  {:>5}",
            o.id,
            o.len,
            o.meta_len,
            state(o.state),
            o.pins
        )?;
        shown += 1;
    }
    match limit {
        Some(n) if shown == n => writeln!(
            out,
            "{shown} object(s) shown (--limit {n}; `shmstore stat {name}` has the totals)"
        )?,
        _ => writeln!(out, "{shown} object(s)")?,
    }
    out.flush()
}

/// How many looks `check` takes before it calls a finding damage while other processes
/// are attached (one look when none is), and the pause between looks.
const CHECK_LOOKS: usize = 3;
const CHECK_PAUSE: Duration = Duration::from_millis(100);

/// The figures of `stats` that operations move: all but the page figures, which the
/// creator's background rebuild of the heap as 2 MiB pages moves for seconds after a
/// create without changing anything `check_invariants` reads.
fn activity(st: &shmstore::Stats) -> shmstore::Stats {
    shmstore::Stats {
        huge_pages: false,
        page_size: 0,
        huge_page_bytes: 0,
        ..st.clone()
    }
}

/// What `check` concluded.
#[derive(Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Verdict {
    /// A look found every invariant holding.
    Sound,
    /// Every look found the same thing wrong, nothing changed in between, and no dead
    /// process is waiting to be recovered: something broke the store.
    Damaged,
    /// As `Damaged`, but dead processes are not recovered yet: a step one of them left
    /// half-done reads as damage until recovery finishes it (a normal state after a crash).
    Unrecovered,
    /// Every look found something wrong, but other processes were changing the store (its
    /// figures moved, or the findings differed): what they had in flight can look like
    /// damage.
    Busy,
}

/// Checks every invariant of the store (`Store::check_invariants`: allocator bitmaps
/// against their counts, every table entry against its block, no overlaps, bytes and
/// counters against the table, nothing held by a detached client). The scan reads the
/// store as it is, so a step another process has in flight can look like damage: with
/// others attached, a finding counts only if `CHECK_LOOKS` looks find the same while the
/// store's figures stay as they were (`activity`: every count and counter of `stats`).
pub fn check(name: &str, json: bool) -> Result<(), String> {
    let s = attach(name)?;
    let t0 = Instant::now();
    let first = s.stats();
    let mut findings: Vec<String> = Vec::new();
    // This tool is attached too; do not count it.
    let mut others = first.clients.saturating_sub(1);
    let mut moved = false;
    let verdict = loop {
        let result = s.check_invariants();
        let now = s.stats();
        others = others.max(now.clients.saturating_sub(1));
        moved |= activity(&now) != activity(&first);
        match result {
            Ok(()) => break Verdict::Sound,
            Err(shmstore::Error::Corrupted { what }) => findings.push(what),
            Err(e) => return Err(e.to_string()),
        }
        if others == 0 || findings.len() == CHECK_LOOKS {
            break if moved || findings.iter().any(|f| *f != findings[0]) {
                Verdict::Busy
            } else if now.dead_clients > 0 || now.sweep_pending {
                Verdict::Unrecovered
            } else {
                Verdict::Damaged
            };
        }
        // The pause is the method, not a race papered over: a step in flight finishes
        // (or moves the figures) within it, while damage stays the same.
        std::thread::sleep(CHECK_PAUSE);
    };
    let st = s.stats();
    let looks = findings.len() + usize::from(verdict == Verdict::Sound);
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let finding = findings.pop().unwrap_or_default();
    if json {
        let out = CheckJson {
            verdict,
            finding: (verdict != Verdict::Sound).then(|| finding.clone()),
            looks: looks as u64,
            clients_alive: others,
            clients_dead: st.dead_clients,
            sweep_pending: st.sweep_pending,
            objects: st.objects,
            used: st.used,
            capacity: st.capacity,
            elapsed_ms: ms,
        };
        println!("{}", to_json(&out)?);
    }
    let path = resolve(name).display().to_string();
    // How the finding was confirmed: one look alone, or several with nothing moving.
    let seen = if others == 0 {
        "no other process attached, so nothing in flight".to_owned()
    } else {
        format!(
            "the same in {looks} looks {} ms apart, with {others} other process(es) attached \
             and none of them changing anything",
            CHECK_PAUSE.as_millis()
        )
    };
    let rebuild = format!("remove it (`shmstore rm {name}`) and let the engine create it again");
    match verdict {
        Verdict::Sound => {
            if !json {
                println!(
                    "{path} is sound: {} object(s), {} of {} used; checked in {ms:.1} ms \
                     ({looks} look(s), {others} other process(es) attached)",
                    st.objects,
                    human(st.used),
                    human(st.capacity),
                );
            }
            Ok(())
        }
        Verdict::Unrecovered => {
            let what = match (st.dead_clients, st.sweep_pending) {
                (0, _) => "blocks that processes killed inside allocator steps left, which \
                           only the leak sweep frees (owed, and not run yet: processes were \
                           allocating)"
                    .to_owned(),
                (n, true) => {
                    format!("what {n} dead process(es) left half-done (and a leak sweep is owed)")
                }
                (n, false) => format!("what {n} dead process(es) left half-done"),
            };
            Err(format!(
                "{path} holds {what}, which reads as damage until it is recovered \
                 ({finding}; {seen}). Live processes recover it on their next maintenance; \
                 to do it now, run `shmstore recover {name}`, then check again."
            ))
        }
        Verdict::Damaged if others == 0 => Err(format!(
            "{path} is damaged: {finding} ({seen}). A process broke the store (a bug, or \
             garbage written into it): {rebuild}."
        )),
        Verdict::Damaged => Err(format!(
            "{path} is damaged: {finding} ({seen}). Unless one of those processes is stopped \
             (SIGSTOP, a debugger) in the middle of a step, a process broke the store (a bug, \
             or garbage written into it): stop them, {rebuild}."
        )),
        Verdict::Busy => Err(format!(
            "{path} could not be checked: {others} other process(es) changed it during the \
             check, and steps they had in flight read as damage in each of {looks} looks \
             (the last: {finding}). Run it again when they are idle."
        )),
    }
}

pub fn rm(name: &str) -> Result<(), String> {
    let path = resolve(name);
    // Validate first: never remove a file that is not a shmstore region.
    let others = match Store::open_with(&path, &tool_options(true)) {
        Ok(s) => s.stats().clients.saturating_sub(1),
        // A store of another shmstore version (left from before an upgrade): the magic
        // says it is one; the kernel's locks say whether anyone is attached.
        Err(shmstore::Error::VersionMismatch { found, .. }) => {
            if Store::remove_if_unused(&path).map_err(|e| e.to_string())? {
                println!(
                    "removed {} (a store of layout version {found})",
                    path.display()
                );
                return Ok(());
            }
            std::fs::remove_file(&path).map_err(|e| format!("removing {}: {e}", path.display()))?;
            println!(
                "removed {} (a store of layout version {found}; processes still attached \
                 keep their mapping until they detach)",
                path.display()
            );
            return Ok(());
        }
        Err(e) => return Err(e.to_string()),
    };
    std::fs::remove_file(&path).map_err(|e| format!("removing {}: {e}", path.display()))?;
    if others > 0 {
        println!(
            "removed {} ({others} attached process(es) keep their mapping until they detach)",
            path.display()
        );
    } else {
        println!("removed {}", path.display());
    }
    Ok(())
}

pub fn recover(name: &str, json: bool) -> Result<(), String> {
    let s = attach_with(name, false)?;
    let r = s.recover().map_err(|e| e.to_string())?;
    if json {
        let out = RecoverJson {
            clients_recovered: r.clients_recovered,
            pins_released: r.pins_released,
            creations_aborted: r.creations_aborted,
            slots_returned: r.slots_returned,
            leaked_blocks_freed: r.leaked_blocks_freed,
            bytes_reclaimed: r.bytes_reclaimed,
            sweep_pending: r.sweep_pending,
        };
        println!("{}", to_json(&out)?);
        return Ok(());
    }
    println!(
        "recovered {} dead client(s): {} pin(s) released, {} unsealed object(s) aborted, \
         {} half-changed slot(s) returned, {} leaked block(s) freed, {} reclaimed",
        r.clients_recovered,
        r.pins_released,
        r.creations_aborted,
        r.slots_returned,
        r.leaked_blocks_freed,
        human(r.bytes_reclaimed)
    );
    if r.sweep_pending {
        println!(
            "a leak sweep is still owed: live processes were allocating the whole time; \
             it runs on their own schedule, or rerun this when the store is quieter"
        );
    }
    Ok(())
}

fn to_json(v: &impl Serialize) -> Result<String, String> {
    serde_json::to_string(v).map_err(|e| format!("encoding JSON: {e}"))
}

/// `stat --json`: one object, keys as documented in README.md.
#[derive(Serialize)]
struct StatJson {
    capacity: u64,
    used: u64,
    free: u64,
    largest_free: u64,
    objects: u64,
    creating: u64,
    draining: u64,
    pinned: u64,
    pins: u64,
    clients_alive: u64,
    clients_dead: u64,
    clients_recovered: u64,
    bytes_reclaimed: u64,
    sweep_pending: bool,
    evictions: u64,
    bytes_evicted: u64,
    table_slots: u64,
    page_size: u64,
    huge_pages: bool,
    huge_page_bytes: u64,
    max_clients: u64,
    creates: u64,
    bytes_created: u64,
    deletes: u64,
    gets_hit: u64,
    gets_waited: u64,
    gets_missed: u64,
    full_events: u64,
}

/// One object of `ls --json`.
#[derive(Serialize)]
struct ObjectJson {
    id: String,
    len: u64,
    meta_len: u16,
    state: &'static str,
    pins: u64,
}

/// One store of `stores --json`.
#[derive(Serialize)]
struct StoreRow {
    name: String,
    path: String,
    /// `None` when it could not be opened (then `problem` says why).
    #[serde(flatten)]
    stats: Option<StoreFigures>,
    problem: Option<String>,
}

/// What `stores` shows of a store it opened.
#[derive(Serialize)]
struct StoreFigures {
    capacity: u64,
    used: u64,
    objects: u64,
    /// Live processes attached (not counting the tool).
    alive: u64,
    /// Dead ones not yet recovered.
    dead: u64,
}

/// `check --json`.
#[derive(Serialize)]
struct CheckJson {
    verdict: Verdict,
    finding: Option<String>,
    looks: u64,
    clients_alive: u64,
    clients_dead: u64,
    sweep_pending: bool,
    objects: u64,
    used: u64,
    capacity: u64,
    elapsed_ms: f64,
}

/// `recover --json`.
#[derive(Serialize)]
struct RecoverJson {
    clients_recovered: u64,
    pins_released: u64,
    creations_aborted: u64,
    slots_returned: u64,
    leaked_blocks_freed: u64,
    bytes_reclaimed: u64,
    sweep_pending: bool,
}

#[cfg(test)]
mod tests {
    use super::human;

    #[test]
    fn human_sizes_use_the_largest_unit_below_the_value_up_to_tib() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1024), "1.0 KiB");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human((1 << 20) - 1), "1024.0 KiB");
        assert_eq!(human(4 << 20), "4.0 MiB");
        assert_eq!(human(100 << 30), "100.0 GiB");
        assert_eq!(human(1 << 40), "1.0 TiB");
        // TiB is the last unit: nothing past it, and no unit out of the table.
        assert_eq!(human(1 << 50), "1024.0 TiB");
        assert_eq!(human(u64::MAX), "16777216.0 TiB");
    }
}
