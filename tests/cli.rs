//! The `shmstore` command-line tool: stores, stat, ls, check, rm, recover, metrics, and
//! its interface (help, version, exit codes, JSON).

mod common;

use common::{shmstore_cli as shmstore, unique_name};
use shmstore::{HugePages, ObjectId, Store, StoreConfig};
use std::process::{Command, Stdio};

/// The first line a child writes to one of its pipes (read without waiting for the rest).
fn first_line(pipe: impl std::io::Read) -> String {
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(pipe), &mut line).unwrap();
    line
}

/// A worker process attached to the store at `path` (the bench's end-to-end child), once it
/// says it is attached.
fn attached_worker(path: &std::path::Path) -> std::process::Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_shmstore"))
        .args(["__child", "e2e", path.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(first_line(child.stdout.as_mut().unwrap()).trim(), "ready");
    child
}

/// Leaves a dead client in the store at `path`: a worker attaches and is SIGKILLed.
fn kill_a_worker_of(path: &std::path::Path) {
    let mut child = attached_worker(path);
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Sets `stop` when dropped: a failed assertion in a `thread::scope` then stops the
/// scope's workers, instead of leaving the scope waiting on them for ever.
struct StopOnDrop<'a>(&'a std::sync::OnceLock<()>);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.set(());
    }
}

fn field(json: &str, key: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"));
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {json}"))
}

#[test]
fn stat_ls_and_rm_a_live_store() {
    let name = unique_name("cli");
    let s = Store::create(&name, &StoreConfig::with_capacity(4 << 20)).unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    let a = ObjectId::of_key("a");
    s.put(&a, &[1; 5000]).unwrap();
    let _pin = s.try_get(&a).unwrap();
    let _creating = s.create_object(&ObjectId::of_key("b"), 10).unwrap();

    let (ok, out, err) = shmstore(&["stat", &name, "--json"]);
    assert!(ok, "{err}");
    assert_eq!(field(&out, "objects"), 1);
    assert_eq!(field(&out, "creating"), 1);
    assert_eq!(field(&out, "pins"), 1);
    assert_eq!(field(&out, "clients_alive"), 1);
    assert_eq!(field(&out, "clients_dead"), 0);
    assert_eq!(field(&out, "capacity"), 4 << 20);
    assert_eq!(field(&out, "evictions"), 0);

    let (ok, out, _) = shmstore(&["stat", &name]);
    assert!(
        ok && out.contains("clients alive") && out.contains("4.0 MiB"),
        "{out}"
    );

    let (ok, out, _) = shmstore(&["ls", &name, "--json"]);
    assert!(ok);
    assert!(
        out.contains(&a.to_string()) && out.contains("\"state\":\"sealed\""),
        "{out}"
    );
    assert!(out.contains("\"state\":\"creating\""), "{out}");
    let (ok, out, _) = shmstore(&["ls", &name]);
    assert!(ok && out.contains("2 object(s)"), "{out}");

    let (ok, out, err) = shmstore(&["rm", &name]);
    assert!(ok, "{err}");
    assert!(out.contains("1 attached process"), "{out}");
    assert!(!s.path().unwrap().exists());
    // The attached store keeps working after its name is gone.
    assert_eq!(&s.try_get(&a).unwrap()[..10], &[1; 10]);
}

