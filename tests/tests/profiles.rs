//! CPU profiles from the admin port (`GET /debug/pprof/profile`), as
//! ztunnel serves them: a profile of an agent serving connections is
//! a pprof protobuf whose samples name the agent's own code; bad bounds are
//! refused with 400, and a heap profile is answered 501 with the reason.

use dataplane_tests::{
    mesh::{TwoNodes, addr},
    traffic::{echo_server, http, http_bytes},
    upgrade::Loop,
};
use pprof::protos::{Message as _, Profile};

#[test]
fn a_cpu_profile_of_an_agent_at_work_names_its_code() -> anyhow::Result<()> {
    // Node 1's agent serves `client` and `local`.
    let w = TwoNodes::new("prof")?;
    let agent = w.agent("prof", 1, &w.config()?, &[])?;
    let _echo = echo_server(&w.local, 9000)?;
    let admin = agent.admin_addr()?;

    // Refusals first: they must not start the profiler.
    for query in [
        "seconds=0",
        "seconds=301",
        "seconds=x",
        "frequency=0",
        "frequency=1001",
    ] {
        let (status, text) = http(admin, "GET", &format!("/debug/pprof/profile?{query}"))?;
        assert_eq!(status, 400, "{query}: {text}");
    }
    let (status, text) = http(admin, "GET", "/debug/pprof/heap")?;
    assert_eq!(status, 501, "{text}");
    assert!(text.contains("jemalloc"), "{text}");
    let (status, _) = http(admin, "POST", "/debug/pprof/profile")?;
    assert_eq!(status, 405);

    // Connections one after another between two pods of the agent
    // meanwhile (the same-node fast path splices them after the agent
    // accepted and decided each).
    let mut load = Loop::start("client (HBONE)", &w.client, addr(&w.local, 9000))?;
    load.advance(20)?;
    let (status, body) = http_bytes(admin, "GET", "/debug/pprof/profile?seconds=2&frequency=500")?;
    load.advance(1)?;
    let counts = load.finish()?;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(counts["reset"], 0, "{counts}");

    let profile = Profile::decode(body.as_slice())?;
    let samples: i64 = profile.sample.iter().filter_map(|s| s.value.first()).sum();
    assert!(samples > 0, "a profile of a busy agent has no samples");
    // The functions sampled, by name (pprof's string table).
    let names: Vec<&str> = profile
        .function
        .iter()
        .filter_map(|f| profile.string_table.get(usize::try_from(f.name).ok()?))
        .map(String::as_str)
        .collect();
    for ours in ["dataplane_engine::", "tokio::"] {
        assert!(
            names.iter().any(|name| name.contains(ours)),
            "no sampled function of {ours} among {names:?}"
        );
    }
    // Once it is done, another may be taken.
    let (status, _) = http_bytes(admin, "GET", "/debug/pprof/profile?seconds=1&frequency=10")?;
    assert_eq!(status, 200);
    Ok(())
}
