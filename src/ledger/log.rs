//! The events collection's log: its change stream, read by the fold and by
//! exact reads.
//!
//! The fold stands on what MongoDB documents of change streams (the book's
//! design chapter names each page): a stream returns only changes a
//! majority has committed, in the order they committed (merged across
//! shards by `mongos`), each once, and can be resumed after any failure
//! from a **resume token** — an event's `_id`, or the `postBatchResumeToken`
//! of a reply, a high-water mark where the stream stands between events. A
//! change that commits later always comes after every token already read,
//! so a position in the stream ([`Position`]) splits the events collection's
//! inserts for good: those at or before it, and those after. Nothing can
//! land behind it.
//!
//! A [`Position`] is a token and the cluster time it stands for, read out
//! of the token: the manual's "Resume Tokens" section documents that the
//! hex `_data` string encodes the event's cluster time (MongoDB's source,
//! `resume_token.cpp`, writes it first, as a KeyString timestamp: the type
//! byte `0x82`, then the seconds and the increment as one big-endian
//! 64-bit number). A reader that must have seen every insert before a
//! moment (an exact read's own start) reads until the stream's position has
//! reached that moment's cluster time ([`Reader::read_until`]).
//!
//! Only inserts are read (an event is never updated after its insert), with
//! the fields the fold and the reads use; a drop, a rename or an
//! `invalidate` ends the log ([`Error::FoldStopped`]). A position older than
//! the oplog reaches is lost for good ([`Error::HistoryLost`]): the fold
//! stops there, never guesses.

use std::time::{Duration, Instant, SystemTime};

use mongodb::bson::{Bson, Document, Timestamp, doc};
use mongodb::change_stream::ChangeStream;
use mongodb::change_stream::event::ResumeToken;
use serde::Deserialize;

use super::field;
use crate::error::{Error, Failure, code, server_code};
use crate::store::Store;

/// A place in the events collection's log: every insert either is at or
/// before it, or comes after it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Position {
    /// Where a stream resumes from.
    pub(crate) token: ResumeToken,
    /// The cluster time it stands for.
    pub(crate) time: Timestamp,
    /// The key of the event whose insert it is (`None`: a high-water mark,
    /// between inserts). A stream resumed from an insert's token must show
    /// that insert again (the server checks it), so a stream filtered by
    /// counter asks for it too.
    pub(crate) event: Option<Bson>,
}

impl Position {
    /// The position of `token`, its time read out of it.
    pub(crate) fn of(token: ResumeToken, events: &str) -> Result<Self, Error> {
        let time = token_time(&token).ok_or_else(|| Error::FoldStopped {
            events: events.to_owned(),
            why: "the server's change-stream resume token does not carry a cluster time tally \
                  can read (an unknown token format): the ledger needs MongoDB 4.4 or newer"
                .into(),
        })?;
        Ok(Self {
            token,
            time,
            event: None,
        })
    }

    /// As stored: `{token: <the token>, time: <its cluster time>, event:
    /// <its insert's event key, if any>}`.
    pub(crate) fn to_document(&self) -> Document {
        let token = mongodb::bson::serialize_to_bson(&self.token).unwrap_or(Bson::Null);
        let mut stored = doc! { "token": token, "time": self.time };
        if let Some(event) = &self.event {
            stored.insert("event", event.clone());
        }
        stored
    }

    /// As stored by [`Position::to_document`], or what is wrong with it.
    pub(crate) fn from_document(document: &Document) -> Result<Self, String> {
        let token = document
            .get("token")
            .cloned()
            .ok_or("its resume token is missing")?;
        let token: ResumeToken = mongodb::bson::deserialize_from_bson(token)
            .map_err(|_| "its resume token is malformed")?;
        let time = document
            .get_timestamp("time")
            .map_err(|_| "its cluster time is not a timestamp")?;
        Ok(Self {
            token,
            time,
            event: document.get("event").cloned(),
        })
    }

    /// The wall-clock time of its cluster time (whole seconds).
    pub(crate) fn wall_time(&self) -> SystemTime {
        wall_time(self.time)
    }
}

/// The wall-clock time of the cluster time `time` (its seconds).
pub(crate) fn wall_time(time: Timestamp) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(u64::from(time.time))
}

