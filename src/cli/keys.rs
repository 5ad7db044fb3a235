//! Keys given on the command line, checked before anything connects.

/// A counter key (or sequence name) given on the command line: any text but
/// the empty one, which names no counter anyone means, and one that only a
/// paste gone wrong makes — a control character (a line end, a tab, an
/// escape) or a space at either end — which would count into another
/// counter than the one meant (exit 64).
pub(crate) fn counter_key(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("a counter key must not be empty: give the counter's _id, such as home".into());
    }
    pasted_whole("a counter key", "count into another counter", text)?;
    Ok(text.to_owned())
}

/// An event key given on the command line: as a counter key, any text but
/// the empty one and one a paste gone wrong makes (exit 64).
pub(crate) fn event_key(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("an event key must not be empty: give the event's idempotency key, such as a message id".into());
    }
    pasted_whole("an event key", "be another event", text)?;
    Ok(text.to_owned())
}

/// Refuses `text` when it holds a control character or begins or ends
/// with white space, saying what it holds (escaped) and what to do.
fn pasted_whole(what: &str, otherwise: &str, text: &str) -> Result<(), String> {
    let shown: String = text.chars().take(64).flat_map(char::escape_debug).collect();
    let shown = if text.chars().count() > 64 {
        format!("{shown}…")
    } else {
        shown
    };
    if text.chars().any(char::is_control) {
        return Err(format!(
            "{what} must not hold a line end, tab or other control character (\"{shown}\"): \
             pasted with one, it would {otherwise}; give the key without it"
        ));
    }
    if text.starts_with(char::is_whitespace) || text.ends_with(char::is_whitespace) {
        return Err(format!(
            "{what} must not begin or end with a space (\"{shown}\"): pasted with one, it \
             would {otherwise}; give the key without it"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_a_paste_gone_wrong_makes_are_refused_saying_what_they_hold() {
        for ok in ["home", "a b", "page:2026-11-28", "ünïcode", "x\u{00a0}y"] {
            assert_eq!(counter_key(ok).as_deref(), Ok(ok));
            assert_eq!(event_key(ok).as_deref(), Ok(ok));
        }
        let err = counter_key("home\n").unwrap_err();
        assert!(err.contains(r#"("home\n")"#), "{err}");
        assert!(err.contains("control character"), "{err}");
        assert!(counter_key("a\tb").unwrap_err().contains(r#""a\tb""#));
        assert!(
            counter_key("\u{1b}[31mred")
                .unwrap_err()
                .contains(r"\u{1b}")
        );
        let err = counter_key(" home").unwrap_err();
        assert!(err.contains("begin or end with a space"), "{err}");
        assert!(event_key("e1 ").unwrap_err().contains("an event key"));
        let long = format!("{}\n", "k".repeat(100_000));
        assert!(counter_key(&long).unwrap_err().len() < 400);
    }
}
