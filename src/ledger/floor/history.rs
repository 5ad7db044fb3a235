//! The server's own log of the events collection, read through its change
//! stream: which validator a raise of the floor replaced (the `modify`
//! event's `stateBeforeChange`, MongoDB 6.0 and newer), and which events
//! landed between two cluster times.
//!
//! A change stream returns only what a majority has written, in the order
//! it took effect, and a window of it read twice is the same window: what
//! a pass reads from it, it reads again exactly when it is resumed.

use std::time::{Duration, Instant};

use mongodb::bson::{Document, Timestamp, doc};
use mongodb::change_stream::ChangeStream;
use tokio::sync::Mutex;

use super::{Floor, Raise, token_of};
use crate::document::integer_value;
use crate::error::{Error, Failure, server_code};
use crate::ledger::field;
use crate::store::Store;

/// How long the fold waits for its own raise to show in a new stream.
const RAISE_WAIT: Duration = Duration::from_secs(30);
/// How long it waits for it in the stream it kept before it gives that
/// one up for a new one (which gets [`RAISE_WAIT`] of its own).
const KEPT_WAIT: Duration = Duration::from_secs(10);
/// How long it reads a window of the stream before it gives up.
const WINDOW_WAIT: Duration = Duration::from_secs(600);
/// How long one read of the stream waits for more.
const AWAIT: Duration = Duration::from_millis(200);

/// `ChangeStreamHistoryLost`, `CappedPositionLost`: the oplog no longer
/// reaches back to where the stream was asked to start.
const HISTORY_LOST: [i32; 2] = [286, 136];

/// `Unauthorized`: the user may not read the change stream.
const UNAUTHORIZED: i32 = 13;

/// The events collection's change stream of `collMod`s, kept open from one
/// raise of the floor to the next by the fold that raises it.
///
/// A raise reads its own `modify` event from the stream. A stream opened
/// at a given time makes the server find where to start, and a server that
/// finds it by reading its oplog from the beginning (the test server does)
/// would pay for the whole oplog at every pass; a stream kept open reads
/// only what was written since the last raise. Its position is never past a
/// raise not yet made, so it cannot miss one; a stream that fails (its
/// cursor killed, its history lost, the collection dropped) is given up and
/// the raise reads a new one.
///
/// On its way to a raise the stream shows every change of the collection's
/// validation since the last one, so the raise also learns whether anything
/// changed the floor between the raise the fold remembers and itself — a
/// floor taken away and put back as it was included, which what the raise
/// replaced cannot show.
#[derive(Default)]
pub(crate) struct Watch(Mutex<Option<Kept>>);

/// A stream kept open, and what it showed.
struct Kept {
    stream: ChangeStream<Document>,
    seen: Seen,
}

impl Kept {
    fn new(stream: ChangeStream<Document>, from: Option<Timestamp>) -> Self {
        Self {
            stream,
            seen: Seen {
                from,
                changes: Vec::new(),
            },
        }
    }
}

/// The validation changes a stream showed.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    /// The stream has shown every change after this cluster time (`None`:
    /// opened with no start point, it has shown what came after it opened,
    /// from a time it does not know).
    from: Option<Timestamp>,
    /// The validation changes it showed after `from`, oldest first.
    changes: Vec<Timestamp>,
}

impl Seen {
    /// Notes a validation change at `at`.
    fn note(&mut self, at: Timestamp) {
        if self.from.is_none_or(|from| at > from) {
            self.changes.push(at);
        }
    }

    /// Whether it has shown every change after `since`.
    fn covers(&self, since: Timestamp) -> bool {
        self.from.is_some_and(|from| from <= since)
    }

    /// Whether it showed a validation change after `since` and before
    /// `until` (`None`: it cannot tell, not having shown all of them).
    fn changed_between(&self, since: Timestamp, until: Timestamp) -> Option<bool> {
        self.covers(since)
            .then(|| self.changes.iter().any(|&at| at > since && at < until))
    }

