//! Which lane an increment goes through: a lane a handle minted (a fresh
//! ObjectId, whose time is the lane's creation time) or a lane the caller
//! named for an ordered source (`orders:3`, a source and its partition).

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use mongodb::bson::oid::ObjectId;

/// The longest lane name, in bytes.
const MAX_NAME_BYTES: usize = 128;

/// A caller-chosen lane for an ordered source (a Kafka partition, a change
/// stream, a log file): its positions are the source's own (an offset), so
/// a message the source delivers again is recognised and counted once.
///
/// 1 to 128 bytes, no `.`, not starting with `$`, no NUL (it is a field
/// name in the counter document), and not 24 hex digits — that form is
/// reserved for minted lanes, which the daemon prunes by age; named lanes
/// are never pruned.
///
/// ```
/// use tally::LaneName;
///
/// let lane: LaneName = "orders-3".parse().expect("a lane name");
/// assert_eq!(lane.as_str(), "orders-3");
/// assert!("orders.3".parse::<LaneName>().is_err(), "a dot is refused");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LaneName(String);

impl LaneName {
    /// Checks `name` and wraps it.
    ///
    /// ```
    /// use tally::LaneName;
    ///
    /// let lane = LaneName::new("orders-3").expect("a lane name");
    /// println!("counting through {lane}");
    /// match LaneName::new("$orders") {
    ///     Ok(_) => unreachable!(),
    ///     Err(bad) => eprintln!("{bad}"),
    /// }
    /// ```
    pub fn new(name: impl Into<String>) -> Result<Self, BadLaneName> {
        let name = name.into();
        let reason = if name.is_empty() || name.len() > MAX_NAME_BYTES {
            Some("must be 1 to 128 bytes long")
        } else if name.contains('.') {
            Some("must not contain '.' (it is a field name in the counter document)")
        } else if name.starts_with('$') {
            Some("must not start with '$' (it is a field name in the counter document)")
        } else if name.contains('\0') {
            Some("must not contain NUL")
        } else if is_minted_key(&name) {
            Some("must not be 24 hex digits: that form is reserved for minted lanes")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(BadLaneName { name, reason }),
            None => Ok(Self(name)),
        }
    }

    /// The name, as it stands in the lane map.
    ///
    /// ```
    /// use tally::LaneName;
    ///
    /// let lane = LaneName::new("orders-3").expect("a lane name");
    /// assert_eq!(lane.as_str(), "orders-3");
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LaneName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for LaneName {
    type Err = BadLaneName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// A string that cannot name a lane.
///
/// ```
/// use tally::{BadLaneName, LaneName};
///
/// let bad: BadLaneName = LaneName::new("a".repeat(200)).unwrap_err();
/// assert!(bad.to_string().contains("1 to 128 bytes"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("lane name {name:?} {reason}")]
pub struct BadLaneName {
    name: String,
    reason: &'static str,
}

/// A lane: its key in the counter's lane map.
///
/// ```
/// use tally::{LaneId, LaneName};
///
/// let named = LaneId::Named(LaneName::new("orders-3").expect("a lane name"));
/// assert_eq!(named.key(), "orders-3");
/// // A lane a handle minted is an ObjectId, its key the 24 hex digits.
/// let minted: LaneId = "65f1a2b3c4d5e6f708192a3b".parse().expect("a lane");
/// assert!(matches!(minted, LaneId::Minted(_)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LaneId {
    /// Minted by a [`Counters`](crate::Counters) handle: the key is the
    /// ObjectId's 24 lower-case hex digits, its time the lane's creation
    /// time. Its entry in a counter is pruned by the daemon once the lane
    /// has not written that counter for `lane_ttl`.
    Minted(ObjectId),
    /// Named by the caller for an ordered source; never pruned by age.
    Named(LaneName),
}

impl LaneId {
    /// The lane's key in the lane map.
    ///
    /// ```
    /// use mongodb::bson::oid::ObjectId;
    /// use tally::LaneId;
    ///
    /// let oid = ObjectId::new();
    /// assert_eq!(LaneId::Minted(oid).key(), oid.to_hex());
    /// ```
    pub fn key(&self) -> String {
        match self {
            Self::Minted(oid) => oid.to_hex(),
            Self::Named(name) => name.0.clone(),
        }
    }

