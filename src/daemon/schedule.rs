//! When the daemon folds: a cron expression (seconds first) in a time zone,
//! ticked by tokio-cron-scheduler.
//!
//! Two things the scheduler alone does not give:
//!
//! - **Catch-up.** [`Schedule::missed`] says whether a scheduled time passed
//!   since the last successful run (stored in MongoDB), so a run missed
//!   while the daemon was down happens at start.
//! - **Daylight saving.** tokio-cron-scheduler fixes a job's UTC offset when
//!   the job is created, so a local-time schedule would drift by an hour
//!   after a DST change. [`Schedule::start`] re-creates the job when the
//!   zone's offset changes.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, Offset, TimeZone, Utc};
use chrono_tz::Tz;
use tokio_cron_scheduler::{Job, JobScheduler};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::{ScheduleConfig, parse_cron};

/// How often the ticker checks whether the zone's UTC offset changed.
const OFFSET_CHECK: Duration = Duration::from_secs(600);

/// A parsed schedule.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    expression: String,
    cron: croner::Cron,
    timezone: Tz,
}

/// The schedule could not be started.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the schedule {expression:?}: {reason}")]
pub(crate) struct ScheduleError {
    expression: String,
    reason: String,
}

impl Schedule {
    /// The schedule `[schedule]` describes (already validated by the
    /// configuration).
    pub(crate) fn new(config: &ScheduleConfig) -> Result<Self, ScheduleError> {
        let cron = parse_cron(&config.cron).map_err(|reason| ScheduleError {
            expression: config.cron.clone(),
            reason,
        })?;
        Ok(Self {
            expression: config.cron.clone(),
            cron,
            timezone: config.timezone,
        })
    }

    /// The latest scheduled time at or before `now`.
    pub(crate) fn previous(&self, now: SystemTime) -> Option<SystemTime> {
        let now = DateTime::<Utc>::from(now).with_timezone(&self.timezone);
        self.cron
            .find_previous_occurrence(&now, true)
            .ok()
            .map(|t| t.with_timezone(&Utc).into())
    }

    /// The next scheduled time after `now`.
    pub(crate) fn next(&self, now: SystemTime) -> Option<SystemTime> {
        let now = DateTime::<Utc>::from(now).with_timezone(&self.timezone);
        self.cron
            .find_next_occurrence(&now, false)
            .ok()
            .map(|t| t.with_timezone(&Utc).into())
    }

    /// Whether a scheduled run was due since `last_success` (never run
    /// counts as missed).
    pub(crate) fn missed(&self, last_success: Option<SystemTime>, now: SystemTime) -> bool {
        match (self.previous(now), last_success) {
            (Some(due), Some(last)) => last < due,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }

    /// Starts ticking: `on_tick` is called at every scheduled time until
    /// `shutdown`. It must return quickly (hand the work to another task).
    pub(crate) async fn start(
        &self,
        on_tick: Arc<dyn Fn() + Send + Sync>,
        shutdown: CancellationToken,
    ) -> Result<(), ScheduleError> {
        let fail = |reason: String| ScheduleError {
            expression: self.expression.clone(),
            reason,
        };
        let scheduler = JobScheduler::new().await.map_err(|e| fail(e.to_string()))?;
        let mut offset = self.offset_now();
        let mut job = scheduler
            .add(self.job(on_tick.clone()).map_err(fail)?)
            .await
            .map_err(|e| fail(e.to_string()))?;
        scheduler.start().await.map_err(|e| fail(e.to_string()))?;
        let schedule = self.clone();
        tokio::spawn(async move {
            let mut scheduler = scheduler;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = tokio::time::sleep(OFFSET_CHECK) => {}
                }
                let now_offset = schedule.offset_now();
                if now_offset == offset {
                    continue;
                }
                tracing::info!(
                    timezone = schedule.timezone.name(),
                    from = offset,
                    to = now_offset,
                    "the time zone's UTC offset changed; re-creating the schedule"
                );
                let replaced = match schedule.job(on_tick.clone()) {
                    Ok(new_job) => match scheduler.add(new_job).await {
                        Ok(id) => {
                            let _ = scheduler.remove(&job).await;
                            Ok(id)
                        }
                        Err(err) => Err(err.to_string()),
                    },
                    Err(err) => Err(err),
                };
                match replaced {
                    Ok(id) => {
                        job = id;
                        offset = now_offset;
                    }
                    Err(reason) => {
                        tracing::error!(%reason, "cannot re-create the schedule; keeping the old one")
                    }
                }
            }
            if let Err(err) = scheduler.shutdown().await {
                tracing::warn!(cause = %err, "the scheduler did not shut down cleanly");
            }
        });
        Ok(())
    }

    fn job(&self, on_tick: Arc<dyn Fn() + Send + Sync>) -> Result<Job, String> {
        Job::new_async_tz(
            self.expression.as_str(),
            self.timezone,
            move |_id: Uuid, _scheduler| {
                on_tick();
                Box::pin(async {})
            },
        )
        .map_err(|err| err.to_string())
    }

    fn offset_now(&self) -> i32 {
        self.timezone
            .offset_from_utc_datetime(&Utc::now().naive_utc())
            .fix()
            .local_minus_utc()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(cron: &str, tz: &str) -> Schedule {
        Schedule::new(&ScheduleConfig {
            cron: cron.into(),
            timezone: tz.parse().unwrap(),
            catch_up: true,
        })
        .unwrap()
    }

    fn at(rfc3339: &str) -> SystemTime {
        DateTime::parse_from_rfc3339(rfc3339)
            .unwrap()
            .with_timezone(&Utc)
            .into()
    }

    #[test]
    fn the_previous_and_next_nightly_runs() {
        let nightly = schedule("0 30 3 * * *", "UTC");
        let now = at("2026-11-22T10:00:00Z");
        assert_eq!(nightly.previous(now), Some(at("2026-11-22T03:30:00Z")));
        assert_eq!(nightly.next(now), Some(at("2026-11-23T03:30:00Z")));
    }

    #[test]
    fn a_run_is_missed_when_the_last_success_is_before_the_latest_scheduled_time() {
        let nightly = schedule("0 30 3 * * *", "UTC");
        let now = at("2026-11-22T10:00:00Z");
        assert!(nightly.missed(Some(at("2026-11-21T03:30:05Z")), now));
        assert!(!nightly.missed(Some(at("2026-11-22T03:30:05Z")), now));
        assert!(nightly.missed(None, now), "never run: catch up");
    }

    #[test]
    fn time_zones_shift_the_schedule_and_follow_daylight_saving() {
        let berlin = schedule("0 30 3 * * *", "Europe/Berlin");
        // Winter: UTC+1.
        assert_eq!(
            berlin.previous(at("2026-01-10T12:00:00Z")),
            Some(at("2026-01-10T02:30:00Z"))
        );
        // Summer: UTC+2.
        assert_eq!(
            berlin.previous(at("2026-07-10T12:00:00Z")),
            Some(at("2026-07-10T01:30:00Z"))
        );
    }
}
