//! The `[api]` section's checks: what the HTTP API would serve, and how it
//! is protected — its ledgers, its TLS files, its tokens, its exposure.
//! Nothing connects: the section is read as the daemon reads it.

use super::{Check, Verdict, ledgers};
use crate::config::Config;
use crate::daemon::api::serve::tls_acceptor;

/// The checks of `[api]` (none when it is off): `api` (the ledgers served
/// and who may use them) and, with TLS, `api_tls`.
pub(super) fn checks(config: &Config) -> Vec<Check> {
    let api = &config.api;
    if !api.enabled {
        return Vec::new();
    }
    let served: Vec<&str> = ledgers(config).map(|c| c.name.as_str()).collect();
    let mut checks = Vec::new();
    let access = if api.tokens.is_empty() {
        "open: no token is configured, so anyone who reaches it may record and read".to_owned()
    } else {
        let tokens: Vec<String> = api
            .tokens
            .iter()
            .map(|t| format!("{} ({})", t.name, t.scopes_text()))
            .collect();
        format!("tokens {}", tokens.join(", "))
    };
    let check = if served.is_empty() {
        Check::new(
            "api",
            Verdict::Fail,
            format!(
                "[api] is on at {}, but no configured collection has a ledger: every request \
                 would be refused (404); set ledger = true on the collections it should serve",
                api.listen
            ),
        )
    } else if !api.listen.ip().is_loopback() && !api.serve_without.is_empty() {
        Check::new(
            "api",
            Verdict::Warn,
            format!(
                "{} serves {} to other hosts without {} (serve_without): a proxy in front must \
                 provide it; {access}",
                api.listen,
                served.join(", "),
                api.serve_without.join(" and ")
            ),
        )
    } else if api.tokens.is_empty() {
        Check::new(
            "api",
            Verdict::Warn,
            format!(
                "{} serves {} to this host's processes; {access}: add a token (tallyd \
                 api-token NAME) unless every process here may count",
                api.listen,
                served.join(", ")
            ),
        )
    } else {
        Check::new(
            "api",
            Verdict::Ok,
            format!("{} serves {}; {access}", api.listen, served.join(", ")),
        )
    };
    checks.push(check);
    if api.tls_cert.is_some() {
        checks.push(match tls_acceptor(api) {
            Ok(_) => Check::new(
                "api_tls",
                Verdict::Ok,
                "the certificate and its key are read and make a pair",
            ),
            Err(why) => Check::new("api_tls", Verdict::Fail, why),
        });
    }
    checks
}