#[test]
fn ls_streams_every_object_and_stops_at_its_limit() {
    let name = unique_name("ls-stream");
    let s = Store::create(
        &name,
        &StoreConfig {
            max_objects: 20_000,
            ..StoreConfig::with_capacity(8 << 20)
        },
    )
    .unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    let n = 10_000u64;
    for i in 0..n {
        s.put(&ObjectId::of_key(format!("o{i}")), &i.to_le_bytes())
            .unwrap();
    }
    let (ok, out, err) = shmstore(&["ls", &name]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count() as u64, n + 2, "header, objects, total");
    assert!(
        out.ends_with(&format!("{n} object(s)\n")),
        "{}",
        &out[out.len() - 80..]
    );

    let (ok, out, err) = shmstore(&["ls", &name, "--limit", "3"]);
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 5, "{out}");
    assert!(
        lines[4].starts_with("3 object(s) shown (--limit 3"),
        "{out}"
    );
    let (ok, out, _) = shmstore(&["ls", &name, "--json", "--limit", "2"]);
    assert!(ok);
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(listed.len(), 2, "{out}");
    // A limit above the count lists everything, and says the total.
    let (ok, out, _) = shmstore(&["ls", &name, "--limit", "20000"]);
    assert!(
        ok && out.ends_with(&format!("\n{n} object(s)\n")),
        "{}",
        &out[out.len() - 80..]
    );
    let (ok, _, err) = shmstore(&["ls", &name, "--limit", "many"]);
    assert!(
        !ok && err.contains("invalid value 'many' for '--limit <N>'"),
        "{err}"
    );

    // A reader that goes away (`| head`) ends the listing; it is not an error to hang on.
    let mut child = Command::new(env!("CARGO_BIN_EXE_shmstore"))
        .args(["ls", &name])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let first = first_line(child.stdout.take().unwrap());
    assert!(first.starts_with("id"), "{first}");
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    // Any other failure to write is one: a listing redirected to a full disk fails.
    let out = Command::new(env!("CARGO_BIN_EXE_shmstore"))
        .args(["ls", &name])
        .stdout(std::fs::File::create("/dev/full").unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("No space left on device"),
        "{err}"
    );
}

#[test]
fn rm_removes_a_store_of_an_older_version() {
    // After an upgrade, a store left by the old version cannot be opened, but `rm` still
    // knows it for a store (its magic) and removes it.
    let name = unique_name("old-version");
    let s = Store::create(&name, &StoreConfig::with_capacity(1 << 20)).unwrap();
    let path = s.path().unwrap().to_path_buf();
    drop(s);
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.seek(SeekFrom::Start(8)).unwrap();
        f.write_all(&3u32.to_le_bytes()).unwrap();
    }
    let (ok, _, err) = shmstore(&["stat", &name]);
    assert!(!ok && err.contains("version"), "{err}");
    let (ok, out, err) = shmstore(&["rm", &name]);
    assert!(ok, "{err}");
    assert!(out.contains("a store of layout version 3"), "{out}");
    assert!(!path.exists());
}

#[test]
fn stores_lists_the_stores_of_a_directory_and_the_memory_unused_ones_hold() {
    let dir = std::path::PathBuf::from("/dev/shm").join(unique_name("stores-dir"));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = DirCleanup(dir.clone());
    let cfg = |cap| StoreConfig {
        dir: dir.clone(),
        ..StoreConfig::with_capacity(cap)
    };
    // One in use (this process), one left with nobody attached, one of another layout
    // version, and files that are not stores, hidden or not.
    let live = Store::create("in-use", &cfg(2 << 20)).unwrap();
    live.put(&ObjectId::of_key("a"), &[1; 5000]).unwrap();
    drop(Store::create("left", &cfg(1 << 20)).unwrap());
    let old = Store::create("old", &cfg(1 << 20)).unwrap();
    let old_path = old.path().unwrap().to_path_buf();
    drop(old);
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&old_path)
            .unwrap();
        f.seek(SeekFrom::Start(8)).unwrap();
        f.write_all(&3u32.to_le_bytes()).unwrap();
    }
    // One whose only other process was killed.
    let crashed = Store::create("crashed", &cfg(1 << 20)).unwrap();
    kill_a_worker_of(crashed.path().unwrap());
    drop(crashed);
    // One in use whose other worker was killed.
    let half = Store::create("half-crashed", &cfg(1 << 20)).unwrap();
    kill_a_worker_of(half.path().unwrap());
    std::fs::write(dir.join("notes.txt"), b"precious data").unwrap();
    std::fs::write(dir.join(".hidden"), b"SHMSTORE").unwrap();

    let d = dir.to_str().unwrap();
    let (ok, out, err) = shmstore(&["stores", d, "--json"]);
    assert!(ok, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
    let names: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["crashed", "half-crashed", "in-use", "left", "old"],
        "{out}"
    );
    let r = &rows[2];
    assert_eq!(
        (
            r["capacity"].as_u64(),
            r["objects"].as_u64(),
            r["alive"].as_u64()
        ),
        (Some(2 << 20), Some(1), Some(1)),
        "{r}"
    );
    let alive_dead = |r: &serde_json::Value| (r["alive"].as_u64(), r["dead"].as_u64());
    assert_eq!(alive_dead(&rows[0]), (Some(0), Some(1)), "{out}");
    assert_eq!(alive_dead(&rows[1]), (Some(1), Some(1)), "{out}");
    assert_eq!(alive_dead(&rows[3]), (Some(0), Some(0)), "{out}");
    assert!(
        rows[4]["problem"]
            .as_str()
            .unwrap()
            .contains("layout version 3"),
        "{out}"
    );

    let (ok, out, _) = shmstore(&["stores", d]);
    assert!(ok);
    let line = |name: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} in {out}"))
            .to_owned()
    };
    assert!(line("in-use").ends_with("1 alive"), "{out}");
    assert!(line("half-crashed").ends_with("1 alive, 1 dead"), "{out}");
    assert!(line("left").ends_with("none: unused"), "{out}");
    assert!(
        line("crashed").ends_with("none alive, 1 dead: left by a crash"),
        "{out}"
    );
    assert!(
        out.contains("2 store(s) that no live process uses hold 2.0 MiB"),
        "{out}"
    );
    assert!(
        !out.contains("notes.txt") && !out.contains(".hidden"),
        "{out}"
    );
    // A directory whose every store is in use has no memory to point at.
    let busy = dir.join("busy");
    std::fs::create_dir(&busy).unwrap();
    let _busy_store = Store::create(
        "busy",
        &StoreConfig {
            dir: busy.clone(),
            ..StoreConfig::with_capacity(1 << 20)
        },
    )
    .unwrap();
    let (ok, out, _) = shmstore(&["stores", busy.to_str().unwrap()]);
    assert!(ok && out.lines().count() == 2, "{out}");
    assert!(!out.contains("no live process"), "{out}");
    drop((live, half));
    let empty = dir.join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (ok, out, _) = shmstore(&["stores", empty.to_str().unwrap()]);
    assert!(ok && out.starts_with("no store in"), "{out}");
    let (ok, _, err) = shmstore(&["stores", dir.join("missing").to_str().unwrap()]);
    assert!(!ok && err.contains("reading"), "{err}");
}

