//! The `tallyd` command line: each command is a thin layer over the library.
//!
//! Every command exits by the class of what happened, the same way
//! (`exit`; `sysexits.h` where one fits):
//!
//! | exit | meaning |
//! |---|---|
//! | 0 | done |
//! | 1 | definitely not done (refused, nothing written); `status --check`: something needs attention |
//! | 64 | usage: an unknown command or flag, a missing or malformed argument |
//! | 69 | the server is unavailable (nothing was written) |
//! | 75 | the outcome is unknown or pending: resuming is safe |
//! | 77 | permission denied: authentication failed, or a privilege is missing |
//! | 78 | configuration: a bad key, a collection not configured, an unusable URI |
//!
//! Every command reads and checks the configuration the same way
//! ([`Cli::load_config`]), so one configuration gets one verdict from all
//! of them; `--collection` names a configured collection (another one only
//! with `--any-collection`). What a command prints about a failure is one
//! sentence for people (the messages of `error`), secrets removed.

mod api_token;
mod bench;
mod daemon;
mod database;
mod doctor;
mod envfile;
pub(crate) mod exit;
mod fold_from;
mod generate;
mod increment;
mod keys;
mod lane;
mod ledger;
mod reach;
mod reconcile;
mod sequence;
mod settle;
mod setup;
mod shown;

pub(crate) use doctor::sharding::refusal as shard_key_refusal;
pub(crate) use keys::{counter_key, event_key};
use reach::connect;
pub(crate) use shown::{shown_command, write_out};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::config::{Config, ConfigErrors};
use crate::daemon::clock::{Clock, ClockOffset};
use crate::error::words;
use crate::logging::Logging;
use crate::redact::Secrets;
use crate::store::Store;
use crate::write::counter::CollectionConfig;

use bench::BenchArgs;
use daemon::StatusArgs;
use doctor::DoctorArgs;
use fold_from::FoldFromArgs;
use generate::{CompletionsArgs, ManArgs};
use increment::IncrArgs;
use ledger::{GetArgs, RecordArgs};
use reconcile::ReconcileArgs;
use sequence::SeqCommand;
use settle::{CompleteArgs, ResumeArgs};
use setup::SetupArgs;

pub(crate) use exit::{
    EXIT_CONFIG, EXIT_FAILED, EXIT_NOPERM, EXIT_OK, EXIT_TEMPFAIL, EXIT_USAGE, exit_code_for,
};
use exit::{fail, fail_with};

/// `tallyd`: exact counters in MongoDB.
#[derive(Debug, Parser)]
#[command(name = "tallyd", version, about, propagate_version = true)]
pub(crate) struct Cli {
    /// Configuration file. Default: /etc/tally/tallyd.toml, which may be
    /// absent when the environment (TALLYD__SECTION__KEY) sets everything.
    #[arg(long, short, global = true, value_name = "PATH")]
    pub(crate) config: Option<PathBuf>,

    /// Read environment variables from this file first, in the syntax of
    /// systemd's EnvironmentFile= (one KEY=VALUE a line, taken as it is:
    /// `&` and spaces need no quoting), e.g. /etc/tally/tallyd.env. Its
    /// values win over the environment's.
    #[arg(long, global = true, value_name = "PATH")]
    pub(crate) env_file: Option<PathBuf>,

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

