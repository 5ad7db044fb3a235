//! What a failure says to the person who reads it.
//!
//! The driver's own `Display` of an error is written for its developers
//! (`Kind: …, labels: {…}, server response: Some(RawDocumentBuf …)`).
//! tally describes a failure from the driver's error kinds instead, in one
//! sentence: what failed — the server's message with its code and code
//! name, "connection refused at HOST:PORT", "authentication failed for
//! USER on DB", "no server could be selected within 30s at HOST:PORT
//! (why)" — then, where tally knows, what to do. [`Reach`] is what the
//! driver's error does not carry: where the operation was sent, as whom,
//! and why each host could not be reached at the last try.
//!
//! Durations and lists read as words here too ([`human_duration`],
//! [`words`]); every message people read is built from these.

use std::error::Error as _;
use std::fmt;
use std::time::Duration;

use mongodb::error::{Error as MongoError, ErrorKind, WriteFailure};

use super::code;

mod network;
use network::{network_problem, unreadable_reply};

/// Where an operation was sent and as whom, for its failure's message.
#[derive(Debug, Clone, Default)]
pub(crate) struct Reach {
    /// The connection string's hosts, as `host:port`.
    pub(crate) hosts: Vec<String>,
    /// The user the connection authenticates as, if any.
    pub(crate) user: Option<String>,
    /// The database the user is defined in (`authSource`).
    pub(crate) auth_source: Option<String>,
    /// How long an operation waits for a usable server.
    pub(crate) selection_timeout: Duration,
    /// How long tally waits for one attempt's reply.
    pub(crate) attempt_timeout: Duration,
    /// The replica set the connection string names (`replicaSet`), if
    /// any.
    pub(crate) replica_set: Option<String>,
    /// Why each host the driver could not reach failed at its last try
    /// (its monitor's last heartbeat), taken when the failure happened.
    pub(crate) unreachable: Vec<(String, MongoError)>,
    /// The replica set each host that answered named in its last answer
    /// (`None`: none), taken when no server could be selected.
    pub(crate) set_names: Vec<(String, Option<String>)>,
}

impl Reach {
    /// The hosts as words: `127.0.0.1:27017`, `a:27017, b:27017 and c:27017`.
    pub(crate) fn hosts(&self) -> String {
        if self.hosts.is_empty() {
            "the configured hosts".to_owned()
        } else {
            words(&self.hosts)
        }
    }

    /// The hosts that answered as members of another replica set than the
    /// connection string names (or of none), each with the set it named —
    /// when no host answered as a member of the named one. Not empty: the
    /// connection string cannot work as written, and no wait will help.
    pub(crate) fn in_other_sets(&self) -> Vec<(&str, Option<&str>)> {
        let Some(wanted) = self.replica_set.as_deref() else {
            return Vec::new();
        };
        if self
            .set_names
            .iter()
            .any(|(_, set)| set.as_deref() == Some(wanted))
        {
            return Vec::new();
        }
        self.set_names
            .iter()
            .map(|(host, set)| (host.as_str(), set.as_deref()))
            .collect()
    }

    /// ` at HOST` when the connection has one host (a failure's host is
    /// then known), else nothing.
    fn at_the_host(&self) -> String {
        match self.hosts.as_slice() {
            [one] => format!(" at {one}"),
            _ => String::new(),
        }
    }
}

/// A driver error as a person reads it: what failed, with the server's
/// code, code name and message, then what to do where tally knows.
pub(crate) struct Readable<'a> {
    /// The driver's error.
    pub(crate) err: &'a MongoError,
    /// Where the operation went, when known.
    pub(crate) reach: Option<&'a Reach>,
}