    /// Forgets what it showed before `at` (a raise just found: what comes
    /// after it is what the next raise asks about).
    fn forget_before(&mut self, at: Timestamp) {
        self.changes.retain(|&change| change >= at);
        self.from = Some(self.from.map_or(at, |from| from.max(at)));
    }
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Watch")
    }
}

impl Watch {
    /// Before a raise: makes sure a stream is kept that will show the
    /// raise's own event and, when the fold remembers a raise that took
    /// effect at `since`, every change after it. A stream opened with no
    /// start point costs the server no search of its oplog; one opened at
    /// `since` does once (a fold's first raise in a process, or after
    /// another fold's raises it did not see). One that cannot be opened
    /// leaves none, and the raise reads a new stream from its `ping`.
    pub(crate) async fn prepare(&self, store: &Store, events: &str, since: Option<Timestamp>) {
        let mut kept = self.0.lock().await;
        if kept
            .as_ref()
            .is_some_and(|kept| since.is_none_or(|since| kept.seen.covers(since)))
        {
            return;
        }
        *kept = None;
        match open_kept(store, events, since, None).await {
            Ok(opened) => *kept = Some(opened),
            Err(err) => tracing::debug!(events, error = %err, "cannot open the change stream yet"),
        }
    }

    /// Lets go of the kept stream (the collection was created again: its
    /// stream ended).
    pub(crate) async fn forget(&self) {
        *self.0.lock().await = None;
    }
}

/// A stream of `collMod`s from the remembered raise at `since` when the
/// server still has it (it then shows every validation change after that
/// raise), else from `or` (`None`: from now, which costs the server no
/// search of its oplog; then only what a raise replaced tells).
async fn open_kept(
    store: &Store,
    events: &str,
    since: Option<Timestamp>,
    or: Option<Timestamp>,
) -> Result<Kept, Error> {
    if let Some(since) = since {
        match open(store, events, Some(since), modify_events()).await {
            Ok(stream) => return Ok(Kept::new(stream, Some(since))),
            Err(err) => tracing::warn!(
                events,
                error = %err,
                "cannot read the events collection's changes since the floor's last raise; \
                 this raise checks only what it replaced"
            ),
        }
    }
    let stream = open(store, events, or, modify_events()).await?;
    Ok(Kept::new(stream, or))
}

/// The change stream's pipeline that keeps `collMod`s alone.
fn modify_events() -> Vec<Document> {
    vec![doc! { "$match": { "operationType": "modify" } }]
}

/// What a raise's own `modify` event says.
pub(crate) struct Replaced {
    /// The floor it replaced.
    pub(crate) floor: Floor,
    /// The cluster time it took effect.
    pub(crate) at: Timestamp,
    /// Whether the validation changed after the cluster time `since` and
    /// before the raise (`None`: not asked, or the stream read cannot
    /// tell).
    pub(crate) changed: Option<bool>,
}

/// What `raise`'s `collMod` replaced, when it took effect, and whether
/// anything changed the validation between `since` and it: read from
/// `watch`'s kept stream, or from a new one from `since` or `before` (a
/// cluster time before the raise took effect).
pub(crate) async fn replaced(
    store: &Store,
    events: &str,
    raise: &Raise,
    (since, before): (Option<Timestamp>, Timestamp),
    watch: &Watch,
) -> Result<Replaced, Error> {
    let mut kept = watch.0.lock().await;
    if let Some(stream) = kept.as_mut() {
        match find(stream, events, raise, Instant::now() + KEPT_WAIT).await {
            Ok(Some(found)) => return found.map(|found| settle(stream, found, since)),
            Ok(None) => tracing::debug!(events, "the kept change stream did not show the raise"),
            Err(err) => tracing::debug!(events, error = %err, "the kept change stream failed"),
        }
        *kept = None;
    }
    let mut stream = open_kept(store, events, since, Some(before)).await?;
    let Some(found) = find(&mut stream, events, raise, Instant::now() + RAISE_WAIT).await? else {
        return Err(unverified(
            events,
            format!(
                "its floor's collMod did not show in the change stream within {}s",
                RAISE_WAIT.as_secs()
            ),
        ));
    };
    let found = found.map(|found| settle(&mut stream, found, since));
    *kept = Some(stream);
    found
}

