//! The warnings and errors of the last minute, for `dataplane status`:
//! a `tracing` layer copies every WARN and ERROR event (refused
//! connections included) into a small ring, whatever the log level.

use std::{
    collections::VecDeque,
    fmt::Write as _,
    sync::{Mutex, PoisonError},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};
use tracing::{
    Event, Level, Subscriber,
    field::{Field, Visit},
};
use tracing_subscriber::{layer::Context, registry::LookupSpan};

/// How far back `dataplane status` looks.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Most events kept; older ones are dropped first.
const CAPACITY: usize = 512;

/// A warning or error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecentError {
    /// When, in seconds since the Unix epoch.
    pub at: u64,
    /// `WARN` or `ERROR`.
    pub level: String,
    /// The log target (`access` for refused connections).
    pub target: String,
    /// The message and its fields, as the text log shows them.
    pub message: String,
}

/// The ring of recent warnings and errors.
#[derive(Debug, Default)]
pub struct RecentErrors {
    events: Mutex<VecDeque<(Instant, RecentError)>>,
}

static GLOBAL: RecentErrors = RecentErrors {
    events: Mutex::new(VecDeque::new()),
};

/// The process's ring (log events are process-wide).
pub fn global() -> &'static RecentErrors {
    &GLOBAL
}

impl RecentErrors {
    fn push(&self, event: RecentError) {
        let mut events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        if events.len() == CAPACITY {
            events.pop_front();
        }
        events.push_back((Instant::now(), event));
    }

    /// Events of the last [`WINDOW`], oldest first, and how many there
    /// were (more than returned when the ring overflowed).
    pub fn last_minute(&self) -> Vec<RecentError> {
        let events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        events
            .iter()
            .filter(|(at, _)| at.elapsed() <= WINDOW)
            .map(|(_, e)| e.clone())
            .collect()
    }
}

/// The layer feeding [`global`]; add it with a WARN level filter.
#[derive(Debug, Default)]
pub struct RecentLayer;

impl<S: Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for RecentLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let level = *event.metadata().level();
        if level > Level::WARN {
            return;
        }
        let mut visitor = Render::default();
        event.record(&mut visitor);
        let at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        global().push(RecentError {
            at,
            level: level.to_string(),
            target: event.metadata().target().to_owned(),
            message: visitor.out,
        });
    }
}

#[derive(Default)]
struct Render {
    out: String,
}

impl Visit for Render {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let fields = std::mem::take(&mut self.out);
            let _ = write!(self.out, "{value:?}");
            if !fields.is_empty() {
                self.out.push(' ');
                self.out.push_str(&fields);
            }
        } else {
            if !self.out.is_empty() {
                self.out.push(' ');
            }
            let _ = write!(self.out, "{}={value:?}", field.name());
        }
    }
}
