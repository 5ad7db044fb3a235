//! Turning untyped values into typed ones while collecting every problem.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::Value;

use super::raw::{Section, Unknown};
use super::{ConfigErrors, ConfigIssue, ENV_PREFIX, ENV_SEPARATOR};

/// Collects configuration problems, each under the key it concerns.
#[derive(Debug, Default)]
pub(crate) struct Issues {
    list: Vec<ConfigIssue>,
    /// Keys (dotted, lower case) that were set by an environment variable,
    /// with the variable's name.
    from_env: BTreeMap<String, String>,
    /// The top-level keys the file itself sets.
    in_file: BTreeSet<String>,
}

impl Issues {
    /// Collects issues for a configuration whose keys came from `from_env`
    /// (dotted key → variable name) and from a file setting the top-level
    /// keys `in_file`.
    pub(crate) fn new(from_env: BTreeMap<String, String>, in_file: BTreeSet<String>) -> Self {
        Self {
            list: Vec::new(),
            from_env,
            in_file,
        }
    }

    /// Whether a problem with `key` was reported.
    pub(crate) fn has(&self, key: &str) -> bool {
        self.list.iter().any(|issue| issue.key == key)
    }

    /// Whether a problem with `key` or a key below it (`collections[1].name`
    /// is below `collections`) was reported.
    pub(crate) fn has_under(&self, key: &str) -> bool {
        self.list.iter().any(|issue| {
            issue
                .key
                .strip_prefix(key)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
        })
    }

    /// `config` when no problem was reported, else every problem.
    pub(crate) fn into_result<T>(self, config: T) -> Result<T, ConfigErrors> {
        if self.list.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors { issues: self.list })
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Records a problem that comes before all others: the one that
    /// explains them.
    pub(crate) fn push_first(&mut self, key: impl Into<String>, message: impl Into<String>) {
        let issue = ConfigIssue {
            key: key.into(),
            message: message.into(),
        };
        self.list.insert(0, issue);
    }

    /// Records a problem with `key`. When an environment variable set it,
    /// the message says which.
    pub(crate) fn push(&mut self, key: impl Into<String>, message: impl Into<String>) {
        let key = key.into();
        let mut message = message.into();
        if let Some(var) = self.from_env.get(&key.to_lowercase()) {
            message.push_str(&format!(" (set by {var})"));
        }
        self.list.push(ConfigIssue { key, message });
    }

    /// The variables that set keys below `key` (`collections.0.grace` is
    /// below `collections`), not `key` itself.
    pub(crate) fn vars_below(&self, key: &str) -> Vec<String> {
        let below = format!("{key}.");
        self.from_env
            .iter()
            .filter(|(dotted, _)| dotted.starts_with(&below))
            .map(|(_, var)| var.clone())
            .collect()
    }

    /// Reports every key of a table that is not part of the schema. An
    /// unknown top-level key set from the environment (`TALLYD__X__Y`)
    /// names its variable, since no table of the file shows it.
    pub(crate) fn unknown_keys(&mut self, table: &str, unknown: &Unknown) {
        for key in unknown.keys() {
            if !table.is_empty() {
                self.push(format!("{table}.{key}"), "unknown key");
                continue;
            }
            let below = format!("{key}.");
            let vars: Vec<String> = self
                .from_env
                .iter()
                .filter(|(dotted, _)| *dotted == key || dotted.starts_with(&below))
                .map(|(_, var)| var.clone())
                .collect();
            for var in &vars {
                self.list.push(ConfigIssue {
                    key: format!("{var} (environment)"),
                    message: format!("unknown key {key}"),
                });
            }
            if vars.is_empty() || self.in_file.contains(key) {
                self.push(key.clone(), "unknown key");
            }
        }
    }

    /// The table at `key`, or the default after reporting that something
    /// else stood there.
    pub(crate) fn table<T: Default>(&mut self, key: &str, section: Option<Section<T>>) -> T {
        match section {
            None => T::default(),
            Some(Section::Table(table)) => table,
            Some(Section::NotATable(value)) => {
                self.push(key, format!("expected a table, found {}", describe(&value)));
                T::default()
            }
        }
    }

    /// A string value; `None` when absent or of the wrong type (reported).
    pub(crate) fn string(&mut self, key: &str, value: Option<Value>) -> Option<String> {
        match value? {
            Value::String(s) => Some(s),
            other => {
                self.push(
                    key,
                    format!("expected a string, found {}", describe(&other)),
                );
                None
            }
        }
    }