    /// Whether the command asked for one JSON object (its `--json`): known
    /// before the configuration is read, so that a configuration refused
    /// is reported in JSON too.
    #[arg(skip)]
    pub(crate) json: bool,
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
    /// Show the server and database, then per collection the pending and
    /// stuck tokens and the malformed documents (and a bucketed one's open
    /// buckets). With --check, exit 1 when something needs attention.
    Status(StatusArgs),
    /// Check the configuration and print the effective settings, secrets
    /// masked. Exits 78 naming every bad key: what every command would
    /// refuse. With --connect, also connects (69: unreachable, 77:
    /// authentication refused) and says which indexes are missing (exit 1
    /// when a ledger lacks one: the daemon would refuse to fold it).
    CheckConfig(CheckConfigArgs),
    /// Connect with the configured URI and say, check by check, what is
    /// safe and what is not: topology, database, write concern, clock skew,
    /// indexes, privileges, change-stream history. Exits 1 when a check
    /// fails (warnings allowed); 69 or 77 when it cannot connect.
    Doctor(DoctorArgs),
    /// Add to a counter and say exactly what happened: the two-step
    /// increment, or with --lane one round trip through a fresh lane
    /// (default: `[writer] protocol`).
    Incr(IncrArgs),
    /// Count a pending token (step 2 only), by the ticket its increment
    /// printed or the bare token: safe at any age.
    Complete(CompleteArgs),
    /// Settle an increment reported as unknown, by the ticket it printed
    /// (whose shape says the protocol: a number is a lane's).
    Resume(ResumeArgs),
    /// Fold leftover pending tokens older than the grace into their
    /// counters, safely on live documents, and close the buckets past their
    /// closing time (or, with --dry-run, report what that would do). When a
    /// collection failed, exits by the failure's class (1, 69 or 77);
    /// stopped by Ctrl-C, 130 after its summary.
    Reconcile(ReconcileArgs),
    /// Record an event once under its key (an idempotency key): a repeat
    /// is a duplicate, counted once. Exit 0 recorded or duplicate, 75
    /// unknown (run it again), 1 conflict or not recorded.
    Record(RecordArgs),
    /// Read a counter exactly: the counter plus its recorded events not
    /// folded into it yet; with --from and --to, a key's buckets in a range.
    Get(GetArgs),
    /// Create the indexes the configuration needs (idempotent; says what
    /// it did): the ledgers' and the advised sparse ones.
    Setup(SetupArgs),
    /// Fold a ledger again from a time you choose after its fold stopped
    /// (its place in the change stream no longer in the oplog): the events
    /// recorded after TIME, then the change stream; names the events
    /// recorded near the stop, whose count cannot be certain.
    FoldFrom(FoldFromArgs),
    /// Measure tally against a plain `$inc` on the configured server, in a
    /// scratch collection it creates and drops: ops/s, p50/p99, outcomes
    /// and the ratio per protocol, then every side's counters checked
    /// against its counted increments (exit 1 on any difference).
    Bench(BenchArgs),
    /// Make a bearer token for the HTTP API ([api]): prints the token, once,
    /// and the line that stores it (hashed) in the environment file.
    ApiToken(api_token::ApiTokenArgs),
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
    /// The counter collection: one of the configured ones (exit 78
    /// otherwise). May be omitted when exactly one is configured.
    #[arg(long, value_name = "NAME")]
    pub(crate) collection: Option<String>,

    /// Let --collection name a collection that is not configured: it is
    /// then used with the default field names and no ledger.
    #[arg(long, requires = "collection")]
    pub(crate) any_collection: bool,

    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

impl TargetArgs {
    /// `--collection NAME` for the collection `name` the command works on
    /// (named, or the only one configured), and `--any-collection` when it
    /// was given: what a printed command repeats.
    fn collection_options(&self, name: &str) -> String {
        let any = if self.any_collection {
            " --any-collection"
        } else {
            ""
        };
        format!(" --collection {}{any}", increment::shell_word(name))
    }

    /// The collection the command works on, or the failure's message and
    /// exit code; `ledger` for a command of the events ledger (a
    /// collection the configuration does not list has none).
    fn resolve(&self, config: &Config, ledger: bool) -> Result<CollectionConfig, (String, u8)> {
        match (&self.collection, config.collections.as_slice()) {
            (Some(name), _) => {
                configured(
                    config,
                    std::slice::from_ref(name),
                    self.any_collection,
                    ledger,
                )?;
                Ok(config.collection(name))
            }
            (None, [only]) => Ok(only.clone()),
            (None, listed) => {
                let names: Vec<&str> = listed.iter().map(|c| c.name.as_str()).collect();
                Err((
                    format!(
                        "name the collection with --collection: {} are configured",
                        words(&names)
                    ),
                    EXIT_USAGE,
                ))
            }
        }
    }

    /// The collection the command works on and a connection: a command's
    /// first steps. A failure is printed (secrets masked); its exit code is
    /// the `Err`.
    async fn open(&self, config: &Config) -> Result<(CollectionConfig, Store), ExitCode> {
        let secrets = config.secrets();
        let spec = self
            .resolve(config, false)
            .map_err(|(message, code)| fail(self.json, &message, &secrets, code))?;
        let store = connect(config, self.json).await?;
        Ok((spec, store))
    }

