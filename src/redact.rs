//! Keeping secrets out of logs, errors and output.
//!
//! The MongoDB URI may carry a password and the webhook an auth token. Both
//! live in [`SecretString`], whose `Debug` and `Display` never show the
//! value; the URI is shown with its password replaced by `****`. Messages
//! that come from elsewhere (the driver's errors) pass through
//! [`Secrets::scrub`] before tally prints them.

use std::fmt;

/// What replaces a secret in anything tally prints.
pub(crate) const MASK: &str = "****";

/// A string that must not be printed as is.
#[derive(Clone, Default, PartialEq, Eq)]
pub(crate) struct SecretString(String);

impl SecretString {
    /// Wraps a secret.
    pub(crate) fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that needs it.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl fmt::Display for SecretString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

/// A MongoDB connection string with its password (if any) replaced by
/// `****`; everything else (user, hosts, options) stays readable.
pub(crate) fn redact_uri(uri: &str) -> String {
    match uri_password_span(uri) {
        Some((start, end)) => format!("{}{MASK}{}", &uri[..start], &uri[end..]),
        None => uri.to_owned(),
    }
}

/// The byte range of the password in `scheme://user:password@hosts/...`.
fn uri_password_span(uri: &str) -> Option<(usize, usize)> {
    // Where the user info starts: after `//`, or — a URI missing a slash or
    // its colon, which the driver refuses with the URI in its message —
    // after the scheme and its colon and slashes.
    let start = match uri.find("//") {
        Some(slashes) => slashes + 2,
        None => {
            let colon = uri.find(':')?;
            colon + 1 + uri[colon + 1..].len() - uri[colon + 1..].trim_start_matches('/').len()
        }
    };
    let rest = &uri[start..];
    // The user info ends at the last '@': a password with an unencoded
    // '/', '?' or '@' (refused by the driver, and printed in its message)
    // is masked whole.
    let at = rest.rfind('@')?;
    let user_info = &rest[..at];
    // `user:password`, or a password after a stray '@' (`user@password`).
    let secret_start = user_info.find(':').or_else(|| user_info.find('@'))?;
    Some((start + secret_start + 1, start + at))
}

/// The secret strings of a configuration, to scrub from foreign messages.
#[derive(Clone, Default)]
pub(crate) struct Secrets(Vec<String>);

impl Secrets {
    /// Collects the secrets: the URI's password (raw and percent-decoded)
    /// and any other secret values.
    pub(crate) fn new<'a>(uri: &str, others: impl IntoIterator<Item = &'a str>) -> Self {
        let mut values = Vec::new();
        if let Some((start, end)) = uri_password_span(uri) {
            let raw = &uri[start..end];
            values.push(raw.to_owned());
            values.push(percent_decode(raw));
        }
        values.extend(others.into_iter().map(str::to_owned));
        values.retain(|v| !v.is_empty());
        values.sort_by_key(|v| std::cmp::Reverse(v.len()));
        values.dedup();
        Self(values)
    }

    /// `message` with every secret replaced by `****`.
    pub(crate) fn scrub(&self, message: &str) -> String {
        let mut out = message.to_owned();
        for secret in &self.0 {
            out = out.replace(secret.as_str(), MASK);
        }
        out
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secrets({} values)", self.0.len())
    }
}

fn percent_decode(s: &str) -> String {
    let hex = |b: u8| char::from(b).to_digit(16);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_is_masked_and_the_rest_kept() {
        assert_eq!(
            redact_uri("mongodb://app:s3cret@db1:27017,db2/admin?replicaSet=rs0"),
            "mongodb://app:****@db1:27017,db2/admin?replicaSet=rs0"
        );
        assert_eq!(
            redact_uri("mongodb+srv://app:p%40ss@cluster.example.net/?w=majority"),
            "mongodb+srv://app:****@cluster.example.net/?w=majority"
        );
    }

    #[test]
    fn a_malformed_uri_never_shows_its_password() {
        for uri in [
            "mongodb//tallyd:S3cretPW@127.0.0.1:27517/",
            "mongodb:/tallyd:S3cretPW@127.0.0.1:27517/",
            "mongodb://tallyd:S3cr/etPW@127.0.0.1:27517/",
            "mongodb://tallyd:S3cr?etPW@127.0.0.1:27517/",
            "mongodb://tallyd@S3cretPW@127.0.0.1:27517/",
            "mongodb://tallyd:S3cr@tPW@127.0.0.1:27517/?replicaSet=rs0",
        ] {
            let secrets = Secrets::new(uri, []);
            let message =
                format!("malformed connection string {uri}: password must be URL encoded");
            let scrubbed = secrets.scrub(&message);
            for part in ["S3cretPW", "S3cr/etPW", "S3cr?etPW", "S3cr@tPW"] {
                assert!(!scrubbed.contains(part), "{uri}: {scrubbed}");
            }
            assert!(scrubbed.contains("127.0.0.1:27517"), "{uri}: {scrubbed}");
        }
    }

    #[test]
    fn uris_without_a_password_are_unchanged() {
        for uri in [
            "mongodb://localhost:27017",
            "mongodb://user@host/db",
            "mongodb://host/?authSource=admin",
            "not a uri",
        ] {
            assert_eq!(redact_uri(uri), uri);
        }
    }

    #[test]
    fn scrub_removes_raw_and_decoded_passwords() {
        let secrets = Secrets::new("mongodb://u:p%40ss@h/", ["tok123"]);
        let message = "failed for p%40ss and p@ss with header tok123";
        let scrubbed = secrets.scrub(message);
        assert!(!scrubbed.contains("p%40ss"));
        assert!(!scrubbed.contains("p@ss"));
        assert!(!scrubbed.contains("tok123"));
    }

    #[test]
    fn secret_strings_never_print() {
        let s = SecretString::new("hunter2");
        assert_eq!(format!("{s} {s:?}"), "**** ****");
    }
}
