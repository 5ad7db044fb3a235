//! `[api]`: tally over HTTP — where the daemon serves the events ledger to
//! other languages, how it is protected (TLS, bearer tokens), and the
//! limits every request is held to.
//!
//! Tokens never come from the TOML file: each is an environment variable
//! `TALLYD_API_TOKEN_<NAME>` (the environment file the unit reads, or
//! `--env-file`), holding the token's SHA-256 and its scopes, never the
//! token itself: `sha256:<64 hex digits> record:orders read:orders`
//! (`tallyd api-token NAME` prints a new token and the line). A scope is a
//! verb (`record`, `read`) and a collection with a ledger, or `*` for
//! every one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use super::field::{Issues, describe};
use super::raw::RawApi;
use crate::ledger::MAX_EVENT_KEY_BYTES;
use crate::store::serialize_duration;
use crate::write::counter::CollectionConfig;

/// How a token's environment variable begins: `TALLYD_API_TOKEN_BILLING`
/// holds the token named `billing`.
pub(crate) const TOKEN_VAR_PREFIX: &str = "TALLYD_API_TOKEN_";

/// How a token's stored form begins: the hash it is stored as.
pub(crate) const TOKEN_HASH_PREFIX: &str = "sha256:";

/// `[api]`: the events ledger over HTTP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ApiConfig {
    /// Serve the API (`POST /v1/{collection}/events`, `GET
    /// /v1/{collection}/counters/{key}`, `GET /v1/openapi.json`). Default:
    /// false.
    pub(crate) enabled: bool,
    /// The address the API listens on, apart from `[http] listen`. An
    /// address that is not loopback needs TLS and tokens, unless
    /// `serve_without` says which to go without. Default: `127.0.0.1:9188`.
    pub(crate) listen: SocketAddr,
    /// A PEM file with the certificate chain to serve TLS with (rustls);
    /// with `tls_key`. Read at start and at every reload. Default: none
    /// (plain HTTP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// A PEM file with the certificate's private key; with `tls_cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_key: Option<PathBuf>,
    /// The protections a `listen` address that is not loopback goes
    /// without, said in words: `"tls"` (a proxy in front terminates it),
    /// `"tokens"` (a proxy in front authenticates). Default: none: such an
    /// address without TLS and tokens refuses to start.
    pub(crate) serve_without: Vec<String>,
    /// The limits every request is held to.
    #[serde(flatten)]
    pub(crate) limits: ApiLimits,
    /// The tokens, from `TALLYD_API_TOKEN_<NAME>` variables (never the
    /// file, so never shown as part of it: `doctor` lists them by name).
    #[serde(skip)]
    pub(crate) tokens: Vec<ApiToken>,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            listen: SocketAddr::from(([127, 0, 0, 1], 9188)),
            tls_cert: None,
            tls_key: None,
            serve_without: Vec::new(),
            limits: ApiLimits::default(),
            tokens: Vec::new(),
        }
    }
}

/// What one request may hold and take: every bound of `[api]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct ApiLimits {
    /// The largest request body, in bytes: a larger one is refused whole
    /// (413), nothing written. Default: 1048576 (1 MiB).
    pub(crate) max_body_bytes: u64,
    /// The most events in one batch (a JSON array or NDJSON): a longer
    /// batch is refused whole (413). Default: 1000.
    pub(crate) max_batch: u64,
    /// The longest event id, in bytes (at most 512, the ledger's own
    /// bound). Default: 256.
    pub(crate) max_event_bytes: u64,
    /// The longest counter key, in bytes. Default: 256.
    pub(crate) max_key_bytes: u64,
    /// The largest amount one event may add or take away (`by` between
    /// -max_amount and max_amount, never 0). Default: 1000000000.
    pub(crate) max_amount: u64,
    /// How long a client may take to send a request's headers, and to
    /// send the next request's on a kept-alive connection once it began.
    /// Default: 10s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) header_timeout: Duration,
    /// How long a client may take to send a request's body. Default: 30s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) body_timeout: Duration,
    /// How long a kept-alive connection may stay idle before the daemon
    /// closes it. Default: 60s.
    #[serde(serialize_with = "serialize_duration")]
    pub(crate) idle_timeout: Duration,
    /// The most requests served at once: one more is refused at once with
    /// 503 and `Retry-After` (nothing written). Default: 256.
    pub(crate) max_requests: u64,
}

