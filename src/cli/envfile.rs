//! `tallyd --env-file PATH`: the environment file systemd's unit reads
//! (`EnvironmentFile=`), read the way systemd reads it, so a command run by
//! hand sees exactly what the daemon sees.
//!
//! A shell's `set -a; . FILE` reads the same file differently: an unquoted
//! `&` ends the command (`TALLYD__MONGODB__URI=…?replicaSet=rs0&authSource=
//! admin` loses everything after it) and an unquoted space starts the next
//! one (`TALLYD_WEBHOOK_TOKEN=Bearer abc` runs `abc`). Here, as in systemd:
//!
//! - one `KEY=VALUE` a line; empty lines and lines starting with `#` or `;`
//!   are skipped; whitespace around the key and before the value is not
//!   part of them, nor is trailing whitespace of an unquoted value;
//! - a value is taken as it is — `&`, `?`, `$`, spaces inside included;
//! - a value that starts with `'` is quoted up to the next `'`, literally
//!   (newlines too); with `"`, the same, except that a backslash escapes
//!   `"`, `\`, `` ` `` and `$` and joins a line break; after the closing
//!   quote, whitespace is skipped and another quoted or unquoted part may
//!   follow; outside quotes a backslash takes the next character
//!   literally, and one at the end of a line joins the next line.
//!
//! A line systemd would skip as not an assignment (no `=`, a key that is
//! not a variable name, such as `export KEY`) is an error here, with its
//! line number: a variable silently missing is what this option exists to
//! prevent.

use std::path::Path;

/// The variables of the environment file at `path`, in order.
pub(crate) fn read(path: &Path) -> Result<Vec<(String, String)>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|err| crate::error::cannot_read(path, &err))?;
    parse(&text).map_err(|(line, problem)| format!("{}, line {line}: {problem}", path.display()))
}

/// Where the parser is inside a line.
#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the key: whitespace, a comment, or the key's first letter.
    PreKey,
    /// A comment, up to the end of the line.
    Comment,
    /// The key, up to `=`.
    Key,
    /// Between `=` and the value.
    PreValue,
    /// An unquoted value.
    Value,
    /// After a backslash in an unquoted value.
    ValueEscape,
    /// Inside `'…'`.
    SingleQuote,
    /// Inside `"…"`.
    DoubleQuote,
    /// After a backslash inside `"…"`.
    DoubleQuoteEscape,
}

/// The assignments of an environment file's text, or the line number of
/// the first problem and what it is.
pub(crate) fn parse(text: &str) -> Result<Vec<(String, String)>, (usize, String)> {
    let mut found = Vec::new();
    let mut state = State::PreKey;
    let (mut key, mut value) = (String::new(), String::new());
    // Trailing whitespace of an unquoted value is not part of it.
    let mut pending_space = String::new();
    let mut line = 1;
    let mut key_line = 1;
    let mut finish = |key: &mut String, value: &mut String, line: usize| {
        let name = key.trim_end().to_owned();
        if !is_variable_name(&name) {
            return Err((
                line,
                format!("{name:?} is not a variable name (write KEY=VALUE, without `export`)"),
            ));
        }
        found.push((name, std::mem::take(value)));
        key.clear();
        Ok(())
    };
    for c in text.chars() {
        match (state, c) {
            (State::PreKey, '#' | ';') => state = State::Comment,
            (State::PreKey, c) if c.is_whitespace() => {}
            (State::PreKey, c) => {
                key_line = line;
                key.push(c);
                state = State::Key;
            }
            (State::Comment, '\n') => state = State::PreKey,
            (State::Comment, _) => {}
            (State::Key, '=') => state = State::PreValue,
            (State::Key, '\n') => {
                let shown = key.trim_end();
                return Err((key_line, format!("{shown:?} is not KEY=VALUE")));
            }
            (State::Key, c) => key.push(c),
            (State::PreValue, '\n') => {
                finish(&mut key, &mut value, key_line)?;
                state = State::PreKey;
            }
            (State::PreValue, '\'') => state = State::SingleQuote,
            (State::PreValue, '"') => state = State::DoubleQuote,
            (State::PreValue, '\\') => state = State::ValueEscape,
            (State::PreValue, c) if c.is_whitespace() => {}
            (State::PreValue | State::Value, c) if c != '\n' && c.is_whitespace() => {
                pending_space.push(c);
                state = State::Value;
            }
            (State::Value, '\n') => {
                pending_space.clear();
                finish(&mut key, &mut value, key_line)?;
                state = State::PreKey;
            }
            (State::Value, '\\') => {
                value.push_str(&std::mem::take(&mut pending_space));
                state = State::ValueEscape;
            }
            (State::PreValue | State::Value, c) => {
                value.push_str(&std::mem::take(&mut pending_space));
                value.push(c);
                state = State::Value;
            }
            // A backslash at the end of a line joins the next one.
            (State::ValueEscape, '\n') => state = State::Value,
            (State::ValueEscape, c) => {
                value.push(c);
                state = State::Value;
            }
            // After a closing quote, as before the value: whitespace is
            // skipped, another quote opens, anything else goes on unquoted.
            (State::SingleQuote, '\'') => state = State::PreValue,
            (State::SingleQuote, c) => value.push(c),
            (State::DoubleQuote, '"') => state = State::PreValue,
            (State::DoubleQuote, '\\') => state = State::DoubleQuoteEscape,
            (State::DoubleQuote, c) => value.push(c),
            (State::DoubleQuoteEscape, '\n') => state = State::DoubleQuote,
            (State::DoubleQuoteEscape, c) => {
                if !"\"\\`$".contains(c) {
                    value.push('\\');
                }
                value.push(c);
                state = State::DoubleQuote;
            }
        }
        if c == '\n' {
            line += 1;
        }
    }
    match state {
        State::PreKey | State::Comment => {}
        State::Key => {
            let shown = key.trim_end();
            return Err((key_line, format!("{shown:?} is not KEY=VALUE")));
        }
        State::SingleQuote | State::DoubleQuote | State::DoubleQuoteEscape => {
            return Err((key_line, "a quote is not closed".to_owned()));
        }
        State::PreValue | State::Value | State::ValueEscape => {
            finish(&mut key, &mut value, key_line)?;
        }
    }
    Ok(found)
}

