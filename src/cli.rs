//! The `tallyd` command line: each command is a thin layer over the library.
//!
//! Exit codes follow `sysexits.h` where one fits: 0 done, 1 failed or
//! refused, 75 (`EX_TEMPFAIL`) pending or unknown — try again later,
//! 78 (`EX_CONFIG`) bad configuration.

mod bench;
mod daemon;
mod doctor;
mod generate;
mod increment;
mod lane;
mod ledger;
mod reconcile;
mod sequence;
mod setup;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::config::{Config, ConfigErrors};
use crate::daemon::clock::{Clock, ClockOffset};
use crate::logging::Logging;
use crate::redact::Secrets;
use crate::write::counter::CollectionConfig;

use bench::BenchArgs;
use daemon::StatusArgs;
use doctor::DoctorArgs;
use generate::{CompletionsArgs, ManArgs};
use increment::{CompleteArgs, IncrArgs, ResumeArgs};
use ledger::{GetArgs, RecordArgs};
use reconcile::ReconcileArgs;
use sequence::SeqCommand;
use setup::SetupArgs;

/// Exit status: success.
pub(crate) const EXIT_OK: u8 = 0;
/// Exit status: the operation failed, or was refused; nothing more will
/// happen on its own.
pub(crate) const EXIT_FAILED: u8 = 1;
/// Exit status: the outcome is pending or unknown; settle it later
/// (`EX_TEMPFAIL`).
pub(crate) const EXIT_TEMPFAIL: u8 = 75;
pub(crate) use crate::config::EXIT_CONFIG;

/// `tallyd`: exact counters in MongoDB.
#[derive(Debug, Parser)]
#[command(name = "tallyd", version, about, propagate_version = true)]
pub struct Cli {
    /// Configuration file. Default: /etc/tally/tallyd.toml, which may be
    /// absent when the environment (TALLYD__SECTION__KEY) sets everything.
    #[arg(long, short, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// A testing aid, hidden from help: pretend this host's clock is off by
    /// this much (`10m` ahead, `-10m` behind) when its skew against the
    /// server's is measured (`doctor`, and the daemon's `clock_skew`
    /// alert). Nothing else reads the moved clock.
    #[arg(
        long,
        global = true,
        hide = true,
        env = "TALLYD_CLOCK_OFFSET",
        hide_env = true,
        value_name = "DURATION",
        allow_hyphen_values = true
    )]
    pub(crate) clock_offset: Option<ClockOffset>,

    /// What to do.
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// `tallyd check-config`.
#[derive(Debug, clap::Args)]
pub(crate) struct CheckConfigArgs {
    /// Also connect and say which indexes the configuration needs that are
    /// missing (the ledgers' and the advised sparse ones).
    #[arg(long)]
    pub(crate) connect: bool,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the daemon: fold on the schedule, watch the counters, alert,
    /// serve /metrics. Stops at SIGTERM or SIGINT; SIGHUP reloads the
    /// configuration.
    Run,
    /// Show, per collection, the pending and stuck tokens and the malformed
    /// documents.
    Status(StatusArgs),
    /// Check the configuration and print the effective settings, secrets
    /// masked. Exits 78 naming every bad key: what `run` would refuse.
    /// With --connect, also connects and says which indexes are missing
    /// (exit 1 when a ledger lacks one: the daemon would refuse to fold it).
    CheckConfig(CheckConfigArgs),
    /// Connect with the configured URI and say, check by check, what is
    /// safe and what is not: topology, write concern, clock skew, indexes,
    /// privileges, change-stream history. Exits 1 when a check fails
    /// (warnings allowed).
    Doctor(DoctorArgs),
    /// Add to a counter and say exactly what happened: the two-step
    /// increment, or with --lane one round trip through a fresh lane
    /// (default: `[writer] protocol`).
    Incr(IncrArgs),
    /// Count a pending token (step 2 only): safe at any age.
    Complete(CompleteArgs),
    /// Settle a token an increment reported as unknown (with --lane: a
    /// lane; default: `[writer] protocol`).
    Resume(ResumeArgs),
    /// Fold leftover pending tokens older than the grace into their
    /// counters, safely on live documents (or, with --dry-run, report what
    /// that would do). Exit 1 if any collection failed.
    Reconcile(ReconcileArgs),
    /// Record an event once under its key (an idempotency key): a repeat
    /// is a duplicate, counted once. Exit 0 recorded or duplicate, 75
    /// unknown (run it again), 1 conflict or not recorded.
    Record(RecordArgs),
    /// Read a counter exactly: the counter plus its recorded events not
    /// folded into it yet.
    Get(GetArgs),
    /// Create the indexes the configuration needs (idempotent; says what
    /// it did): the ledgers' and the advised sparse ones.
    Setup(SetupArgs),
    /// Measure tally against a plain `$inc` on the configured server, in a
    /// scratch collection it creates and drops: ops/s, p50/p99, outcomes
    /// and the ratio per protocol, then every side's counters checked
    /// against its counted increments (exit 1 on any difference).
    Bench(BenchArgs),
    /// Sequences: hand out numbers from the counters collection.
    #[command(subcommand)]
    Seq(SeqCommand),
    /// Print the shell completion script (for packaging).
    #[command(hide = true)]
    Completions(CompletionsArgs),
    /// Write the man pages into a directory (for packaging).
    #[command(hide = true)]
    Man(ManArgs),
}

