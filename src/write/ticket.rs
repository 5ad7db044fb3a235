//! The tickets `tallyd` prints for an increment that is not settled yet,
//! takes back in `resume` and `complete`, and an application prints with
//! [`Counters::ticket`] and [`Counters::lane_ticket`].
//!
//! A ticket names what it settles: besides the token (two-step) or the lane
//! and its number (lanes), it carries a short check over the collection,
//! the counter key, the amount and the id. `resume` and `complete` compute
//! the check again from what they are given (`--collection`, the key,
//! `--by`) and refuse a ticket whose check differs — a key pasted wrong, a
//! forgotten `--by`, another collection — before anything is read or
//! written: a resume re-sends step 1 (or the lane's update), and on the
//! wrong key it would count there.
//!
//! A two-step ticket's check also says which command may settle it
//! ([`Settles`]): only an *unknown* increment's ticket is resumable. A
//! resume re-sends step 1 when the document shows neither the token nor
//! its marker, which for an unknown token proves its step 1 never landed —
//! but a counted token (its step 2 applied; an increment writes no marker
//! when its step 1 was sent once) and a pending one (whose step 2 may have
//! applied unseen) show the same, and a resume would count them again. So
//! their tickets settle with `complete` only (harmless for any token: step
//! 2, while the token is pending). A lane's ticket is always resumable: the
//! lane's number applies once.
//!
//! ```text
//! 65f1a2b3c4d5e6f708192a3b-7kq2mz              a two-step token
//! 65f1a2b3c4d5e6f708192a3b.1-xq80ab            a lane at its number
//! ```
//!
//! The check is 30 bits in Crockford's base32 (case-insensitive): not a
//! secret, a guard against a slip, which it misses about once in a billion.

use std::fmt;
use std::str::FromStr;

use mongodb::bson::{Bson, doc, oid::ObjectId};

use super::counter::{Counters, Protocol, UnknownToken};
use super::lane::{LaneId, LaneTicket};
use crate::error::Error;
use crate::token::Token;

/// Characters of the check: Crockford's base32 (no i, l, o, u), lower case.
const ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";
/// Characters in a check: 30 bits.
const CHECK_LEN: usize = 6;

/// A ticket as printed or typed: an id, a lane's number for the lanes
/// protocol, and the check (absent when a bare token was typed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    /// The token (two-step) or the lane (lanes).
    id: ObjectId,
    /// The lane's number; `None` for a two-step token.
    position: Option<i64>,
    /// The check as typed; `None` for a bare id.
    check: Option<[u8; CHECK_LEN]>,
}

/// Which command may settle a two-step ticket, as its increment's outcome
/// decides (a lane's ticket is always [`Settles::Resume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settles {
    /// An unknown increment's: `resume`, or `complete`.
    Resume,
    /// A pending, counted or not-counted increment's: `complete` only.
    Complete,
}

impl Settles {
    /// The tag the check covers.
    fn tag(self) -> &'static [u8] {
        match self {
            Self::Resume => b"resume",
            Self::Complete => b"complete",
        }
    }
}

/// What a ticket settles, as the command is told it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Names<'a> {
    pub(crate) collection: &'a str,
    pub(crate) key: &'a Bson,
    pub(crate) amount: i64,
}

impl Ticket {
    /// The ticket of an increment: `id` (and `position`, for a lane) with
    /// the check of `names`, settled by the commands `settles` says.
    pub(crate) fn issue(
        id: ObjectId,
        position: Option<i64>,
        names: Names<'_>,
        settles: Settles,
    ) -> Self {
        let settles = if position.is_some() {
            Settles::Resume
        } else {
            settles
        };
        Self {
            id,
            position,
            check: Some(check(id, position, names, settles)),
        }
    }

    /// The token (two-step), or the minted lane's id (lanes).
    pub(crate) fn token(&self) -> Token {
        Token::from_object_id(self.id)
    }

    /// The lane's number; `None` for a two-step token.
    pub(crate) fn position(&self) -> Option<i64> {
        self.position
    }

    /// The protocol the ticket's shape says: a number means a lane.
    pub(crate) fn protocol(&self) -> Protocol {
        match self.position {
            Some(_) => Protocol::Lanes,
            None => Protocol::TwoStep,
        }
    }

