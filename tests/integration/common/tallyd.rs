//! The real `tallyd run` as a child process: started with a config file,
//! its HTTP endpoints queried, stopped with SIGTERM or killed with SIGKILL.

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A loopback address nothing listens on right now.
pub fn free_address() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

/// Writes `config` plus an `[http]` section listening on `http`.
fn write_config(path: &std::path::Path, config: &str, http: SocketAddr) {
    std::fs::write(path, format!("{config}\n[http]\nlisten = \"{http}\"\n")).expect("write config");
}

/// A running `tallyd run`.
pub struct Tallyd {
    child: Child,
    /// Where `/metrics`, `/healthz` and `/readyz` listen.
    pub http: SocketAddr,
    path: PathBuf,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tallyd {
    /// Starts `tallyd --config <file> run` with `config` (which must not
    /// have an `[http]` section: one is added on a free port) and `env`.
    pub fn start(config: &str, env: &[(&str, &str)]) -> Self {
        Self::start_on(config, env, free_address())
    }

    /// The same, with the HTTP endpoints on `http`.
    pub fn start_on(config: &str, env: &[(&str, &str)], http: SocketAddr) -> Self {
        Self::start_with(config, env, http, &[])
    }

    /// The same, with `options` (global ones, e.g. `--env-file PATH`)
    /// before `run`.
    pub fn start_with(
        config: &str,
        env: &[(&str, &str)],
        http: SocketAddr,
        options: &[&std::ffi::OsStr],
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tallyd.toml");
        write_config(&path, config, http);
        let log = dir.path().join("tallyd.log");
        let child = Command::new(env!("CARGO_BIN_EXE_tallyd"))
            .arg("--config")
            .arg(&path)
            .args(options)
            .arg("run")
            .env_clear()
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("log file"))
            .spawn()
            .expect("start tallyd");
        Self {
            child,
            http,
            path,
            log,
            _dir: dir,
        }
    }

    /// Replaces its configuration file with `config` (plus the same
    /// `[http]` section); a SIGHUP makes it read the file again.
    pub fn rewrite_config(&self, config: &str) {
        write_config(&self.path, config, self.http);
    }

    /// Replaces its configuration file with `config` plus an `[http]`
    /// section listening on `http` (its endpoints are still queried on the
    /// address it started with).
    pub fn rewrite_config_listening(&self, config: &str, http: SocketAddr) {
        write_config(&self.path, config, http);
    }

    /// Sends `signal` (`HUP`, `TERM`, ...).
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{signal} failed");
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Everything it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn get(&self, path: &str) -> Option<(u16, String)> {
        let response = reqwest::Client::new()
            .get(format!("http://{}{path}", self.http))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?;
        let status = response.status().as_u16();
        Some((status, response.text().await.ok()?))
    }

    /// `/readyz`'s body when it answers 200 (`active` or `standby`).
    pub async fn ready(&self) -> Option<String> {
        match self.get("/readyz").await {
            Some((200, body)) => Some(body.trim().to_owned()),
            _ => None,
        }
    }

    /// `/readyz`'s status code, if it answers at all.
    pub async fn ready_status(&self) -> Option<u16> {
        self.get("/readyz").await.map(|(status, _)| status)
    }

    /// The value of one metric line, e.g.
    /// `tally_reconcile_runs_total{collection="views",result="ok"}`.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let (_, text) = self.get("/metrics").await?;
        text.lines().find_map(|line| {
            line.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
    }

    /// Polls until `series` is at least `at_least`.
    pub async fn wait_metric(&self, series: &str, at_least: f64, timeout: Duration) -> f64 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(value) = self.metric(series).await
                && value >= at_least
            {
                return value;
            }
            if Instant::now() > deadline {
                panic!(
                    "{series} did not reach {at_least} within {timeout:?} (now {:?})\nlog:\n{}",
                    self.metric(series).await,
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls until `/readyz` says `role`.
    pub async fn wait_ready(&self, role: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.ready().await.as_deref() != Some(role) {
            assert!(
                Instant::now() < deadline,
                "not {role} within {timeout:?} (readyz: {:?})\nlog:\n{}",
                self.ready().await,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Sends SIGTERM and waits (up to 40 s) for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal("TERM");
        self.wait(Duration::from_secs(40))
    }

    /// Kills it with SIGKILL: no shutdown, nothing saved.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            if Instant::now() > deadline {
                self.kill();
                panic!(
                    "tallyd did not exit within {timeout:?}\nlog:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tallyd {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}
