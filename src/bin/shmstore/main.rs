//! `shmstore`: the command-line tool. `shmstore bench` is the main job: a benchmark of
//! the store across real processes, each figure printed beside its floor or peer measured
//! in the same run. The other subcommands find, inspect, check, repair, remove and export stores.
//!
//! Arguments are parsed by clap (derive); JSON goes through serde_json; the Prometheus
//! exposition through prometheus-client, served over tiny_http (`metrics.rs`).

mod bench;
mod child;
mod frag;
mod ipc;
mod metrics;
mod report;
mod scale;
mod tools;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Exit codes, documented in every `--help`.
const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the command failed (the message says what and how to fix it)
  2  usage error (unknown flag, missing NAME)

NAME is a store in /dev/shm, or a path if it contains '/'.";

/// A lock-free shared-memory object store: inspect, benchmark and export stores.
#[derive(Parser)]
#[command(name = "shmstore", version, propagate_version = true, about, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmark on a temporary store in /dev/shm (1 engine + 2 worker processes), each
    /// figure beside its floor or peer measured in the same run.
    #[command(after_help = EXIT_CODES)]
    Bench {
        /// Fewer samples: finishes in under 30 s.
        #[arg(long)]
        quick: bool,
        /// Print the figures as one JSON object (keys in docs/benchmarks.md).
        #[arg(long)]
        json: bool,
        /// The scaling rows instead: operations at 1k-1M objects, create/open at 1, 4 and
        /// 16 GiB, page tables per process.
        #[arg(long)]
        scale: bool,
    },
    /// Every store in a directory (default /dev/shm): capacity, use, objects, processes
    /// alive and dead; the ones no live process uses, and the memory they hold.
    #[command(after_help = EXIT_CODES)]
    Stores {
        /// The directory (default /dev/shm).
        dir: Option<String>,
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Capacity, use, objects, pins, operation counts, clients alive and dead.
    #[command(after_help = EXIT_CODES)]
    Stat {
        /// The store.
        name: String,
        /// One JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Every object with its size, state and pins, streamed in table order as it is read.
    #[command(after_help = EXIT_CODES)]
    Ls {
        /// The store.
        name: String,
        /// One JSON array instead of a table.
        #[arg(long)]
        json: bool,
        /// List the first N objects only.
        #[arg(long, value_name = "N")]
        limit: Option<u64>,
    },
    /// Check every invariant of the store (allocator against table, bytes, counters,
    /// owners) without changing anything: exits 0 if it is sound, 1 if damaged or too busy
    /// to tell.
    #[command(after_help = EXIT_CODES)]
    Check {
        /// The store.
        name: String,
        /// One JSON object (with the verdict: sound, damaged or busy) instead of a sentence.
        #[arg(long)]
        json: bool,
    },
    /// Remove a store's name (checks that it is a store first; attached processes keep
    /// their mapping until they detach).
    #[command(after_help = EXIT_CODES)]
    Rm {
        /// The store.
        name: String,
    },
    /// Reclaim what dead processes left: pins, unsealed objects, half-done allocations
    /// (live processes also do this by themselves).
    #[command(after_help = EXIT_CODES)]
    Recover {
        /// The store.
        name: String,
        /// One JSON object instead of a sentence.
        #[arg(long)]
        json: bool,
    },
    /// The store's figures in the Prometheus text exposition format: printed once, or
    /// served at http://ADDR/metrics with --listen.
    #[command(after_help = EXIT_CODES)]
    Metrics {
        /// The store.
        name: String,
        /// Serve at this address (e.g. 127.0.0.1:9464) until killed, instead of printing.
        #[arg(long, value_name = "ADDR")]
        listen: Option<String>,
    },
}

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    // The benchmark's child processes: a hidden entry point, not part of the interface.
    if args.nth(1).is_some_and(|a| a == child::ENTRY) {
        let rest: Vec<String> = std::env::args().skip(2).collect();
        return child::main(&rest);
    }
    let cli = Cli::parse();
    let (what, result) = match &cli.command {
        Command::Bench { quick, json, scale } => (
            "bench",
            bench::run(&bench::Options {
                quick: *quick,
                json: *json,
                scale: *scale,
            }),
        ),
        Command::Stores { dir, json } => ("stores", tools::stores(dir.as_deref(), *json)),
        Command::Stat { name, json } => ("stat", tools::stat(name, *json)),
        Command::Ls { name, json, limit } => ("ls", tools::ls(name, *json, *limit)),
        Command::Check { name, json } => ("check", tools::check(name, *json)),
        Command::Rm { name } => ("rm", tools::rm(name)),
        Command::Recover { name, json } => ("recover", tools::recover(name, *json)),
        Command::Metrics { name, listen } => ("metrics", metrics::run(name, listen.as_deref())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shmstore {what}: {e}");
            ExitCode::FAILURE
        }
    }
}
