//! The state document as stored: read into its parts (refusing, never
//! guessing, what is malformed) and each part's document form. The field
//! names are the parent module's.

use std::time::SystemTime;

use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

use super::{CatchUp, Earlier, FoldState, Held, LastInsert, Pass, Stopped, Window, field};
use crate::document::{bson_type_name, integer_value};
use crate::ledger::log::Position;

/// The state document read into its parts, or what is wrong with it.
pub(super) fn parse(document: &Document) -> Result<FoldState, String> {
    let number = |name: &str| match document.get(name) {
        None => Ok(0),
        Some(value) => integer_value(value)
            .ok_or_else(|| format!("its {name} is a {}, not an integer", bson_type_name(value))),
    };
    let mut state = FoldState {
        pass: number(field::PASS)?,
        version: number(field::VERSION)?,
        ..FoldState::default()
    };
    state.earlier = earlier(document)?;
    if let Some(position) = document.get(field::POSITION) {
        state.position = Some(position_of(position, "position")?);
    }
    state.catch_up_started = document.get_document(field::CATCH_UP_STARTED).ok().cloned();
    if let Some(catch_up) = document.get(field::CATCH_UP) {
        let Bson::Document(catch_up) = catch_up else {
            return Err("its catch-up is not a document".into());
        };
        state.catch_up = Some(parse_catch_up(catch_up)?);
    }
    // An earlier version's pass in progress is read as `earlier`'s.
    if let (Some(intent), None) = (document.get(field::INTENT), &state.earlier) {
        let Bson::Document(intent) = intent else {
            return Err("its pass in progress is not a document".into());
        };
        state.intent = Some(parse_pass(intent)?);
    }
    if let Some(held) = document.get(field::HELD) {
        let Bson::Array(held) = held else {
            return Err("its held sums are not an array".into());
        };
        for entry in held {
            let Bson::Document(entry) = entry else {
                return Err("a held sum is not a document".into());
            };
            state.held.push(parse_held(entry)?);
        }
    }
    if let Some(stopped) = document.get(field::STOPPED) {
        let Bson::Document(stopped) = stopped else {
            return Err("its stop is not a document".into());
        };
        state.stopped = Some(Stopped {
            why: stopped.get_str("why").unwrap_or_default().to_owned(),
            since: stopped
                .get_datetime("at")
                .map_or(SystemTime::UNIX_EPOCH, |d| d.to_system_time()),
        });
    }
    Ok(state)
}

/// What an earlier version left in the document, if anything.
fn earlier(document: &Document) -> Result<Option<Earlier>, String> {
    if let Some(folded) = document.get(field::EARLIER_LANES) {
        let Bson::Document(folded) = folded else {
            return Err("its folded map (tally 0.2.0) is not a document".into());
        };
        let in_progress = document
            .get_document(field::INTENT)
            .is_ok_and(|intent| intent.contains_key("ranges"));
        let mut lanes = Vec::with_capacity(folded.len());
        for (lane, value) in folded {
            let lane = ObjectId::parse_str(lane).map_err(|_| format!("{lane} is not a lane"))?;
            let number = integer_value(value).ok_or("a folded number is not an integer")?;
            lanes.push((lane, number));
        }
        return Ok(Some(Earlier::Lanes { lanes, in_progress }));
    }
    if let Some(watermark) = document.get(field::EARLIER_WATERMARK) {
        let watermark = integer_value(watermark)
            .ok_or("its watermark W (an earlier version's) is not an integer")?;
        let debts = document
            .get_array(field::EARLIER_DEBTS)
            .is_ok_and(|late| !late.is_empty());
        let in_progress = document.contains_key(field::INTENT) || debts;
        return Ok(Some(Earlier::Watermark {
            watermark,
            in_progress,
        }));
    }
    Ok(None)
}

fn position_of(value: &Bson, name: &str) -> Result<Position, String> {
    match value {
        Bson::Document(document) => {
            Position::from_document(document).map_err(|why| format!("its {name}: {why}"))
        }
        _ => Err(format!("its {name} is not a document")),
    }
}

fn optional_number(document: &Document, name: &str) -> Result<Option<i64>, String> {
    match document.get(name) {
        None | Some(Bson::Null) => Ok(None),
        Some(value) => integer_value(value)
            .map(Some)
            .ok_or_else(|| format!("its {name} is not an integer")),
    }
}

