//! One engine and two workers, real processes: the README's example, runnable.
//!
//! ```sh
//! cargo run --release --example engine_workers
//! ```
//!
//! The engine creates a store, starts two worker processes (this same program, with the
//! argument `worker`), puts each item once (create, write in place, seal) and sends only
//! its id to the workers over their stdin, as an inference engine sends ids over its RPC.
//! Each worker opens the store by name, gets the item (zero-copy, waiting for the seal if
//! the id arrives first), checks every byte and answers with a checksum. The engine
//! compares the answers with its own and removes the store at the end.

use shmstore::{ObjectId, Store, StoreConfig};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Items of 1, 4 and 16 MiB, like image and video tensors.
const ITEM_SIZES: [usize; 3] = [1 << 20, 4 << 20, 16 << 20];
const WORKERS: usize = 2;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("worker") => worker(&args[2]),
        _ => engine(),
    }
}

/// The bytes of item `n` (some pattern a worker can check without being told it).
fn item_bytes(n: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ n) as u8).collect()
}

/// A checksum both sides compute: FNV-1a over every byte.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn engine() -> Result<(), Box<dyn std::error::Error>> {
    let name = format!("shmstore-example-{}", std::process::id());
    let config = StoreConfig {
        // Gone with its last process, even if this one is killed midway.
        remove_when_unused: true,
        ..StoreConfig::with_capacity(256 << 20)
    };
    let store = Store::create(&name, &config)?;
    println!("engine: created store {name} (256 MiB)");

    let exe = std::env::current_exe()?;
    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let mut child = Command::new(&exe)
            .args(["worker", &name])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        workers.push((child, stdin, stdout));
    }

    for (n, &len) in ITEM_SIZES.iter().enumerate() {
        let bytes = item_bytes(n, len);
        let id = ObjectId::of_content(&bytes);
        // Send the id first: the workers block in get until the seal below wakes them.
        for (_, stdin, _) in &mut workers {
            writeln!(stdin, "{id} {n}")?;
        }
        let t = Instant::now();
        let mut c = store.create_object(&id, len as u64)?;
        c.write_at(0, &bytes);
        c.seal()?;
        let put = t.elapsed();
        let want = checksum(&bytes);
        for (w, (_, _, stdout)) in workers.iter_mut().enumerate() {
            let mut line = String::new();
            stdout.read_line(&mut line)?;
            let got: u64 = line.trim().parse()?;
            if got != want {
                return Err(format!("worker {w} read other bytes for item {n}").into());
            }
        }
        println!(
            "engine: item {n} ({} MiB) put in {put:.2?}, read in place by {WORKERS} workers, every byte checked",
            len >> 20
        );
    }
    for (mut child, stdin, _) in workers {
        drop(stdin); // end of input: the worker exits
        let status = child.wait()?;
        if !status.success() {
            return Err(format!("a worker failed: {status}").into());
        }
    }
    let st = store.stats();
    println!(
        "engine: done; the store holds {} objects, {} gets hit, {} waited for a seal",
        st.objects, st.gets_hit, st.gets_waited
    );
    Ok(())
}

fn worker(name: &str) -> Result<(), Box<dyn std::error::Error>> {
    let store = Store::open(name)?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let (id, n) = line.split_once(' ').ok_or("expected: ID N")?;
        let id: ObjectId = id.parse()?;
        // Zero-copy: `view` derefs to the bytes in shared memory, pinned until dropped.
        let view = store.get(&id, Duration::from_secs(10))?;
        let n: usize = n.parse()?;
        if view[..] != item_bytes(n, view.len())[..] {
            return Err(format!("item {n}: bytes differ").into());
        }
        println!("{}", checksum(&view));
        std::io::stdout().flush()?;
    }
    Ok(())
}