impl fmt::Display for Readable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reach = self.reach;
        let at = reach.map(Reach::at_the_host).unwrap_or_default();
        match self.err.kind.as_ref() {
            ErrorKind::Command(err) => server_says(f, err.code, Some(&err.code_name), &err.message),
            ErrorKind::Write(WriteFailure::WriteError(err)) => {
                server_says(f, err.code, err.code_name.as_deref(), &err.message)
            }
            ErrorKind::Write(WriteFailure::WriteConcernError(err)) => {
                unconfirmed(f, err.code, &err.code_name, &err.message)
            }
            ErrorKind::InsertMany(err) => match (&err.write_errors, &err.write_concern_error) {
                (Some(errors), _) if !errors.is_empty() => {
                    let first = &errors[0];
                    server_says(f, first.code, first.code_name.as_deref(), &first.message)?;
                    if errors.len() > 1 {
                        write!(f, " (and {} more write errors)", errors.len() - 1)?;
                    }
                    Ok(())
                }
                (_, Some(wce)) => unconfirmed(f, wce.code, &wce.code_name, &wce.message),
                _ => f.write_str("the server refused the insert without saying why"),
            },
            ErrorKind::Io(err) if err.kind() == std::io::ErrorKind::TimedOut => match reach {
                Some(reach) if !reach.attempt_timeout.is_zero() => write!(
                    f,
                    "no reply{at} within the attempt timeout of {}: the server or the \
                     network is slow or down",
                    human_duration(reach.attempt_timeout)
                ),
                _ => write!(
                    f,
                    "no reply{at} in time: the server or the network is slow or down"
                ),
            },
            ErrorKind::Io(err) => write!(f, "{}{at}", network_problem(err)),
            ErrorKind::ConnectionPoolCleared { .. } => write!(
                f,
                "the connection{at} was dropped: another operation's network error made the \
                 driver close its connections"
            ),
            ErrorKind::ServerSelection { .. } => match reach {
                Some(reach) => match other_set(reach) {
                    Some(other) => write!(
                        f,
                        "{other} (no server could be selected within {}, and none will be)",
                        human_duration(reach.selection_timeout)
                    ),
                    None => unselectable(f, reach),
                },
                None => f.write_str(
                    "no server could be selected within the server selection timeout: is MongoDB \
                     running, and are the connection string's hosts right?",
                ),
            },
            ErrorKind::Authentication { message, .. } => {
                authentication(f, self.err, message, reach)
            }
            ErrorKind::InvalidArgument { message, .. } => {
                write!(f, "the driver refused the request: {message}")
            }
            ErrorKind::DnsResolve { message, .. } => {
                write!(f, "cannot resolve the connection string's hosts: {message}")
            }
            ErrorKind::InvalidTlsConfig { message, .. } => {
                write!(f, "the TLS settings cannot be used: {message}")
            }
            ErrorKind::InvalidResponse { message, .. } => {
                f.write_str(&unreadable_reply(message, &at))
            }
            ErrorKind::IncompatibleServer { message, .. } => {
                write!(f, "the server{at} does not support this: {message}")
            }
            ErrorKind::Internal { message, .. } => {
                write!(f, "the MongoDB driver failed: {message}")
            }
            ErrorKind::Shutdown => f.write_str("the connection was already shut down"),
            ErrorKind::SessionsNotSupported => {
                write!(f, "the server{at} does not support sessions")
            }
            ErrorKind::BsonSerialization(err) => write!(f, "a document cannot be encoded: {err}"),
            ErrorKind::BsonDeserialization(err) => {
                write!(f, "a reply cannot be decoded: {err}")
            }
            ErrorKind::Bson(err) => write!(f, "a document cannot be read: {err}"),
            ErrorKind::Transaction { message, .. } => {
                write!(f, "the transaction failed: {message}")
            }
            ErrorKind::MissingResumeToken => {
                f.write_str("the change stream cannot be resumed: its position is missing")
            }
            // The remaining kinds (bulk write, GridFS) are ones tally never
            // causes; their own text is written with `Debug`.
            ErrorKind::BulkWrite(_) => f.write_str("a bulk write failed"),
            ErrorKind::GridFs(_) => f.write_str("a GridFS operation failed"),
            other => write!(f, "{other}"),
        }
    }
}

