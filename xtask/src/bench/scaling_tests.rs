//! The model's arithmetic and choice of limit, on the figures of issue 32's
//! side-by-side run (2 vCPUs, cross-node HBONE): ours 3,231 conn/s at
//! 3.25 s of proxy CPU per 10k connections with the machine 77 % busy,
//! ztunnel 3,100 at 4.18 s and 91 %, no mesh 17,088 at 92 %; bulk with
//! the machine saturated.

use serde_json::json;

use super::*;

const CORES_RUN: usize = 2;

fn close(actual: Option<f64>, expected: f64) -> bool {
    actual.is_some_and(|a| (a - expected).abs() <= expected.abs() * 1e-3)
}

/// Machine CPU seconds per connection from the rate and the busy share.
fn machine_s(rate: f64, busy: f64) -> f64 {
    busy * CORES_RUN as f64 / rate
}

fn ours_conn() -> ConnCosts {
    ConnCosts {
        rate: 3231.0,
        proxy_s: 3.25e-4,
        machine_s: machine_s(3231.0, 0.77),
        clients: 5.0,
        latency_s: Some(450e-6),
    }
}

fn ztunnel_conn() -> ConnCosts {
    ConnCosts {
        rate: 3100.0,
        proxy_s: 4.18e-4,
        machine_s: machine_s(3100.0, 0.91),
        clients: 5.0,
        latency_s: Some(420e-6),
    }
}

fn binding(p: &Projection) -> Option<Limit> {
    p.binding().map(|(l, _)| l)
}

#[test]
fn ztunnel_workers_follow_its_default() {
    let counts: Vec<usize> = [1, 2, 4, 9, 16, 64]
        .into_iter()
        .map(ztunnel_workers)
        .collect();
    assert_eq!(counts, [2, 2, 2, 3, 4, 16]);
}

#[test]
fn connection_rate_moves_from_cpu_to_one_pinned_worker_for_ours() {
    let ours = ours_conn();
    let at = |n| ours.project(Threading::Pinned, n, CORES_RUN);
    // 2 cores: 2 / 4.766e-4 s = 4,196/s, CPU-bound, 30 % above the 3,231
    // measured: the idle fifth of the machine.
    let two = at(2);
    assert!(close(two.value(), 4196.1), "{two:?}");
    assert!(
        matches!(binding(&two), Some(Limit::Cpu { proxy_share }) if (proxy_share - 0.682).abs() < 1e-3),
        "{two:?}"
    );
    // From 4 cores one worker per end binds: 1 / (3.25e-4 / 2) = 6,154/s,
    // however many cores.
    for n in [4, 16, 64] {
        let p = at(n);
        assert_eq!(
            binding(&p),
            Some(Limit::ProxyThreads { threads: 1 }),
            "{p:?}"
        );
        assert!(close(p.value(), 6153.8), "{p:?}");
    }
    // The CPU bound itself keeps growing with the cores.
    let cpu64 = at(64)
        .bounds
        .iter()
        .find(|(l, _)| matches!(l, Limit::Cpu { .. }))
        .map(|(_, v)| *v);
    assert!(close(cpu64, 134_275.0), "{cpu64:?}");
}

#[test]
fn connection_rate_of_ztunnel_follows_its_worker_count() {
    let z = ztunnel_conn();
    let at = |n| z.project(Threading::Ztunnel, n, CORES_RUN);
    // 2 and 4 cores: CPU (2 / 5.871e-4 s = 3,407/s; twice that).
    for (n, expected) in [(2, 3406.6), (4, 6813.2)] {
        let p = at(n);
        assert!(matches!(binding(&p), Some(Limit::Cpu { .. })), "{p:?}");
        assert!(close(p.value(), expected), "{p:?}");
    }
    // 16 cores: 4 workers per end, 4 / 2.09e-4 s = 19,139/s, below the
    // CPU's 27,253; 64 cores: 16 workers, 76,555/s.
    for (n, threads, expected) in [(16, 4, 19_138.8), (64, 16, 76_555.0)] {
        let p = at(n);
        assert_eq!(binding(&p), Some(Limit::ProxyThreads { threads }), "{p:?}");
        assert!(close(p.value(), expected), "{p:?}");
    }
}

