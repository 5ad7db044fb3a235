//! Settling a ticket: `complete` (step 2 of a pending token) and `resume`
//! (an unknown one), both counting at most once however often, wherever
//! they run — through the settle markers (see the module docs of
//! [`super`]) — and the lookup of a token in its counter document.

use mongodb::bson::{Bson, Document, doc};
use std::time::SystemTime;

use super::outcome::{Completion, Counted, Increment, PendingToken, UnknownToken};
use super::step::By;
use super::{Added, Counters};
use crate::error::Error;
use crate::token::{Entry, Token};
use crate::write::at::by_id;

/// How often `resume` reads the document again after its step 1 found it
/// changed (a duplicate key: a marker appeared, or a race created it).
const RESUME_ROUNDS: u32 = 3;

/// What the counter document says about one token.
#[derive(Debug)]
pub(crate) enum Found {
    /// A settle counted it: its marker, as a counted increment.
    Settled(Counted),
    /// Step 1 applied and nothing counted it yet: the entry as stored.
    Pending(PendingToken),
    /// Neither, or there is no such document.
    Absent,
}

impl Counters {
    /// Runs step 2 only for a pending token, leaving its settle marker:
    /// safe at any age, and counts it exactly once however often it is
    /// settled, by this process or any other. When step 2 fails, the
    /// document is read again: a token another settle or the fold counted
    /// meanwhile is counted (settled earlier), not pending.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) {
    /// use tally::{Completion, Increment};
    ///
    /// if let Increment::Pending(pending) = views.increment("home", 1).await {
    ///     match views.complete(pending).await {
    ///         Completion::Counted(counted) => assert_eq!(counted.amount(), 1),
    ///         // Still not confirmed: try again later, or leave it to the daemon.
    ///         Completion::Pending(pending) => eprintln!("still pending: {}", pending.token()),
    ///     }
    /// }
    /// # }
    /// ```
    pub async fn complete(&self, pending: PendingToken) -> Completion {
        let counted = |pending: PendingToken, settled_earlier| Counted {
            key: pending.key,
            entry: pending.entry,
            settled_earlier,
        };
        let cause = match self
            .count_token(&pending.key, &pending.entry, By::Settle)
            .await
        {
            Ok(settled_earlier) => return Completion::Counted(counted(pending, settled_earlier)),
            Err(cause) => cause,
        };
        match self.lookup(pending.key.clone(), pending.token()).await {
            Ok(Found::Settled(counted)) if counted.amount() == pending.amount() => {
                Completion::Counted(counted)
            }
            // Step 1 applied, so a token gone was counted, as step 2 itself
            // concludes when it matches nothing.
            Ok(Found::Absent) => Completion::Counted(counted(pending, true)),
            _ => Completion::Pending(PendingToken {
                cause: Some(cause),
                ..pending
            }),
        }
    }