/// What a failure means to the person who asked for the operation, by the
/// error's kind and code (never its text): it decides the command line's
/// exit code.
#[cfg(feature = "daemon")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trouble {
    /// No server could be reached or used: nothing more can be done now.
    Unavailable,
    /// The server refused the credentials or the user lacks a privilege.
    PermissionDenied,
    /// The server refused the operation for another reason.
    Refused,
    /// The connection string cannot work as written (it names a replica
    /// set its hosts do not belong to): the configuration must change.
    Misconfigured,
}

/// What a driver error means to the person who asked, by kind and code.
#[cfg(feature = "daemon")]
fn trouble(err: &MongoError) -> Trouble {
    if matches!(err.kind.as_ref(), ErrorKind::Authentication { .. })
        || matches!(
            super::server_code(err),
            Some(code::UNAUTHORIZED | code::AUTHENTICATION_FAILED)
        )
    {
        return Trouble::PermissionDenied;
    }
    let facts = super::Facts::of(err);
    match (facts.kind, facts.class()) {
        (
            super::FailureKind::ServerSelection
            | super::FailureKind::Io
            | super::FailureKind::PoolCleared,
            _,
        )
        | (_, super::ErrorClass::Transient) => Trouble::Unavailable,
        _ if matches!(err.kind.as_ref(), ErrorKind::DnsResolve { .. }) => Trouble::Unavailable,
        _ => Trouble::Refused,
    }
}

/// [`trouble`], knowing where the operation went: no server selected
/// because the hosts belong to another replica set than the connection
/// string names is a configuration to fix, not an outage.
#[cfg(feature = "daemon")]
pub(crate) fn trouble_reaching(err: &MongoError, reach: Option<&Reach>) -> Trouble {
    match (err.kind.as_ref(), reach) {
        (ErrorKind::ServerSelection { .. }, Some(reach)) if !reach.in_other_sets().is_empty() => {
            Trouble::Misconfigured
        }
        _ => trouble(err),
    }
}

/// The server's code and its name, when the server answered with one: for
/// programs reading a failure (`--json`).
#[cfg(feature = "daemon")]
pub(crate) fn server_code_and_name(err: &MongoError) -> Option<(i32, String)> {
    let named = |code: i32, name: Option<&str>| {
        let name = name.filter(|n| !n.is_empty()).or_else(|| code::name(code));
        (code, name.unwrap_or_default().to_owned())
    };
    match err.kind.as_ref() {
        ErrorKind::Command(c) => Some(named(c.code, Some(&c.code_name))),
        ErrorKind::Write(WriteFailure::WriteError(w)) => {
            Some(named(w.code, w.code_name.as_deref()))
        }
        ErrorKind::Write(WriteFailure::WriteConcernError(w)) => {
            Some(named(w.code, Some(&w.code_name)))
        }
        _ => super::server_code(err).map(|code| named(code, None)),
    }
}

/// `MESSAGE (CODE CodeName)`, then what to do for the codes tally knows.
fn server_says(
    f: &mut fmt::Formatter<'_>,
    code: i32,
    code_name: Option<&str>,
    message: &str,
) -> fmt::Result {
    let name = code_name
        .filter(|n| !n.is_empty())
        .or_else(|| code::name(code));
    // A server error's message often carries the execution stack of its
    // plan ("Plan executor error during update :: caused by :: …"): the
    // last cause is the one that says what happened.
    let message = message
        .rsplit(" :: caused by :: ")
        .next()
        .unwrap_or(message);
    let message = message.trim();
    match name {
        Some(name) => write!(f, "{message} ({code} {name})")?,
        None => write!(f, "{message} (code {code})")?,
    }
    if code == code::UNAUTHORIZED && message.contains("requires authentication") {
        // No user logged in at all: no role would help.
        f.write_str(
            "; no user is logged in: the server requires one, so put its name and password in \
             the connection string (mongodb://USER:PASSWORD@HOST/?authSource=admin)",
        )?;
    } else if let Some(advice) = advice(code) {
        write!(f, "; {advice}")?;
    }
    Ok(())
}

