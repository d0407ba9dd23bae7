//! CPU profiles on the admin port, as ztunnel serves them (`src/admin.rs`
//! `handle_pprof`): `GET /debug/pprof/profile?seconds=<1-300>&frequency=<1-1000>`
//! samples every thread of the agent for `seconds` (default 10) at
//! `frequency` per second (default 100, Go's, as ztunnel's: `SIGPROF` does
//! not queue, so a higher rate under-reports a busy process) and answers
//! the profile in pprof's protobuf form (`go tool pprof`, `pprof -http`).
//!
//! One profile at a time: the sampler is process-wide, a second request
//! while one runs is answered 409. Heap profiles (`/debug/pprof/heap`) need a sampling
//! allocator (ztunnel links jemalloc for them); the agent uses the C
//! library's, whose heap it trims after large changes, so it answers 501
//! saying so.

use std::time::Duration;

use http::{StatusCode, request::Parts};

use crate::httpd::{Answer, Reply, query_value};

/// Default and bounds of `seconds`, as ztunnel's.
const SECONDS: (u64, std::ops::RangeInclusive<u64>) = (10, 1..=300);
/// Default and bounds of `frequency` (samples per second), as ztunnel's.
const FREQUENCY: (i32, std::ops::RangeInclusive<i32>) = (100, 1..=1000);

/// Libraries whose frames the sampler does not unwind through (a signal
/// that lands inside them could deadlock the unwinder; pprof-rs's advice).
const BLOCKLIST: [&str; 4] = ["libc", "libgcc", "pthread", "vdso"];

/// Content type of a pprof protobuf.
const PROFILE: &str = "application/octet-stream";

/// `GET /debug/pprof/profile`.
pub fn cpu(request: &Parts) -> Answer {
    let query = request.uri.query();
    let seconds = match parse(query_value(query, "seconds"), SECONDS) {
        Ok(seconds) => seconds,
        Err(()) => return bad("seconds", &SECONDS.1),
    };
    let frequency = match parse(query_value(query, "frequency"), FREQUENCY) {
        Ok(frequency) => frequency,
        Err(()) => return bad("frequency", &FREQUENCY.1),
    };
    let guard = match pprof::ProfilerGuardBuilder::default()
        .frequency(frequency)
        .blocklist(&BLOCKLIST)
        .build()
    {
        Ok(guard) => guard,
        Err(pprof::Error::Running) => {
            return Reply::text(
                StatusCode::CONFLICT,
                "a CPU profile is being taken; ask again once it is done\n",
            )
            .into();
        }
        Err(err) => {
            return Reply::text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot start the CPU profiler: {err}\n"),
            )
            .into();
        }
    };
    tracing::info!(seconds, frequency, "CPU profile started");
    Answer::Later(Box::pin(async move {
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        // Resolving the sampled addresses to symbols reads the binary's
        // symbol tables: off the runtime's threads.
        let encoded = tokio::task::spawn_blocking(move || {
            use pprof::protos::Message as _;
            let report = guard.report().build()?;
            drop(guard);
            Ok::<_, pprof::Error>(report.pprof()?.encode_to_vec())
        })
        .await;
        match encoded {
            Ok(Ok(body)) => {
                tracing::info!(seconds, bytes = body.len(), "CPU profile taken");
                Reply {
                    status: StatusCode::OK,
                    content_type: PROFILE,
                    body: body.into(),
                }
            }
            Ok(Err(err)) => Reply::text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot build the CPU profile: {err}\n"),
            ),
            Err(err) => Reply::text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("building the CPU profile failed: {err}\n"),
            ),
        }
    }))
}

/// `GET /debug/pprof/heap`.
pub fn heap() -> Answer {
    Reply::text(
        StatusCode::NOT_IMPLEMENTED,
        "heap profiles need a sampling allocator (ztunnel links jemalloc for them); \
         this agent uses the C library's allocator. Use /debug/pprof/profile for CPU, \
         and the process metrics on /metrics for memory.\n",
    )
    .into()
}

/// `value` as a number within `bounds`, or the default when absent.
fn parse<T>(
    value: Option<&str>,
    (default, bounds): (T, std::ops::RangeInclusive<T>),
) -> Result<T, ()>
where
    T: std::str::FromStr + PartialOrd + Copy,
{
    match value {
        None => Ok(default),
        Some(text) => match text.parse() {
            Ok(n) if bounds.contains(&n) => Ok(n),
            _ => Err(()),
        },
    }
}

fn bad<T: std::fmt::Display>(name: &str, bounds: &std::ops::RangeInclusive<T>) -> Answer {
    Reply::text(
        StatusCode::BAD_REQUEST,
        format!(
            "invalid {name} value; expected {}-{}\n",
            bounds.start(),
            bounds.end()
        ),
    )
    .into()
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use http::StatusCode;

    use super::{FREQUENCY, SECONDS, cpu, parse};
    use crate::httpd::Answer;

    #[test]
    fn bounds_refuse_what_is_outside_them_and_defaults_fill_what_is_absent() {
        assert_eq!(parse(None, SECONDS), Ok(10));
        assert_eq!(parse(Some("300"), SECONDS), Ok(300));
        for bad in ["0", "301", "-1", "ten", ""] {
            assert_eq!(parse(Some(bad), SECONDS), Err(()), "{bad}");
        }
        assert_eq!(parse(None, FREQUENCY), Ok(100));
        assert_eq!(parse(Some("1000"), FREQUENCY), Ok(1000));
        assert_eq!(parse(Some("1001"), FREQUENCY), Err(()));
    }

    #[test]
    fn a_second_profile_while_one_runs_is_refused_and_one_after_it_is_not() {
        let request = |query: &str| {
            http::Request::get(format!("/debug/pprof/profile?{query}"))
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        // The profiler runs from the request on (the answer is not
        // awaited here; dropping it stops the profiler).
        let first = cpu(&request("seconds=300"));
        assert!(matches!(first, Answer::Later(_)), "{first:?}");
        match cpu(&request("seconds=1")) {
            Answer::Now(reply) => assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}"),
            other => panic!("a second profile started: {other:?}"),
        }
        drop(first);
        let after = cpu(&request("seconds=1&frequency=1"));
        assert!(matches!(after, Answer::Later(_)), "{after:?}");
    }
}