/// The cluster time `token` stands for: MongoDB's KeyString form (`82` and
/// eight big-endian bytes), or the test server's (`quirks`).
fn token_time(token: &ResumeToken) -> Option<Timestamp> {
    let data = token_bytes(token)?;
    if let Some(time) = crate::quirks::token_time(&data) {
        return Some(time);
    }
    let (&kind, rest) = data.split_first()?;
    if kind != KEYSTRING_TIMESTAMP {
        return None;
    }
    let whole = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    Some(Timestamp {
        time: (whole >> 32) as u32,
        increment: whole as u32,
    })
}

/// The KeyString type byte of a timestamp (`CType::kTimestamp`).
const KEYSTRING_TIMESTAMP: u8 = 0x82;

/// The bytes of a token's hex `_data` string.
fn token_bytes(token: &ResumeToken) -> Option<Vec<u8>> {
    let document = match mongodb::bson::serialize_to_bson(token).ok()? {
        Bson::Document(document) => document,
        _ => return None,
    };
    let hex = document.get_str("_data").ok()?;
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// A recorded event as its insert shows in the log: the fields the fold
/// and the reads use (any type: what they cannot count is reported there).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct Logged {
    /// The event key.
    #[serde(rename = "_id")]
    pub(crate) key: Bson,
    /// The counter key.
    #[serde(rename = "k", default)]
    pub(crate) counter: Option<Bson>,
    /// The amount.
    #[serde(rename = "n", default)]
    pub(crate) amount: Option<Bson>,
    /// The event's number on its recorder's lane (the server's time).
    #[serde(rename = "s", default)]
    pub(crate) number: Option<Bson>,
}

impl Logged {
    /// The counter key (`null` when the event has none).
    pub(crate) fn counter(&self) -> Bson {
        self.counter.clone().unwrap_or(Bson::Null)
    }
}

/// One insert of the log: where it stands, and the event.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Inserted {
    /// Its position (its own token and cluster time).
    pub(crate) at: Position,
    /// The event inserted.
    pub(crate) event: Logged,
}

impl Inserted {
    /// Which insert it is, whatever stream shows it: its cluster time and
    /// the event key (a key is inserted once at a time; a stream's tokens
    /// may differ between server versions).
    pub(crate) fn identity(&self) -> (Timestamp, &Bson) {
        (self.at.time, &self.event.key)
    }
}

/// A change event as the stream's pipeline leaves it.
#[derive(Debug, Deserialize)]
struct Change {
    #[serde(rename = "_id")]
    token: ResumeToken,
    #[serde(rename = "operationType")]
    operation: String,
    #[serde(rename = "clusterTime", default)]
    time: Option<Timestamp>,
    #[serde(rename = "fullDocument", default)]
    document: Option<Logged>,
}

/// What one read of a stream gave.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per insert read, moved once
pub(crate) enum Step {
    /// The next insert.
    Inserted(Inserted),
    /// A `getMore` that returned nothing (the stream's position may have
    /// moved: [`Reader::position`]).
    Nothing,
}

/// Which inserts a reader sees: all of them, or those of some counters.
#[derive(Debug, Clone)]
pub(crate) enum Scope {
    /// Every insert (the fold).
    All,
    /// The inserts whose event matches `counters`, a filter on the event's
    /// fields (`k` and its dotted paths), applied by the server — and the
    /// inserts of the events `events`, whatever their counters (the insert
    /// the stream resumes after, which the server must find again; where a
    /// pass in progress ends).
    Matching {
        counters: Document,
        events: Vec<Bson>,
    },
}

/// A change stream on the events collection, from a position.
pub(crate) struct Reader {
    stream: ChangeStream<Change>,
    events: String,
    /// Reads made so far (the first answers from the opening reply).
    reads: u64,
    /// The last read found nothing: the token before it, and whether it
    /// was a `getMore` (not the opening reply).
    nothing_after: Option<(Option<ResumeToken>, bool)>,
}

/// A moment a reader must reach: every insert that committed at or before
/// it has been read once the reader is there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Moment {
    /// Its cluster time.
    time: Timestamp,
    /// On the test server, its place in the oplog (`quirks`).
    place: Option<i64>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("events", &self.events)
            .finish_non_exhaustive()
    }
}