/// Options shared by the commands that work on one collection.
#[derive(Debug, Clone, Args)]
pub(crate) struct TargetArgs {
    /// The counter collection. A collection not listed in the configuration
    /// uses the default field names. May be omitted when exactly one
    /// collection is configured.
    #[arg(long, value_name = "NAME")]
    pub(crate) collection: Option<String>,

    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

impl TargetArgs {
    /// The collection the command works on.
    fn resolve(&self, config: &Config) -> Result<CollectionConfig, String> {
        match (&self.collection, config.collections.as_slice()) {
            (Some(name), _) => Ok(config.collection(name)),
            (None, [only]) => Ok(only.clone()),
            (None, listed) => Err(format!(
                "name the collection with --collection ({} configured)",
                listed.len()
            )),
        }
    }

    /// The collection the command works on and a connection: a command's
    /// first steps. A failure is printed (secrets masked); its exit code is
    /// the `Err`.
    async fn open(
        &self,
        config: &Config,
    ) -> Result<(CollectionConfig, crate::store::Store), ExitCode> {
        let secrets = config.secrets();
        let spec = self
            .resolve(config)
            .map_err(|message| fail(self.json, &message, &secrets))?;
        let store = crate::store::Store::connect(&config.mongodb)
            .await
            .map_err(|err| fail(self.json, &err.to_string(), &secrets))?;
        Ok((spec, store))
    }
}

impl Cli {
    /// Runs the commands that need no configuration (the completions and
    /// man pages of packaging): `Some(exit)` when this was one.
    pub fn run_without_config(&self) -> Option<ExitCode> {
        match &self.command {
            Command::Completions(args) => Some(generate::completions(args)),
            Command::Man(args) => Some(generate::man(args)),
            _ => None,
        }
    }

    /// This host's clock, as `--clock-offset` moves it.
    pub(crate) fn clock(&self) -> Clock {
        Clock::with_offset(self.clock_offset.unwrap_or_default())
    }

    /// Loads the configuration from `--config` (or the default file) and
    /// `env`, with the checks the command needs: `run` and `check-config`
    /// (which answers for `run`) refuse the same configurations.
    pub fn load_config(
        &self,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigErrors> {
        let config = Config::load(self.config.as_deref(), env)?;
        if matches!(self.command, Command::Run | Command::CheckConfig(_)) {
            config.check_daemon()?;
        }
        Ok(config)
    }
}

/// `println!` for what a command prints on standard output, through
/// [`write_out`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_out(format_args!($($arg)*), true)
    };
}
pub(crate) use out;