/// What to do about a server's refusal, where tally knows.
fn advice(code: i32) -> Option<&'static str> {
    Some(match code {
        code::UNAUTHORIZED => {
            "the connected user lacks this privilege: grant it the role the book's \"The \
             smallest MongoDB role\" (docs/src/operations/role.md) lists (`tallyd doctor` names \
             each missing action)"
        }
        code::DOCUMENT_VALIDATION_FAILURE => {
            "the collection's validator refused the document: let the validator accept tally's \
             fields (the counter, pending, settled and lanes fields)"
        }
        code::BSON_OBJECT_TOO_LARGE | code::UPDATE_RESULT_TOO_LARGE | code::UPSERT_TOO_LARGE => {
            "the document would pass the server's 16 MB limit: fold its pending tokens \
             (`tallyd reconcile`), prune its lanes, or use another key"
        }
        code::TYPE_MISMATCH => {
            "a field of the document holds another type than tally writes (`tallyd reconcile \
             --dry-run` lists malformed documents)"
        }
        _ => return None,
    })
}

/// A write-concern error: applied on the primary, not confirmed.
fn unconfirmed(
    f: &mut fmt::Formatter<'_>,
    code: i32,
    code_name: &str,
    message: &str,
) -> fmt::Result {
    f.write_str(
        "the write was applied on the primary, but a majority of the replica set did not \
         confirm it: ",
    )?;
    server_says(f, code, Some(code_name), message)
}

/// `no server could be selected within 30s at HOST (why)`; when every host
/// refused the connection, what to check: nothing listens there, and
/// waiting helps only if a server is about to start.
fn unselectable(f: &mut fmt::Formatter<'_>, reach: &Reach) -> fmt::Result {
    write!(
        f,
        "no server could be selected within {} at {} ({})",
        human_duration(reach.selection_timeout),
        reach.hosts(),
        why_unreachable(reach)
    )?;
    let all_refused = !reach.unreachable.is_empty()
        && reach.unreachable.iter().all(|(_, err)| {
            matches!(err.kind.as_ref(), ErrorKind::Io(io)
                if io.kind() == std::io::ErrorKind::ConnectionRefused)
        });
    if all_refused {
        f.write_str(
            ": nothing listens there; check the host and port of the connection string, or \
             start MongoDB",
        )?;
    }
    Ok(())
}

/// `the connection string names replica set rs0, but the server at HOST
/// belongs to replica set other: …`, when [`Reach::in_other_sets`] says
/// so.
pub(crate) fn other_set(reach: &Reach) -> Option<String> {
    let hosts = reach.in_other_sets();
    if hosts.is_empty() {
        return None;
    }
    let said: Vec<String> = hosts
        .into_iter()
        .map(|(host, set)| match set {
            Some(set) => format!("{host} belongs to replica set {set}"),
            None => format!("{host} belongs to no replica set"),
        })
        .collect();
    Some(format!(
        "the connection string names replica set {}, but the server at {}: correct the \
         replicaSet option of the connection string",
        reach.replica_set.as_deref().unwrap_or_default(),
        words(&said),
    ))
}

impl Reach {
    /// `MongoDB at HOST has not answered for 5s (why)`: what the daemon
    /// says while it waits for the server.
    #[cfg(feature = "daemon")]
    pub(crate) fn unanswered(&self, waited: Duration) -> String {
        format!(
            "MongoDB at {} has not answered for {} ({})",
            self.hosts(),
            human_duration(waited),
            why_unreachable(self)
        )
    }
}

/// Why each host could not be reached at its last try, or what else keeps
/// the servers from being used.
fn why_unreachable(reach: &Reach) -> String {
    let why: Vec<String> = reach
        .unreachable
        .iter()
        .map(|(host, err)| {
            let problem = match err.kind.as_ref() {
                ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => {
                    "no answer in time".to_owned()
                }
                ErrorKind::Io(io) => network_problem(io).to_owned(),
                _ => Readable { err, reach: None }.to_string(),
            };
            if reach.hosts.len() == 1 {
                problem
            } else {
                format!("{host}: {problem}")
            }
        })
        .collect();
    if why.is_empty() {
        "no host refused or failed; none that answers can take it: is there a primary, and do \
         the hosts belong to one deployment?"
            .to_owned()
    } else {
        why.join("; ")
    }
}

