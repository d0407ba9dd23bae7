//! The queries a pod makes are logged on their own target when asked.

use super::*;

/// The queries a pod makes, on the log target `dns` (as ztunnel's): off at
/// the default level, one record per query once `dns=debug` is set, naming
/// the pod, the query, the result and how many records answered it.
#[test]
fn queries_are_logged_on_their_own_target_when_asked() -> anyhow::Result<()> {
    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnslog", upstream.addr())?;
    let server = asked(ASKED_V4);
    let mesh_name = format!("echo.{NAMESPACE}.svc.cluster.local.");
    let records = |agent: &Agent| -> Vec<HashMap<String, String>> {
        agent
            .log_text()
            .lines()
            .filter_map(|line| line.split_once(" dns: query answered "))
            .map(|(_, fields)| parse_fields(fields))
            .collect()
    };
    query(&w.client, "udp", server, &mesh_name, "A", None)?;
    assert!(records(&w.agent).is_empty(), "{}", w.agent.log_text());
    let admin = w.agent.admin_addr()?;
    let (status, body) = http(admin, "POST", "/logging?level=info,dns=debug")?;
    assert_eq!(status, 200, "{body}");
    query(&w.client, "udp", server, &mesh_name, "A", None)?;
    query(&w.client, "tcp", server, "www.up.test.", "A", None)?;
    wait_until("both queries to be logged", || {
        Ok(records(&w.agent).len() >= 2)
    })?;
    let logged = records(&w.agent);
    let mesh = logged
        .iter()
        .find(|r| field(r, "domain") == mesh_name)
        .ok_or_else(|| anyhow::anyhow!("no record of {mesh_name}: {logged:?}"))?;
    assert_eq!(
        (
            field(mesh, "result"),
            field(mesh, "answers"),
            field(mesh, "query"),
            field(mesh, "protocol"),
            field(mesh, "src_namespace"),
        ),
        ("mesh", "1", "A", "udp", NAMESPACE),
        "{mesh:?}"
    );
    assert!(!field(mesh, "src_workload").is_empty(), "{mesh:?}");
    let forwarded = logged
        .iter()
        .find(|r| field(r, "domain") == "www.up.test.")
        .ok_or_else(|| anyhow::anyhow!("no record of www.up.test.: {logged:?}"))?;
    assert_eq!(
        (field(forwarded, "result"), field(forwarded, "protocol")),
        ("forwarded", "tcp"),
        "{forwarded:?}"
    );
    Ok(())
}
