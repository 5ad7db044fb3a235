//! The pruning of a lane map (the book: design/lanes.md), in plain Rust: which entries
//! go at a cutoff, or why the map must be left alone.
//!
//! At lane cutoff L (the server's time minus `lane_ttl`), for a map
//! `{<lane>: s, ...}`:
//!
//! 1. **Minted lanes expire.** An entry whose key is a minted lane (24 hex
//!    digits: an ObjectId) that was last written before L is removed: its
//!    value is the time of that write in microseconds (at or above 10^15;
//!    below, a count of tally 0.1's lane pool or a fold's batch number,
//!    whose time is the lane's creation, in its id). Its writer stopped
//!    sending and resuming that update well before
//!    (`lane_resume_horizon`), and a lane that writes the counter again
//!    refreshes its entry.
//! 2. **Named lanes stay.** Any other key is a lane a caller named for an
//!    ordered source; it has no age and is never removed.
//! 3. **No empty map.** A map left empty (or found empty) is removed.
//! 4. The counter is never touched by pruning.
//!
//! A map that is not a document, or holds a value that is not a
//! non-negative int32 or int64, is malformed: the whole document is left
//! alone (the same rule as a malformed `pending`).

use std::collections::BTreeMap;

use mongodb::bson::{Bson, oid::ObjectId};

use super::Malformed;
use crate::document::bson_type_name;
use crate::write::lane::{LaneId, written_before};

/// What pruning one document's lane map does.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LanePlan {
    /// The lanes field exists.
    pub(crate) has_lanes: bool,
    /// Entries in the map, as read.
    pub(crate) entries: u64,
    /// The expired minted entries, key and value as read: every one is
    /// removed, each only while it still holds that value.
    pub(crate) expired: Vec<(String, Bson)>,
    /// The named lanes and the position each holds.
    pub(crate) named: BTreeMap<String, i64>,
}

impl LanePlan {
    /// Whether pruning changes the document: an expired entry, or an empty
    /// map to remove.
    pub(crate) fn has_work(&self) -> bool {
        !self.expired.is_empty() || (self.has_lanes && self.entries == 0)
    }

    /// Entries that stay.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> u64 {
        self.entries - self.expired.len() as u64
    }
}

