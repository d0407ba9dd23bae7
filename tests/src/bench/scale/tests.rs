use super::*;
use super::{conn::conn_time_ms, proxies::check_held, report::*};

fn result(scale: f64) -> ScaleResult {
    ScaleResult {
        first_state_ms: 120.0 * scale,
        first_state_cpu_ms: 80.0 * scale,
        rss_first: (27e6 * scale) as u64,
        rss_peak_first: (31e6 * scale) as u64,
        rss_after_churn: (30e6 * scale) as u64,
        updates: 600,
        acked: 600,
        cpu_per_update_ms: 0.5 * scale,
        ack_p50_ms: 4.0 * scale,
        ack_p99_ms: 18.0 * scale,
        conns: 0,
        conn_p50_ms: None,
        conn_p99_ms: None,
        conn_cpu_ms: None,
    }
}

#[test]
fn figures_are_written_to_their_size() {
    assert_eq!(ms(0.184), "0.18 ms");
    assert_eq!(ms(4.04), "4.0 ms");
    assert_eq!(ms(450.2), "450 ms");
    assert_eq!(ms(53_400.0), "53.4 s");
    assert_eq!(ms(f64::NAN), "-");
    assert_eq!(ratio(1.0, 2.0), "0.50x");
    assert_eq!(ratio(7.0, 2.0), "3.5x");
    assert_eq!(ratio(85_000.0, 1.0), "85000x");
    assert_eq!(ratio(1.0, 0.0), "-");
    assert_eq!(ratio(f64::NAN, 1.0), "-");
    assert_eq!(count(1_000), "1k");
    assert_eq!(count(100_000), "100k");
    assert_eq!(count(1_000_000), "1M");
    assert_eq!(count(1_500), "1500");
    assert_eq!(count(10), "10");
}

#[test]
fn the_table_sets_ours_beside_ztunnel() {
    let row = ScaleRow {
        workloads: 1_000,
        services: 100,
        policies: 10,
        first_push_bytes: 0,
        ours: result(2.0),
        ztunnel: Some(result(1.0)),
        ztunnel_error: None,
    };
    let text = table(std::slice::from_ref(&row));
    assert!(text.contains("| 1k (100, 10) | first complete state: time / CPU | 240 ms / 160 ms | 120 ms / 80.0 ms | 2.0x / 2.0x |"), "{text}");
    assert!(
        text.contains("|  | CPU per update | 1.0 ms | 0.50 ms | 2.0x |"),
        "{text}"
    );
    assert!(
        text.contains("|  | RSS per workload (first state) | 54.0 KB | 27.0 KB | 2.0x |"),
        "{text}"
    );
    // No connection figures: none was measured.
    assert_eq!(text.lines().count(), 2 + FIGURES.len() - 2);

    let failed = ScaleRow {
        ztunnel: None,
        ztunnel_error: Some("ztunnel exited:\nlog".to_owned()),
        ..row.clone()
    };
    let text = table(&[failed]);
    assert!(text.contains("| failed | - |"), "{text}");
    assert!(text.contains("- ztunnel at 1k: ztunnel exited:"), "{text}");

    let alone = ScaleRow {
        ztunnel: None,
        ..row
    };
    let text = table(&[alone]);
    assert!(
        text.starts_with("| workloads (services, policies) | first state"),
        "{text}"
    );
    assert_eq!(text.lines().count(), 3);
}

#[test]
fn the_held_state_must_match_what_istiod_served() -> anyhow::Result<()> {
    let mesh = synthetic_mesh(200);
    let mut held = HeldState {
        workloads: mesh
            .workloads
            .iter()
            .map(|w| (w.uid.to_string(), w.node.to_string()))
            .collect(),
        services: mesh.services.len(),
        policies: mesh.policies.len(),
    };
    check_held(&held, &mesh, None)?;
    let moved = workload(3, &mesh.services, 5);
    assert!(check_held(&held, &mesh, Some(&moved)).is_err());
    held.workloads[3].1 = moved.node.to_string();
    check_held(&held, &mesh, Some(&moved))?;
    held.policies = 0;
    assert!(check_held(&held, &mesh, None).is_err());
    Ok(())
}

#[test]
fn service_vips_are_distinct_up_to_a_million() {
    assert_eq!(service_vip(0), IpAddr::from([172, 16, 0, 0]));
    assert_eq!(service_vip(257), IpAddr::from([172, 16, 1, 1]));
    assert_eq!(service_vip(65_536), IpAddr::from([172, 17, 0, 0]));
    assert_eq!(service_vip(999_999), IpAddr::from([172, 31, 66, 63]));
}

#[test]
fn a_connection_time_from_dp_loads_report() -> anyhow::Result<()> {
    let report = r#"{"ops":1,"secs":0.002,"rate":500.0,"latency":{"samples":1,"p50_us":1523.5,"p99_us":1523.5}}"#;
    assert!((conn_time_ms(report)? - 1.5235).abs() < 1e-9);
    assert!(conn_time_ms(r#"{"ops":1}"#).is_err());
    assert!(conn_time_ms("oops").is_err());
    Ok(())
}

#[test]
fn the_ack_guard_grows_with_the_mesh() {
    assert_eq!(ack_limit(0), Duration::from_secs(300));
    assert_eq!(ack_limit(100_000), Duration::from_secs(800));
}
