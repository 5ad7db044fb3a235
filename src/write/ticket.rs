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
//! The library prints tickets; reading and checking them is the command
//! line's (the `daemon` feature).

use std::fmt;

use mongodb::bson::{Bson, doc, oid::ObjectId};

use super::counter::{Counters, UnknownToken};
use super::lane::{LaneId, LaneTicket};

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
    #[cfg(feature = "daemon")]
    Complete,
}

impl Settles {
    /// The tag the check covers.
    fn tag(self) -> &'static [u8] {
        match self {
            Self::Resume => b"resume",
            #[cfg(feature = "daemon")]
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
}

/// Reading a ticket back, and checking it: `tallyd resume` and `complete`.
#[cfg(feature = "daemon")]
mod read;

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

    /// What a command is told, in collection `views`.
    pub(super) fn names(key: &Bson, amount: i64) -> Names<'_> {
        Names {
            collection: "views",
            key,
            amount,
        }
    }

    /// The same id in every run.
    pub(super) fn fixed_id() -> ObjectId {
        ObjectId::from_bytes(*b"tally ticket")
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
}
