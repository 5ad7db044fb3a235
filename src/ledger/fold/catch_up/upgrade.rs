//! What an earlier version's fold state stands for, for its catch-up: tally
//! 0.2.0 kept, per recorder lane, the highest number folded; the version
//! before this one a watermark (its `W`). Both become "the events numbered
//! above a number" when that is exact; otherwise the upgrade is refused,
//! naming what to run first.

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};
use mongodb::options::ReadConcern;

use crate::document::integer_value;
use crate::error::{Error, Failure};
use crate::ledger::field;
use crate::ledger::fold::EventFold;

impl EventFold {
    /// The watermark a tally 0.2.0 state `lanes` stands for: the highest
    /// number it folded, when every event it did not fold is numbered
    /// above it (the usual case: those are the newest). Otherwise refused,
    /// naming what to run.
    pub(super) async fn watermark_of(&self, lanes: &[(ObjectId, i64)]) -> Result<i64, Error> {
        let folded: std::collections::HashMap<ObjectId, i64> = lanes.iter().copied().collect();
        let pipeline = vec![doc! { "$group": {
            "_id": format!("${}", field::LANE),
            "lo": { "$min": format!("${}", field::NUMBER) },
            "hi": { "$max": format!("${}", field::NUMBER) },
        } }];
        let spans = self.aggregate(pipeline).await?;
        let (mut highest_folded, mut lowest_unfolded) = (0i64, i64::MAX);
        for span in spans {
            let number = |name| span.get(name).and_then(integer_value);
            let (Some(lo), Some(hi)) = (number("lo"), number("hi")) else {
                continue;
            };
            match span.get_object_id("_id").ok().and_then(|l| folded.get(&l)) {
                None => lowest_unfolded = lowest_unfolded.min(lo),
                Some(&m) if hi <= m => highest_folded = highest_folded.max(hi),
                Some(&m) if lo > m => lowest_unfolded = lowest_unfolded.min(lo),
                Some(&m) => {
                    // Folded and unfolded events on one lane.
                    highest_folded = highest_folded.max(m);
                    let lane = span.get_object_id("_id").ok();
                    if let Some(above) = self.first_above(lane, m).await? {
                        lowest_unfolded = lowest_unfolded.min(above);
                    }
                }
            }
        }
        if highest_folded >= lowest_unfolded {
            return Err(self.upgrade_blocked(&format!(
                "an event it did not fold is numbered {lowest_unfolded}, at or below one it \
                 folded ({highest_folded}): fold them with tally 0.2.0's `tallyd reconcile` \
                 (with every recorder stopped) until `tallyd status` shows no backlog"
            )));
        }
        Ok(highest_folded)
    }

    /// The lowest number above `above` on `lane`, if any.
    async fn first_above(&self, lane: Option<ObjectId>, above: i64) -> Result<Option<i64>, Error> {
        let pipeline = vec![
            doc! { "$match": { field::LANE: lane, field::NUMBER: { "$gt": above } } },
            doc! { "$group": { "_id": Bson::Null, "lo": { "$min": format!("${}", field::NUMBER) } } },
        ];
        let rows = self.aggregate(pipeline).await?;
        Ok(rows
            .first()
            .and_then(|row| row.get("lo"))
            .and_then(integer_value))
    }

    /// Runs `pipeline` on the events collection at read concern `majority`.
    async fn aggregate(&self, pipeline: Vec<Document>) -> Result<Vec<Document>, Error> {
        const OPERATION: &str = "ledger.catch_up.convert";
        let mut budget = crate::error::RetryBudget::read_once(OPERATION);
        let cursor = self
            .store
            .with_retry(&mut budget, || {
                self.events
                    .aggregate(pipeline.clone())
                    .read_concern(ReadConcern::majority())
            })
            .await
            .map_err(Error::Server)?;
        cursor
            .try_collect()
            .await
            .map_err(|err| Error::Server(Failure::once(OPERATION, err)))
    }

    pub(super) fn upgrade_blocked(&self, why: &str) -> Error {
        Error::UpgradeBlocked {
            collection: self.keeper.name().to_owned(),
            why: why.to_owned(),
        }
    }
}