impl Reader {
    /// Opens the stream of `events`' inserts after `from` (`None`: from now),
    /// each `getMore` waiting at most `wait` for more.
    pub(crate) async fn open(
        store: &Store,
        events: &str,
        from: Option<&Position>,
        scope: &Scope,
        wait: Duration,
    ) -> Result<Self, Error> {
        let collection = store.collection(events);
        let pipeline = pipeline(scope);
        let token = from.map(|from| from.token.clone());
        let opening = collection
            .watch()
            .pipeline(pipeline)
            .max_await_time(wait)
            .resume_after(token);
        let stream = store
            .attempt(opening)
            .await
            .map_err(|err| failed(events, from, err))?;
        Ok(Self {
            stream: stream.with_type::<Change>(),
            events: events.to_owned(),
            reads: 0,
            nothing_after: None,
        })
    }

    /// The next insert, or [`Step::Nothing`] after a `getMore` that found
    /// none.
    pub(crate) async fn next(&mut self, store: &Store) -> Result<Step, Error> {
        let before = self.stream.resume_token();
        let asked = self.reads > 0;
        self.reads += 1;
        self.nothing_after = None;
        let read = store.attempt(self.stream.next_if_any()).await;
        let change = match read {
            Ok(Some(change)) => change,
            Ok(None) if self.stream.is_alive() => {
                self.nothing_after = Some((before, asked));
                return Ok(Step::Nothing);
            }
            Ok(None) => return Err(self.ended("its change stream was closed by the server")),
            Err(err) => return Err(failed(&self.events, None, err)),
        };
        if change.operation != "insert" {
            return Err(self.ended(&format!(
                "the events collection had a {} (at cluster time {}): the events recorded before \
                 it are not in the collection any more",
                change.operation,
                change.time.map_or(0, |t| t.time)
            )));
        }
        let (Some(time), Some(event)) = (change.time, change.document) else {
            return Err(self.ended("an insert's change event lacks its time or its document"));
        };
        Ok(Step::Inserted(Inserted {
            at: Position {
                token: change.token,
                time,
                event: Some(event.key.clone()),
            },
            event,
        }))
    }

    /// Where the stream stands: after the last insert it returned, or at
    /// the high-water mark of its last `getMore`.
    pub(crate) fn position(&self) -> Result<Position, Error> {
        let token = self
            .stream
            .resume_token()
            .ok_or_else(|| self.ended("the change stream gave no resume token"))?;
        Position::of(token, &self.events)
    }

    /// The moment `time` as this reader can tell it has reached it: its
    /// cluster time — and on the test server, whose tokens' times do not
    /// say where a stream stands (`quirks`), the place in the oplog of a
    /// new stream opened now, after `time`.
    pub(crate) async fn moment(&mut self, store: &Store, time: Timestamp) -> Result<Moment, Error> {
        let mut moment = Moment { time, place: None };
        let test_server = token_bytes(&self.position()?.token)
            .is_some_and(|data| crate::quirks::token_place(&data).is_some());
        if test_server {
            let now = Self::open(store, &self.events, None, &Scope::All, AT_ONCE).await?;
            moment.place = token_bytes(&now.position()?.token)
                .and_then(|data| crate::quirks::token_place(&data));
        }
        Ok(moment)
    }

    /// Whether the stream has read every insert that committed at or before
    /// `moment`: its position's time is past it (a high-water mark at a
    /// time sorts before the inserts of that time: the server's
    /// `docs/change_streams.md`), or, on the test server, its place in the
    /// oplog is as far as the moment's.
    pub(crate) fn reached(&self, moment: &Moment) -> Result<bool, Error> {
        let now = self.position()?;
        let Some(target) = moment.place else {
            return Ok(now.time > moment.time);
        };
        let after = token_bytes(&now.token);
        let place = after
            .as_deref()
            .and_then(crate::quirks::token_place)
            .is_some_and(|place| place >= target);
        let at_end = match (&self.nothing_after, after) {
            (Some((Some(before), true)), Some(after)) => {
                token_bytes(before).is_some_and(|before| crate::quirks::at_end(&before, &after))
            }
            _ => false,
        };
        Ok(place || at_end)
    }