    /// [`TargetArgs::open`] for a command of the events ledger: the
    /// collection must have one (nothing would fold a recorded event).
    async fn open_ledger(&self, config: &Config) -> Result<(CollectionConfig, Store), ExitCode> {
        let secrets = config.secrets();
        let spec = self
            .resolve(config, true)
            .map_err(|(message, code)| fail(self.json, &message, &secrets, code))?;
        if spec.events_collection.is_none() {
            let message = format!(
                "{} has no events ledger (`ledger = true` in its [[collections]] entry): nothing \
                 would fold a recorded event into it",
                spec.name
            );
            return Err(fail(self.json, &message, &secrets, EXIT_CONFIG));
        }
        let store = connect(config, self.json).await?;
        Ok((spec, store))
    }
}

/// Checks that each of `names` is a configured collection, unless `any`
/// (`--any-collection`) lets it be another — never for a command of the
/// events ledger (`ledger`: only a configured entry has one): the message
/// and exit code (78) of the first that is not.
fn configured(
    config: &Config,
    names: &[String],
    any: bool,
    ledger: bool,
) -> Result<(), (String, u8)> {
    let listed: Vec<&str> = config.collections.iter().map(|c| c.name.as_str()).collect();
    match names.iter().find(|name| !listed.contains(&name.as_str())) {
        Some(name) if ledger => Err((
            format!(
                "{name} is not a configured collection (configured: {}); correct the name (an \
                 events ledger is a [[collections]] entry's, with `ledger = true`: \
                 --any-collection cannot give one)",
                words(&listed)
            ),
            EXIT_CONFIG,
        )),
        Some(name) if !any => Err((
            format!(
                "{name} is not a configured collection (configured: {}); correct the name, or \
                 pass --any-collection to use a collection the configuration does not list (with \
                 the default field names and no ledger)",
                words(&listed)
            ),
            EXIT_CONFIG,
        )),
        _ => Ok(()),
    }
}

impl Cli {
    /// Parses the command line: `Err` with the exit code when it is wrong
    /// (the message printed: 64) or when it asked for `--help` or
    /// `--version` (printed: 0).
    pub(crate) fn from_args() -> Result<Self, ExitCode> {
        command()
            .try_get_matches()
            .and_then(|matches| {
                let cli = <Self as clap::FromArgMatches>::from_arg_matches(&matches)?;
                Ok(Self {
                    json: asks_for_json(&matches),
                    ..cli
                })
            })
            .map_err(|err| {
                // A value its parser refused: the parser's sentence names
                // the value (escaped, shortened); clap's own would repeat
                // it raw and whole, a line end or 100 kB of it included.
                if err.kind() == clap::error::ErrorKind::ValueValidation
                    && let Some(clap::error::ContextValue::String(arg)) =
                        err.get(clap::error::ContextKind::InvalidArg)
                    && let Some(why) = std::error::Error::source(&err)
                {
                    eprintln!("error: {arg}: {why}\n\nFor more information, try '--help'.");
                    return ExitCode::from(EXIT_USAGE);
                }
                let _ = err.print();
                // Help and version are written to standard output: not errors.
                ExitCode::from(if err.use_stderr() {
                    EXIT_USAGE
                } else {
                    EXIT_OK
                })
            })
    }

