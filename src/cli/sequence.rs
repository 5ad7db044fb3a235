//! `tallyd seq next NAME [--block N]`, `tallyd seq current NAME`.

use crate::cli::out;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::json;

use super::exit::exit_code_for_write;
use super::{EXIT_OK, exit_code_for, fail};
use crate::config::Config;
use crate::error::{Effect, Error};
use crate::write::sequence::Sequences;

/// `tallyd seq ...`: sequences in the `[sequences]` collection.
#[derive(Debug, Subcommand)]
pub(crate) enum SeqCommand {
    /// Hand out the next number (or a block of numbers) of a sequence.
    Next(NextArgs),
    /// Show the last number handed out, changing nothing.
    Current(CurrentArgs),
}

/// `tallyd seq next NAME [--block N]`.
#[derive(Debug, Args)]
pub(crate) struct NextArgs {
    /// The sequence's name (its `_id` in the counters collection; not
    /// empty).
    #[arg(value_parser = super::counter_key)]
    pub(crate) name: String,
    /// Reserve N consecutive numbers in one round trip.
    #[arg(long, value_name = "N", value_parser = block_size)]
    pub(crate) block: Option<u32>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `tallyd seq current NAME`.
#[derive(Debug, Args)]
pub(crate) struct CurrentArgs {
    /// The sequence's name (not empty).
    #[arg(value_parser = super::counter_key)]
    pub(crate) name: String,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `--block N`: a whole number from 1 to 4294967295 (said in words: clap's
/// own range check would print a Rust range).
fn block_size(text: &str) -> Result<u32, String> {
    match text.parse::<u32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("a block is a whole number from 1 to {}", u32::MAX)),
    }
}

pub(super) async fn run(command: SeqCommand, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    let json = match &command {
        SeqCommand::Next(args) => args.json,
        SeqCommand::Current(args) => args.json,
    };
    let store = match super::connect(config, json).await {
        Ok(store) => store,
        Err(code) => return code,
    };
    let writes = matches!(command, SeqCommand::Next(_));
    let sequences = Sequences::new(&store, &config.sequences);
    let result = match command {
        SeqCommand::Next(NextArgs {
            name,
            block: Some(n),
            json,
        }) => sequences.next_block(&name, n).await.map(|block| {
            if json {
                json!({ "name": name, "first": block.first, "last": block.last }).to_string()
            } else {
                format!("{} to {}", block.first, block.last)
            }
        }),
        SeqCommand::Next(NextArgs { name, json, .. }) => sequences.next(&name).await.map(|value| {
            if json {
                json!({ "name": name, "value": value }).to_string()
            } else {
                value.to_string()
            }
        }),
        SeqCommand::Current(CurrentArgs { name, json }) => {
            sequences
                .current(&name)
                .await
                .map(|value| match (json, value) {
                    (true, value) => json!({ "name": name, "value": value }).to_string(),
                    (false, Some(value)) => value.to_string(),
                    (false, None) => {
                        format!("sequence {name} does not exist yet (next would be 1)")
                    }
                })
        }
    };
    drop(sequences);
    let code = match result {
        Ok(line) => {
            out!("{line}");
            ExitCode::from(EXIT_OK)
        }
        // A write that may have applied consumed a number (a gap): trying
        // again later is the right move, and the exit code says so.
        Err(err) if writes => fail(
            json,
            &describe(&err, store.explain(&err)),
            &secrets,
            exit_code_for_write(&err),
        ),
        Err(err) => fail(json, &store.explain(&err), &secrets, exit_code_for(&err)),
    };
    store.shutdown().await;
    code
}

/// A failed `next`: `explained`, and whether a number may be lost.
fn describe(err: &Error, explained: String) -> String {
    match err {
        Error::Server(failure) if failure.effect != Effect::NotApplied => {
            format!("{explained} (a number may have been skipped; none was handed out twice)")
        }
        _ => explained,
    }
}
