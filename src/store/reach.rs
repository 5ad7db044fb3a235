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
use crate::error::Reach;
#[cfg(feature = "daemon")]
use crate::error::{Error, Readable};

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
        unreachable: Vec::new(),
    }
}

/// The last heartbeat failure of each host that is failing them now, kept
/// by the client's monitoring events: what a server-selection failure's
/// message says about why.
#[derive(Debug, Clone, Default)]
pub(super) struct Heartbeats(Arc<Mutex<BTreeMap<String, MongoError>>>);

impl Heartbeats {
    /// Installs the recorder on `options` (replacing no handler: tally's
    /// clients have none).
    pub(super) fn record_from(&self, options: &mut ClientOptions) {
        let failures = self.0.clone();
        options.sdam_event_handler = Some(EventHandler::callback(move |event: SdamEvent| {
            let mut failures = failures.lock().unwrap_or_else(PoisonError::into_inner);
            match event {
                SdamEvent::ServerHeartbeatFailed(failed) => {
                    failures.insert(failed.server_address.to_string(), failed.failure);
                }
                SdamEvent::ServerHeartbeatSucceeded(succeeded) => {
                    failures.remove(&succeeded.server_address.to_string());
                }
                _ => {}
            }
        }));
    }

    pub(super) fn now(&self) -> Vec<(String, MongoError)> {
        let failures = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        failures
            .iter()
            .map(|(h, e)| (h.clone(), e.clone()))
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
                ..Reach::clone(&self.inner.reach)
            }),
            _ => self.inner.reach.clone(),
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

    /// Whether the driver's monitoring reached a server at its last try:
    /// false once every host of the connection string failed its last
    /// heartbeat. A stop does not wait for a server known to be gone.
    #[cfg(feature = "daemon")]
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