    /// Runs the commands that need no configuration (the completions and
    /// man pages of packaging): `Some(exit)` when this was one.
    pub(crate) fn run_without_config(&self) -> Option<ExitCode> {
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
    /// `env`, with `--env-file`'s variables over `env`'s. Every command
    /// checks the same way — `check-config` answers for all of them — so
    /// one configuration gets one verdict (and exit code 78) everywhere.
    pub(crate) fn load_config(
        &self,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigErrors> {
        let mut env: Vec<(String, String)> = env.into_iter().collect();
        if let Some(path) = &self.env_file {
            let file = envfile::read(path)
                .map_err(|problem| ConfigErrors::single("--env-file", problem))?;
            env.retain(|(key, _)| !file.iter().any(|(k, _)| k == key));
            env.extend(file);
        }
        Config::load(self.config.as_deref(), env)
    }
}

/// Whether the (innermost) command of `matches` was given `--json`:
/// every command that takes it, found by the flag's name rather than
/// command by command.
fn asks_for_json(matches: &clap::ArgMatches) -> bool {
    match matches.subcommand() {
        Some((_, command)) => asks_for_json(command),
        None => matches!(matches.try_get_one::<bool>("json"), Ok(Some(true))),
    }
}

/// The command line as `--help` (and so the man pages) shows it: the help
/// of every command ends with the table of exit codes.
pub(crate) fn command() -> clap::Command {
    fn with_exit_codes(command: clap::Command) -> clap::Command {
        command
            .after_help(exit::exit_codes_help())
            .mut_subcommands(with_exit_codes)
    }
    with_exit_codes(<Cli as clap::CommandFactory>::command())
}

/// `println!` for what a command prints on standard output, through
/// [`write_out`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cli::write_out(format_args!($($arg)*), true)
    };
}
pub(crate) use out;

/// The `tallyd` binary's entry point: parses the command line, loads the
/// configuration, starts logging and runs the command, returning the exit
/// code of its outcome (see the table of exit codes in `tallyd --help`).
///
/// The binary's `main` is this one call; it is public so that a build of
/// `tallyd` with its own `main` (a distribution's wrapper, a binary linking
/// more of its own) runs exactly the daemon and commands tally ships. It
/// reads the process's arguments and environment and builds its own async
/// runtime: call it from a plain `fn main`, not from inside a runtime.
///
/// ```no_run
/// fn main() -> std::process::ExitCode {
///     tally::tallyd_main()
/// }
/// ```
pub fn tallyd_main() -> ExitCode {
    let cli = match Cli::from_args() {
        Ok(cli) => cli,
        Err(exit) => return exit,
    };
    if let Some(exit) = cli.run_without_config() {
        return exit;
    }
    cli.remember_options();
    let config = match cli.load_config(std::env::vars()) {
        Ok(config) => config,
        // The problems quote no secret (a URI's password is left out where
        // it is found): there is nothing more to scrub.
        Err(errors) if cli.json => {
            return fail(true, &errors.to_string(), &Secrets::default(), EXIT_CONFIG);
        }
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let logging = crate::logging::init(&config);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(cli, config, logging))
}

/// Runs a command against a loaded configuration; `logging` follows a
/// reload of `tallyd run`.
pub(crate) async fn run(cli: Cli, config: Config, logging: Logging) -> ExitCode {
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
                env_file: cli.env_file,
                clock_offset: cli.clock_offset,
                command: Command::Run,
                json: false,
            };
            daemon::run(&reload, config, &logging).await
        }
        Command::Status(args) => daemon::status(args, &config).await,
        Command::Doctor(args) => doctor::run(args, &config, clock).await,
        Command::Incr(args) => increment::incr(args, &config).await,
        Command::Complete(args) => settle::complete(args, &config).await,
        Command::Resume(args) => settle::resume(args, &config).await,
        Command::Seq(command) => sequence::run(command, &config).await,
        Command::Reconcile(args) => reconcile::run(args, &config).await,
        Command::FoldFrom(args) => fold_from::run(args, &config).await,
        Command::Record(args) => ledger::record(args, &config).await,
        Command::Get(args) => ledger::get(args, &config).await,
        Command::Setup(args) => setup::run(args, &config).await,
        Command::Bench(args) => bench::run(args, &config).await,
        Command::ApiToken(args) => api_token::run(&args, &config),
        Command::Completions(args) => generate::completions(&args),
        Command::Man(args) => generate::man(&args),
    }
}

/// `--collection NAME` (repeatable) and `--any-collection`: the
/// collections a command over several works on.
#[derive(Debug, Clone, Args)]
pub(crate) struct CollectionsArgs {
    /// Only this collection (repeatable): a configured one (exit 78
    /// otherwise). Default: every configured collection.
    #[arg(long = "collection", value_name = "NAME")]
    pub(crate) collections: Vec<String>,

    /// Let --collection name collections the configuration does not list:
    /// they are used with the default field names and no ledger.
    #[arg(long, requires = "collections")]
    pub(crate) any_collection: bool,
}

/// The collections a multi-collection command works on (the ones named,
/// else every configured one), a reconciler, the server's time, and the
/// store to shut down at the end — or the exit code of the failure, already
/// reported.
async fn survey_setup(
    which: &CollectionsArgs,
    json: bool,
    config: &Config,
) -> Result<
    (
        Vec<String>,
        crate::reconcile::Reconciler,
        std::time::SystemTime,
        Store,
    ),
    ExitCode,
> {
    let secrets = config.secrets();
    configured(config, &which.collections, which.any_collection, false)
        .map_err(|(message, code)| fail(json, &message, &secrets, code))?;
    let names: Vec<String> = if which.collections.is_empty() {
        config.collections.iter().map(|c| c.name.clone()).collect()
    } else {
        which.collections.clone()
    };
    let store = connect(config, json).await?;
    let reconciler = config.reconciler(&store);
    let now = match reconciler.server_time().await {
        Ok(now) => now,
        Err(err) => {
            drop(reconciler);
            let code = fail_with(json, &err, &store, &secrets);
            store.shutdown().await;
            return Err(code);
        }
    };
    Ok((names, reconciler, now, store))
}
