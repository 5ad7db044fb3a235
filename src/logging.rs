//! Logging setup: tracing to standard error, readable text on a terminal or
//! one JSON object per line, filtered by `RUST_LOG` when set, else by
//! `[log] level`.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::FmtSpan;

use crate::config::{Config, LogFormat};

/// Installs the global subscriber as `[log]` says. Call once, at start-up;
/// later calls are ignored (tests install their own).
pub fn init(config: &Config) {
    let config = &config.log;
    let filter = match &config.rust_log {
        Some(directives) => EnvFilter::builder().parse_lossy(directives),
        // The scheduler library narrates its own start-up at INFO.
        _ => {
            EnvFilter::builder().parse_lossy(format!("{},tokio_cron_scheduler=warn", config.level))
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_span_events(FmtSpan::NONE);
    let _ = match config.format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .with_target(false)
            .try_init(),
    };
}
