//! Keys given on the command line, checked before anything connects.

/// A counter key (or sequence name) given on the command line: any text
/// but the empty one, which names no counter anyone means (exit 64).
pub(crate) fn counter_key(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("a counter key must not be empty: give the counter's _id, such as home".into());
    }
    Ok(text.to_owned())
}

/// An event key given on the command line: any text but the empty one
/// (exit 64), as a counter key.
pub(crate) fn event_key(text: &str) -> Result<String, String> {
    if text.is_empty() {
        return Err("an event key must not be empty: give the event's idempotency key, such as a message id".into());
    }
    Ok(text.to_owned())
}