impl Default for ApiLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 1024 * 1024,
            max_batch: 1000,
            max_event_bytes: 256,
            max_key_bytes: 256,
            max_amount: 1_000_000_000,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_requests: 256,
        }
    }
}

/// What a token allows: recording events, or reading counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Verb {
    /// `POST /v1/{collection}/events`.
    Record,
    /// `GET /v1/{collection}/counters/{key}`.
    Read,
}

impl Verb {
    /// The verb as a scope writes it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Record => "record",
            Self::Read => "read",
        }
    }
}

/// One bearer token, as the daemon keeps it: its name, the SHA-256 of the
/// token, and what it may do.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct ApiToken {
    /// The name, from the variable (`TALLYD_API_TOKEN_BILLING`: `billing`):
    /// what logs and metrics say, never the token.
    pub(crate) name: String,
    /// The SHA-256 of the token.
    pub(crate) hash: [u8; 32],
    /// Verb and collection (`None`: every collection) pairs it may use.
    pub(crate) scopes: Vec<(Verb, Option<String>)>,
}

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiToken({}: {})", self.name, self.scopes_text())
    }
}

impl ApiToken {
    /// Whether the token may use `verb` on `collection`.
    pub(crate) fn allows(&self, verb: Verb, collection: &str) -> bool {
        self.scopes
            .iter()
            .any(|(v, c)| *v == verb && c.as_deref().is_none_or(|c| c == collection))
    }

    /// The scopes as the variable writes them: `record:orders read:*`.
    pub(crate) fn scopes_text(&self) -> String {
        let scopes: Vec<String> = self
            .scopes
            .iter()
            .map(|(verb, c)| format!("{}:{}", verb.as_str(), c.as_deref().unwrap_or("*")))
            .collect();
        scopes.join(" ")
    }
}

/// The protections `serve_without` may name.
const PROTECTIONS: [&str; 2] = ["tls", "tokens"];

pub(super) fn validate_api(
    raw: RawApi,
    env: &HashMap<String, String>,
    collections: &[CollectionConfig],
    issues: &mut Issues,
) -> ApiConfig {
    issues.unknown_keys("api", &raw.unknown);
    let defaults = ApiConfig::default();
    if raw.tokens.is_some() {
        issues.push(
            "api.tokens",
            format!(
                "tokens are never read from the configuration file: put each in the \
                 environment file as {TOKEN_VAR_PREFIX}NAME (`tallyd api-token NAME` prints a \
                 new token and the line to add)"
            ),
        );
    }
    let limits = validate_limits(&raw, issues);
    let enabled = issues.boolean("api.enabled", raw.enabled, defaults.enabled);
    let listen = super::daemon::address(issues, "api.listen", raw.listen, defaults.listen);
    let tls_cert = issues
        .string("api.tls_cert", raw.tls_cert)
        .map(PathBuf::from);
    let tls_key = issues.string("api.tls_key", raw.tls_key).map(PathBuf::from);
    if tls_cert.is_some() != tls_key.is_some() {
        let (given, missing) = if tls_cert.is_some() {
            ("api.tls_cert", "api.tls_key")
        } else {
            ("api.tls_key", "api.tls_cert")
        };
        issues.push(
            missing,
            format!("missing: {given} is set, and TLS needs both the certificate and its key"),
        );
    }
    let serve_without = words(issues, raw.serve_without);
    let tokens = tokens_from(env, collections, issues);
    let api = ApiConfig {
        enabled,
        listen,
        tls_cert,
        tls_key,
        serve_without,
        limits,
        tokens,
    };
    if api.enabled {
        check_exposure(&api, issues);
    }
    api
}

/// `[api] listen` must not be `[http] listen`: each is a socket of its own.
pub(super) fn check_listen(api: &ApiConfig, http: &super::HttpConfig, issues: &mut Issues) {
    // Port 0 is any free port: two of them never collide.
    if api.enabled && api.listen == http.listen && api.listen.port() != 0 {
        issues.push(
            "api.listen",
            format!(
                "{} is also [http] listen: the API needs an address of its own; choose \
                 another port",
                api.listen
            ),
        );
    }
}

