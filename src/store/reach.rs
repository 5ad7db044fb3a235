//! What a store knows about where it connects, for the messages of its
//! failures: the hosts, the user and the timeouts of its connection
//! string ([`Reach`]), and why each host failed the driver's last
//! heartbeat, recorded from the client's monitoring events.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use mongodb::error::{Error as MongoError, ErrorKind};
use mongodb::event::EventHandler;
use mongodb::event::sdam::SdamEvent;
use mongodb::options::ClientOptions;

use super::Store;
#[cfg(feature = "daemon")]
use crate::error::{Error, Readable};
use crate::error::{Failure, Next, Reach, RetryBudget};

/// Where a client built from `options` connects and as whom.
pub(super) fn of(
    options: &ClientOptions,
    server_selection_timeout: Duration,
    attempt_timeout: Duration,
) -> Reach {
    let credential = options.credential.as_ref();
    Reach {
        hosts: options.hosts.iter().map(ToString::to_string).collect(),
        user: credential.and_then(|c| c.username.clone()),
        // The driver's default: the URI's database, else admin.
        auth_source: credential.map(|c| {
            c.source
                .clone()
                .or_else(|| options.default_database.clone())
                .unwrap_or_else(|| "admin".to_owned())
        }),
        selection_timeout: server_selection_timeout,
        attempt_timeout,
        replica_set: options.repl_set_name.clone(),
        unreachable: Vec::new(),
        set_names: Vec::new(),
    }
}

/// What the client's monitoring events say about each host, kept for the
/// messages of failures: what a server-selection failure says about why.
#[derive(Debug, Clone, Default)]
pub(super) struct Heartbeats(Arc<Mutex<Monitored>>);

#[derive(Debug, Default)]
struct Monitored {
    /// The last heartbeat failure of each host that is failing them now.
    failures: BTreeMap<String, MongoError>,
    /// The replica set each host named in its last answer (`None`: it
    /// named none). A host that names another set than the connection
    /// string is dropped by the driver, which then waits for server
    /// selection in vain: this is how its message can say so.
    set_names: BTreeMap<String, Option<String>>,
}

impl Heartbeats {
    /// Installs the recorder on `options` (replacing no handler: tally's
    /// clients have none).
    pub(super) fn record_from(&self, options: &mut ClientOptions) {
        let monitored = self.0.clone();
        options.sdam_event_handler = Some(EventHandler::callback(move |event: SdamEvent| {
            let mut monitored = monitored.lock().unwrap_or_else(PoisonError::into_inner);
            match event {
                SdamEvent::ServerHeartbeatFailed(failed) => {
                    let host = failed.server_address.to_string();
                    monitored.failures.insert(host, failed.failure);
                }
                SdamEvent::ServerHeartbeatSucceeded(succeeded) => {
                    let host = succeeded.server_address.to_string();
                    monitored.failures.remove(&host);
                    let set_name = succeeded.reply.get_str("setName").ok();
                    if monitored.set_names.get(&host).map(Option::as_deref) != Some(set_name) {
                        monitored
                            .set_names
                            .insert(host, set_name.map(str::to_owned));
                    }
                }
                _ => {}
            }
        }));
    }

    /// The hosts failing their heartbeats now, each with its last failure.
    pub(super) fn now(&self) -> Vec<(String, MongoError)> {
        let monitored = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        monitored
            .failures
            .iter()
            .map(|(h, e)| (h.clone(), e.clone()))
            .collect()
    }

    /// The replica set each host that answered named in its last answer.
    fn set_names(&self) -> Vec<(String, Option<String>)> {
        let monitored = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        monitored
            .set_names
            .iter()
            .map(|(h, s)| (h.clone(), s.clone()))
            .collect()
    }
}

