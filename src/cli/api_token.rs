//! `tallyd api-token NAME`: a new bearer token for the HTTP API.
//!
//! The token is 32 bytes from the operating system's randomness, written
//! `tally_` and 64 hex digits. It is printed once, for the client; the
//! daemon never stores it — the line printed beside it holds its SHA-256
//! and its scopes, for the environment file (`TALLYD_API_TOKEN_<NAME>=…`),
//! never the TOML file. The line is checked as the daemon will read it
//! (the collections it names must have a ledger) before it is printed.

use std::process::ExitCode;

use serde_json::json;

use super::{EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_USAGE, fail, out};
use crate::config::{
    Config, TOKEN_HASH_PREFIX, TOKEN_VAR_PREFIX, hash_hex, parse_token, token_hash,
};

/// `tallyd api-token NAME [--record COLLECTION]… [--read COLLECTION]…`.
#[derive(Debug, clap::Args)]
pub(crate) struct ApiTokenArgs {
    /// The token's name, as logs and errors show it (letters, digits and
    /// underscores): the variable is TALLYD_API_TOKEN_NAME.
    #[arg(value_parser = token_name)]
    name: String,
    /// Let the token record events into COLLECTION (a collection with a
    /// ledger; * for every one). Repeatable.
    #[arg(long, value_name = "COLLECTION")]
    record: Vec<String>,
    /// Let the token read the counters of COLLECTION (* for every one).
    /// Repeatable.
    #[arg(long, value_name = "COLLECTION")]
    read: Vec<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// A token's name: letters, digits and underscores (exit 64 otherwise).
fn token_name(text: &str) -> Result<String, String> {
    if !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "a token's name is letters, digits and underscores (it becomes part of a variable's \
             name), not {:?}; e.g. billing_service",
            text.chars().take(64).collect::<String>()
        ))
    }
}

/// A new token: `tally_` and 64 hex digits of the system's randomness.
fn new_token() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|err| format!("cannot read the system's randomness to make a token: {err}"))?;
    Ok(format!("tally_{}", hash_hex(&bytes)))
}

pub(super) fn run(args: &ApiTokenArgs, config: &Config) -> ExitCode {
    let secrets = config.secrets();
    if args.record.is_empty() && args.read.is_empty() {
        let message = "give the token something to do: --record COLLECTION and/or --read \
                       COLLECTION (repeatable; * for every collection with a ledger)";
        return fail(args.json, message, &secrets, EXIT_USAGE);
    }
    let scopes: Vec<String> = args
        .record
        .iter()
        .map(|c| format!("record:{c}"))
        .chain(args.read.iter().map(|c| format!("read:{c}")))
        .collect();
    let token = match new_token() {
        Ok(token) => token,
        Err(message) => return fail(args.json, &message, &secrets, EXIT_FAILED),
    };
    let variable = format!("{TOKEN_VAR_PREFIX}{}", args.name.to_uppercase());
    let value = format!(
        "{TOKEN_HASH_PREFIX}{} {}",
        hash_hex(&token_hash(&token)),
        scopes.join(" ")
    );
    // The line as the daemon will read it: a scope naming a collection
    // without a ledger would make the daemon refuse its configuration.
    if let Err(problem) = parse_token(&variable, &value, &config.collections) {
        return fail(args.json, &problem, &secrets, EXIT_CONFIG);
    }
    let line = format!("{variable}={value}");
    if args.json {
        out!(
            "{}",
            json!({ "name": args.name, "token": token, "variable": variable, "line": line, "scopes": scopes })
        );
    } else {
        out!(
            "token {} (shown once: give it to the client; it is a password):",
            args.name
        );
        out!("{token}");
        out!(
            "add this line to the daemon's environment file (/etc/tally/tallyd.env), then \
             restart the daemon, or reload it (SIGHUP) when it runs with --env-file:"
        );
        out!("{line}");
    }
    ExitCode::from(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_names_are_variable_safe() {
        let (a, b) = (new_token().unwrap(), new_token().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), "tally_".len() + 64);
        assert!(token_name("billing_2").is_ok());
        assert!(token_name("billing-2").is_err());
        assert!(token_name("").is_err());
    }
}