/// `serve_without`: a list of the words [`PROTECTIONS`] holds.
fn words(issues: &mut Issues, value: Option<Value>) -> Vec<String> {
    let key = "api.serve_without";
    let Some(value) = value else {
        return Vec::new();
    };
    let Value::Array(items) = value else {
        issues.push(
            key,
            format!(
                "expected a list of words such as [\"tls\"], found {}",
                describe(&value)
            ),
        );
        return Vec::new();
    };
    let mut found = Vec::new();
    for item in items {
        match item.as_str() {
            Some(word) if PROTECTIONS.contains(&word) => found.push(word.to_owned()),
            _ => issues.push(
                key,
                format!(
                    "{} is not a protection to go without: write \"tls\", \"tokens\" or both",
                    describe(&item)
                ),
            ),
        }
    }
    found
}

/// A `listen` that is not loopback must have TLS and tokens, or say in
/// `serve_without` which it goes without.
fn check_exposure(api: &ApiConfig, issues: &mut Issues) {
    if api.listen.ip().is_loopback() {
        return;
    }
    let mut lacking = Vec::new();
    if api.tls_cert.is_none() && !api.serve_without.iter().any(|w| w == "tls") {
        lacking.push(("tls", "TLS (tls_cert and tls_key)"));
    }
    if api.tokens.is_empty() && !api.serve_without.iter().any(|w| w == "tokens") {
        lacking.push((
            "tokens",
            "tokens (TALLYD_API_TOKEN_… variables: `tallyd api-token NAME`)",
        ));
    }
    if lacking.is_empty() {
        return;
    }
    let what: Vec<&str> = lacking.iter().map(|(_, what)| *what).collect();
    let words: Vec<String> = lacking.iter().map(|(w, _)| format!("\"{w}\"")).collect();
    issues.push(
        "api.listen",
        format!(
            "{} is not a loopback address, and the API would serve it without {}: anyone who \
             reaches it could record and read counts; add them, or, when a proxy in front \
             provides them, say so: serve_without = [{}]",
            api.listen,
            what.join(" and without "),
            words.join(", ")
        ),
    );
}

fn validate_limits(raw: &RawApi, issues: &mut Issues) -> ApiLimits {
    let d = ApiLimits::default();
    let mut integer = |key: &str, value: &Option<Value>, default: u64, max: u64| {
        issues
            .optional_integer(&format!("api.{key}"), value.clone(), 1, max)
            .unwrap_or(default)
    };
    let max_body_bytes = integer(
        "max_body_bytes",
        &raw.max_body_bytes,
        d.max_body_bytes,
        1 << 30,
    );
    let max_batch = integer("max_batch", &raw.max_batch, d.max_batch, 100_000);
    let max_event_bytes = integer(
        "max_event_bytes",
        &raw.max_event_bytes,
        d.max_event_bytes,
        MAX_EVENT_KEY_BYTES as u64,
    );
    let max_key_bytes = integer("max_key_bytes", &raw.max_key_bytes, d.max_key_bytes, 1024);
    let max_amount = integer("max_amount", &raw.max_amount, d.max_amount, i64::MAX as u64);
    let max_requests = integer("max_requests", &raw.max_requests, d.max_requests, 100_000);
    ApiLimits {
        max_body_bytes,
        max_batch,
        max_event_bytes,
        max_key_bytes,
        max_amount,
        header_timeout: issues.duration(
            "api.header_timeout",
            raw.header_timeout.clone(),
            d.header_timeout,
        ),
        body_timeout: issues.duration("api.body_timeout", raw.body_timeout.clone(), d.body_timeout),
        idle_timeout: issues.duration("api.idle_timeout", raw.idle_timeout.clone(), d.idle_timeout),
        max_requests,
    }
}

/// The tokens of the `TALLYD_API_TOKEN_<NAME>` variables of `env`, sorted
/// by name; each bad one reported under its variable (never quoting its
/// value).
fn tokens_from(
    env: &HashMap<String, String>,
    collections: &[CollectionConfig],
    issues: &mut Issues,
) -> Vec<ApiToken> {
    let mut tokens = Vec::new();
    let mut vars: Vec<(&String, &String)> = env
        .iter()
        .filter(|(k, _)| k.starts_with(TOKEN_VAR_PREFIX))
        .collect();
    vars.sort();
    for (var, value) in vars {
        let key = format!("{var} (environment)");
        match parse_token(var, value, collections) {
            Ok(token) => tokens.push(token),
            Err(problem) => issues.push(key, problem),
        }
    }
    tokens
}