/// `authentication failed for USER on DB (18 AuthenticationFailed)`.
fn authentication(
    f: &mut fmt::Formatter<'_>,
    err: &MongoError,
    message: &str,
    reach: Option<&Reach>,
) -> fmt::Result {
    let user = reach.and_then(|r| r.user.as_deref());
    let source = reach.and_then(|r| r.auth_source.as_deref());
    match (user, source) {
        (Some(user), Some(source)) => write!(f, "authentication failed for {user} on {source}")?,
        (Some(user), None) => write!(f, "authentication failed for {user}")?,
        _ => f.write_str("authentication failed")?,
    }
    // The server's refusal, when the driver kept it as the cause.
    let refusal = err
        .source()
        .and_then(|cause| {
            cause.downcast_ref::<MongoError>().or_else(|| {
                cause
                    .downcast_ref::<Box<MongoError>>()
                    .map(|boxed| &**boxed)
            })
        })
        .and_then(|cause| match cause.kind.as_ref() {
            ErrorKind::Command(command) => Some(command),
            _ => None,
        });
    match refusal {
        Some(command) => {
            let name = Some(command.code_name.as_str())
                .filter(|n| !n.is_empty())
                .or_else(|| code::name(command.code))
                .unwrap_or("code");
            write!(f, " ({} {name})", command.code)?;
        }
        None if !message.is_empty() => write!(f, " ({message})")?,
        None => {}
    }
    f.write_str(": check the user name, password and authSource of the connection string")
}

/// `n` and its noun, singular for one: `1 duplicate`, `0 duplicates`,
/// `2 duplicates` (`plural` for the rest).
#[cfg(feature = "daemon")]
pub(crate) fn counted(n: impl Into<u128>, singular: &str, plural: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { singular } else { plural })
}

/// A duration as people read it: whole seconds (`1h 0m 5s` reads
/// `1h 5s`), or milliseconds below a second — never `3600.364973994s`.
pub(crate) fn human_duration(duration: Duration) -> String {
    let shown = if duration >= Duration::from_secs(1) {
        Duration::from_secs(duration.as_secs() + u64::from(duration.subsec_millis() >= 500))
    } else {
        Duration::from_millis(duration.as_millis().try_into().unwrap_or(u64::MAX))
    };
    humantime::format_duration(shown).to_string()
}

/// Why the file at `path` could not be read, in one sentence with what to
/// do, instead of the system's `(os error N)` text.
#[cfg(feature = "daemon")]
pub(crate) fn cannot_read(path: &std::path::Path, err: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let path = path.display();
    match err.kind() {
        ErrorKind::NotFound => format!("cannot read {path}: there is no such file; check the path"),
        ErrorKind::PermissionDenied => format!(
            "cannot read {path}: permission denied; run as a user that may read it, or make it \
             readable"
        ),
        ErrorKind::IsADirectory => {
            format!("cannot read {path}: it is a directory; name the file inside it")
        }
        ErrorKind::InvalidData => format!("cannot read {path}: it is not UTF-8 text"),
        _ => {
            let text = err.to_string();
            let text = text.split(" (os error").next().unwrap_or(&text).to_owned();
            format!("cannot read {path}: {}", text.to_lowercase())
        }
    }
}

/// A list as words: `a`, `a and b`, `a, b and c`; `none` when empty.
pub(crate) fn words<T: AsRef<str>>(items: &[T]) -> String {
    match items {
        [] => "none".to_owned(),
        [one] => one.as_ref().to_owned(),
        [init @ .., last] => {
            let init: Vec<&str> = init.iter().map(AsRef::as_ref).collect();
            format!("{} and {}", init.join(", "), last.as_ref())
        }
    }
}

impl super::Failure {
    /// The failure as people read it; `fallback` names where the
    /// operation went when the failure itself does not say.
    pub(crate) fn describe(&self, fallback: Option<&Reach>) -> String {
        let readable = Readable {
            err: &self.source,
            // The caller's (the store's, taken now) knows more than the
            // reach the failure took along: why no server could be selected.
            reach: fallback.or(self.reach.as_deref()),
        };
        match self.attempts {
            1 => readable.to_string(),
            n => format!("{readable} (after {n} attempts)"),
        }
    }
}