    /// Every insert up to the moment `time`: read until the stream has
    /// reached it ([`Reader::reached`]); an insert of a later cluster time
    /// ends the read (it and what follows are not returned). Gives up at
    /// `deadline` with a transient error (try again).
    pub(crate) async fn read_until(
        &mut self,
        store: &Store,
        time: Timestamp,
        deadline: Instant,
    ) -> Result<Vec<Inserted>, Error> {
        let moment = self.moment(store, time).await?;
        let mut read = Vec::new();
        loop {
            if self.reached(&moment)? {
                return Ok(read);
            }
            match self.next(store).await? {
                Step::Inserted(inserted) if inserted.at.time > time => return Ok(read),
                Step::Inserted(inserted) => read.push(inserted),
                Step::Nothing if Instant::now() >= deadline => return Err(too_slow()),
                Step::Nothing => {}
            }
        }
    }

    fn ended(&self, why: &str) -> Error {
        Error::FoldStopped {
            events: self.events.clone(),
            why: format!(
                "{why}; fold again from a time you choose with `tallyd fold-from` (the book: \
                 \"when the fold stops\")"
            ),
        }
    }
}

/// How long a stream opened only for its position waits.
const AT_ONCE: Duration = Duration::from_millis(1);

/// The error of a read of the log that did not reach its moment in time.
pub(crate) fn too_slow() -> Error {
    Error::Server(Failure::once(
        "ledger.log.read",
        mongodb::error::Error::from(std::io::ErrorKind::TimedOut),
    ))
}

/// The changes that end the log: the collection (or its database) dropped
/// or renamed, the stream invalidated.
const ENDS: [&str; 4] = ["drop", "rename", "dropDatabase", "invalidate"];

/// The stream's pipeline: inserts (and the changes that end the log), with
/// the event's fields the fold and the reads use.
fn pipeline(scope: &Scope) -> Vec<Document> {
    let full = |name: &str| format!("fullDocument.{name}");
    let mut wanted = vec![doc! { "operationType": { "$in": ENDS } }];
    match scope {
        Scope::All => wanted.push(doc! { "operationType": "insert" }),
        Scope::Matching { counters, events } => {
            let mut inserts = doc! { "operationType": "insert" };
            for (path, condition) in counters {
                inserts.insert(full(path), condition.clone());
            }
            wanted.push(inserts);
            if !events.is_empty() {
                let events = events.clone();
                wanted.push(doc! { "operationType": "insert", full("_id"): { "$in": events } });
            }
        }
    }
    let mut project = doc! { "_id": 1, "operationType": 1, "clusterTime": 1, full("_id"): 1 };
    for name in [field::COUNTER, field::AMOUNT, field::NUMBER] {
        project.insert(full(name), 1);
    }
    vec![
        doc! { "$match": { "$or": wanted } },
        doc! { "$project": project },
    ]
}

/// The error of a stream that failed: its history lost, or the server's.
fn failed(events: &str, from: Option<&Position>, err: mongodb::error::Error) -> Error {
    let code = server_code(&err);
    if code == Some(code::CHANGE_STREAM_HISTORY_LOST) || code == Some(code::CAPPED_POSITION_LOST) {
        return Error::HistoryLost {
            events: events.to_owned(),
            since: from.map(Position::wall_time),
        };
    }
    let failure = Failure::once("ledger.log", err);
    if code == Some(code::UNAUTHORIZED) {
        return Error::LogRefused {
            events: events.to_owned(),
            cause: failure,
        };
    }
    Error::Server(failure)
}

/// The deployment's oplog: when its oldest entry was written, by the
/// server's clock (`None` when the user may see neither `serverStatus`'s
/// oplog section nor `local.oplog.rs`). Its window is the time from there
/// to now: how long a fold may stand still and still resume.
#[cfg(feature = "daemon")]
pub(crate) async fn oplog_start(store: &Store) -> Result<Option<SystemTime>, Error> {
    let status = store
        .attempt(
            store
                .client()
                .database("admin")
                .run_command(doc! { "serverStatus": 1, "oplog": 1 }),
        )
        .await;
    if let Ok(status) = status
        && let Ok(oplog) = status.get_document("oplog")
        && let Ok(earliest) = oplog.get_timestamp("earliestOptime")
    {
        return Ok(Some(wall_time(earliest)));
    }
    Ok(oplog_first(store).await?.map(wall_time))
}