fn parse_catch_up(catch_up: &Document) -> Result<CatchUp, String> {
    Ok(CatchUp {
        boundary: position_of(
            catch_up.get("to").ok_or("its catch-up has no boundary")?,
            "catch-up's boundary",
        )?,
        since: optional_number(catch_up, "since")?,
        done: optional_number(catch_up, "done")?,
        // Written before the field was: a first fold's or an upgrade's.
        unnumbered: match catch_up.get("unnumbered") {
            None => true,
            Some(Bson::Boolean(unnumbered)) => *unnumbered,
            Some(_) => return Err("its catch-up's unnumbered is not a boolean".into()),
        },
        dropped: match catch_up.get("dropped") {
            None | Some(Bson::Null) => Vec::new(),
            Some(Bson::Array(passes)) => passes
                .iter()
                .map(|pass| {
                    integer_value(pass).ok_or("its catch-up's dropped passes are not integers")
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err("its catch-up's dropped passes are not an array".into()),
        },
    })
}

fn parse_pass(intent: &Document) -> Result<Pass, String> {
    let bad = |what: &str| format!("its pass in progress: its {what} is malformed");
    let window = if let Ok(log) = intent.get_document("log") {
        let to = match log.get("to") {
            None | Some(Bson::Null) => None,
            Some(Bson::Document(to)) => Some(LastInsert {
                at: Position::from_document(to).map_err(|why| bad(&format!("end ({why})")))?,
                key: to.get("key").cloned().ok_or_else(|| bad("end's event"))?,
            }),
            Some(_) => return Err(bad("end")),
        };
        Window::Log {
            from: position_of(log.get("from").ok_or_else(|| bad("start"))?, "pass's start")?,
            to,
        }
    } else if let Ok(chunk) = intent.get_document("chunk") {
        Window::Chunk {
            after: optional_number(chunk, "after")?,
            upto: chunk
                .get("upto")
                .and_then(integer_value)
                .ok_or_else(|| bad("chunk's end"))?,
        }
    } else {
        return Err(bad("window"));
    };
    Ok(Pass {
        number: intent
            .get("pass")
            .and_then(integer_value)
            .ok_or_else(|| bad("number"))?,
        owner: intent.get_object_id("owner").map_err(|_| bad("owner"))?,
        deadline: intent
            .get_datetime("deadline")
            .map_err(|_| bad("deadline"))?
            .to_system_time(),
        recovered: intent.get_bool("recovered").unwrap_or(false),
        window,
    })
}

fn parse_held(entry: &Document) -> Result<Held, String> {
    let bad = |what: &str| format!("a held sum's {what} is malformed");
    let amount = match entry.get("n") {
        Some(Bson::String(text)) => text.parse::<i128>().map_err(|_| bad("sum"))?,
        Some(value) => i128::from(integer_value(value).ok_or_else(|| bad("sum"))?),
        None => return Err(bad("sum")),
    };
    Ok(Held {
        key: entry.get("k").cloned().ok_or_else(|| bad("counter key"))?,
        pass: entry
            .get("p")
            .and_then(integer_value)
            .ok_or_else(|| bad("pass"))?,
        amount,
        events: entry
            .get("e")
            .and_then(integer_value)
            .and_then(|e| u64::try_from(e).ok())
            .unwrap_or(0),
        maybe_applied: entry.get_bool("a").unwrap_or(true),
        cause: entry.get_str("why").unwrap_or_default().to_owned(),
        since: entry
            .get_datetime("at")
            .map_or(SystemTime::UNIX_EPOCH, |d| d.to_system_time()),
    })
}

impl Held {
    /// The held sum as stored.
    pub(crate) fn to_document(&self) -> Document {
        let amount = match i64::try_from(self.amount) {
            Ok(n) => Bson::Int64(n),
            Err(_) => Bson::String(self.amount.to_string()),
        };
        let mut entry = Document::new();
        entry.insert("k", self.key.clone());
        entry.insert("p", self.pass);
        entry.insert("n", amount);
        entry.insert("e", i64::try_from(self.events).unwrap_or(i64::MAX));
        entry.insert("a", self.maybe_applied);
        entry.insert("why", self.cause.clone());
        entry.insert("at", DateTime::from_system_time(self.since));
        entry
    }
}

impl Pass {
    /// The pass as stored.
    pub(super) fn to_document(&self) -> Document {
        let window = match &self.window {
            Window::Log { from, to } => {
                let to = to.as_ref().map_or(Bson::Null, |to| {
                    let mut end = to.at.to_document();
                    end.insert("key", to.key.clone());
                    Bson::Document(end)
                });
                ("log", doc! { "from": from.to_document(), "to": to })
            }
            Window::Chunk { after, upto } => (
                "chunk",
                doc! { "after": after.map_or(Bson::Null, Bson::Int64), "upto": upto },
            ),
        };
        let mut pass = doc! {
            "pass": self.number,
            "owner": self.owner,
            "deadline": DateTime::from_system_time(self.deadline),
            "recovered": self.recovered,
        };
        pass.insert(window.0, window.1);
        pass
    }
}

impl CatchUp {
    /// The catch-up as stored.
    pub(super) fn to_document(&self) -> Document {
        let number = |n: Option<i64>| n.map_or(Bson::Null, Bson::Int64);
        doc! {
            "to": self.boundary.to_document(),
            "since": number(self.since),
            "done": number(self.done),
            "unnumbered": self.unnumbered,
            "dropped": self.dropped.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::state::STATE_ID;
    use mongodb::bson::Timestamp;
    use mongodb::change_stream::event::ResumeToken;

    fn position(increment: u32) -> Position {
        let token: ResumeToken = mongodb::bson::deserialize_from_bson(Bson::Document(
            doc! { "_data": format!("8264A1B2C3{increment:08X}2B") },
        ))
        .unwrap();
        Position {
            token,
            time: Timestamp {
                time: 0x64A1_B2C3,
                increment,
            },
            event: None,
        }
    }

    fn pass(window: Window) -> Pass {
        Pass {
            number: 4,
            owner: ObjectId::new(),
            deadline: DateTime::from_millis(1_700_000_000_000).to_system_time(),
            recovered: true,
            window,
        }
    }

    #[test]
    fn a_state_document_reads_back_what_the_fold_writes() {
        let log = pass(Window::Log {
            from: position(1),
            to: Some(LastInsert {
                at: position(9),
                key: Bson::from("evt_9"),
            }),
        });
        let held = Held {
            key: Bson::Document(doc! { "u": 5 }),
            pass: 3,
            amount: i128::from(i64::MAX) + 1,
            events: 2,
            maybe_applied: false,
            cause: "refused".into(),
            since: DateTime::from_millis(1_700_000_000_000).to_system_time(),
        };
        let catch_up = CatchUp {
            boundary: position(3),
            since: None,
            done: Some(17),
            unnumbered: false,
            dropped: vec![15, 16],
        };
        let document = doc! {
            "_id": STATE_ID, "pass": 3i64, "v": 7i64,
            "position": position(1).to_document(),
            "catch_up": catch_up.to_document(),
            "intent": log.to_document(),
            "held": [held.to_document()],
        };
        let state = parse(&document).unwrap();
        assert_eq!((state.pass, state.version), (3, 7));
        assert_eq!(state.position, Some(position(1)));
        assert_eq!(state.intent, Some(log));
        assert_eq!(state.catch_up, Some(catch_up));
        assert_eq!(state.held, vec![held]);
        assert_eq!(state.earlier, None);
        let chunk = pass(Window::Chunk {
            after: None,
            upto: i64::MAX,
        });
        let state = parse(&doc! { "intent": chunk.to_document() }).unwrap();
        assert_eq!(state.intent, Some(chunk));
        let idle = pass(Window::Log {
            from: position(2),
            to: None,
        });
        assert_eq!(
            parse(&doc! { "intent": idle.to_document() })
                .unwrap()
                .intent,
            Some(idle)
        );
    }

    #[test]
    fn what_earlier_versions_left_is_recognised() {
        let lane = ObjectId::new();
        let state = parse(&doc! { "pass": 2i64, "folded": { lane.to_hex(): 10i64 } }).unwrap();
        assert_eq!(
            state.earlier,
            Some(Earlier::Lanes {
                lanes: vec![(lane, 10)],
                in_progress: false
            })
        );
        let busy = parse(&doc! { "folded": {}, "intent": { "pass": 3i64, "ranges": {} } }).unwrap();
        assert!(matches!(
            busy.earlier,
            Some(Earlier::Lanes {
                in_progress: true,
                ..
            })
        ));
        let watermark = parse(&doc! { "W": 40i64, "pass": 5i64 }).unwrap();
        assert_eq!(
            watermark.earlier,
            Some(Earlier::Watermark {
                watermark: 40,
                in_progress: false
            })
        );
        let owing = parse(&doc! { "W": 40i64, "late": [{ "after": Timestamp { time: 1, increment: 1 }, "below": 3i64 }] }).unwrap();
        assert!(matches!(
            owing.earlier,
            Some(Earlier::Watermark {
                in_progress: true,
                ..
            })
        ));
        let passing =
            parse(&doc! { "W": 40i64, "intent": { "pass": 6i64, "from": 40i64 } }).unwrap();
        assert!(
            passing.intent.is_none(),
            "an earlier version's pass is not read as ours"
        );
    }

    #[test]
    fn a_malformed_state_is_refused_never_guessed() {
        assert!(parse(&doc! { "pass": "x" }).is_err());
        assert!(parse(&doc! { "W": "x" }).is_err());
        assert!(parse(&doc! { "folded": { "nota lane": 1 } }).is_err());
        assert!(parse(&doc! { "intent": { "pass": 1 } }).is_err());
        assert!(parse(&doc! { "held": [{ "k": "a" }] }).is_err());
        assert!(parse(&doc! { "position": { "time": 1 } }).is_err());
        assert!(parse(&doc! { "catch_up": { "since": 1 } }).is_err());
    }
}
