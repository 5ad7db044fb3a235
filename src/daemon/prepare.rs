//! A configuration made ready before the running one is let go: what makes
//! a reload all or nothing.

use std::io::ErrorKind;
use std::sync::Arc;

use super::schedule::Schedule;
use super::{DaemonError, readiness};
use crate::config::Config;
use crate::store::Store;

/// A configuration made ready to take over: checked, its `[http] listen`
/// bound, its MongoDB client built. Until [`run`] takes it, nothing of the
/// running daemon was let go.
pub(crate) struct Prepared {
    pub(super) config: Config,
    pub(super) schedule: Schedule,
    pub(super) listener: Listening,
    pub(super) store: Store,
    /// The API's TLS, from `[api] tls_cert` and `tls_key` read anew.
    pub(super) api_tls: Option<tokio_rustls::TlsAcceptor>,
}

/// The socket `[http] listen` is bound to. The supervisor keeps it across
/// reloads while the address stays the same (each run serves a duplicate of
/// it), so a reload never has to bind an address the old run still holds,
/// and connections that come during the drain wait in its backlog.
#[derive(Clone, Debug)]
pub(crate) struct Listening {
    pub(super) address: std::net::SocketAddr,
    pub(super) socket: Arc<std::net::TcpListener>,
    /// `[api] listen`'s socket when the API is on, kept across reloads the
    /// same way.
    pub(super) api: Option<Box<Listening>>,
}

impl Prepared {
    /// Makes `config` ready to run: its schedule checked, its `[http]
    /// listen` bound (or `current`'s socket kept when the address is the
    /// same), its MongoDB client built. Nothing connects yet.
    pub(crate) async fn new(
        config: Config,
        current: Option<&Listening>,
    ) -> Result<Self, DaemonError> {
        let schedule =
            Schedule::new(&config.schedule).map_err(|e| DaemonError::Config(e.to_string()))?;
        let mut listener = match current {
            Some(current) if current.address == config.http.listen => current.clone(),
            _ => bind(config.http.listen, "[http] listen")?,
        };
        listener.api = match current.and_then(|c| c.api.as_deref()) {
            _ if !config.api.enabled => None,
            Some(api) if api.address == config.api.listen => Some(Box::new(api.clone())),
            _ => Some(Box::new(bind(config.api.listen, "[api] listen")?)),
        };
        let api_tls = if config.api.enabled {
            super::api::serve::tls_acceptor(&config.api).map_err(DaemonError::Config)?
        } else {
            None
        };
        let store = Store::connect(&config.mongodb)
            .await
            .map_err(|err| DaemonError::Start(config.secrets().scrub(&err.to_string())))?;
        Ok(Self {
            config,
            schedule,
            listener,
            store,
            api_tls,
        })
    }

    /// The configuration it runs.
    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// The MongoDB client it runs with.
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// The socket it serves the HTTP endpoints on.
    pub(crate) fn listening(&self) -> &Listening {
        &self.listener
    }

    /// Asks the new server once (within `within`) whether it takes the new
    /// credentials: refused ones are the operator's to fix, and a reload
    /// must not let the running daemon go for them. When the reload moves
    /// to another server (`new_server`: the URI changed), that server must
    /// answer too: a running daemon is not let go for one it cannot reach.
    /// Otherwise a server that does not answer in time is not a refusal:
    /// the new run waits for it as a start does (the outage is the running
    /// one's too).
    pub(crate) async fn check_credentials(
        &self,
        within: std::time::Duration,
        new_server: bool,
    ) -> Result<(), DaemonError> {
        let unreachable = |cause: String| {
            DaemonError::Start(format!(
                "MongoDB at the new [mongodb] uri did not answer within {} ({cause}); \
                 send SIGHUP again once it answers, or correct the URI",
                humantime::format_duration(within)
            ))
        };
        match tokio::time::timeout(within, self.store.hello()).await {
            Ok(Err(err)) if readiness::refused_credentials(&err) => {
                Err(DaemonError::Denied(format!(
                    "MongoDB refused the credentials of [mongodb] uri: {}",
                    self.config.secrets().scrub(&self.store.explain(&err))
                )))
            }
            Ok(Err(err)) if new_server => Err(unreachable(
                self.config.secrets().scrub(&self.store.explain(&err)),
            )),
            Err(_) if new_server => Err(unreachable("no reply".to_owned())),
            _ => Ok(()),
        }
    }

    /// Gives up this configuration without running it: its client closes
    /// its connections.
    pub(crate) async fn discard(self) {
        self.store.shutdown().await;
    }
}

/// Binds `listen`, the address of the key `key` (`[http] listen`). An
/// address this host cannot listen on (taken, not its own, a port it may
/// not bind) is the operator's to fix: restarting would fail the same way.
fn bind(listen: std::net::SocketAddr, key: &str) -> Result<Listening, DaemonError> {
    std::net::TcpListener::bind(listen)
        .and_then(|socket| {
            socket.set_nonblocking(true)?;
            Ok(Listening {
                address: listen,
                socket: Arc::new(socket),
                api: None,
            })
        })
        .map_err(|err| cannot_listen(listen, key, &err))
}

/// The error of an address the daemon cannot listen on, in words (never
/// the system's `(os error N)`): the operator's to fix when the address is
/// taken, absent or forbidden.
fn cannot_listen(listen: std::net::SocketAddr, key: &str, err: &std::io::Error) -> DaemonError {
    let start = format!("cannot listen on {listen} ({key})");
    let config = |why: &str, what: &str| DaemonError::Config(format!("{start}: {why}; {what}"));
    match err.kind() {
        ErrorKind::AddrInUse => config(
            "another process listens there",
            &format!("stop it, or choose another address in {key}"),
        ),
        ErrorKind::AddrNotAvailable => config(
            "this host has no such address",
            &format!("choose one of this host's addresses in {key}"),
        ),
        ErrorKind::PermissionDenied => config(
            "permission denied (a port below 1024 needs privileges)",
            &format!("choose a port above 1023 in {key}"),
        ),
        _ => {
            let text = err.to_string();
            let text = text.split(" (os error").next().unwrap_or(&text);
            DaemonError::Start(format!("{start}: {}", text.to_lowercase()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_in_use_is_named_in_words_with_the_remedy() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = taken.local_addr().unwrap();
        let err = std::net::TcpListener::bind(address).unwrap_err();
        let DaemonError::Config(message) = cannot_listen(address, "[http] listen", &err) else {
            panic!("a configuration error (78)");
        };
        assert_eq!(
            message,
            format!(
                "cannot listen on {address} ([http] listen): another process listens there; \
                 stop it, or choose another address in [http] listen"
            )
        );
        let other = std::io::Error::from_raw_os_error(22);
        let DaemonError::Start(message) = cannot_listen(address, "[http] listen", &other) else {
            panic!("a start error");
        };
        assert!(!message.contains("os error"), "{message}");
    }
}