#[test]
fn a_long_connection_latency_makes_the_clients_the_limit() {
    // 5 clients each waiting 2 ms per connection: 2,500/s whatever the
    // CPU, and twice that with twice the cores (and clients).
    let slow = ConnCosts {
        latency_s: Some(2e-3),
        ..ours_conn()
    };
    let two = slow.project(Threading::Pinned, 2, CORES_RUN);
    assert_eq!(binding(&two), Some(Limit::Clients { clients: 5.0 }));
    assert!(close(two.value(), 2500.0), "{two:?}");
    let four = slow.project(Threading::Pinned, 4, CORES_RUN);
    assert_eq!(binding(&four), Some(Limit::Clients { clients: 10.0 }));
    assert!(close(four.value(), 5000.0), "{four:?}");
    // Without the latency measured there is no such bound.
    let unknown = ConnCosts {
        latency_s: None,
        ..slow
    };
    let p = unknown.project(Threading::Pinned, 2, CORES_RUN);
    assert!(matches!(binding(&p), Some(Limit::Cpu { .. })), "{p:?}");
}

#[test]
fn bulk_is_bound_by_cpu_then_one_core_per_stream_or_the_flow_path() {
    let flow = Some(19.8);
    // Ours, 1 stream: 8 x 2 / 2.54 s/GB = 6.30 Gbit/s on 2 cores; from 4
    // cores one worker per end at 2.07 / 2 s/GB: 7.73 Gbit/s.
    let ours = BulkCosts {
        streams: 1,
        gbps: 6.31,
        proxy_s_per_gb: 2.07,
        machine_s_per_gb: 2.54,
    };
    let p = ours.project(Threading::Pinned, 2, flow);
    assert!(matches!(binding(&p), Some(Limit::Cpu { .. })), "{p:?}");
    assert!(close(p.value(), 6.299), "{p:?}");
    for n in [4, 64] {
        let p = ours.project(Threading::Pinned, n, flow);
        assert_eq!(binding(&p), Some(Limit::ProxyThreads { threads: 1 }));
        assert!(close(p.value(), 7.729), "{p:?}");
    }
    // ztunnel, 4 streams: CPU on 2 and 4 cores; on 16 its 4 workers each
    // carry a stream (4 x 8 / 1.135 = 28.2 Gbit/s), and 16 workers do no
    // better, one stream being one task.
    let z4 = BulkCosts {
        streams: 4,
        gbps: 5.10,
        proxy_s_per_gb: 2.27,
        machine_s_per_gb: 3.15,
    };
    let p = z4.project(Threading::Ztunnel, 4, flow);
    assert!(matches!(binding(&p), Some(Limit::Cpu { .. })), "{p:?}");
    assert!(close(p.value(), 10.159), "{p:?}");
    for n in [16, 64] {
        let p = z4.project(Threading::Ztunnel, n, flow);
        assert_eq!(binding(&p), Some(Limit::ProxyThreads { threads: 4 }));
        assert!(close(p.value(), 28.194), "{p:?}");
    }
    // ztunnel, 1 stream: one worker carries it, whatever the count.
    let z1 = BulkCosts {
        streams: 1,
        gbps: 5.54,
        proxy_s_per_gb: 2.01,
        machine_s_per_gb: 2.89,
    };
    let p = z1.project(Threading::Ztunnel, 64, flow);
    assert_eq!(binding(&p), Some(Limit::ProxyThreads { threads: 1 }));
    assert!(close(p.value(), 7.960), "{p:?}");
    // No mesh, 1 stream: CPU on 2 cores (19.5), then one flow's kernel
    // path (19.8) with CPU to spare (39.0 on 4 cores).
    let direct = BulkCosts {
        streams: 1,
        gbps: 19.8,
        proxy_s_per_gb: 0.0,
        machine_s_per_gb: 0.82,
    };
    let p = direct.project(Threading::NoProxy, 2, flow);
    assert!(
        matches!(binding(&p), Some(Limit::Cpu { proxy_share }) if proxy_share == 0.0),
        "{p:?}"
    );
    assert!(close(p.value(), 19.512), "{p:?}");
    let p = direct.project(Threading::NoProxy, 4, flow);
    assert_eq!(binding(&p), Some(Limit::FlowPath { streams: 1 }));
    assert!(close(p.value(), 19.8), "{p:?}");
    assert_eq!(p.bounds.len(), 2, "no proxy bound without a proxy: {p:?}");
}