    /// A required string; reports its absence with a hint on how to set it.
    pub(crate) fn required_string(&mut self, key: &str, value: Option<Value>) -> Option<String> {
        if value.is_none() {
            let var = env_var(key);
            self.push(key, format!("missing (set it in the file or with {var})"));
            return None;
        }
        self.string(key, value)
    }

    /// A duration written the usual way (`60s`, `15m`, `1h 30m`), greater
    /// than zero.
    pub(crate) fn duration(
        &mut self,
        key: &str,
        value: Option<Value>,
        default: Duration,
    ) -> Duration {
        self.optional_duration(key, value).unwrap_or(default)
    }

    /// A duration that may be absent (`None`, also after a reported
    /// problem).
    pub(crate) fn optional_duration(
        &mut self,
        key: &str,
        value: Option<Value>,
    ) -> Option<Duration> {
        let text = match value? {
            Value::String(s) => s,
            Value::Number(n) => {
                self.push(
                    key,
                    format!("expected a duration with a unit, like \"{n}s\", found the number {n}"),
                );
                return None;
            }
            other => {
                self.push(
                    key,
                    format!(
                        "expected a duration like \"60s\", found {}",
                        describe(&other)
                    ),
                );
                return None;
            }
        };
        match humantime::parse_duration(text.trim()) {
            Ok(d) if d.is_zero() => {
                self.push(key, "must be greater than zero");
                None
            }
            Ok(d) => Some(d),
            Err(_) if text.trim_start().starts_with('-') => {
                self.push(key, format!("must be greater than zero, found {text:?}"));
                None
            }
            Err(err) => {
                self.push(
                    key,
                    format!(
                        "not a duration ({err}): {text:?}; write e.g. \"60s\", \"15m\", \"1h\""
                    ),
                );
                None
            }
        }
    }

    /// An integer in `min..=max`, which may be absent (environment variables
    /// arrive as text).
    pub(crate) fn optional_integer(
        &mut self,
        key: &str,
        value: Option<Value>,
        min: u64,
        max: u64,
    ) -> Option<u64> {
        let value = value?;
        let parsed = match &value {
            Value::Number(n) => n.as_i64().map(i128::from),
            Value::String(s) => s.trim().parse::<i128>().ok(),
            _ => None,
        };
        match parsed {
            Some(n) if n >= i128::from(min) && n <= i128::from(max) => Some(n as u64),
            Some(n) => {
                self.push(key, format!("must be between {min} and {max}, found {n}"));
                None
            }
            None => {
                self.push(
                    key,
                    format!("expected an integer, found {}", describe(&value)),
                );
                None
            }
        }
    }
}

impl Issues {
    /// A boolean (environment variables arrive as text).
    pub(crate) fn boolean(&mut self, key: &str, value: Option<Value>, default: bool) -> bool {
        match value {
            None => default,
            Some(Value::Bool(b)) => b,
            Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => true,
            Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => false,
            Some(other) => {
                self.push(
                    key,
                    format!("expected true or false, found {}", describe(&other)),
                );
                default
            }
        }
    }
}

/// The environment variable that sets the dotted `key`.
pub(crate) fn env_var(key: &str) -> String {
    format!(
        "{ENV_PREFIX}{ENV_SEPARATOR}{}",
        key.to_uppercase().replace('.', ENV_SEPARATOR)
    )
}

/// A short description of a value for error messages. Strings are quoted
/// only when short: a long string may be a secret pasted in the wrong place.
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "nothing".into(),
        Value::Bool(b) => format!("the boolean {b}"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) if s.len() <= 40 && !s.contains("://") => format!("the string {s:?}"),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "a table".into(),
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    /// A `TALLYD__COLLECTIONS__…` variable replaces the file's list of
    /// collections with a table: the error names the variable and says
    /// what to do, not only "found a table".
    #[test]
    fn a_bad_collections_variable_is_named() {
        let text = "[mongodb]\nuri = \"mongodb://h/\"\ndatabase = \"app\"\n\
                    [[collections]]\nname = \"views\"\n";
        let env = [(
            "TALLYD__COLLECTIONS__0__GRACE".to_owned(),
            "soon".to_owned(),
        )];
        let message = Config::from_toml(text, env).unwrap_err().to_string();
        assert!(
            message.contains("set by TALLYD__COLLECTIONS__0__GRACE"),
            "{message}"
        );
        assert!(message.contains("set the key in the file"), "{message}");
    }
}