/// The raise found in `kept` at `at`: what it replaced, and whether the
/// validation changed since `since`; `kept` then looks ahead from it.
fn settle(kept: &mut Kept, (floor, at): (Floor, Timestamp), since: Option<Timestamp>) -> Replaced {
    let changed = since.and_then(|since| kept.seen.changed_between(since, at));
    kept.seen.forget_before(at);
    Replaced { floor, at, changed }
}

/// `raise`'s own `modify` event in `kept`'s stream: what it replaced and
/// when it took effect; `None` when it did not show by `deadline` or the
/// stream ended. Every validation change it passes is noted in `kept`.
async fn find(
    kept: &mut Kept,
    events: &str,
    raise: &Raise,
    deadline: Instant,
) -> Result<Option<Result<(Floor, Timestamp), Error>>, Error> {
    loop {
        let Some(event) = next(&mut kept.stream, events, deadline).await? else {
            return Ok(None);
        };
        if let Ok(at) = event.get_timestamp("clusterTime")
            && changes_validation(&event)
        {
            kept.seen.note(at);
        }
        if !is_ours(&event, raise) {
            continue;
        }
        let Ok(before) = event
            .get_document("stateBeforeChange")
            .and_then(|state| state.get_document("collectionOptions"))
        else {
            return Ok(Some(Err(unverified(
                events,
                "the server's change stream does not say what a collMod replaced \
                 (stateBeforeChange): the ledger's fold needs MongoDB 6.0 or newer"
                    .into(),
            ))));
        };
        let at = event.get_timestamp("clusterTime").unwrap_or(raise.at);
        return Ok(Some(Ok((Floor::of(before), at))));
    }
}

/// Whether the `modify` event `event` changed the collection's validation
/// (its validator, level or action), which sets the floor.
fn changes_validation(event: &Document) -> bool {
    event
        .get_document("operationDescription")
        .is_ok_and(|description| {
            ["validator", "validationLevel", "validationAction"]
                .iter()
                .any(|name| description.contains_key(name))
        })
}

/// The events that landed after the cluster time `after` and before the
/// raise `until` took effect, numbered at or below `below`, for which
/// `keep(number, cluster time)` holds: their `_id`, counter, amount and
/// number. The stream ends at `until`'s own `modify` event.
pub(crate) async fn landed(
    store: &Store,
    events: &str,
    after: Timestamp,
    until: &Raise,
    below: i64,
    keep: impl Fn(i64, Timestamp) -> bool,
) -> Result<Vec<Document>, Error> {
    let full = |name: &str| format!("fullDocument.{name}");
    let mut project = doc! { "operationType": 1, "clusterTime": 1, "operationDescription": 1 };
    for name in ["_id", field::COUNTER, field::AMOUNT, field::NUMBER] {
        project.insert(full(name), 1);
    }
    let pipeline = vec![
        doc! { "$match": { "$or": [
            { "operationType": "insert", full(field::NUMBER): { "$lte": below } },
            { "operationType": "modify" },
        ] } },
        doc! { "$project": project },
    ];
    let mut stream = open(store, events, Some(after), pipeline).await?;
    let deadline = Instant::now() + WINDOW_WAIT;
    let mut found = Vec::new();
    loop {
        let Some(event) = next(&mut stream, events, deadline).await? else {
            return Err(unverified(
                events,
                format!(
                    "its change stream did not reach the floor's raise within {}s",
                    WINDOW_WAIT.as_secs()
                ),
            ));
        };
        let at = event.get_timestamp("clusterTime").ok();
        if at.is_some_and(|at| at >= until.at) || is(&event, until) {
            return Ok(found);
        }
        if event.get_str("operationType").ok() != Some("insert") || at.is_none_or(|at| at <= after)
        {
            continue;
        }
        let Ok(document) = event.get_document("fullDocument") else {
            continue;
        };
        let number = document.get(field::NUMBER).and_then(integer_value);
        if let (Some(number), Some(at)) = (number, at)
            && number <= below
            && keep(number, at)
        {
            found.push(document.clone());
        }
    }
}