impl Store {
    /// Where this store connects and as whom, with why each host is
    /// unreachable when `err` says no server could be selected.
    pub(super) fn reach_for(&self, err: &MongoError) -> Arc<Reach> {
        match err.kind.as_ref() {
            ErrorKind::ServerSelection { .. } => Arc::new(Reach {
                unreachable: self.inner.heartbeats.now(),
                set_names: self.inner.heartbeats.set_names(),
                ..Reach::clone(&self.inner.reach)
            }),
            _ => self.inner.reach.clone(),
        }
    }

    /// `failure`, naming where its operation went and — when no server
    /// could be selected — why, as this store knows now: what a retry loop
    /// returns when it gives up. (The exit code of a server selection that
    /// failed because the hosts belong to another replica set depends on
    /// it: a configuration to fix, not an outage.)
    fn reached(&self, failure: Box<Failure>) -> Box<Failure> {
        let reach = self.reach_for(&failure.source);
        failure.with_reach(reach)
    }

    /// `budget`'s verdict on a failed attempt of an operation on this
    /// store: every retry loop asks here, so a give-up names where its
    /// operation went ([`Store::reached`]).
    pub(crate) fn after_failure(&self, budget: &mut RetryBudget, err: MongoError) -> Next {
        match budget.after_failure(err) {
            Next::GiveUp(failure) => Next::GiveUp(self.reached(failure)),
            retry => retry,
        }
    }

    /// Where this store connects (hosts, user, timeouts): what `tallyd
    /// status` and `doctor` name.
    pub(crate) fn reach(&self) -> Arc<Reach> {
        self.inner.reach.clone()
    }

    /// A driver error of an operation on this store as people read it
    /// (naming its host, its user, why no server could be selected), the
    /// password removed.
    #[cfg(feature = "daemon")]
    pub(crate) fn describe(&self, err: &MongoError) -> String {
        let reach = self.reach_for(err);
        let readable = Readable {
            err,
            reach: Some(&reach),
        };
        self.scrub(&readable.to_string())
    }

    /// `MongoDB at HOST has not answered for 5s (why)`, for a caller
    /// waiting for the server.
    #[cfg(feature = "daemon")]
    pub(crate) fn unanswered(&self, waited: Duration) -> String {
        let reach = Reach {
            unreachable: self.inner.heartbeats.now(),
            ..Reach::clone(&self.inner.reach)
        };
        self.scrub(&reach.unanswered(waited))
    }

    /// `the connection string names replica set rs0, but the server at
    /// HOST belongs to replica set other: …` when the hosts that answered
    /// belong to another set than the connection string names (so far):
    /// what a caller waiting for the server says at once.
    #[cfg(feature = "daemon")]
    pub(crate) fn in_another_set(&self) -> Option<String> {
        let reach = Reach {
            set_names: self.inner.heartbeats.set_names(),
            ..Reach::clone(&self.inner.reach)
        };
        crate::error::other_set(&reach).map(|said| self.scrub(&said))
    }

    /// Whether any host has answered a heartbeat since the client started.
    #[cfg(feature = "daemon")]
    pub(crate) fn answered(&self) -> bool {
        !self.inner.heartbeats.set_names().is_empty()
    }

    /// Whether the driver's monitoring reached a server at its last try:
    /// false once every host of the connection string failed its last
    /// heartbeat. A stop does not wait for a server known to be gone.
    pub(crate) fn seems_reachable(&self) -> bool {
        let failing = self.inner.heartbeats.now();
        let hosts = &self.inner.reach.hosts;
        failing.is_empty() || !hosts.iter().all(|h| failing.iter().any(|(f, _)| f == h))
    }

    /// An error of an operation on this store as people read it: a
    /// failure names the hosts, the user, why no server could be selected
    /// (what this store knows, when the failure does not say); the
    /// password removed.
    #[cfg(feature = "daemon")]
    pub(crate) fn explain(&self, err: &Error) -> String {
        let reach = match err {
            Error::Server(failure) => self.reach_for(&failure.source),
            _ => self.inner.reach.clone(),
        };
        self.scrub(&err.describe(Some(&reach)))
    }
}
