//! Logging setup: tracing to standard error, readable text on a terminal or
//! one JSON object per line, filtered by `RUST_LOG` when set, else by
//! `[log] level`. The filter follows a configuration reload; the format is
//! chosen once, at start.

use std::io::IsTerminal;

use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

use crate::config::{Config, LogConfig, LogFormat};

/// The installed logging: applies the filter of a reloaded configuration.
#[derive(Debug)]
pub(crate) struct Logging {
    filter: reload::Handle<EnvFilter, Registry>,
    format: LogFormat,
}

/// Installs the global subscriber as `[log]` says. Call once, at start-up;
/// later calls install nothing (tests install their own) and return a
/// handle that changes nothing.
pub(crate) fn init(config: &Config) -> Logging {
    let config = &config.log;
    let (filter, handle) = reload::Layer::new(filter(config));
    let output = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_span_events(FmtSpan::NONE);
    let output = match config.format {
        LogFormat::Json => output
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .boxed(),
        LogFormat::Text => output
            // Colour only on a terminal, and never when NO_COLOR is set
            // (https://no-color.org: to anything but the empty string).
            .with_ansi(
                std::io::stderr().is_terminal()
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            )
            .with_target(false)
            .boxed(),
    };
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(output)
        .try_init();
    Logging {
        filter: handle,
        format: config.format,
    }
}

impl Logging {
    /// Applies `config`'s filter (`RUST_LOG`, else `[log] level`); a new
    /// `[log] format` takes effect at the next start.
    pub(crate) fn apply(&self, config: &Config) {
        let config = &config.log;
        if let Err(err) = self.filter.reload(filter(config)) {
            tracing::warn!(cause = %err, "cannot change the log filter");
        }
        if config.format != self.format {
            tracing::warn!("[log] format changes take effect at the next start");
        }
    }
}

/// The filter `[log]` (or `RUST_LOG`, already checked) describes.
fn filter(config: &LogConfig) -> EnvFilter {
    match &config.rust_log {
        Some(directives) => EnvFilter::builder().parse_lossy(directives),
        // The scheduler library narrates its own start-up at INFO.
        None => {
            EnvFilter::builder().parse_lossy(format!("{},tokio_cron_scheduler=warn", config.level))
        }
    }
}