fn sample(
    workload: &str,
    mode: &str,
    protocol: &str,
    result: Value,
    agent: f64,
    machine: f64,
) -> Value {
    json!({
        "ok": true, "workload": workload, "placement": "cross-node",
        "mode": mode, "protocol": protocol, "round": 0, "result": result,
        "agent_cpu_s": agent, "machine_cpu_s": machine, "machine_kernel_s": 0.1,
    })
}

#[test]
fn a_run_is_modelled_checked_on_its_cores_and_reported() -> anyhow::Result<()> {
    let conn = |rate: f64| json!({"ops": 10_000, "rate": rate});
    let bulk = |gbps: f64| json!({"ops": 1, "bytes": 1e9, "gbps": gbps});
    let samples = [
        sample(
            "conn-rate",
            "ebpf",
            "hbone",
            conn(3231.0),
            3.25,
            10_000.0 * machine_s(3231.0, 0.77),
        ),
        sample(
            "conn-rate",
            "ztunnel",
            "hbone",
            conn(3100.0),
            4.18,
            10_000.0 * machine_s(3100.0, 0.91),
        ),
        sample("bulk-1", "ebpf", "hbone", bulk(6.31), 2.07, 2.54),
        sample("bulk-1", "direct", "plain", bulk(19.8), 0.0, 0.82),
    ];
    let figures = Figures::from_samples(&samples)?;
    let meta = json!({"machine": {"cpus": 2}, "counts": {"conn_concurrency": 5}});
    let model = Model::from_run(&figures, &meta);
    assert_eq!(model.measured_cores, 2);
    let names: Vec<(&str, &str)> = model.rows.iter().map(|r| (r.figure, r.path)).collect();
    assert_eq!(
        names,
        [
            ("connections/s", "ztunnel"),
            ("connections/s", "ours"),
            ("bulk 1 stream Gbit/s", "no mesh"),
            ("bulk 1 stream Gbit/s", "ours"),
        ]
    );
    let ours = &model.rows[1];
    let cores: Vec<usize> = ours.projections.iter().map(|p| p.cores).collect();
    assert_eq!(cores, [2, 4, 16, 64]);
    assert!(close(ours.error(), 0.2987), "{ours:?}");
    // No conn-rr run: no latency, no clients bound.
    assert_eq!(ours.projections[0].bounds.len(), 2, "{ours:?}");

    let md = model.markdown();
    assert!(
        md.contains(
            "| connections/s | ours | 3,231 | 4,196 (CPU, proxy 68 %) (+30 %) | 6,154 (1 proxy core per end) |"
        ),
        "{md}"
    );
    assert!(
        md.contains("| bulk 1 stream Gbit/s | no mesh | 19.8 | 19.5 (CPU) (-1 %) | 19.8 (kernel path, 1 flow) |"),
        "{md}"
    );
    let json = model.to_json();
    assert_eq!(json["measured_cores"], 2);
    assert_eq!(json["rows"][1]["projections"][1]["limit"], "proxy_threads");
    assert_eq!(json["rows"][1]["projections"][0]["limit"], "cpu");
    assert!(
        json["rows"][1]["error_at_measured_cores"]
            .as_f64()
            .is_some()
    );
    Ok(())
}

#[test]
fn a_run_without_conn_rate_or_bulk_says_so() -> anyhow::Result<()> {
    let model = Model::from_run(&Figures::from_samples(&[])?, &json!({}));
    assert!(model.rows.is_empty());
    assert!(
        model
            .markdown()
            .contains("No connection-rate or bulk run to model.")
    );
    Ok(())
}
