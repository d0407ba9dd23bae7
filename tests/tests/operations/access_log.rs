//! Access records (log target `access`): one per connection with its byte
//! counts, as text and as JSON objects.

use super::*;

#[test]
fn access_log_has_one_record_per_connection_with_the_byte_counts() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("opaccess")?;
    let (a1, a2) = mesh.agents("op", &mesh.mesh_config())?;
    let _servers = [
        doubling_server(&mesh.remote, 9000)?,
        doubling_server(&mesh.local, 9000)?,
        doubling_server(&mesh.plain, 9100)?,
    ];
    // (size, destination, destination workload, its node)
    let conns = [
        (10_001, addr(&mesh.remote, 9000), Some("remote"), 2),
        (20_002, addr(&mesh.remote, 9000), Some("remote"), 2),
        (30_003, addr(&mesh.local, 9000), Some("local"), 1),
        (5_005, addr(&mesh.plain, 9100), None, 2),
    ];
    for (len, dst, _, _) in conns {
        exchange(&mesh.client, dst, len)?;
    }
    wait_until("both agents to log every leg", || {
        Ok(
            access_records(&a1.log_text(), "connection closed").len() >= 5
                && access_records(&a2.log_text(), "connection closed").len() >= 2,
        )
    })?;
    let (log1, log2) = (a1.log_text(), a2.log_text());
    let (r1, r2) = (
        access_records(&log1, "connection closed"),
        access_records(&log2, "connection closed"),
    );
    assert_eq!(
        r1.len(),
        5,
        "node1: 4 outbound + 1 same-node inbound:\n{log1}"
    );
    assert_eq!(r2.len(), 2, "node2: the 2 cross-node inbound:\n{log2}");
    for (len, dst, workload, node) in conns {
        let principal = |w| format!("spiffe://cluster.local/ns/test/sa/{w}");
        let (dst, n, n2) = (dst.to_string(), len.to_string(), (2 * len).to_string());
        let (dst_ns, dst_id) = workload.map_or(("-", "-".into()), |w| ("test", principal(w)));
        let protocol = if workload.is_some() { "HBONE" } else { "TCP" };
        let mut want = vec![
            ("protocol", protocol),
            ("dst", &dst),
            ("src_workload", "client"),
            ("src_namespace", "test"),
            ("src_identity", CLIENT_ID),
            ("dst_workload", workload.unwrap_or("-")),
            ("dst_namespace", dst_ns),
            ("dst_identity", &dst_id),
            ("bytes_sent", &n),
            ("bytes_received", &n2),
            ("error", "-"),
        ];
        // Outbound on node1; inbound where the server's agent runs (none for
        // the pod outside the mesh).
        let mut sides = vec![("outbound", &r1)];
        if workload.is_some() {
            sides.push(("inbound", if node == 1 { &r1 } else { &r2 }));
        }
        for (direction, records) in sides {
            want.push(("direction", direction));
            let found: Vec<_> = records
                .iter()
                .filter(|r| want.iter().all(|(k, v)| field(r, k) == *v))
                .collect();
            assert_eq!(found.len(), 1, "{want:?}:\n{log1}\n{log2}");
            assert!(field(found[0], "duration_ms").parse::<u64>().is_ok());
            // Both sides name the client pod's address (outbound, not the
            // loopback the capture listener saw).
            let src: SocketAddr = field(found[0], "src").parse()?;
            assert_eq!(src.ip(), IpAddr::V4(mesh.client.ip4), "{:?}", found[0]);
            want.pop();
        }
    }
    Ok(())
}

#[test]
fn json_logs_carry_access_records_as_objects() -> anyhow::Result<()> {
    let mesh = TwoNodes::new("opjson")?;
    let config = mesh.config()?;
    let a1 = mesh.agent("opj", 1, &config, &["--log-format", "json"])?;
    let _a2 = mesh.agent("opj", 2, &config, &[])?;
    let _server = doubling_server(&mesh.remote, 9000)?;
    exchange(&mesh.client, addr(&mesh.remote, 9000), 7_007)?;
    let closed = |log: &str| -> Vec<Value> {
        log.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["target"] == "access" && v["message"] == "connection closed")
            .collect()
    };
    wait_until("the JSON access record", || {
        Ok(!closed(&a1.log_text()).is_empty())
    })?;
    let log = a1.log_text();
    // Every line is one JSON object.
    for line in log.lines() {
        serde_json::from_str::<Value>(line).map_err(|e| anyhow::anyhow!("{e}: {line}"))?;
    }
    let records = closed(&log);
    assert_eq!(records.len(), 1, "{log}");
    let r = &records[0];
    assert_eq!(r["direction"], "outbound", "{r}");
    assert_eq!(r["protocol"], "HBONE", "{r}");
    assert_eq!(r["src_workload"], "client", "{r}");
    assert_eq!(
        r["dst_identity"], "spiffe://cluster.local/ns/test/sa/remote",
        "{r}"
    );
    assert_eq!(r["bytes_sent"], 7_007, "{r}");
    assert_eq!(r["bytes_received"], 14_014, "{r}");
    assert_eq!(r["level"], "INFO", "{r}");
    Ok(())
}