    /// A minted lane's age at `now` (from the whole seconds in its id, so
    /// never under-estimated); `None` for a named lane, which has no age.
    ///
    /// ```
    /// use std::time::{Duration, SystemTime};
    /// use mongodb::bson::oid::ObjectId;
    /// use tally::{LaneId, LaneName};
    ///
    /// let minted = LaneId::Minted(ObjectId::new());
    /// let later = SystemTime::now() + Duration::from_secs(60);
    /// assert!(minted.age(later).is_some_and(|age| age >= Duration::from_secs(60)));
    /// let named = LaneId::Named(LaneName::new("orders-3").expect("a lane name"));
    /// assert_eq!(named.age(later), None, "a named lane has no age");
    /// ```
    pub fn age(&self, now: SystemTime) -> Option<Duration> {
        match self {
            Self::Minted(oid) => {
                let created: SystemTime = oid.timestamp().into();
                Some(now.duration_since(created).unwrap_or(Duration::ZERO))
            }
            Self::Named(_) => None,
        }
    }
}

impl fmt::Display for LaneId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Minted(oid) => write!(f, "{}", oid.to_hex()),
            Self::Named(name) => f.write_str(&name.0),
        }
    }
}

impl FromStr for LaneId {
    type Err = BadLaneName;

    /// 24 hex digits are a minted lane; anything else must be a valid
    /// [`LaneName`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if is_minted_key(s) {
            let oid = ObjectId::parse_str(s).map_err(|_| BadLaneName {
                name: s.to_owned(),
                reason: "is not an ObjectId",
            })?;
            return Ok(Self::Minted(oid));
        }
        LaneName::new(s).map(Self::Named)
    }
}

/// Whether `key` has the form of a minted lane's key: 24 hex digits (in
/// either case, so a minted id typed in upper case is not taken for a name).
fn is_minted_key(key: &str) -> bool {
    key.len() == 24 && key.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_names_follow_the_field_name_rules_and_leave_minted_keys_alone() {
        for good in [
            "orders:3",
            "a",
            "kafka/topic-1:0",
            "ünïcode",
            &"x".repeat(128),
        ] {
            assert!(LaneName::new(good).is_ok(), "{good:?}");
        }
        let hex = ObjectId::new().to_hex();
        for bad in [
            "",
            "a.b",
            "$set",
            "nul\0",
            hex.as_str(),
            &hex.to_uppercase(),
            &"x".repeat(129),
        ] {
            assert!(LaneName::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_lane_id_parses_24_hex_digits_as_minted_and_shows_them_lower_case() {
        let oid = ObjectId::new();
        let parsed: LaneId = oid.to_hex().to_uppercase().parse().unwrap();
        assert_eq!(parsed, LaneId::Minted(oid));
        assert_eq!(parsed.key(), oid.to_hex());
        let named: LaneId = "orders:3".parse().unwrap();
        assert_eq!(named.key(), "orders:3");
        assert_eq!(named.age(SystemTime::now()), None);
        assert!("a.b".parse::<LaneId>().is_err());
    }

    #[test]
    fn a_minted_lanes_age_comes_from_its_id() {
        let oid = ObjectId::new();
        let created: SystemTime = oid.timestamp().into();
        let lane = LaneId::Minted(oid);
        let later = created + Duration::from_secs(90);
        assert_eq!(lane.age(later), Some(Duration::from_secs(90)));
        assert_eq!(
            lane.age(created - Duration::from_secs(5)),
            Some(Duration::ZERO)
        );
    }
}