/// Whether the change event `event` is `raise`'s own `collMod`, by its
/// token alone (the token is unique to the attempt).
fn is_ours(event: &Document, raise: &Raise) -> bool {
    event.get_str("operationType").ok() == Some("modify")
        && event
            .get_document("operationDescription")
            .and_then(|d| d.get_document("validator"))
            .ok()
            .and_then(token_of)
            .as_deref()
            == Some(raise.token.as_str())
}

/// Whether the change event `event` is `raise`'s own `collMod`.
fn is(event: &Document, raise: &Raise) -> bool {
    if event.get_str("operationType").ok() != Some("modify") {
        return false;
    }
    let token = event
        .get_document("operationDescription")
        .and_then(|d| d.get_document("validator"))
        .ok()
        .and_then(token_of);
    token.as_deref() == Some(raise.token.as_str())
        || event.get_timestamp("clusterTime").ok() == Some(raise.at)
}

/// The events collection's change stream from the cluster time `from`
/// (itself included), with `collMod`s shown.
async fn open(
    store: &Store,
    events: &str,
    from: Option<Timestamp>,
    pipeline: Vec<Document>,
) -> Result<ChangeStream<Document>, Error> {
    let collection = store.database().collection::<Document>(events);
    let mut watch = collection
        .watch()
        .pipeline(pipeline)
        .show_expanded_events(true)
        .max_await_time(AWAIT);
    if let Some(from) = from {
        watch = watch.start_at_operation_time(from);
    }
    let stream = watch.await.map_err(|err| failed(events, from, err))?;
    Ok(stream.with_type::<Document>())
}

/// The next change event, `None` once `deadline` passed or the stream
/// ended.
async fn next(
    stream: &mut ChangeStream<Document>,
    events: &str,
    deadline: Instant,
) -> Result<Option<Document>, Error> {
    while Instant::now() < deadline {
        match stream.next_if_any().await {
            Ok(Some(event)) => return Ok(Some(event)),
            // Nothing buffered and no cursor left (an `invalidate`).
            Ok(None) if !stream.is_alive() => return Ok(None),
            Ok(None) => {}
            Err(err) => {
                return Err(failed(events, None, err));
            }
        }
    }
    Ok(None)
}

/// The error of a stream that failed: its history lost, or the server's.
fn failed(events: &str, from: Option<Timestamp>, err: mongodb::error::Error) -> Error {
    if server_code(&err).is_some_and(|code| HISTORY_LOST.contains(&code)) {
        let since = from.map_or_else(String::new, |from| format!(" (cluster time {})", from.time));
        return unverified(
            events,
            format!(
                "the server's oplog no longer reaches back to its floor's last raise{since}, so \
                 the events that landed while a late collMod held the floor down cannot be \
                 found; fold at least once per oplog window (the daemon does), and see the \
                 book's \"floor lowered\" limit for what to do now"
            ),
        );
    }
    if server_code(&err) == Some(UNAUTHORIZED) {
        return unverified(
            events,
            format!(
                "it may not read {events}'s change stream (13 Unauthorized), which it reads to \
                 find what a late collMod let land below its watermark: grant changeStream on \
                 {events} (the book's smallest role)"
            ),
        );
    }
    Error::Server(Failure::once("ledger.fold.history", err))
}

