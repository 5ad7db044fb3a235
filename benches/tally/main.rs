//! tally's benchmarks: each section runs tally's way and a baseline side by
//! side against the same server in the same run, and prints the ratio.
//! Absolute numbers depend on the machine and the server; ratios are what
//! BENCHMARKS.md records.
//!
//! ```text
//! cargo bench --bench tally -- [increment] [sequence] [fold] [daemon] [lanes] [ledger] [ledger-fold] [ledger-reads] [ledger-recorders] [buckets] [closing] [--seconds S] [--rounds R]
//! ```
//!
//! Each side runs `R` slices of `S` seconds, alternating with the other
//! side (which goes first alternates too), and the slices of a side are
//! merged, so drift in the server's speed hits both sides alike.
//!
//! ```text
//! ```
//!
//! The server is a fresh SecantusDB started for the run (installed by
//! `scripts/install-test-server`), or the one named by
//! `TALLY_BENCH_MONGODB_URI`.

#[path = "../../tests/integration/common/server.rs"]
#[allow(dead_code)]
mod server;

mod buckets;
mod closing;
mod daemon;
mod fold;
mod increment;
mod lanes;
mod ledger;
mod measure;
mod reads;
mod recorders;
mod sequence;

use std::time::Duration;

/// Settings shared by every section.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long each timed slice lasts.
    pub run: Duration,
    /// How many slices each side runs, alternating with the other side;
    /// the slices of a side are merged (total operations over total time).
    pub rounds: usize,
}

fn main() {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let mut sections = Vec::new();
    let mut settings = Settings {
        run: Duration::from_millis(1500),
        rounds: 8,
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                let s: f64 = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--seconds N");
                settings.run = Duration::from_secs_f64(s);
            }
            "--rounds" => {
                settings.rounds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--rounds N");
            }
            section => sections.push(section.to_owned()),
        }
    }
    if sections.is_empty() {
        sections.push("increment".into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    for section in sections {
        match section.as_str() {
            "increment" => runtime.block_on(increment::run(&settings)),
            "buckets" => runtime.block_on(buckets::run(&settings)),
            "closing" => runtime.block_on(closing::run(&settings)),
            "sequence" => runtime.block_on(sequence::run(&settings)),
            "fold" => runtime.block_on(fold::run(&settings)),
            "daemon" => runtime.block_on(daemon::run(&settings)),
            "lanes" => runtime.block_on(lanes::run(&settings)),
            "ledger" => runtime.block_on(ledger::run(&settings)),
            "ledger-fold" => runtime.block_on(ledger::run_fold(&settings)),
            "ledger-reads" => runtime.block_on(reads::run(&settings)),
            "ledger-recorders" => runtime.block_on(recorders::run(&settings)),
            other => {
                eprintln!(
                    "unknown section {other:?}; sections: increment, sequence, fold, daemon, lanes, ledger, ledger-fold, ledger-reads, ledger-recorders, buckets, closing"
                );
                std::process::exit(2);
            }
        }
    }
}
