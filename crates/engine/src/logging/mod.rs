//! Log set-up: `tracing` to stderr, text or JSON (one object per line),
//! level from `RUST_LOG` (default `info`) and changeable at runtime
//! ([`set_filter`], reached through the admin endpoint `/logging`).
//!
//! Access records have their own target, `access`: `RUST_LOG=info,access=off`
//! silences them, `warn,access=info` keeps only them and the warnings.
//! DNS queries have theirs, `dns`, at debug level (`info,dns=debug` shows
//! them).
//! Warnings and errors are also copied to the last-minute ring that
//! `dataplane status` shows, whatever the level ([`recent`]).

pub mod recent;

use std::{
    io::IsTerminal,
    sync::{Mutex, OnceLock, PoisonError},
};

use tracing_subscriber::{
    EnvFilter, Layer as _, Registry, filter::LevelFilter, fmt, layer::SubscriberExt as _, reload,
    util::SubscriberInitExt as _,
};

pub use recent::{RecentError, RecentLayer};

/// Moved to `dataplane_core::error`; named here for the modules that still
/// import it from `logging`.
pub use dataplane_core::error::Chain;

/// Why a new log filter was not applied.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    /// The directives do not parse.
    #[error(
        "invalid log filter `{directives}` (use a level such as `debug`, or directives such as `info,access=off`)"
    )]
    Parse {
        /// What was asked for.
        directives: String,
        /// The parser's error.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// This process did not install the subscriber (a library user, tests).
    #[error("logging was not initialised by this process; the level cannot be changed")]
    NotInitialised,
    /// The subscriber is gone.
    #[error("the log filter could not be replaced")]
    Reload(#[source] reload::Error),
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

struct Filter {
    handle: reload::Handle<EnvFilter, Registry>,
    current: Mutex<String>,
}

static FILTER: OnceLock<Filter> = OnceLock::new();

/// Installs the global subscriber. Safe to call once per process; later
/// calls keep the first subscriber.
pub fn init(format: LogFormat) {
    let directives = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned());
    let filter = EnvFilter::try_new(&directives).unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);
    let output = match format {
        LogFormat::Text => fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        LogFormat::Json => fmt::layer()
            .with_writer(std::io::stderr)
            .json()
            .flatten_event(true)
            .boxed(),
    };
    // Per-layer filters: a quiet level must not hide warnings from the
    // last-minute ring.
    let installed = tracing_subscriber::registry()
        .with(output.with_filter(filter))
        .with(RecentLayer.with_filter(LevelFilter::WARN))
        .try_init();
    if installed.is_ok() {
        let _ = FILTER.set(Filter {
            handle,
            current: Mutex::new(directives),
        });
    }
}

/// Replaces the log filter (`debug`, `info,access=off`, ...) and returns
/// the previous one.
pub fn set_filter(directives: &str) -> Result<String, LoggingError> {
    let filter = FILTER.get().ok_or(LoggingError::NotInitialised)?;
    let parsed = EnvFilter::try_new(directives).map_err(|source| LoggingError::Parse {
        directives: directives.to_owned(),
        source,
    })?;
    filter.handle.reload(parsed).map_err(LoggingError::Reload)?;
    let mut current = filter
        .current
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    Ok(std::mem::replace(&mut *current, directives.to_owned()))
}

/// The filter in force.
pub fn current_filter() -> Option<String> {
    FILTER.get().map(|f| {
        f.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    })
}