/// A fold stopped because it cannot tell what it must.
fn unverified(events: &str, why: String) -> Error {
    Error::FoldFloorUnverified {
        events: events.to_owned(),
        why,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raise_is_known_by_its_token_or_its_cluster_time() {
        let raise = Raise {
            floor: 9,
            token: "t1".into(),
            at: Timestamp {
                time: 7,
                increment: 2,
            },
        };
        let modify = |token: &str, at: Timestamp| {
            doc! { "operationType": "modify", "clusterTime": at,
            "operationDescription": { "validator": super::super::validator(9, token) } }
        };
        assert!(is(
            &modify(
                "t1",
                Timestamp {
                    time: 1,
                    increment: 1
                }
            ),
            &raise
        ));
        assert!(is(&modify("t2", raise.at), &raise));
        assert!(!is(
            &modify(
                "t2",
                Timestamp {
                    time: 8,
                    increment: 1
                }
            ),
            &raise
        ));
        let insert = doc! { "operationType": "insert", "clusterTime": raise.at };
        assert!(!is(&insert, &raise));
    }

    #[test]
    fn a_raise_learns_of_every_validation_change_since_the_remembered_one() {
        let t = |increment| Timestamp {
            time: 10,
            increment,
        };
        // Opened at the remembered raise (t1): a change at t3, the raise at t5.
        let mut seen = Seen {
            from: Some(t(1)),
            changes: Vec::new(),
        };
        for at in [t(1), t(3), t(5)] {
            seen.note(at);
        }
        assert_eq!(seen.changed_between(t(1), t(5)), Some(true));
        // Nothing between the remembered raise and this one.
        assert_eq!(seen.changed_between(t(3), t(5)), Some(false));
        // Before the stream's start: it cannot tell.
        assert_eq!(seen.changed_between(t(0), t(5)), None);
        // The raise at t5 found: the next asks from t5 on.
        seen.forget_before(t(5));
        assert_eq!(seen.from, Some(t(5)));
        assert_eq!(seen.changed_between(t(5), t(9)), Some(false));
        assert_eq!(
            seen.changed_between(t(3), t(9)),
            None,
            "forgotten: not told"
        );
        seen.note(t(7));
        assert_eq!(seen.changed_between(t(5), t(9)), Some(true));
        // Opened with no start point: from its first raise on.
        let mut now = Seen {
            from: None,
            changes: Vec::new(),
        };
        now.note(t(4));
        assert_eq!(now.changed_between(t(2), t(4)), None);
        now.forget_before(t(4));
        assert_eq!(now.changed_between(t(4), t(8)), Some(false));

        let modify = |description: Document| doc! { "operationDescription": description };
        assert!(changes_validation(&modify(
            doc! { "validationLevel": "off" }
        )));
        assert!(changes_validation(&modify(
            doc! { "validationAction": "warn" }
        )));
        assert!(changes_validation(&modify(doc! { "validator": {} })));
        assert!(!changes_validation(&modify(
            doc! { "index": { "name": "s_1" } }
        )));
    }

    #[test]
    fn a_change_stream_whose_history_is_lost_stops_the_fold_saying_why() {
        use mongodb::bson::deserialize_from_document as from_document;
        use mongodb::error::{CommandError, ErrorKind};
        let error = |code: i32| {
            let command: CommandError = from_document(doc! {
                "code": code, "codeName": "ChangeStreamHistoryLost",
                "errmsg": "Resume of change stream was not possible",
            })
            .unwrap();
            mongodb::error::Error::from(ErrorKind::Command(command))
        };
        let from = Timestamp {
            time: 1_795_853_166,
            increment: 3,
        };
        let lost = failed("views_events", Some(from), error(286));
        let Error::FoldFloorUnverified { events, why } = &lost else {
            panic!("{lost:?}");
        };
        assert_eq!(events, "views_events");
        assert!(why.contains("oplog") && why.contains("1795853166"), "{why}");
        assert!(
            lost.to_string()
                .starts_with("the fold of views_events stopped: the server's oplog"),
            "{lost}"
        );
        // Any other failure is the server's, classified as usual.
        assert!(matches!(
            failed("views_events", Some(from), error(11601)),
            Error::Server(_)
        ));
    }
}
