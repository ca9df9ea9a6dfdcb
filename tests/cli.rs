//! The `shmstore` command-line tools: stat, ls, rm, recover.

mod common;

use common::unique_name;
use shmstore::{ObjectId, Store, StoreConfig};
use std::process::{Command, Stdio};

fn shmstore(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_shmstore"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn field(json: &str, key: &str) -> u64 {
    let at = json
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("{key} in {json}"));
    json[at + key.len() + 3..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .unwrap()
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
    assert!(ok && out.trim_end().starts_with('[') && out.trim_end().ends_with(']'));
    assert_eq!(out.matches("\"id\"").count(), 2, "{out}");
    let (ok, _, err) = shmstore(&["ls", &name, "--limit", "many"]);
    assert!(!ok && err.contains("--limit takes a number"), "{err}");

    // A reader that goes away (`| head`) ends the listing; it is not an error to hang on.
    let mut child = Command::new(env!("CARGO_BIN_EXE_shmstore"))
        .args(["ls", &name])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut first,
    )
    .unwrap();
    assert!(first.starts_with("id"), "{first}");
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
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
    let mut child = Command::new(env!("CARGO_BIN_EXE_shmstore"))
        .args(["__child", "e2e", s.path().unwrap().to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "ready");
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