/// One token variable read: `sha256:<hex> verb:collection …`.
pub(crate) fn parse_token(
    var: &str,
    value: &str,
    collections: &[CollectionConfig],
) -> Result<ApiToken, String> {
    let name = var
        .strip_prefix(TOKEN_VAR_PREFIX)
        .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .ok_or_else(|| {
            format!(
                "a token's name is letters, digits and underscores after {TOKEN_VAR_PREFIX}; \
                 rename the variable"
            )
        })?
        .to_lowercase();
    let mut words = value.split_whitespace();
    let hash = words
        .next()
        .and_then(|w| w.strip_prefix(TOKEN_HASH_PREFIX))
        .and_then(hash_from_hex)
        .ok_or_else(|| {
            format!(
                "not a stored token: the value must begin with {TOKEN_HASH_PREFIX} and the \
                 token's SHA-256 in 64 hex digits (the line `tallyd api-token {name}` prints), \
                 never the token itself"
            )
        })?;
    let mut scopes = Vec::new();
    for word in words {
        scopes.push(parse_scope(word, collections)?);
    }
    if scopes.is_empty() {
        return Err(format!(
            "the token {name} names no scope, so it could do nothing: add record:COLLECTION \
             or read:COLLECTION (or * for every collection) after its hash"
        ));
    }
    Ok(ApiToken { name, hash, scopes })
}

fn parse_scope(
    word: &str,
    collections: &[CollectionConfig],
) -> Result<(Verb, Option<String>), String> {
    let bad = || {
        format!(
            "{word:?} is not a scope: write record:COLLECTION or read:COLLECTION, with a \
             collection that has a ledger, or * for every one"
        )
    };
    let (verb, collection) = word.split_once(':').ok_or_else(bad)?;
    let verb = match verb {
        "record" => Verb::Record,
        "read" => Verb::Read,
        _ => return Err(bad()),
    };
    if collection == "*" {
        return Ok((verb, None));
    }
    let ledgers: Vec<&str> = collections
        .iter()
        .filter(|c| c.events_collection.is_some())
        .map(|c| c.name.as_str())
        .collect();
    if !ledgers.contains(&collection) {
        return Err(format!(
            "the scope {word:?} names {collection:?}, which is not a configured collection with \
             a ledger (those are: {}); correct it",
            if ledgers.is_empty() {
                "none".to_owned()
            } else {
                ledgers.join(", ")
            }
        ));
    }
    Ok((verb, Some(collection.to_owned())))
}

fn hash_from_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut hash = [0u8; 32];
    for (i, byte) in hash.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(hash)
}

/// The SHA-256 of `token`: what a token is stored as.
pub(crate) fn token_hash(token: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(token.as_bytes()).into()
}

