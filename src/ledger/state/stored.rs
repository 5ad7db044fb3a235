//! The state document as stored: read into its parts (refusing, never
//! guessing, what is malformed) and each part's document form. The field
//! paths are the parent module's.

use std::time::SystemTime;

use mongodb::bson::{Bson, DateTime, Document, doc, oid::ObjectId};

use super::{FoldState, Held, Intent, Late, Legacy, field};
use crate::document::{bson_type_name, integer_value};
use crate::ledger::floor::Raise;

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
        watermark: number(field::WATERMARK)?,
        ..FoldState::default()
    };
    if let Some(folded) = document.get(field::LEGACY_FOLDED) {
        let Bson::Document(folded) = folded else {
            return Err("its folded map (tally 0.2.0) is not a document".into());
        };
        let mut legacy = Legacy::default();
        for (lane, value) in folded {
            let lane = ObjectId::parse_str(lane).map_err(|_| format!("{lane} is not a lane"))?;
            let number = integer_value(value).ok_or("a folded number is not an integer")?;
            legacy.folded.push((lane, number));
        }
        state.legacy = Some(legacy);
    }
    if let Some(intent) = document.get(field::INTENT) {
        let Bson::Document(intent) = intent else {
            return Err("its intent is not a document".into());
        };
        if intent.contains_key("ranges") {
            return Err(
                "its intent is a pass of tally 0.2.0 (lane ranges): finish it with tally 0.2.0's \
                 `tallyd reconcile` before upgrading"
                    .into(),
            );
        }
        state.intent = Some(parse_intent(intent)?);
    }
    if let Some(floor) = document.get(field::FLOOR) {
        let Bson::Document(floor) = floor else {
            return Err("its floor is not a document".into());
        };
        state.floor = Some(Raise::from_document(floor).map_err(|why| format!("{why} (floor)"))?);
    }
    state.late = parse_late(document.get(field::LATE))?;
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
    Ok(state)
}

fn parse_late(late: Option<&Bson>) -> Result<Vec<Late>, String> {
    let Some(late) = late else {
        return Ok(Vec::new());
    };
    let Bson::Array(late) = late else {
        return Err("its debts (late) are not an array".into());
    };
    late.iter()
        .map(|entry| match entry {
            Bson::Document(entry) => Late::from_document(entry),
            _ => Err("a debt is not a document".into()),
        })
        .collect()
}

fn parse_raise(intent: &Document, name: &str) -> Result<Option<Raise>, String> {
    match intent.get(name) {
        None => Ok(None),
        Some(Bson::Document(raise)) => Raise::from_document(raise)
            .map(Some)
            .map_err(|why| format!("its intent's {name}: {why}")),
        Some(_) => Err(format!("its intent's {name} is not a document")),
    }
}

fn parse_intent(intent: &Document) -> Result<Intent, String> {
    let bad = |what: &str| format!("its intent's {what} is malformed");
    let number = |name: &str| {
        intent
            .get(name)
            .and_then(integer_value)
            .ok_or_else(|| bad(name))
    };
    Ok(Intent {
        pass: number("pass")?,
        from: number("from")?,
        to: number("to")?,
        owner: intent.get_object_id("owner").map_err(|_| bad("owner"))?,
        deadline: intent
            .get_datetime("deadline")
            .map_err(|_| bad("deadline"))?
            .to_system_time(),
        recovered: intent.get_bool("recovered").unwrap_or(false),
        anchor: parse_raise(intent, "anchor")?,
        live: parse_raise(intent, "live")?,
        late: parse_late(intent.get("late"))?,
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

impl Intent {
    /// The intent as stored.
    pub(crate) fn to_document(&self) -> Document {
        let mut intent = doc! {
            "pass": self.pass,
            "from": self.from,
            "to": self.to,
            "owner": self.owner,
            "deadline": DateTime::from_system_time(self.deadline),
            "recovered": self.recovered,
        };
        if let Some(anchor) = &self.anchor {
            intent.insert("anchor", anchor.to_document());
        }
        if let Some(live) = &self.live {
            intent.insert("live", live.to_document());
        }
        if !self.late.is_empty() {
            let late: Vec<Document> = self.late.iter().map(Late::to_document).collect();
            intent.insert("late", late);
        }
        intent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::state::STATE_ID;
    use mongodb::bson::Timestamp;
    use mongodb::bson::doc;

    #[test]
    fn a_state_document_reads_back_what_the_fold_writes() {
        let intent = Intent {
            pass: 4,
            from: 10,
            to: 20,
            owner: ObjectId::new(),
            deadline: DateTime::from_millis(1_700_000_000_000).to_system_time(),
            recovered: true,
            anchor: Some(Raise {
                floor: 20,
                token: "a".into(),
                at: Timestamp {
                    time: 9,
                    increment: 1,
                },
            }),
            live: None,
            late: vec![Late {
                after: Timestamp {
                    time: 3,
                    increment: 4,
                },
                below: 10,
            }],
        };
        let held = Held {
            key: Bson::Document(doc! { "u": 5 }),
            pass: 3,
            amount: i128::from(i64::MAX) + 1,
            events: 2,
            maybe_applied: false,
            cause: "refused".into(),
            since: DateTime::from_millis(1_700_000_000_000).to_system_time(),
        };
        let document = doc! {
            "_id": STATE_ID, "pass": 3i64, "v": 7i64, "W": 10i64,
            "intent": intent.to_document(),
            "held": [held.to_document()],
        };
        let state = parse(&document).unwrap();
        assert_eq!((state.pass, state.version, state.watermark), (3, 7, 10));
        assert_eq!(state.intent, Some(intent.clone()));
        assert_eq!(state.held, vec![held]);
        assert_eq!(state.legacy, None);
        let late = &intent.late[0];
        assert!(late.owes(
            10,
            Timestamp {
                time: 3,
                increment: 5
            }
        ));
        assert!(!late.owes(
            11,
            Timestamp {
                time: 4,
                increment: 0
            }
        ));
        assert!(!late.owes(10, late.after));
        assert!(intent.folds(11) && intent.folds(20));
        assert!(!intent.folds(10) && !intent.folds(21));
    }

    #[test]
    fn a_state_of_tally_0_2_0_is_recognised() {
        let lane = ObjectId::new();
        let state = parse(&doc! { "pass": 2i64, "folded": { lane.to_hex(): 10i64 } }).unwrap();
        assert_eq!(state.legacy.unwrap().folded, vec![(lane, 10)]);
        let unfinished = doc! { "intent": { "pass": 3i64, "ranges": {} } };
        let refused = parse(&unfinished).unwrap_err();
        assert!(refused.contains("0.2.0"), "{refused}");
    }

    #[test]
    fn a_malformed_state_is_refused_never_guessed() {
        assert!(parse(&doc! { "pass": "x" }).is_err());
        assert!(parse(&doc! { "W": "x" }).is_err());
        assert!(parse(&doc! { "folded": { "nota lane": 1 } }).is_err());
        assert!(parse(&doc! { "intent": { "pass": 1 } }).is_err());
        assert!(parse(&doc! { "held": [{ "k": "a" }] }).is_err());
    }
}