impl fmt::Display for super::Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(None))
    }
}

impl super::Error {
    /// The error as people read it; `fallback` names where a failed
    /// operation went when the failure itself does not say.
    #[cfg(feature = "daemon")]
    pub(crate) fn describe(&self, fallback: Option<&Reach>) -> String {
        match self {
            Self::Server(failure) => failure.describe(fallback),
            other => other.to_string(),
        }
    }
}

/// ` (its position: <time>)`, or nothing.
pub(crate) fn position_since(since: &Option<std::time::SystemTime>) -> String {
    since.map_or_else(String::new, |since| {
        format!(
            " (its position: {})",
            humantime::format_rfc3339_seconds(since)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::{deserialize_from_document as from_document, doc};
    use mongodb::error::{CommandError, WriteError};

    #[test]
    #[cfg(feature = "daemon")]
    fn one_of_a_thing_is_singular_and_the_rest_plural() {
        assert_eq!(counted(1u64, "duplicate", "duplicates"), "1 duplicate");
        assert_eq!(counted(0u64, "duplicate", "duplicates"), "0 duplicates");
        assert_eq!(counted(2u64, "sum", "sums"), "2 sums");
    }

    fn command(code: i32, name: &str, message: &str) -> MongoError {
        let err: CommandError =
            from_document(doc! { "code": code, "codeName": name, "errmsg": message }).unwrap();
        ErrorKind::Command(err).into()
    }

    fn write(code: i32, message: &str) -> MongoError {
        // Write errors arrive without a code name.
        let err: WriteError = from_document(doc! { "code": code, "errmsg": message }).unwrap();
        ErrorKind::Write(WriteFailure::WriteError(err)).into()
    }

    fn io(kind: std::io::ErrorKind) -> MongoError {
        ErrorKind::Io(std::sync::Arc::new(kind.into())).into()
    }

    fn shown(err: &MongoError, reach: Option<&Reach>) -> String {
        let text = Readable { err, reach }.to_string();
        for debug in ["Kind:", "Some(", "RawDocumentBuf", "labels:", "{ ", "[\""] {
            assert!(!text.contains(debug), "{debug} in {text}");
        }
        text
    }

    fn one_host() -> Reach {
        Reach {
            hosts: vec!["db:27017".into()],
            user: Some("app".into()),
            auth_source: Some("admin".into()),
            selection_timeout: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(60),
            replica_set: None,
            unreachable: Vec::new(),
            set_names: Vec::new(),
        }
    }

    #[test]
    fn a_refusal_shows_the_servers_message_code_and_code_name_then_what_to_do() {
        let err = command(
            13,
            "Unauthorized",
            "not authorized on app to execute update",
        );
        let text = shown(&err, None);
        assert!(
            text.starts_with("not authorized on app to execute update (13 Unauthorized); "),
            "{text}"
        );
        assert!(text.contains("smallest MongoDB role"), "{text}");
        // A write error's code name comes from tally's table; the plan's
        // stack is cut to its last cause.
        let err = write(
            121,
            "Plan executor error during update :: caused by :: Document failed validation",
        );
        let text = shown(&err, None);
        assert!(
            text.starts_with("Document failed validation (121 DocumentValidationFailure); "),
            "{text}"
        );
        assert_eq!(shown(&write(2, "bad"), None), "bad (2 BadValue)");
        assert_eq!(shown(&write(99999, "odd"), None), "odd (code 99999)");
        assert!(shown(&write(10334, "too big"), None).contains("16 MB"));
    }

    #[test]
    fn network_failures_name_the_host_and_the_attempt_timeout() {
        let reach = one_host();
        assert_eq!(
            shown(&io(std::io::ErrorKind::ConnectionRefused), Some(&reach)),
            "connection refused at db:27017"
        );
        assert_eq!(
            shown(&io(std::io::ErrorKind::TimedOut), Some(&reach)),
            "no reply at db:27017 within the attempt timeout of 1m: the server or the network is \
             slow or down"
        );
        assert_eq!(
            shown(&io(std::io::ErrorKind::ConnectionReset), None),
            "the connection was reset"
        );
        // What a new user met: a host name that does not resolve, and a
        // port where something other than MongoDB answers.
        let dns = std::io::Error::other(
            "failed to lookup address information: Name or service not known",
        );
        let dns: MongoError = ErrorKind::Io(std::sync::Arc::new(dns)).into();
        assert_eq!(
            shown(&dns, Some(&reach)),
            "the host name does not resolve (name or service not known; check the host in the \
             connection string) at db:27017"
        );
        let text = unreadable_reply("Invalid wire protocol opcode: 171854925", " at db:27017");
        assert_eq!(
            text,
            "what answered at db:27017 does not speak MongoDB's protocol: check that the \
             connection string names a MongoDB server's host and port"
        );
    }

    /// (The driver does not let other crates build a server-selection
    /// error: its message's parts are checked here, the whole in the
    /// integration tests.)
    #[test]
    #[cfg(feature = "daemon")]
    fn no_server_selected_says_where_and_why() {
        let mut reach = one_host();
        reach.unreachable = vec![("db:27017".into(), io(std::io::ErrorKind::ConnectionRefused))];
        assert_eq!(why_unreachable(&reach), "connection refused");
        assert_eq!(
            reach.unanswered(Duration::from_secs(6)),
            "MongoDB at db:27017 has not answered for 6s (connection refused)"
        );
        reach.hosts = vec!["a:1".into(), "b:2".into()];
        reach.unreachable = vec![
            ("a:1".into(), io(std::io::ErrorKind::ConnectionRefused)),
            ("b:2".into(), io(std::io::ErrorKind::TimedOut)),
        ];
        assert_eq!(
            why_unreachable(&reach),
            "a:1: connection refused; b:2: no answer in time"
        );
        assert_eq!(reach.hosts(), "a:1 and b:2");
        reach.unreachable.clear();
        assert!(why_unreachable(&reach).contains("is there a primary"));
    }

    /// A connection string naming a replica set its hosts do not belong
    /// to: said as such (never "try again"), and only when no host answered
    /// as a member of the named set.
    #[test]
    fn hosts_of_another_replica_set_are_named_with_their_set() {
        let mut reach = one_host();
        reach.set_names = vec![("db:27017".into(), Some("secantus".into()))];
        assert_eq!(other_set(&reach), None, "no replicaSet named: no verdict");
        reach.replica_set = Some("rs0".into());
        assert_eq!(
            other_set(&reach).unwrap(),
            "the connection string names replica set rs0, but the server at db:27017 belongs to \
             replica set secantus: correct the replicaSet option of the connection string"
        );
        reach.hosts = vec!["a:1".into(), "b:2".into()];
        reach.set_names = vec![("a:1".into(), Some("x".into())), ("b:2".into(), None)];
        assert!(other_set(&reach).unwrap().contains(
            "the server at a:1 belongs to replica set x and b:2 belongs to no replica set"
        ));
        // One host of the named set answered: whatever fails, it is not this.
        reach.set_names.push(("c:3".into(), Some("rs0".into())));
        assert_eq!(other_set(&reach), None);
        reach.set_names.clear();
        assert_eq!(other_set(&reach), None, "no host answered: no verdict");
    }

    #[test]
    fn durations_and_lists_read_as_words() {
        assert_eq!(
            human_duration(Duration::from_secs_f64(3600.364973994)),
            "1h"
        );
        assert_eq!(human_duration(Duration::from_secs(3725)), "1h 2m 5s");
        assert_eq!(human_duration(Duration::from_millis(1500)), "2s");
        assert_eq!(human_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(words::<&str>(&[]), "none");
        assert_eq!(words(&["a"]), "a");
        assert_eq!(words(&["a", "b"]), "a and b");
        assert_eq!(words(&["a", "b", "c"]), "a, b and c");
    }
}