/// The cluster time of the oplog's oldest entry, from `local.oplog.rs`
/// (`None` when the user may not read it).
async fn oplog_first(store: &Store) -> Result<Option<Timestamp>, Error> {
    let oplog = store
        .client()
        .database("local")
        .collection::<Document>("oplog.rs");
    let first = store
        .attempt(
            oplog
                .find_one(doc! {})
                .sort(doc! { "$natural": 1 })
                .projection(doc! { "ts": 1 }),
        )
        .await;
    match first {
        Ok(first) => Ok(first.and_then(|entry| entry.get_timestamp("ts").ok())),
        Err(err) if server_code(&err) == Some(code::UNAUTHORIZED) => Ok(None),
        Err(err) => Err(Error::Server(Failure::once("ledger.oplog_start", err))),
    }
}

/// Fails with [`Error::HistoryLost`] when a stream read from `from` may
/// have missed inserts the oplog dropped before the stream read them.
///
/// MongoDB fails such a stream's `getMore` itself (`CappedPositionLost`,
/// `ChangeStreamHistoryLost`), so on MongoDB there is nothing to check. The
/// test server reads on from the oldest entry it kept (`quirks`): for a
/// stream of its log, the oplog must still hold `from`, checked after the
/// reads — the oplog only ever drops from its start, so what it holds now
/// it held while they ran.
pub(crate) async fn check_history_kept(
    store: &Store,
    events: &str,
    from: &Position,
) -> Result<(), Error> {
    let test_server =
        token_bytes(&from.token).is_some_and(|data| crate::quirks::skips_dropped_history(&data));
    if !test_server {
        return Ok(());
    }
    match oplog_first(store).await? {
        Some(first) if first > from.time => Err(Error::HistoryLost {
            events: events.to_owned(),
            since: Some(from.wall_time()),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(data: &str) -> ResumeToken {
        mongodb::bson::deserialize_from_bson(Bson::Document(doc! { "_data": data })).unwrap()
    }

    #[test]
    fn a_mongodb_resume_token_gives_its_cluster_time() {
        // A token as MongoDB 6.0 writes it: 0x82, then 0x64A1B2C3 seconds
        // and increment 1, then the rest of the KeyString.
        let time = token_time(&token("8264A1B2C3000000012B022C0100296E5A1004")).unwrap();
        assert_eq!(
            time,
            Timestamp {
                time: 0x64A1_B2C3,
                increment: 1
            }
        );
        assert_eq!(token_time(&token("82")), None, "too short");
        assert_eq!(token_time(&token("zz")), None, "not hex");
        assert_eq!(
            token_time(&token("1864A1B2C300000001")),
            None,
            "another type"
        );
    }

    #[test]
    fn a_position_reads_back_as_stored() {
        let at = Position::of(token("8264A1B2C3000000022B"), "views_events").unwrap();
        assert_eq!(at.time.increment, 2);
        assert_eq!(Position::from_document(&at.to_document()), Ok(at.clone()));
        assert!(Position::from_document(&doc! { "time": at.time }).is_err());
        let unreadable = Position::of(token("00"), "views_events").unwrap_err();
        assert!(
            unreadable.to_string().contains("cluster time"),
            "{unreadable}"
        );
    }

    #[test]
    fn the_pipeline_keeps_inserts_of_the_scope_and_the_ends_of_the_log() {
        let scoped = pipeline(&Scope::Matching {
            counters: doc! { "k": "home" },
            events: vec![Bson::from("evt_9")],
        });
        let filter = scoped[0].get_document("$match").unwrap();
        let wanted = filter.get_array("$or").unwrap();
        let insert = wanted[1].as_document().unwrap();
        assert_eq!(insert.get_str("fullDocument.k").unwrap(), "home");
        let end = wanted[2].as_document().unwrap();
        let ids = end.get_document("fullDocument._id").unwrap();
        assert_eq!(ids.get_array("$in").unwrap(), &vec![Bson::from("evt_9")]);
        assert_eq!(
            pipeline(&Scope::All)[1]
                .get_document("$project")
                .unwrap()
                .len(),
            7
        );
    }
}
