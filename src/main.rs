//! `tallyd`: parse the command line, load the configuration, start logging,
//! and hand over to the library.

use std::process::ExitCode;

use tally::cli::{self, Cli};
use tally::config::EXIT_CONFIG;

fn main() -> ExitCode {
    let cli = match Cli::from_args() {
        Ok(cli) => cli,
        Err(exit) => return exit,
    };
    if let Some(exit) = cli.run_without_config() {
        return exit;
    }
    let config = match cli.load_config(std::env::vars()) {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{errors}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let logging = tally::logging::init(&config);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(cli::run(cli, config, logging))
}