    /// Settles an unknown token. Reads the counter document first:
    ///
    /// - a marker for the token (a settle counted it): counted, settled
    ///   earlier — nothing is written;
    /// - the token pending: step 2 only, leaving the marker;
    /// - neither — so the lost attempt provably did not apply, as the daemon
    ///   never folds a token this young: step 1 (applying only while there
    ///   is no marker) and step 2 again, but only while the token is younger
    ///   than the retry horizon.
    ///
    /// `Err` means the ticket is finished without writing anything:
    /// [`Error::RetryHorizonExceeded`] (counted at most once), or
    /// [`Error::AmountMismatch`] (the document holds the token, or its
    /// marker, with another amount). Every other outcome is in the
    /// [`Increment`], with the ticket when it is still unsettled — a failed
    /// read is [`Increment::Unknown`]: nothing was written, resume again
    /// later. A resume is never [`Increment::NotCounted`]: when the server
    /// refuses its step 1, the document is read again and settled from
    /// what it shows, else the ticket comes back unknown (resume again
    /// later) — another host, or the original step 1 held up in the
    /// network, may still add or count it.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
    /// use tally::Increment;
    ///
    /// if let Increment::Unknown(unknown) = views.increment("home", 1).await {
    ///     match views.resume(unknown).await? {
    ///         Increment::Counted(counted) => println!("counted ({})", counted.token()),
    ///         Increment::Pending(pending) => { let _ = views.complete(pending).await; }
    ///         // Still unknown: nothing was learned; resume again later.
    ///         Increment::Unknown(unknown) => {
    ///             eprintln!("resume later: {}", views.ticket(&unknown))
    ///         }
    ///         Increment::NotCounted(_) => unreachable!("a resume is never not counted"),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn resume(&self, unknown: UnknownToken) -> Result<Increment, Error> {
        let mut unknown = unknown;
        for _ in 0..RESUME_ROUNDS {
            let found = match self.lookup(unknown.key.clone(), unknown.token()).await {
                Ok(found) => found,
                Err(cause) => return Ok(Increment::Unknown(unknown.because(cause))),
            };
            if let Some(settled) = self.settle_found(&unknown, found).await {
                return settled;
            }
            let age = unknown.token().age(SystemTime::now());
            if age >= self.retry_horizon {
                return Err(Error::RetryHorizonExceeded {
                    token: unknown.token().to_string(),
                    age,
                    horizon: self.retry_horizon,
                });
            }
            let UnknownToken { key, entry, .. } = unknown;
            match self.add_token(&key, &entry, By::Settle).await {
                Added::Yes { .. } => {
                    let pending = PendingToken {
                        key,
                        entry,
                        cause: None,
                    };
                    return Ok(self.complete(pending).await.into());
                }
                // The token turned older than the horizon while step 1 was
                // being sent: refused, as above.
                Added::No(cause @ Error::RetryHorizonExceeded { .. }) => return Err(cause),
                Added::No(cause) => {
                    let unknown = UnknownToken {
                        key,
                        entry,
                        cause: Some(cause),
                    };
                    let found = self.lookup(unknown.key.clone(), unknown.token()).await;
                    return match found {
                        Ok(found) => match self.settle_found(&unknown, found).await {
                            Some(settled) => settled,
                            None => Ok(Increment::Unknown(unknown)),
                        },
                        Err(_) => Ok(Increment::Unknown(unknown)),
                    };
                }
                Added::Unknown(cause) => {
                    return Ok(Increment::Unknown(UnknownToken {
                        key,
                        entry,
                        cause: Some(cause),
                    }));
                }
                Added::Changed(cause) => {
                    unknown = UnknownToken {
                        key,
                        entry,
                        cause: Some(cause),
                    };
                }
            }
        }
        Ok(Increment::Unknown(unknown))
    }

    /// Settles `unknown` from what its document shows: counted when a settle
    /// counted it (its marker), step 2 when it is pending; `None` when the
    /// document shows neither. Another amount than the ticket's is refused.
    async fn settle_found(
        &self,
        unknown: &UnknownToken,
        found: Found,
    ) -> Option<Result<Increment, Error>> {
        Some(match found {
            Found::Settled(counted) => {
                check_amount(unknown, counted.amount()).map(|()| Increment::Counted(counted))
            }
            Found::Pending(pending) => match check_amount(unknown, pending.amount()) {
                Ok(()) => Ok(self.complete(pending).await.into()),
                Err(err) => Err(err),
            },
            Found::Absent => return None,
        })
    }

    /// Looks `token` up in the counter `key`'s pending entries, in either
    /// entry form (so tokens written by other clients can be completed).
    /// `None` when it is not pending — never added, or counted already.
    ///
    /// ```no_run
    /// # async fn demo(views: tally::Counters) -> Result<(), tally::Error> {
    /// use tally::Token;
    ///
    /// // A token another client left in the counter `home`.
    /// let token: Token = "65f1a2b3c4d5e6f708192a3b".parse().expect("24 hex digits");
    /// if let Some(pending) = views.find_pending("home", token).await? {
    ///     let _ = views.complete(pending).await;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn find_pending(
        &self,
        key: impl Into<Bson>,
        token: Token,
    ) -> Result<Option<PendingToken>, Error> {
        Ok(match self.lookup(key, token).await? {
            Found::Pending(pending) => Some(pending),
            Found::Settled(_) | Found::Absent => None,
        })
    }

    /// What the counter `key` says about `token`: settled (its marker),
    /// pending (its entry, in either form), or neither. A marker wins over
    /// a pending copy of the token (a copy re-added after a settle counted
    /// it: the fold drops it uncounted).
    pub(crate) async fn lookup(&self, key: impl Into<Bson>, token: Token) -> Result<Found, Error> {
        let key = key.into();
        let (pending_field, settled_field) = (&self.spec.pending_field, &self.spec.settled_field);
        let projection = doc! { pending_field: 1, settled_field: 1 };
        let Some(found) = self
            .read_one("counter.lookup", by_id("_id", &key), projection)
            .await?
        else {
            return Ok(Found::Absent);
        };
        let malformed = |reason: String| Error::Malformed {
            collection: self.spec.name.clone(),
            id: key.to_string(),
            reason,
        };
        if let Some(marker) = entries_of(&found, settled_field, token, Entry::parse_marker)
            .map_err(&malformed)?
            .first()
        {
            return Ok(Found::Settled(Counted {
                key,
                entry: *marker,
                settled_earlier: true,
            }));
        }
        let copies = entries_of(&found, pending_field, token, Entry::parse).map_err(&malformed)?;
        match copies.as_slice() {
            [] => Ok(Found::Absent),
            [first, rest @ ..] => {
                if let Some(other) = rest.iter().find(|e| e.amount() != first.amount()) {
                    return Err(malformed(format!(
                        "token {token} is pending with two amounts, {} and {}",
                        first.amount(),
                        other.amount()
                    )));
                }
                Ok(Found::Pending(PendingToken {
                    key,
                    entry: *first,
                    cause: None,
                }))
            }
        }
    }
}

/// Refuses a resume whose amount is not the one the document holds for the
/// token: the caller's ticket and the document disagree about what the
/// increment was.
fn check_amount(unknown: &UnknownToken, stored: i64) -> Result<(), Error> {
    if stored == unknown.amount() {
        Ok(())
    } else {
        Err(Error::AmountMismatch {
            token: unknown.token().to_string(),
            stored,
            given: unknown.amount(),
        })
    }
}

/// The elements of the array `field` of `document` that belong to `token`,
/// parsed with `parse`. An element naming the token that does not parse is
/// reported (as the reason a document is malformed); elements of other
/// tokens are not looked at. No field, or a field that is not an array,
/// holds none.
fn entries_of(
    document: &Document,
    field: &str,
    token: Token,
    parse: fn(&Bson) -> Result<Entry, crate::token::BadEntry>,
) -> Result<Vec<Entry>, String> {
    let Some(Bson::Array(elements)) = document.get(field) else {
        return Ok(Vec::new());
    };
    let oid = Bson::ObjectId(token.object_id());
    let names_token = |value: &Bson| match value {
        Bson::ObjectId(_) => *value == oid,
        Bson::Document(d) => d.get(crate::token::TOKEN_FIELD) == Some(&oid),
        _ => false,
    };
    elements
        .iter()
        .filter(|value| names_token(value))
        .map(|value| {
            parse(value).map_err(|bad| format!("{field}: the entry for token {token}: {bad}"))
        })
        .collect()
}