/// Removes a directory and everything in it when dropped (even if the test fails).
struct DirCleanup(std::path::PathBuf);

impl Drop for DirCleanup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn rm_refuses_files_that_are_not_stores() {
    let path = std::path::PathBuf::from("/dev/shm").join(unique_name("notastore"));
    std::fs::write(&path, b"precious data").unwrap();
    let (ok, _, err) = shmstore(&["rm", path.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("not a shmstore region"), "{err}");
    assert!(path.exists());
    std::fs::remove_file(&path).unwrap();
    let (ok, _, err) = shmstore(&["stat", &unique_name("missing")]);
    assert!(!ok && err.contains("no store at"), "{err}");
}

#[test]
fn stat_reports_a_killed_client_as_dead() {
    let name = unique_name("dead");
    let s = Store::create(&name, &StoreConfig::with_capacity(1 << 20)).unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    // A worker process that attaches and waits for commands; wait until it is attached.
    let mut child = attached_worker(s.path().unwrap());
    assert_eq!(s.stats().clients, 2);
    child.kill().unwrap();
    child.wait().unwrap();
    let st = s.stats();
    assert_eq!((st.clients, st.dead_clients), (1, 1), "{st:?}");
    let (ok, out, _) = shmstore(&["stat", &name]);
    assert!(ok && out.contains("1 dead client"), "{out}");
    let (ok, out, err) = shmstore(&["recover", &name, "--json"]);
    assert!(ok, "{err}");
    assert_eq!(field(&out, "clients_recovered"), 1, "{out}");
    let (ok, out, _) = shmstore(&["stat", &name, "--json"]);
    assert!(ok);
    assert_eq!(
        (
            field(&out, "clients_dead"),
            field(&out, "clients_recovered")
        ),
        (0, 1),
        "{out}"
    );
    let (ok, out, _) = shmstore(&["recover", &name]);
    assert!(ok && out.contains("recovered 0 dead client(s)"), "{out}");
}

/// The value of one row of `shmstore stat`'s text (`key` padded to 20 columns, a space,
/// the value).
fn stat_row(out: &str, key: &str) -> String {
    out.lines()
        .find_map(|l| Some(l.strip_prefix(key)?.trim().to_owned()))
        .unwrap_or_else(|| panic!("{key} in {out}"))
}

#[test]
fn stat_advises_only_when_dead_processes_or_a_crashed_run_left_the_store() {
    let name = unique_name("stat-advice");
    let s = Store::create(
        &name,
        &StoreConfig {
            huge_pages: HugePages::Off,
            ..StoreConfig::with_capacity(4 << 20)
        },
    )
    .unwrap();
    let path = s.path().unwrap().to_path_buf();
    let _cleanup = common::Cleanup(path.clone());
    let dead = "dead client(s) still hold their slots";
    let crashed = "No live process is attached: this store was left by a crashed run";
    // Clean, with this process attached: figures only.
    let (ok, out, err) = shmstore(&["stat", &name]);
    assert!(ok, "{err}");
    assert_eq!(stat_row(&out, "page size"), "4.0 KiB", "{out}");
    assert_eq!(stat_row(&out, "capacity"), "4.0 MiB", "{out}");
    assert!(!out.contains(dead) && !out.contains(crashed), "{out}");
    // A worker killed, this process still attached: recover, but nothing was abandoned.
    kill_a_worker_of(&path);
    let (ok, out, _) = shmstore(&["stat", &name]);
    assert!(ok && out.contains(&format!("1 {dead}")), "{out}");
    assert!(!out.contains(crashed), "{out}");
    // This process gone too: the store was left by a crash.
    drop(s);
    let (ok, out, _) = shmstore(&["stat", &name]);
    assert!(ok && out.contains(&format!("1 {dead}")), "{out}");
    assert!(out.contains(crashed), "{out}");
    // Recovered, nobody attached: a store kept for later, nothing to advise.
    let (ok, _, err) = shmstore(&["recover", &name]);
    assert!(ok, "{err}");
    let (ok, out, _) = shmstore(&["stat", &name]);
    assert!(ok && !out.contains(dead) && !out.contains(crashed), "{out}");
    // Removing a store nobody uses says just that.
    let (ok, out, err) = shmstore(&["rm", &name]);
    assert!(ok, "{err}");
    assert_eq!(out, format!("removed {}\n", path.display()));
}

#[test]
fn stat_names_the_page_size_the_store_really_uses() {
    // A store the creator has rebuilt as 2 MiB pages (where this kernel can), whole: no
    // "so far" once the rebuild is done. (One on 4 KiB pages: the test above.)
    let name = unique_name("stat-pages");
    let s = Store::create(&name, &StoreConfig::with_capacity(64 << 20)).unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    s.prefault();
    let st = s.stats();
    let (ok, out, err) = shmstore(&["stat", &name]);
    assert!(ok, "{err}");
    if st.page_size != 2 << 20 {
        eprintln!(
            "stat_names_the_page_size_the_store_really_uses: skipped, the kernel did not \
             rebuild the heap as 2 MiB pages here ({st:?})"
        );
        return;
    }
    // The creator's rebuild makes them transparent huge pages (MADV_COLLAPSE).
    assert_eq!(
        stat_row(&out, "page size"),
        "2.0 MiB (transparent huge pages)",
        "{out}"
    );
}

#[test]
fn every_subcommand_has_help_version_and_exit_codes() {
    for sub in [
        "bench", "stores", "stat", "ls", "check", "rm", "recover", "metrics",
    ] {
        let (ok, out, err) = shmstore(&[sub, "--help"]);
        assert!(ok, "{sub} --help: {err}");
        assert!(
            out.contains(&format!("Usage: shmstore {sub}")) && out.contains("Exit codes:"),
            "{sub} --help: {out}"
        );
        let (ok, out, _) = shmstore(&[sub, "--version"]);
        assert!(ok, "{sub} --version");
        assert!(out.contains(env!("CARGO_PKG_VERSION")), "{out}");
    }
    let (ok, out, _) = shmstore(&["--help"]);
    assert!(
        ok && out.contains("metrics") && out.contains("Exit codes:"),
        "{out}"
    );
    // Usage errors exit 2, with clap's suggestion for a mistyped flag.
    let code = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_shmstore"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (rc, err) = code(&["stat", "some-store", "--jsn"]);
    assert_eq!(rc, Some(2), "{err}");
    assert!(err.contains("similar argument exists: '--json'"), "{err}");
    assert_eq!(code(&["stat"]).0, Some(2));
    assert_eq!(code(&["frobnicate"]).0, Some(2));
    assert_eq!(code(&["ls", "x", "--limit", "many"]).0, Some(2));
    // A command that runs and fails exits 1.
    assert_eq!(code(&["stat", &unique_name("missing")]).0, Some(1));
}

#[test]
fn json_outputs_are_valid_json_with_the_documented_keys() {
    let name = unique_name("json");
    let s = Store::create(&name, &StoreConfig::with_capacity(1 << 20)).unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    // An id with every hex digit, and a meta field: nothing in them needs escaping, but
    // the parser proves the framing.
    s.put(&ObjectId::of_key("a"), &[7; 100]).unwrap();
    let parse = |args: &[&str]| -> serde_json::Value {
        let (ok, out, err) = shmstore(args);
        assert!(ok, "{args:?}: {err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
    };
    let stat = parse(&["stat", &name, "--json"]);
    for key in [
        "capacity",
        "used",
        "free",
        "largest_free",
        "objects",
        "pins",
        "creates",
        "gets_hit",
        "gets_missed",
        "gets_waited",
        "deletes",
        "evictions",
        "full_events",
        "bytes_created",
        "clients_alive",
        "clients_dead",
        "clients_recovered",
        "bytes_reclaimed",
    ] {
        assert!(stat[key].is_u64(), "{key} in {stat}");
    }
    assert_eq!(stat["objects"], 1);
    assert_eq!(stat["bytes_created"], 100);
    let ls = parse(&["ls", &name, "--json"]);
    assert_eq!(ls[0]["id"], ObjectId::of_key("a").to_string());
    assert_eq!(
        (ls[0]["len"].as_u64(), ls[0]["state"].as_str()),
        (Some(100), Some("sealed"))
    );
    let rec = parse(&["recover", &name, "--json"]);
    assert_eq!(rec["clients_recovered"], 0);
    assert_eq!(rec["sweep_pending"], false);
    let check = parse(&["check", &name, "--json"]);
    assert_eq!(check["verdict"], "sound");
    assert!(check["finding"].is_null(), "{check}");
    for key in [
        "looks",
        "clients_alive",
        "clients_dead",
        "objects",
        "used",
        "capacity",
    ] {
        assert!(check[key].is_u64(), "{key} in {check}");
    }
    assert!(check["elapsed_ms"].is_f64(), "{check}");
}

/// `shmstore check --json` on `name`: whether it exited 0, and the verdict object.
fn check_json(name: &str) -> (bool, serde_json::Value) {
    let (ok, out, err) = shmstore(&["check", name, "--json"]);
    let v = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    (ok, v)
}

#[test]
fn check_tells_a_sound_store_from_a_damaged_one() {
    let name = unique_name("check");
    let s = Store::create(&name, &StoreConfig::with_capacity(4 << 20)).unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    let a = ObjectId::of_key("a");
    s.put(&a, &[1; 5000]).unwrap();
    let pin = s.try_get(&a).unwrap();
    let creating = s.create_object(&ObjectId::of_key("b"), 10).unwrap();
    // Sound, with this process attached and holding a pin and an unsealed object.
    let (ok, out, err) = shmstore(&["check", &name]);
    assert!(ok, "{err}");
    assert!(
        out.contains("is sound: 1 object(s)") && out.contains("1 other process(es) attached"),
        "{out}"
    );
    // A block the allocator handed out that no table entry names, left behind by a
    // process that then detached cleanly: what a buggy process could leave.
    s.raw_alloc(100_000).unwrap();
    drop((pin, creating, s));
    // Alone with the store, one look is enough.
    let (ok, _, err) = shmstore(&["check", &name]);
    assert!(!ok);
    assert!(
        err.contains("is damaged: allocator says 107520 bytes used, table entries own 5120")
            && err.contains("no other process attached, so nothing in flight")
            && err.contains(&format!("shmstore rm {name}"))
            && !err.contains("Unless one of those processes is stopped"),
        "{err}"
    );
    let (ok, v) = check_json(&name);
    assert!(!ok);
    assert_eq!(
        (v["verdict"].as_str(), v["looks"].as_u64()),
        (Some("damaged"), Some(1))
    );
    // With an idle process attached, the same finding in three looks while nothing
    // changes is damage too.
    let idle = Store::open(&name).unwrap();
    let t0 = std::time::Instant::now();
    let (ok, v) = check_json(&name);
    let wall_ms = t0.elapsed().as_secs_f64() * 1e3;
    assert!(!ok);
    assert_eq!(
        (
            v["verdict"].as_str(),
            v["looks"].as_u64(),
            v["clients_alive"].as_u64()
        ),
        (Some("damaged"), Some(3), Some(1)),
        "{v}"
    );
    assert!(
        v["finding"].as_str().unwrap().contains("allocator says"),
        "{v}"
    );
    // Three looks are two pauses of 100 ms, all within the command's run.
    let ms = v["elapsed_ms"].as_f64().unwrap();
    assert!((200.0..wall_ms).contains(&ms), "{ms} ms, run {wall_ms} ms");
    // The advice names the attached process as what to stop first.
    let (ok, _, err) = shmstore(&["check", &name]);
    assert!(
        !ok && err.contains("is damaged")
            && err.contains("the same in 3 looks 100 ms apart, with 1 other process(es)")
            && err.contains("Unless one of those processes is stopped"),
        "{err}"
    );
    // A process at work changes the store's figures between looks, and then the same
    // finding is "busy", not a verdict: its steps in flight could be what the looks see.
    // Here it only reads, so the finding is the same in every look and only the figures
    // (its pins, its gets) tell that anything moved.
    let stop = std::sync::OnceLock::new();
    std::thread::scope(|t| {
        let _stop = StopOnDrop(&stop);
        t.spawn(|| {
            while stop.get().is_none() {
                assert_eq!(idle.try_get(&a).unwrap()[4999], 1);
            }
        });
        let (ok, out, err) = shmstore(&["check", &name]);
        let (ok_json, v) = check_json(&name);
        assert!(!ok && err.contains("could not be checked"), "{out} {err}");
        assert!(!ok_json);
        assert_eq!(
            (v["verdict"].as_str(), v["looks"].as_u64()),
            (Some("busy"), Some(3))
        );
    });
}

#[test]
fn check_calls_damage_beside_a_dead_process_unrecovered_until_it_is_recovered() {
    // The same leaked block as above, and a worker killed while attached: what the dead
    // process may have left half-done reads as damage, so the verdict waits for recovery.
    let name = unique_name("check-dead");
    let s = Store::create(&name, &StoreConfig::with_capacity(4 << 20)).unwrap();
    let path = s.path().unwrap().to_path_buf();
    let _cleanup = common::Cleanup(path.clone());
    s.raw_alloc(100_000).unwrap();
    kill_a_worker_of(&path);
    drop(s);
    let (ok, v) = check_json(&name);
    assert!(!ok);
    assert_eq!(
        (
            v["verdict"].as_str(),
            v["looks"].as_u64(),
            v["clients_dead"].as_u64(),
            v["sweep_pending"].as_bool()
        ),
        (Some("unrecovered"), Some(1), Some(1), Some(false)),
        "{v}"
    );
    let (ok, _, err) = shmstore(&["check", &name]);
    assert!(
        !ok && err.contains("holds what 1 dead process(es) left half-done, which reads as damage")
            && err.contains(&format!("run `shmstore recover {name}`, then check again")),
        "{err}"
    );
    // Recovered, the dead process is no excuse: the leak is damage.
    let (ok, _, err) = shmstore(&["recover", &name]);
    assert!(ok, "{err}");
    let (ok, v) = check_json(&name);
    assert!(!ok);
    assert_eq!(
        (v["verdict"].as_str(), v["clients_dead"].as_u64()),
        (Some("damaged"), Some(0)),
        "{v}"
    );
}

#[test]
fn check_is_not_fooled_by_the_creators_rebuild_of_its_pages() {
    // The creator's background thread rebuilds the heap as 2 MiB pages for a while after
    // create, moving `huge_page_bytes`: that is no operation in flight, and damage found
    // meanwhile is damage, not "busy".
    let name = unique_name("check-rebuild");
    let s = Store::create(&name, &StoreConfig::with_capacity(1 << 30)).unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    s.raw_alloc(100_000).unwrap();
    let before = s.stats().huge_page_bytes;
    let (ok, v) = check_json(&name);
    let after = s.stats().huge_page_bytes;
    assert!(!ok);
    assert_eq!(
        (v["verdict"].as_str(), v["looks"].as_u64()),
        (Some("damaged"), Some(3)),
        "{v} (heap rebuilt as 2 MiB pages: {before} then {after} bytes)"
    );
}

#[test]
fn check_never_calls_a_busy_sound_store_damaged() {
    let name = unique_name("check-busy");
    let s = Store::create(&name, &StoreConfig::with_capacity(4 << 20)).unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    // Two threads put, read and delete objects in slabs and page runs as fast as they
    // can: every look of the checks lands among their steps in flight.
    let stop = std::sync::OnceLock::new();
    let verdicts = std::thread::scope(|t| {
        let _stop = StopOnDrop(&stop);
        for w in 0..2u64 {
            let (s, stop) = (&s, &stop);
            t.spawn(move || {
                for n in 0u64.. {
                    if stop.get().is_some() {
                        break;
                    }
                    let id = ObjectId::of_key(format!("w{w}-{}", n % 16));
                    let len = [100, 3000, 40_000][(n % 3) as usize];
                    if s.put(&id, &vec![n as u8; len]).is_ok() {
                        assert_eq!(s.try_get(&id).unwrap()[len - 1], n as u8);
                    }
                    let _ = s.delete(&id);
                }
            });
        }
        (0..8)
            .map(|_| check_json(&name).1["verdict"].as_str().unwrap().to_owned())
            .collect::<Vec<String>>()
    });
    assert!(
        verdicts.iter().all(|v| v == "sound" || v == "busy"),
        "{verdicts:?}"
    );
    // Quiet again: sound.
    let (ok, v) = check_json(&name);
    assert!(ok && v["verdict"] == "sound", "{v}");
}

/// One sample's value from an exposition, by its full name and labels as written.
fn sample(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{series} in\n{text}"))
        .parse()
        .unwrap()
}

#[test]
fn metrics_print_and_serve_the_store_figures() {
    let name = unique_name("metrics");
    let s = Store::create(&name, &StoreConfig::with_capacity(1 << 20)).unwrap();
    let _cleanup = common::Cleanup(s.path().unwrap().to_path_buf());
    let a = ObjectId::of_key("a");
    s.put(&a, &[1; 3000]).unwrap();
    let _pin = s.try_get(&a).unwrap();
    assert!(s.try_get(&ObjectId::of_key("missing")).is_err());

    let (ok, text, err) = shmstore(&["metrics", &name]);
    assert!(ok, "{err}");
    let l = format!("{{store=\"{name}\"}}");
    assert_eq!(
        sample(&text, &format!("shmstore_capacity_bytes{l}")),
        1 << 20
    );
    assert_eq!(sample(&text, &format!("shmstore_objects{l}")), 1);
    assert_eq!(sample(&text, &format!("shmstore_pins{l}")), 1);
    assert_eq!(sample(&text, &format!("shmstore_creates_total{l}")), 1);
    assert_eq!(
        sample(&text, &format!("shmstore_written_bytes_total{l}")),
        3000
    );
    let gets = |r: &str| format!("shmstore_gets_total{{store=\"{name}\",result=\"{r}\"}}");
    assert_eq!(sample(&text, &gets("hit")), 1);
    assert_eq!(sample(&text, &gets("miss")), 1);
    let alive = format!("shmstore_clients{{store=\"{name}\",state=\"alive\"}}");
    assert_eq!(sample(&text, &alive), 1);
    assert!(text.ends_with("# EOF\n"), "{text}");

    // Served: port 0 picks a free port, which the first stderr line names.
    let mut server = Command::new(env!("CARGO_BIN_EXE_shmstore"))
        .args(["metrics", &name, "--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let line = first_line(server.stderr.as_mut().unwrap());
    let url = line.trim().rsplit(' ').next().unwrap().to_string();
    let addr = url
        .strip_prefix("http://")
        .and_then(|u| u.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("{line}"))
        .to_string();
    let fetch = |path: &str| {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        write!(
            c,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut r = String::new();
        c.read_to_string(&mut r).unwrap();
        r
    };
    s.put(&ObjectId::of_key("b"), &[2; 10]).unwrap();
    let r = fetch("/metrics");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains("application/openmetrics-text"), "{r}");
    // Each scrape reads the store afresh.
    assert_eq!(sample(&r, &format!("shmstore_objects{l}")), 2);
    assert!(fetch("/other").starts_with("HTTP/1.1 404"));
    server.kill().unwrap();
    server.wait().unwrap();
}