    /// Whether the ticket carries a check.
    pub(crate) fn is_checked(&self) -> bool {
        self.check.is_some()
    }

    /// For `resume`: refuses a ticket whose check does not match `names`
    /// — it was printed for another collection, key or amount (or
    /// mistyped) — or that is a pending or counted increment's. A bare id
    /// has nothing to compare and passes.
    pub(crate) fn verify_resume(&self, names: Names<'_>) -> Result<(), Error> {
        if self.matches(names, Settles::Resume) {
            Ok(())
        } else if self.matches(names, Settles::Complete) {
            Err(Error::InvalidArgument(format!(
                "ticket {self} is the ticket of a pending or counted increment, which a resume \
                 could count twice (it re-sends step 1 for a token the document does not show): \
                 settle it with `tallyd complete`, which counts the token only while it is \
                 pending; nothing was written"
            )))
        } else {
            Err(self.not_printed_for(names))
        }
    }

    /// For `complete`: refuses a ticket whose check does not match `names`
    /// (every two-step ticket may be completed). A bare id passes.
    pub(crate) fn verify_complete(&self, names: Names<'_>) -> Result<(), Error> {
        if self.matches(names, Settles::Complete) || self.matches(names, Settles::Resume) {
            Ok(())
        } else {
            Err(self.not_printed_for(names))
        }
    }

    /// Whether the ticket is bare, or its check is the one of `names` and
    /// `settles`.
    fn matches(&self, names: Names<'_>, settles: Settles) -> bool {
        self.check
            .is_none_or(|typed| typed == check(self.id, self.position, names, settles))
    }

    fn not_printed_for(&self, names: Names<'_>) -> Error {
        Error::InvalidArgument(format!(
            "ticket {self} was not printed for {}/{} {:+}: give the key, --by and --collection \
             of the command the increment printed; nothing was written",
            names.collection,
            shown_key(names.key),
            names.amount
        ))
    }
}

impl fmt::Display for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.id.to_hex())?;
        if let Some(position) = self.position {
            write!(f, ".{position}")?;
        }
        if let Some(check) = self.check {
            f.write_str("-")?;
            for c in check {
                write!(f, "{}", char::from(c))?;
            }
        }
        Ok(())
    }
}

/// Why a typed ticket does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` is not a ticket: give it as tallyd printed it — 24 hex digits (the token, or the \
     lane), for a lane `.` and its number, then `-` and the 6-character check"
)]
pub(crate) struct BadTicket(String);

impl FromStr for Ticket {
    type Err = BadTicket;

    fn from_str(typed: &str) -> Result<Self, Self::Err> {
        let bad = || BadTicket(typed.to_owned());
        // A paste may carry the line's spaces along.
        let text = typed.trim();
        let (head, check) = match text.rsplit_once('-') {
            Some((head, check)) => {
                let check: [u8; CHECK_LEN] = check
                    .to_ascii_lowercase()
                    .into_bytes()
                    .try_into()
                    .map_err(|_| bad())?;
                if !check.iter().all(|c| ALPHABET.contains(c)) {
                    return Err(bad());
                }
                (head, Some(check))
            }
            None => (text, None),
        };
        let (id, position) = match head.split_once('.') {
            Some((id, position)) => {
                let digits = !position.is_empty() && position.bytes().all(|b| b.is_ascii_digit());
                let position = position.parse::<i64>().ok().filter(|_| digits);
                (id, Some(position.ok_or_else(bad)?))
            }
            None => (head, None),
        };
        if id.len() != 24 {
            return Err(bad());
        }
        let id = ObjectId::parse_str(id).map_err(|_| bad())?;
        Ok(Self {
            id,
            position,
            check,
        })
    }
}