/// Writes `args` (and a newline) to standard output. A reader that went
/// away (`tallyd status | head -1`) is no failure of the command: the rest
/// of the output is dropped, and the command still finishes — closing its
/// connection in order — with the exit code of what it did. Any other
/// failure to write is said on standard error.
pub(crate) fn write_out(args: std::fmt::Arguments<'_>, newline: bool) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let written = if newline {
        writeln!(stdout, "{args}")
    } else {
        write!(stdout, "{args}")
    };
    match written.and_then(|()| stdout.flush()) {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => {
            eprintln!("error: cannot write to standard output: {err}");
        }
        _ => {}
    }
}

/// Runs a command against a loaded configuration; `logging` follows a
/// reload of `tallyd run`.
pub async fn run(cli: Cli, config: Config, logging: Logging) -> ExitCode {
    let clock = cli.clock();
    match cli.command {
        Command::CheckConfig(args) => {
            write_out(format_args!("{}", config.to_redacted_toml()), false);
            for warning in config.warnings() {
                eprintln!("warning: {warning}");
            }
            eprintln!("configuration is valid");
            if args.connect {
                doctor::check_indexes(&config).await
            } else {
                ExitCode::from(EXIT_OK)
            }
        }
        Command::Run => {
            for warning in config.warnings() {
                tracing::warn!("{warning}");
            }
            // A reload reads the configuration again from where this did.
            let reload = Cli {
                config: cli.config,
                clock_offset: cli.clock_offset,
                command: Command::Run,
            };
            daemon::run(&reload, config, &logging).await
        }
        Command::Status(args) => daemon::status(args, &config).await,
        Command::Doctor(args) => doctor::run(args, &config, clock).await,
        Command::Incr(args) => increment::incr(args, &config).await,
        Command::Complete(args) => increment::complete(args, &config).await,
        Command::Resume(args) => increment::resume(args, &config).await,
        Command::Seq(command) => sequence::run(command, &config).await,
        Command::Reconcile(args) => reconcile::run(args, &config).await,
        Command::Record(args) => ledger::record(args, &config).await,
        Command::Get(args) => ledger::get(args, &config).await,
        Command::Setup(args) => setup::run(args, &config).await,
        Command::Bench(args) => bench::run(args, &config).await,
        Command::Completions(args) => generate::completions(&args),
        Command::Man(args) => generate::man(&args),
    }
}

/// The collections a multi-collection command works on (the ones named,
/// else every configured one), a reconciler, the server's time, and the
/// store to shut down at the end — or the exit code of the failure, already
/// reported.
async fn survey_setup(
    named: &[String],
    json: bool,
    config: &Config,
) -> Result<
    (
        Vec<String>,
        crate::reconcile::Reconciler,
        std::time::SystemTime,
        crate::store::Store,
    ),
    ExitCode,
> {
    let secrets = config.secrets();
    let names: Vec<String> = if named.is_empty() {
        config.collections.iter().map(|c| c.name.clone()).collect()
    } else {
        named.to_vec()
    };
    if names.is_empty() {
        let message = "no collections: configure [[collections]] or name one with --collection";
        return Err(fail(json, message, &secrets));
    }
    let store = crate::store::Store::connect(&config.mongodb)
        .await
        .map_err(|err| fail(json, &err.to_string(), &secrets))?;
    let reconciler = config.reconciler(&store);
    let now = match reconciler.server_time().await {
        Ok(now) => now,
        Err(err) => {
            drop(reconciler);
            store.shutdown().await;
            return Err(fail(json, &err.to_string(), &secrets));
        }
    };
    Ok((names, reconciler, now, store))
}

/// Prints a failure that happened before any outcome was known.
fn fail(json: bool, message: &str, secrets: &Secrets) -> ExitCode {
    let message = secrets.scrub(message);
    if json {
        out!(
            "{}",
            serde_json::json!({ "outcome": "error", "error": message })
        );
    } else {
        eprintln!("error: {message}");
    }
    ExitCode::from(EXIT_FAILED)
}
