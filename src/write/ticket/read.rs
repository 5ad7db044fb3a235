//! Reading a ticket back and checking it — `tallyd resume` and `tallyd
//! complete` (the `daemon` feature): the shape says the protocol, the check
//! says whether the collection, key and amount the command was given are
//! the ones it was printed for, and whether a resume may settle it.

use std::str::FromStr;

use mongodb::bson::{Bson, oid::ObjectId};

use super::{ALPHABET, CHECK_LEN, Names, Settles, Ticket, check};
use crate::error::Error;
use crate::token::Token;
use crate::write::counter::Protocol;

impl Ticket {
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

/// A key as a refusal shows it: a string as it is, another value as
/// extended JSON.
fn shown_key(key: &Bson) -> String {
    match key {
        Bson::String(key) => key.clone(),
        other => other.clone().into_relaxed_extjson().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::write::ticket::tests::{fixed_id, names};

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