impl Counters {
    /// The ticket of an unknown two-step increment, as `tallyd` prints it
    /// (`65f1a2b3c4d5e6f708192a3b-7kq2mz`): log it, and an operator settles
    /// the increment with `tallyd resume KEY TICKET --by AMOUNT --collection
    /// COLLECTION`, the increment's key, amount and this handle's
    /// collection. The ticket carries a check over all of them, so a resume
    /// given another key, amount or collection is refused without writing
    /// anything — it would count the increment there. `tallyd resume`
    /// takes string keys only: a ticket of another key (an integer, an
    /// ObjectId) is resumed through [`Counters::resume`].
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::Increment;
    ///
    /// if let Increment::Unknown(unknown) = views.increment("home", 5).await {
    ///     eprintln!(
    ///         "unknown: run `tallyd resume home {} --by 5 --collection {}`",
    ///         views.ticket(&unknown),
    ///         views.spec().name,
    ///     );
    /// }
    /// # }
    /// ```
    pub fn ticket(&self, unknown: &UnknownToken) -> String {
        let id = unknown.token().object_id();
        let amount = unknown.amount();
        self.issue_ticket(unknown.key(), id, None, amount, Settles::Resume)
            .to_string()
    }

    /// The ticket of an unknown increment through a minted lane, as `tallyd`
    /// prints it (`65f1a2b3c4d5e6f708192a3b.1732650000123456-xq80ab`: the
    /// lane, its number, the check): an operator settles the update with
    /// `tallyd resume KEY TICKET --by AMOUNT --collection COLLECTION`, where
    /// AMOUNT is the update's, [`LaneTicket::amount`] — with group commit
    /// the sum of every caller's share, since resuming the ticket re-sends
    /// the whole update. A resume given another key, amount or collection
    /// is refused without writing anything. `None` for a named lane
    /// ([`Counters::add_from`]): `tallyd` does not resume one — the source
    /// delivers the message again, or [`Counters::resume_lane`] sends it.
    /// As for [`Counters::ticket`], `tallyd` takes string keys only.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::LaneIncrement;
    ///
    /// if let LaneIncrement::Unknown(unknown) = views.add("home", 5).await
    ///     && let Some(ticket) = views.lane_ticket(&unknown)
    /// {
    ///     eprintln!(
    ///         "unknown: run `tallyd resume home {ticket} --by {} --collection {}`",
    ///         unknown.amount(),
    ///         views.spec().name,
    ///     );
    /// }
    /// # }
    /// ```
    pub fn lane_ticket(&self, ticket: &LaneTicket) -> Option<String> {
        let LaneId::Minted(lane) = ticket.lane() else {
            return None;
        };
        let (position, amount) = (Some(ticket.position()), ticket.amount());
        let issued = self.issue_ticket(ticket.key(), *lane, position, amount, Settles::Resume);
        Some(issued.to_string())
    }

    /// The ticket of an increment of `amount` to `key` in this handle's
    /// collection: the token `id` (two-step), settled as `settles` says, or
    /// the minted lane `id` at `position`.
    pub(crate) fn issue_ticket(
        &self,
        key: &Bson,
        id: ObjectId,
        position: Option<i64>,
        amount: i64,
        settles: Settles,
    ) -> Ticket {
        let names = Names {
            collection: &self.spec.name,
            key,
            amount,
        };
        Ticket::issue(id, position, names, settles)
    }
}

/// A key as a refusal shows it: a string as it is, another value as
/// extended JSON.
fn shown_key(key: &Bson) -> String {
    match key {
        Bson::String(key) => key.clone(),
        other => other.clone().into_relaxed_extjson().to_string(),
    }
}

/// FNV-1a, 64 bits, fed field by field.
struct Fnv(u64);

