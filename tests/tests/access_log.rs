//! Access records sampled by outcome (`--access-log-sample`,
//! istio/istio#43376): an agent told to write none of the clean closes
//! writes none of them, yet every failure; an agent left at the default
//! writes every one. The failures are written at `warn`, so a log filter
//! `access=warn` keeps exactly them.
//!
//! Access records are matched as log text: those lines are what operators
//! consume. That every decision was made is read from `/metrics` first.

use dataplane_tests::{
    mesh::{TwoNodes, addr},
    observe::{access_records, field, scrape, sum_matching},
    traffic::{echo, echo_server, try_stream, wait_until},
};

#[test]
fn a_zero_sample_drops_clean_closes_and_keeps_every_failure() -> anyhow::Result<()> {
    let w = TwoNodes::new("acclog")?;
    let path = w.write(&w.echo_config())?;
    let a1 = w.agent("acclog", 1, &path, &["--access-log-sample", "0"])?;
    let a2 = w.agent("acclog", 2, &path, &[])?;
    let _remote = echo_server(&w.remote, 9000)?;
    for seed in 0..3 {
        echo(&w.client, addr(&w.remote, 9000), 100, seed)?;
    }
    // Nothing listens on 9001: the far side cannot reach the app.
    let failing = try_stream(
        &w.client,
        &["echo", &addr(&w.remote, 9001).to_string(), "100", "9"],
    )?;
    anyhow::ensure!(failing.code != Some(0), "{}", failing.stdout);

    // Each agent has counted the three clean closes, so each record of
    // them was written or left out by then.
    for (agent, reporter) in [(&a1, "source"), (&a2, "destination")] {
        wait_until("the clean closes to be counted", || {
            let clean = sum_matching(
                &scrape(agent)?,
                "istio_tcp_connections_closed_total",
                &[("reporter", reporter), ("response_flags", "-")],
            );
            Ok(clean == 3.0)
        })?;
    }
    let failures = |log: &str| {
        access_records(log, "connection failed").len()
            + access_records(log, "connection refused").len()
    };
    wait_until("both agents to write the failure", || {
        Ok(failures(&a1.log_text()) >= 1 && failures(&a2.log_text()) >= 1)
    })?;
    let (l1, l2) = (a1.log_text(), a2.log_text());
    assert_eq!(
        access_records(&l1, "connection closed").len(),
        0,
        "a clean close was written at sample 0:\n{l1}"
    );
    let written = access_records(&l2, "connection closed");
    assert_eq!(written.len(), 3, "the default writes every one:\n{l2}");
    assert!(written.iter().all(|r| field(r, "response_flags") == "-"));
    // Failures are warnings; clean closes are not.
    for line in l1.lines().chain(l2.lines()) {
        if line.contains(" access: connection failed ") {
            assert!(line.contains("WARN"), "{line}");
        }
        if line.contains(" access: connection closed ") {
            assert!(line.contains("INFO"), "{line}");
        }
    }
    Ok(())
}