/// `bytes` as lower-case hex digits.
pub(crate) fn hash_hex(hash: &[u8]) -> String {
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    const BASE: &str = "[mongodb]\nuri = \"mongodb://h/\"\ndatabase = \"app\"\n\
                        [[collections]]\nname = \"orders\"\nledger = true\n\
                        [[collections]]\nname = \"views\"\n";

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn stored(token: &str, scopes: &str) -> String {
        format!("sha256:{} {scopes}", hash_hex(&token_hash(token)))
    }

    /// The API and `/metrics` on one address: one sentence, no run of
    /// spaces from a broken string; port 0 (any free port) twice is two
    /// sockets, never the same address.
    #[test]
    fn the_api_and_metrics_on_one_address_are_refused_in_one_sentence() {
        let same = format!(
            "{BASE}[http]\nlisten = \"127.0.0.1:9100\"\n[api]\nenabled = true\n\
             listen = \"127.0.0.1:9100\"\n"
        );
        let text = Config::from_toml(&same, []).unwrap_err().to_string();
        assert!(text.contains("is also [http] listen"), "{text}");
        let said = text.split("api.listen: ").nth(1).unwrap_or_default();
        assert!(!said.contains("  "), "{text:?}");
        let any = format!(
            "{BASE}[http]\nlisten = \"127.0.0.1:0\"\n[api]\nenabled = true\n\
             listen = \"127.0.0.1:0\"\n"
        );
        assert!(Config::from_toml(&any, []).is_ok());
    }

    #[test]
    fn the_api_is_off_by_default_on_loopback_with_its_limits() {
        let config = Config::from_toml(BASE, []).unwrap();
        assert!(!config.api.enabled);
        assert_eq!(config.api.listen.to_string(), "127.0.0.1:9188");
        assert_eq!(config.api.limits, ApiLimits::default());
        assert!(config.api.tokens.is_empty());
    }

    #[test]
    fn tokens_come_from_the_environment_hashed_and_scoped() {
        let value = stored("secret-1", "record:orders read:*");
        let config =
            Config::from_toml(BASE, env(&[("TALLYD_API_TOKEN_BILLING", value.as_str())])).unwrap();
        let [token] = config.api.tokens.as_slice() else {
            panic!("one token: {:?}", config.api.tokens);
        };
        assert_eq!(token.name, "billing");
        assert_eq!(token.hash, token_hash("secret-1"));
        assert!(token.allows(Verb::Record, "orders"));
        assert!(!token.allows(Verb::Record, "other"));
        assert!(token.allows(Verb::Read, "anything"));
        // Never shown with the file's keys.
        let shown = config.to_redacted_toml();
        assert!(!shown.contains(&hash_hex(&token.hash)), "{shown}");
        assert!(!shown.contains("billing"), "{shown}");
    }

    #[test]
    fn a_bad_token_is_named_by_its_variable_without_its_value() {
        let secret = "tally_0123456789abcdef0123456789abcdef";
        let err = Config::from_toml(
            BASE,
            env(&[
                ("TALLYD_API_TOKEN_RAW", secret),
                ("TALLYD_API_TOKEN_TYPO", &stored("x", "record:order")),
                ("TALLYD_API_TOKEN_VIEWS", &stored("y", "read:views")),
                ("TALLYD_API_TOKEN_NONE", &stored("z", "")),
            ]),
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(!text.contains(secret), "{text}");
        for var in ["RAW", "TYPO", "VIEWS", "NONE"] {
            assert!(
                text.contains(&format!("TALLYD_API_TOKEN_{var} (environment)")),
                "{var}: {text}"
            );
        }
        assert!(text.contains("never the token itself"), "{text}");
        assert!(text.contains("with a ledger (those are: orders)"), "{text}");
    }

    #[test]
    fn tokens_in_the_file_are_refused_saying_where_they_go() {
        let text = format!("{BASE}[api]\ntokens = [\"abc\"]\n");
        let err = Config::from_toml(&text, []).unwrap_err().to_string();
        assert!(err.contains("api.tokens"), "{err}");
        assert!(err.contains("environment file"), "{err}");
        assert!(!err.contains("abc"), "{err}");
    }

    #[test]
    fn a_network_address_needs_tls_and_tokens_or_says_it_goes_without() {
        let open = format!("{BASE}[api]\nenabled = true\nlisten = \"0.0.0.0:9188\"\n");
        let err = Config::from_toml(&open, []).unwrap_err().to_string();
        assert!(err.contains("api.listen"), "{err}");
        assert!(
            err.contains("serve_without = [\"tls\", \"tokens\"]"),
            "{err}"
        );
        let said = format!("{open}serve_without = [\"tls\", \"tokens\"]\n");
        assert!(Config::from_toml(&said, []).is_ok());
        let half = format!("{open}serve_without = [\"tls\"]\n");
        let err = Config::from_toml(&half, []).unwrap_err().to_string();
        assert!(err.contains("serve_without = [\"tokens\"]"), "{err}");
        let token = stored("t", "record:orders");
        assert!(Config::from_toml(&half, env(&[("TALLYD_API_TOKEN_A", &token)])).is_ok());
        let bad = format!("{open}serve_without = [\"auth\"]\n");
        let err = Config::from_toml(&bad, []).unwrap_err().to_string();
        assert!(err.contains("not a protection"), "{err}");
    }

    #[test]
    fn limits_are_read_and_bounded() {
        let text = format!(
            "{BASE}[api]\nmax_batch = 10\nmax_event_bytes = 600\nheader_timeout = \"2s\"\n\
             tls_cert = \"/c.pem\"\n"
        );
        let err = Config::from_toml(&text, []).unwrap_err().to_string();
        assert!(err.contains("api.max_event_bytes"), "{err}");
        assert!(err.contains("api.tls_key: missing"), "{err}");
        let text = format!("{BASE}[api]\nmax_batch = 10\nheader_timeout = \"2s\"\n");
        let config = Config::from_toml(&text, []).unwrap();
        assert_eq!(config.api.limits.max_batch, 10);
        assert_eq!(config.api.limits.header_timeout, Duration::from_secs(2));
    }
}