impl Fnv {
    /// Feeds one field, after its length: no two lists of fields feed the
    /// same bytes.
    fn field(&mut self, bytes: &[u8]) {
        let length = (bytes.len() as u64).to_le_bytes();
        for byte in length.iter().chain(bytes) {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The check of a ticket: 30 bits of a hash over everything the ticket
/// settles, and which command settles it, in base32. The hash is FNV-1a, finished with MurmurHash3's
/// 64-bit mix: FNV's multiplication carries a byte's change only towards
/// the higher bits, so without the mix the check's low bits would depend
/// on the low bits of each byte alone (its first character on their lowest
/// five), and a slip in the high bits of a character would be caught by
/// fewer than 30 bits.
fn check(
    id: ObjectId,
    position: Option<i64>,
    names: Names<'_>,
    settles: Settles,
) -> [u8; CHECK_LEN] {
    let mut hash = Fnv(0xcbf2_9ce4_8422_2325);
    hash.field(names.collection.as_bytes());
    // A string key is itself; another value is its BSON, tagged apart, so
    // the integer 42 and the string "42" (another document) differ.
    match names.key {
        Bson::String(key) => {
            hash.field(b"s");
            hash.field(key.as_bytes());
        }
        other => {
            let bytes = doc! { "": other.clone() }
                .to_vec()
                .unwrap_or_else(|_| other.to_string().into_bytes());
            hash.field(b"b");
            hash.field(&bytes);
        }
    }
    hash.field(&names.amount.to_le_bytes());
    hash.field(&id.bytes());
    match position {
        Some(position) => hash.field(&position.to_le_bytes()),
        None => hash.field(&[]),
    }
    hash.field(settles.tag());
    let mixed = mix(hash.0);
    let mut out = [0u8; CHECK_LEN];
    for (i, slot) in out.iter_mut().enumerate() {
        // The top 30 bits, five at a time.
        *slot = ALPHABET[((mixed >> (59 - 5 * i)) & 31) as usize];
    }
    out
}

/// MurmurHash3's 64-bit finaliser: every output bit depends on every input
/// bit.
fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(key: &Bson, amount: i64) -> Names<'_> {
        Names {
            collection: "views",
            key,
            amount,
        }
    }

    fn fixed_id() -> ObjectId {
        ObjectId::from_bytes(*b"tally ticket")
    }

    #[test]
    fn a_printed_ticket_reads_back_and_verifies() {
        let id = ObjectId::new();
        let home = Bson::from("home");
        for position in [None, Some(1), Some(1_732_650_000_123_456)] {
            let ticket = Ticket::issue(id, position, names(&home, 5), Settles::Resume);
            let shown = ticket.to_string();
            let read: Ticket = shown.parse().unwrap();
            assert_eq!(read, ticket, "{shown}");
            assert!(read.is_checked());
            assert_eq!(read.token().object_id(), id);
            assert_eq!(read.position(), position);
            read.verify_resume(names(&home, 5)).unwrap();
            read.verify_complete(names(&home, 5)).unwrap();
            let protocol = if position.is_some() {
                Protocol::Lanes
            } else {
                Protocol::TwoStep
            };
            assert_eq!(read.protocol(), protocol);
            // Upper case, as a terminal font may suggest, and the spaces
            // of a paste read the same.
            assert_eq!(shown.to_uppercase().parse::<Ticket>().unwrap(), ticket);
            assert_eq!(format!(" {shown}\n").parse::<Ticket>().unwrap(), ticket);
        }
    }

    #[test]
    fn a_ticket_pasted_with_another_key_amount_or_collection_is_refused() {
        let (home, k1) = (Bson::from("home"), Bson::from("k1"));
        for settles in [Settles::Resume, Settles::Complete] {
            let ticket = Ticket::issue(ObjectId::new(), None, names(&home, 5), settles);
            for wrong in [names(&k1, 5), names(&home, 1), names(&home, -5)] {
                assert!(ticket.verify_resume(wrong).is_err(), "{settles:?}");
                let refused = ticket.verify_complete(wrong).unwrap_err().to_string();
                assert!(refused.contains("was not printed for"), "{refused}");
            }
        }
        let ticket = Ticket::issue(ObjectId::new(), None, names(&home, 5), Settles::Resume);
        let other = Names {
            collection: "page_veiws",
            ..names(&home, 5)
        };
        let refused = ticket.verify_resume(other).unwrap_err().to_string();
        assert!(refused.contains("page_veiws/home +5"), "{refused}");
        assert!(refused.contains("nothing was written"), "{refused}");
        // A lane's number, and whether there is one, are covered too.
        let lane = Ticket::issue(ObjectId::new(), Some(7), names(&home, 5), Settles::Resume);
        let moved = Ticket {
            position: Some(8),
            ..lane
        };
        assert!(moved.verify_resume(names(&home, 5)).is_err());
        let unnumbered = Ticket {
            position: None,
            ..lane
        };
        assert!(unnumbered.verify_resume(names(&home, 5)).is_err());
    }

    /// A pending or counted increment's ticket completes, and is refused by
    /// a resume — which could count it twice — with the command to use.
    #[test]
    fn only_an_unknown_increments_ticket_resumes() {
        let home = Bson::from("home");
        let ticket = Ticket::issue(ObjectId::new(), None, names(&home, 5), Settles::Complete);
        ticket.verify_complete(names(&home, 5)).unwrap();
        let refused = ticket
            .verify_resume(names(&home, 5))
            .unwrap_err()
            .to_string();
        assert!(refused.contains("pending or counted"), "{refused}");
        assert!(refused.contains("tallyd complete"), "{refused}");
        assert!(refused.contains("nothing was written"), "{refused}");
        // A lane's ticket resumes whatever its outcome was.
        let lane = Ticket::issue(ObjectId::new(), Some(1), names(&home, 5), Settles::Complete);
        lane.verify_resume(names(&home, 5)).unwrap();
    }

    #[test]
    fn a_string_key_and_another_value_of_the_same_text_differ() {
        let (text, number) = (Bson::from("42"), Bson::Int64(42));
        let ticket = Ticket::issue(fixed_id(), None, names(&number, 1), Settles::Resume);
        assert!(ticket.verify_resume(names(&text, 1)).is_err());
        ticket.verify_resume(names(&number, 1)).unwrap();
        let refused = Ticket::issue(fixed_id(), None, names(&text, 1), Settles::Resume)
            .verify_resume(names(&number, 1))
            .unwrap_err()
            .to_string();
        assert!(refused.contains("views/42 +1"), "{refused}");
    }

    /// Every bit of the check flips for about half of the one-bit changes
    /// to a key. Without the final mix, the check's first character would
    /// never change when a key's character changed only above its lowest
    /// five bits — `1` for `q`, `a` for `A` — and the check's lowest bit
    /// would flip for one change in seven.
    #[test]
    fn every_bit_of_the_check_follows_every_bit_of_the_key() {
        let value = |check: [u8; CHECK_LEN]| {
            check.iter().fold(0u32, |acc, c| {
                let digit = ALPHABET.iter().position(|a| a == c).unwrap() as u32;
                (acc << 5) | digit
            })
        };
        let mut flips = [0u32; 30];
        let mut changes = 0u32;
        for n in 0..300 {
            let key = format!("user:{n:04}");
            let base = value(check(
                fixed_id(),
                None,
                names(&Bson::from(key.as_str()), 1),
                Settles::Resume,
            ));
            for at in 0..key.len() {
                for bit in 0..7 {
                    let mut bytes = key.clone().into_bytes();
                    bytes[at] ^= 1 << bit;
                    let changed = Bson::from(String::from_utf8(bytes).unwrap());
                    let diff =
                        base ^ value(check(fixed_id(), None, names(&changed, 1), Settles::Resume));
                    assert_ne!(diff, 0, "{key} at {at}, bit {bit}: the same check");
                    changes += 1;
                    for (i, flipped) in flips.iter_mut().enumerate() {
                        *flipped += (diff >> i) & 1;
                    }
                }
            }
        }
        for (i, flipped) in flips.iter().enumerate() {
            let share = f64::from(*flipped) / f64::from(changes);
            assert!((0.45..0.55).contains(&share), "bit {i}: {share:.3}");
        }
    }

    #[test]
    fn a_bare_token_parses_without_a_check() {
        let id = ObjectId::new();
        let read: Ticket = id.to_hex().parse().unwrap();
        assert!(!read.is_checked());
        read.verify_resume(names(&Bson::from("anything"), 9))
            .unwrap();
        read.verify_complete(names(&Bson::from("anything"), 9))
            .unwrap();
        assert_eq!(read.to_string(), id.to_hex());
    }

    #[test]
    fn what_is_not_a_ticket_is_refused() {
        let id = ObjectId::new().to_hex();
        for text in [
            String::new(),
            "home".into(),
            id[..23].to_string(),
            format!("{id}-"),
            format!("{id}-abc"),
            format!("{id}-abcdefg"),
            format!("{id}-abcdei"),
            format!("{id}.-abcdef"),
            format!("{id}.x1-abcdef"),
            format!("{id}.-5-abcdef"),
            format!("{id}.+5-abcdef"),
            format!("{id}.99999999999999999999-abcdef"),
            format!("{}g-abcdef", &id[..23]),
        ] {
            let refused = text.parse::<Ticket>().unwrap_err().to_string();
            assert!(refused.contains("as tallyd printed it"), "{refused}");
        }
    }
}
