//! Exact reads while the fold catches up (`fold::catch_up`): the events it
//! has yet to fold, from the collection itself and from the log after the
//! catch-up's boundary; an event found in both is one event.

use std::collections::HashSet;

use mongodb::ClientSession;
use mongodb::bson::{Document, doc};

use super::{Reading, Which};
use crate::document::{CanonicalKey, integer_value};
use crate::error::Error;
use crate::ledger::log::{Logged, Position};
use crate::ledger::state::Window;
use crate::ledger::{Ledger, field};

impl Ledger {
    /// While the fold catches up: the counters' events numbered above its
    /// progress (above a chunk a counter has already), from the collection,
    /// and every insert of theirs after the boundary, from the log; an
    /// event found in both is one event.
    pub(super) async fn catching_up(
        &self,
        session: &mut ClientSession,
        counters: &Which<'_>,
        reading: &Reading,
        boundary: Option<&Position>,
    ) -> Result<Vec<Logged>, Error> {
        let state = &reading.state;
        let catch_up = state.catch_up.as_ref();
        let progress = catch_up.and_then(crate::ledger::state::CatchUp::next_after);
        // The events without a number are the catch-up's only when its last
        // chunk takes them (a first fold's, an upgrade's); `fold-from`'s
        // leaves them to what counted them before.
        let unnumbered = catch_up.is_some_and(|c| c.unnumbered);
        let chunk = state.intent.as_ref().and_then(|pass| match pass.window {
            Window::Chunk { upto, .. } => Some((pass.number, upto)),
            Window::Log { .. } => None,
        });
        let mut filter = counters.filter(field::COUNTER);
        let not_a_number = doc! { "$not": { "$type": "number" } };
        match (progress, unnumbered) {
            (Some(progress), true) => {
                filter.insert(
                    "$or",
                    vec![
                        doc! { field::NUMBER: { "$gt": progress } },
                        doc! { field::NUMBER: not_a_number },
                    ],
                );
            }
            (Some(progress), false) => {
                filter.insert(field::NUMBER, doc! { "$gt": progress });
            }
            (None, true) => {}
            (None, false) => {
                filter.insert(field::NUMBER, doc! { "$type": "number" });
            }
        }
        let mut collected = self.scan(session, filter).await?;
        let after: Vec<Logged> = match boundary {
            Some(boundary) => self
                .log_after(boundary, counters, Vec::new(), reading.until)
                .await?
                .into_iter()
                .map(|i| i.event)
                .collect(),
            None => Vec::new(),
        };
        let logged: HashSet<CanonicalKey> =
            after.iter().map(|e| CanonicalKey::of(&e.key)).collect();
        collected.retain(|event| {
            if logged.contains(&CanonicalKey::of(&event.key)) {
                return false;
            }
            // A counter that has the chunk in progress has its events.
            let Some((number, upto)) = chunk else {
                return true;
            };
            let has_chunk = reading
                .counters
                .get(&CanonicalKey::of(&event.counter()))
                .and_then(|c| c.fold_position)
                .is_some_and(|p| p >= number);
            // The last chunk of a catch-up that takes the events without a
            // number has them too.
            let in_chunk = match event.number.as_ref().and_then(integer_value) {
                Some(s) => s <= upto,
                None => unnumbered && upto == i64::MAX,
            };
            !(has_chunk && in_chunk)
        });
        collected.extend(after);
        Ok(collected)
    }

    /// The events matching `filter`, at read concern `majority` in
    /// `session`.
    async fn scan(
        &self,
        session: &mut ClientSession,
        filter: Document,
    ) -> Result<Vec<Logged>, Error> {
        crate::ledger::scan::events_matching(
            &self.store,
            &self.events,
            session,
            filter,
            "ledger.read_unfolded",
        )
        .await
    }
}
