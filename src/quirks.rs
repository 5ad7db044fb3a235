//! What the test server does differently from MongoDB, and what tally does
//! about it: the one place that knows.
//!
//! tally's tests run against SecantusDB 0.7.0b3 (`scripts/install-test-server`),
//! a server that speaks MongoDB's wire protocol. Where it differs from what
//! MongoDB documents in a way a protocol would notice, the difference is
//! handled here, named, with the measurement that shows it — never inside
//! a protocol's logic. Everything here is a no-op against MongoDB: each
//! rule first recognises the test server's own form of the thing it reads.
//!
//! - **Its change-stream resume tokens** are a hex-encoded BSON document
//!   `{s: <oplog sequence>, t: <cluster time>, n: <namespace>, k: <key>}`,
//!   not MongoDB's KeyString (`82` and the cluster time, big-endian:
//!   `ledger::log`). [`token_time`] reads the time out of one.
//! - **Its token's time does not say where the stream stands.** MongoDB's
//!   high-water mark is the newest oplog time the stream scanned, so a
//!   token whose time is past a moment says every insert before it was
//!   returned. The test server stamps the token of an opening reply — a
//!   new stream's, or a resumed one's, the driver's own resumes after a
//!   network error included — with its cluster clock's time *now*, while
//!   the stream still stands at its resume point (measured: a resumed
//!   stream whose backlog its `$match` filtered out answered an empty batch
//!   with a token of the current time and the resume point's position);
//!   and its clock ticks without writes, so a stream at the end of the log
//!   may keep a token older than a read's `operationTime` for good. Its
//!   tokens do carry the stream's place in its oplog, `s`: a reader of the
//!   test server's log takes the place of a new stream opened at the
//!   moment it must reach, and has reached it once its own token's place
//!   is as far ([`token_place`]; `ledger::log::Reader::read_until`).
//! - **Its token can stay behind where its stream stands.** After a batch
//!   that ends with an event, the test server's token is that event's,
//!   even when the same read went on past entries its `$match` filtered
//!   out; until a later entry comes, every `getMore` answers that token
//!   again (measured: a stream filtered to one key stood at place 340 for
//!   good while a new stream's place was 342). A `getMore` that finds
//!   nothing and leaves the token as it was stands at the end of the log
//!   ([`at_end`]) — never the opening reply, which no `getMore` made.
//! - **Its open stream reads on past what its oplog dropped.** MongoDB
//!   fails a change stream's `getMore` once the oplog dropped the entries
//!   it had yet to read (`CappedPositionLost`, `ChangeStreamHistoryLost`);
//!   the test server checks only when a stream is opened or resumed, and a
//!   `getMore` on a cursor the oplog passed goes on from the oldest entry
//!   it kept (measured: a stream kept open while 600 inserts and 600 other
//!   writes went through a 400-entry oplog returned 300 of the inserts and
//!   no error). A fold that read the test server's log checks, before it
//!   writes anything it read, that the oplog still holds the position it
//!   read from ([`skips_dropped_history`];
//!   `ledger::log::check_history_kept`).

use mongodb::bson::{Bson, Document, Timestamp};

/// The cluster time of a resume token in the test server's form
/// (hex-encoded BSON with the time in `t`); `None` for any other form.
///
/// The BSON form is recognised by its length prefix: the hex string's first
/// four bytes, little-endian, are the length of the whole. A MongoDB token
/// starts with `82` and the cluster time's high bytes, which would make a
/// length of gigabytes: the two forms never meet.
pub(crate) fn token_time(data: &[u8]) -> Option<Timestamp> {
    let length = u32::from_le_bytes(data.get(..4)?.try_into().ok()?) as usize;
    if length != data.len() {
        return None;
    }
    let document = Document::from_reader(data).ok()?;
    match document.get("t") {
        Some(Bson::Timestamp(time)) => Some(*time),
        _ => None,
    }
}

/// Whether a stream of the test server whose token was `before` a
/// `getMore` that found nothing, and `after` it, stands at the end of the
/// log: the token did not move. For MongoDB's tokens never (their time
/// says where a stream stands).
pub(crate) fn at_end(before: &[u8], after: &[u8]) -> bool {
    token_place(after).is_some() && before == after
}

/// The place in its oplog of a resume token in the test server's form
/// (`s`); `None` for any other form.
pub(crate) fn token_place(data: &[u8]) -> Option<i64> {
    token_time(data)?;
    match Document::from_reader(data).ok()?.get("s") {
        Some(Bson::Int64(place)) => Some(*place),
        Some(Bson::Int32(place)) => Some(i64::from(*place)),
        _ => None,
    }
}

/// Whether a stream whose token is `data` may read on past entries its
/// oplog dropped instead of failing: the test server's, by its token's
/// form. For MongoDB's tokens never.
pub(crate) fn skips_dropped_history(data: &[u8]) -> bool {
    token_place(data).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::doc;

    fn test_server_token(seq: i64, time: Timestamp) -> Vec<u8> {
        let mut bytes = Vec::new();
        doc! { "s": seq, "t": time, "n": "app.views_events", "k": {} }
            .to_writer(&mut bytes)
            .unwrap();
        bytes
    }

    #[test]
    fn the_test_servers_tokens_give_their_time_and_mongodbs_are_left_alone() {
        let time = Timestamp {
            time: 1_796_392_841,
            increment: 18,
        };
        assert_eq!(token_time(&test_server_token(7, time)), Some(time));
        // MongoDB's form: 0x82 and the time, then the rest of the key.
        let mongodb = hex("8264A1B2C3000000012B022C0100296E5A1004");
        assert_eq!(token_time(&mongodb), None);
        assert_eq!(token_time(&[]), None);
        assert_eq!(token_time(&[5, 0, 0, 0, 0, 1]), None, "a wrong length");
    }

    #[test]
    fn the_test_servers_tokens_give_their_place_and_mongodbs_none() {
        let time = Timestamp {
            time: 10,
            increment: 1,
        };
        assert_eq!(token_place(&test_server_token(7, time)), Some(7));
        let mongodb = hex("8264A1B2C3000000012B022C0100296E5A1004");
        assert_eq!(token_place(&mongodb), None);
        let token = test_server_token(7, time);
        assert!(at_end(&token, &token));
        assert!(!at_end(&token, &test_server_token(8, time)));
        assert!(!at_end(&mongodb, &mongodb));
    }

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
            .collect()
    }
}