/// Plans the pruning of the lane map `lanes` (`None`: absent) at `cutoff`:
/// a minted lane's entry last written before the cutoff's second is
/// expired.
pub(crate) fn plan_lanes(lanes: Option<&Bson>, cutoff: ObjectId) -> Result<LanePlan, Malformed> {
    let Some(field) = lanes else {
        return Ok(LanePlan::default());
    };
    let Bson::Document(map) = field else {
        return Err(Malformed::LanesNotDocument(bson_type_name(field)));
    };
    let mut plan = LanePlan {
        has_lanes: true,
        entries: map.len() as u64,
        ..LanePlan::default()
    };
    for (key, value) in map {
        let position = match value {
            Bson::Int32(s) => i64::from(*s),
            Bson::Int64(s) => *s,
            other => {
                return Err(Malformed::BadLane {
                    lane: key.clone(),
                    why: bson_type_name(other),
                });
            }
        };
        if position < 0 {
            return Err(Malformed::BadLane {
                lane: key.clone(),
                why: "negative number",
            });
        }
        match key.parse::<LaneId>() {
            Ok(LaneId::Minted(id)) => {
                if written_before(id, position, cutoff) {
                    plan.expired.push((key.clone(), value.clone()));
                }
            }
            // Any other key — a valid name or not — is no minted lane, and
            // only minted lanes have an age.
            _ => {
                plan.named.insert(key.clone(), position);
            }
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mongodb::bson::{Document, doc};
    use proptest::prelude::*;

    const CUTOFF_SECS: u32 = 1_690_000_000;

    fn cutoff() -> ObjectId {
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&CUTOFF_SECS.to_be_bytes());
        ObjectId::from_bytes(bytes)
    }

    /// A minted lane created `offset` seconds after the cutoff second.
    fn minted(offset: i32, rest: [u8; 8]) -> String {
        let secs = CUTOFF_SECS.checked_add_signed(offset).unwrap();
        let mut bytes = [0u8; 12];
        bytes[..4].copy_from_slice(&secs.to_be_bytes());
        bytes[4..].copy_from_slice(&rest);
        ObjectId::from_bytes(bytes).to_hex()
    }

    fn prune(map: Document) -> Result<LanePlan, Malformed> {
        plan_lanes(Some(&Bson::Document(map)), cutoff())
    }

    /// What a map holds after its plan is applied.
    fn apply(map: &Document, plan: &LanePlan) -> Option<Document> {
        let mut rest = map.clone();
        for (key, _) in &plan.expired {
            rest.remove(key);
        }
        (!rest.is_empty()).then_some(rest)
    }

    #[test]
    fn expired_minted_lanes_go_named_and_young_ones_stay() {
        let (old, young) = (minted(-3600, [1; 8]), minted(5, [2; 8]));
        let map = doc! { &old: 4i64, &young: 1, "orders:3": 17i64, "x": 0 };
        let plan = prune(map.clone()).unwrap();
        assert_eq!(plan.expired, vec![(old, Bson::Int64(4))]);
        assert_eq!((plan.entries, plan.kept()), (4, 3));
        assert_eq!(
            plan.named,
            BTreeMap::from([("orders:3".to_owned(), 17), ("x".to_owned(), 0)])
        );
        assert!(plan.has_work());
    }

    /// An entry holding a time is judged by that time, not by its lane's
    /// age: a lane made long ago that wrote the counter a second ago stays.
    #[test]
    fn an_entry_holding_a_time_expires_by_that_time() {
        let old_lane = minted(-86_400, [1; 8]);
        let at = |offset: i64| (i64::from(CUTOFF_SECS) + offset) * 1_000_000;
        let map = doc! { &old_lane: at(1), minted(-5, [2; 8]): at(-1), minted(-5, [3; 8]): 9i64 };
        let plan = prune(map).unwrap();
        let expired: Vec<&str> = plan.expired.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(expired, [minted(-5, [2; 8]), minted(-5, [3; 8])]);
        assert_eq!(plan.kept(), 1);
    }

    #[test]
    fn an_empty_map_is_work_and_no_map_is_none() {
        assert!(prune(doc! {}).unwrap().has_work());
        assert!(!plan_lanes(None, cutoff()).unwrap().has_work());
        assert!(!prune(doc! { minted(1, [0; 8]): 1 }).unwrap().has_work());
    }

    /// An upper-case minted id is still a minted lane (the writer refuses
    /// it as a name), so it expires like any other.
    #[test]
    fn a_minted_key_in_upper_case_is_minted() {
        let old = minted(-10, [0xab; 8]).to_uppercase();
        assert_eq!(prune(doc! { &old: 1 }).unwrap().expired.len(), 1);
    }

    #[test]
    fn every_malformed_lane_map() {
        let old = minted(-10, [0; 8]);
        let cases = [
            (
                Bson::Array(vec![]),
                "the lanes field is a array, not a document",
            ),
            (Bson::Int64(3), "the lanes field is a long, not a document"),
            (Bson::Document(doc! { &old: 1.0 }), "a double"),
            (Bson::Document(doc! { "orders:1": "7" }), "a string"),
            (
                Bson::Document(doc! { "orders:1": -1i64 }),
                "a negative number",
            ),
            (Bson::Document(doc! { &old: -2 }), "a negative number"),
            (Bson::Document(doc! { "a": Bson::Null }), "a null"),
            (Bson::Document(doc! { "a": { "s": 1 } }), "a object"),
        ];
        for (map, said) in cases {
            let shown = plan_lanes(Some(&map), cutoff()).unwrap_err().to_string();
            assert!(shown.contains(said), "{map:?}: {shown}");
        }
    }

    /// Keys and values of a well-formed map: minted lanes around the
    /// cutoff and named lanes, with positions of either integer width —
    /// counts, and times around the cutoff.
    fn entry() -> impl Strategy<Value = (String, Bson)> {
        let cutoff_micros = i64::from(CUTOFF_SECS) * 1_000_000;
        let position = prop_oneof![
            (0i32..i32::MAX).prop_map(Bson::Int32),
            (0i64..i64::MAX).prop_map(Bson::Int64),
            (-5_000_000i64..5_000_000).prop_map(move |o| Bson::Int64(cutoff_micros + o)),
        ];
        let key = prop_oneof![
            (-5i32..5, any::<[u8; 8]>()).prop_map(|(o, r)| minted(o, r)),
            (-100_000i32..100_000, any::<[u8; 8]>()).prop_map(|(o, r)| minted(o, r)),
            "[a-z]{1,8}:[0-9]{1,3}",
        ];
        (key, position)
    }

    fn map_of(entries: &[(String, Bson)]) -> Document {
        entries.iter().cloned().collect()
    }

    /// Whether a minted lane's entry was last written before the cutoff:
    /// by its time (a value from 10^15 on), else by the lane's id.
    fn is_old_minted(key: &str, value: &Bson) -> bool {
        let position = match value {
            Bson::Int32(n) => i64::from(*n),
            Bson::Int64(n) => *n,
            _ => return false,
        };
        let Ok(LaneId::Minted(id)) = key.parse::<LaneId>() else {
            return false;
        };
        if position >= 1_000_000_000_000_000 {
            position < i64::from(CUTOFF_SECS) * 1_000_000
        } else {
            id < cutoff()
        }
    }

    proptest! {
        /// Pruning removes exactly the minted lanes' entries last written
        /// before the cutoff second: never a named lane, never a young
        /// entry, and every value that stays is unchanged.
        #[test]
        fn pruning_removes_exactly_the_expired_minted_lanes(
            entries in proptest::collection::vec(entry(), 0..20),
        ) {
            let map = map_of(&entries);
            let plan = prune(map.clone()).unwrap();
            let after = apply(&map, &plan).unwrap_or_default();
            for (key, value) in &map {
                if is_old_minted(key, value) {
                    prop_assert!(!after.contains_key(key), "{} kept", key);
                } else {
                    prop_assert_eq!(after.get(key), Some(value), "{} removed", key);
                }
            }
            prop_assert_eq!(plan.kept(), after.len() as u64);
        }

        /// Pruning is idempotent: the map it leaves has nothing to prune
        /// (and is absent rather than empty).
        #[test]
        fn pruning_twice_prunes_once(
            entries in proptest::collection::vec(entry(), 0..20),
        ) {
            let map = map_of(&entries);
            let once = apply(&map, &prune(map.clone()).unwrap());
            let again = plan_lanes(once.clone().map(Bson::Document).as_ref(), cutoff()).unwrap();
            prop_assert!(!again.has_work());
            prop_assert_eq!(apply(&once.clone().unwrap_or_default(), &again), once);
        }

        /// Pruning never changes the counter: a document's plan with lanes
        /// counts exactly what the plan without them counts.
        #[test]
        fn pruning_never_changes_the_counter(
            entries in proptest::collection::vec(entry(), 0..20),
            counter in prop_oneof![
                Just(None),
                any::<i32>().prop_map(|c| Some(Bson::Int32(c))),
                any::<i64>().prop_map(|c| Some(Bson::Int64(c))),
            ],
        ) {
            let lanes = Bson::Document(map_of(&entries));
            let cutoffs = super::super::Cutoffs { tokens: cutoff(), lanes: cutoff() };
            let with = super::super::plan_document(counter.as_ref(), None, None, Some(&lanes), cutoffs).unwrap();
            let without = super::super::plan(counter.as_ref(), None, None, cutoff()).unwrap();
            prop_assert_eq!(&with.counter, &without.counter);
            prop_assert_eq!(with.stale_amount, 0);
            prop_assert!(!with.writes_counter(counter.as_ref()) || counter.is_none());
        }
    }
}
