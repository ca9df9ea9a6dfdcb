//! `shmstore`: the command-line tool. `shmstore bench` is the main job: a benchmark of
//! the store across real processes, each figure printed beside its floor or peer measured
//! in the same run.

mod bench;
mod child;
mod frag;
mod ipc;
mod report;
mod scale;
mod tools;

use std::process::ExitCode;

const USAGE: &str = "\
usage: shmstore <command>

commands:
  bench [--quick] [--json] [--scale]
                             benchmark on a temporary store in /dev/shm (1 engine + 2 workers)
                             --quick  fewer samples, finishes in under 30 s
                             --json   print the figures as one JSON object
                             --scale  the scaling rows instead: operations at 1k-1M objects,
                                      create/open at 1, 4, 16 GiB, page tables per process
  stat NAME [--json]         capacity, use, objects, pins, clients alive and dead
  ls NAME [--json] [--limit N]
                             every object with its size, state and pins, streamed in
                             table order as it is read (--limit: the first N only)
  rm NAME                    remove a store's name (checks that it is a store first)
  recover NAME [--json]      reclaim what dead processes left: pins, unsealed objects,
                             half-done allocations (live processes also do this by themselves)
  help                       this text

NAME is a store in /dev/shm, or a path if it contains '/'.
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("bench") => {
            let mut opts = bench::Options::default();
            for a in &args[1..] {
                match a.as_str() {
                    "--quick" => opts.quick = true,
                    "--json" => opts.json = true,
                    "--scale" => opts.scale = true,
                    other => {
                        eprintln!("shmstore bench: unknown option {other}\n\n{USAGE}");
                        return ExitCode::from(2);
                    }
                }
            }
            match bench::run(&opts) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("shmstore bench: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some(cmd @ ("stat" | "ls" | "rm" | "recover")) => {
            let mut json = false;
            let mut limit = None;
            let mut names = Vec::new();
            let mut rest = args[1..].iter();
            while let Some(a) = rest.next() {
                match a.as_str() {
                    "--json" => json = true,
                    "--limit" if cmd == "ls" => match rest.next().map(|n| n.parse::<u64>()) {
                        Some(Ok(n)) => limit = Some(n),
                        _ => {
                            eprintln!("shmstore ls: --limit takes a number\n\n{USAGE}");
                            return ExitCode::from(2);
                        }
                    },
                    other if other.starts_with("--") => {
                        eprintln!("shmstore {cmd}: unknown option {other}\n\n{USAGE}");
                        return ExitCode::from(2);
                    }
                    _ => names.push(a),
                }
            }
            let [name] = names[..] else {
                eprintln!("shmstore {cmd}: give exactly one store NAME\n\n{USAGE}");
                return ExitCode::from(2);
            };
            let r = match cmd {
                "stat" => tools::stat(name, json),
                "ls" => tools::ls(name, json, limit),
                "recover" => tools::recover(name, json),
                _ => tools::rm(name),
            };
            match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("shmstore {cmd}: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some(child::ENTRY) => child::main(&args[1..]),
        Some("help" | "--help" | "-h") | None => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("shmstore: unknown command {other}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