/// A name systemd accepts for a variable: letters, digits and `_`, not
/// starting with a digit.
fn is_variable_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Vec<(String, String)> {
        parse(text).unwrap_or_else(|(line, problem)| panic!("line {line}: {problem}"))
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn values_are_taken_as_they_are_where_a_shell_would_cut_them() {
        let text = "# the URI and the webhook token\n\
                    TALLYD__MONGODB__URI=mongodb://u:p@a:1,b:2/?replicaSet=rs0&authSource=admin\n\
                    TALLYD_WEBHOOK_TOKEN=Bearer abc def  \n\
                    \n\
                    ; another comment\n  \
                    SPACED = value with $HOME and `x` \n";
        assert_eq!(
            parsed(text),
            pairs(&[
                (
                    "TALLYD__MONGODB__URI",
                    "mongodb://u:p@a:1,b:2/?replicaSet=rs0&authSource=admin"
                ),
                ("TALLYD_WEBHOOK_TOKEN", "Bearer abc def"),
                ("SPACED", "value with $HOME and `x`"),
            ])
        );
    }

    #[test]
    fn quotes_and_escapes_read_as_systemd_reads_them() {
        let text = "A='single $quoted \"x\"'\n\
                    B=\"double \\\"q\\\" \\\\ \\$ \\n kept\"\n\
                    C=\"joined \\\nline\"\n\
                    D=unquoted\\ escape \\\n  continued\n\
                    E=\"a\" 'b'c'd'\n\
                    F=\n\
                    G='multi\nline'\n\
                    H=#not a comment";
        assert_eq!(
            parsed(text),
            pairs(&[
                ("A", "single $quoted \"x\""),
                ("B", "double \"q\" \\ $ \\n kept"),
                ("C", "joined line"),
                ("D", "unquoted escape   continued"),
                ("E", "abc'd'"),
                ("F", ""),
                ("G", "multi\nline"),
                ("H", "#not a comment"),
            ])
        );
    }

    #[test]
    fn what_systemd_would_skip_is_an_error_with_its_line() {
        assert_eq!(parse("A=1\nexport B=2\n").unwrap_err().0, 2);
        assert_eq!(parse("A=1\n\njust words\n").unwrap_err().0, 3);
        assert_eq!(parse("1A=x").unwrap_err().0, 1);
        assert_eq!(parse("A=1\nB='open\n").unwrap_err().0, 2);
    }
}
