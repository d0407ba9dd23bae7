//! The engine's hot user-space paths, each paid once per captured
//! connection:
//!
//! - `workload_lookup_hit` / `workload_lookup_miss`: `WorkloadIndex::by_ip`
//!   among 10,000 workloads (20,000 IPs), for a mesh destination and for a
//!   destination outside the mesh (the passthrough case).
//! - `pool_connect_warm`: `HbonePool::connect` on a warm pool: stream slot
//!   checkout, CONNECT request, HTTP/2 round trip to a server on loopback
//!   TCP (no TLS: the TLS cost is `tls_provider`'s), 200 back, tunnel
//!   returned; dropped again.
//! - `connect_request`: building the CONNECT request with its `forwarded`,
//!   `baggage` and `traceparent` headers (`hbone::wire`), traceparent
//!   included, the pod's `baggage` taken from its cache as the engine
//!   does; `connect_request_uncached`: the same with `baggage` formatted
//!   from the pod's peer for each request, as before the cache.
//! - `flow_open_close`: the per-connection telemetry: a `Flow` with both
//!   peers known is opened (Istio's label set resolved, opened counter,
//!   open gauge) and closed (bytes, closed counter, access record; no log
//!   subscriber here, so formatting the record is not included).
//! - `policy_decision`: `MeshState::authorize` for an HBONE stream: the
//!   destination workload found among 10,000, the 25 policies that apply
//!   to it evaluated (1,005 in the mesh), the client's identity as the
//!   connection carries it. Evaluation alone at larger scale:
//!   `benches/policy.rs`, which `cargo xtask bench` runs beside these.
//!
//! `cargo xtask bench` runs them briefly after the kernel-level
//! benchmarks and puts them in its report; alone:
//! `cargo bench -p dataplane-user --bench hot_paths`.

use std::{
    future::Future,
    hint::black_box,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use dataplane_user::{
    config::LocalConfig,
    hbone::{Dialer, HbonePool, PoolKey, wire},
    identity::Identity,
    policy::Request,
    state::{MeshState, WorkloadIndex},
    telemetry::{Direction, Flow, Metrics, Peer, Protocol, ServiceRef},
};
use tokio::net::{TcpListener, TcpStream};

const WORKLOADS: u32 = 10_000;

/// The i-th workload's IPv4 address (10.x.y.z, unique for i < 2^24).
fn workload_ip(i: u32) -> Ipv4Addr {
    let [_, a, b, c] = i.to_be_bytes();
    Ipv4Addr::new(10, a, b, c)
}

/// A local config with `WORKLOADS` dual-stack HBONE workloads.
fn big_config() -> LocalConfig {
    LocalConfig::parse(&workloads_yaml(), "bench").expect("valid generated config")
}

/// 1,000 Namespace policies over the workloads' 50 namespaces (20 apply
/// to each workload) and 5 Global ones matching on principals.
fn policed_config() -> LocalConfig {
    let mut text = workloads_yaml();
    text.push_str("policies:\n");
    for i in 0..1000 {
        text.push_str(&format!(
            "- {{name: p{i}, namespace: ns{ns}, scope: Namespace, action: {action}, rules: [[[{{namespaces: [front{i}], destinationPorts: [{port}]}}], [{{sourceIps: [10.{a}.0.0/16]}}]]]}}\n",
            ns = i % 50,
            action = if i % 3 == 0 { "Deny" } else { "Allow" },
            port = 8000 + (i % 100),
            a = i % 250,
        ));
    }
    for g in 0..5 {
        text.push_str(&format!(
            "- {{name: global{g}, namespace: mesh, scope: Global, action: Deny, rules: [[[{{notPrincipals: ['cluster.local/*'], destinationPorts: [{}]}}]]]}}\n",
            9000 + g
        ));
    }
    LocalConfig::parse(&text, "bench").expect("valid generated config")
}

fn workloads_yaml() -> String {
    let mut text = String::from("workloads:\n");
    for i in 0..WORKLOADS {
        text.push_str(&format!(
            "- uid: w{i}\n  name: w{i}\n  namespace: ns{}\n  serviceAccount: sa{i}\n  protocol: HBONE\n  workloadIps: ['{}', 'fd00::{i:x}']\n",
            i % 50,
            workload_ip(i)
        ));
    }
    text
}

fn workload_lookup(c: &mut Criterion) {
    let index = WorkloadIndex::from_config(&big_config()).expect("index");
    assert_eq!(index.len(), WORKLOADS as usize);
    let hits: Vec<IpAddr> = (0..1024)
        .map(|i| workload_ip(i * 7 % WORKLOADS).into())
        .collect();
    let misses: Vec<IpAddr> = (0..1024)
        .map(|i| Ipv4Addr::new(192, 168, (i >> 8) as u8, i as u8).into())
        .collect();
    let mut group = c.benchmark_group("hot_paths");
    let mut n = 0;
    group.bench_function("workload_lookup_hit", |b| {
        b.iter(|| {
            n = (n + 1) & 1023;
            black_box(index.by_ip(black_box(hits[n])).is_some())
        });
    });
    group.bench_function("workload_lookup_miss", |b| {
        b.iter(|| {
            n = (n + 1) & 1023;
            black_box(index.by_ip(black_box(misses[n])).is_some())
        });
    });
    group.finish();
}

fn baggage() -> wire::Baggage {
    wire::Baggage {
        cluster: "Kubernetes".into(),
        namespace: "shop".into(),
        workload: ("pod".into(), "web-0".into()),
        service: "web".into(),
        version: "latest".into(),
        ..wire::Baggage::default()
    }
}

fn connect_request(c: &mut Criterion) {
    let peer = Arc::new(Peer {
        workload: Some("web".into()),
        namespace: Some("shop".into()),
        canonical_service: Some("web".into()),
        ..Peer::default()
    });
    let cache = wire::BaggageCache::default();
    let source: SocketAddr = "10.1.0.11:40000".parse().expect("address");
    let request = |baggage: &http::HeaderValue| {
        wire::connect_request(
            black_box("10.2.0.12:9000"),
            source,
            Some("web.shop.svc.cluster.local"),
            baggage,
            &wire::new_traceparent(),
        )
        .expect("request")
    };
    let mut group = c.benchmark_group("hot_paths");
    group.bench_function("connect_request", |b| {
        b.iter(|| {
            let baggage = cache
                .get(&peer, || wire::Baggage::of(&peer, "shop", "web-0"))
                .expect("baggage");
            black_box(request(&baggage))
        });
    });
    group.bench_function("connect_request_uncached", |b| {
        b.iter(|| {
            let baggage = wire::Baggage::of(black_box(&peer), "shop", "web-0")
                .value()
                .expect("baggage");
            black_box(request(&baggage))
        });
    });
    group.finish();
}

/// Plain TCP to the key's address (the HBONE layer without TLS).
struct TcpDialer;

impl Dialer for TcpDialer {
    type Io = TcpStream;

    fn dial(
        &self,
        key: &PoolKey,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send>> {
        let addr = key.dst_addr;
        Box::pin(async move {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            Ok(stream)
        })
    }
}

/// An HTTP/2 server on loopback that answers every CONNECT with 200 (and
/// carries no data): only the client's side of opening a tunnel is timed.
async fn connect_server() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::Builder::new()
                    .initial_window_size(wire::STREAM_WINDOW)
                    .initial_connection_window_size(wire::CONNECTION_WINDOW)
                    .max_frame_size(wire::MAX_FRAME)
                    .max_concurrent_streams(wire::MAX_STREAMS)
                    .handshake::<_, Bytes>(stream)
                    .await
                else {
                    return;
                };
                while let Some(Ok((_request, mut respond))) = conn.accept().await {
                    let _ = respond.send_response(http::Response::new(()), false);
                }
            });
        }
    });
    Ok(addr)
}

fn pool_connect(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let server = runtime.block_on(connect_server()).expect("server");
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(600));
    let key = PoolKey {
        src_identity: Identity::new("cluster.local", "shop", "web").expect("valid identity"),
        dst_identity: Identity::new("cluster.local", "shop", "db").expect("valid identity"),
        alt_identities: Arc::default(),
        dst_addr: server,
    };
    let source: SocketAddr = "10.1.0.11:40000".parse().expect("address");
    let baggage = baggage().value().expect("baggage");
    let open = |pool: Arc<HbonePool<TcpDialer>>| {
        let key = key.clone();
        let baggage = baggage.clone();
        async move {
            let traceparent = wire::new_traceparent();
            pool.connect(
                &key,
                "10.2.0.12:9000",
                (source, None),
                (&baggage, &traceparent),
                &Bytes::new(),
            )
            .await
            .expect("tunnel")
        }
    };
    // Warm: the connection is dialled once, here.
    drop(runtime.block_on(open(Arc::clone(&pool))));
    let mut group = c.benchmark_group("hot_paths");
    group.bench_function("pool_connect_warm", |b| {
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let started = Instant::now();
                for _ in 0..iters {
                    black_box(open(Arc::clone(&pool)).await);
                }
                started.elapsed()
            })
        });
    });
    group.finish();
    assert_eq!(pool.dials(), 1, "every tunnel reused the warm connection");
}

fn flow_open_close(c: &mut Criterion) {
    let metrics = Arc::new(Metrics::new());
    let peer = |name: &str| {
        Arc::new(Peer {
            workload: Some(name.into()),
            namespace: Some("shop".into()),
            principal: Some(format!("spiffe://cluster.local/ns/shop/sa/{name}").into()),
            canonical_service: Some(name.into()),
            canonical_revision: Some("v1".into()),
            cluster: Some("Kubernetes".into()),
            region: Some("eu".into()),
            zone: Some("eu-1".into()),
        })
    };
    let flow = Flow {
        direction: Direction::Outbound,
        protocol: Protocol::Hbone,
        src: "10.1.0.11:40000".parse().expect("address"),
        dst: Some("10.2.0.12:9000".parse().expect("address")),
        source: peer("client"),
        destination: peer("server"),
        service: Some(Arc::new(ServiceRef {
            hostname: "web.shop.svc.cluster.local".to_owned(),
            name: "web".to_owned(),
            namespace: "shop".to_owned(),
        })),
        trace: None,
    };
    let mut group = c.benchmark_group("hot_paths");
    group.bench_function("flow_open_close", |b| {
        b.iter(|| {
            let open = black_box(flow.clone()).open(&metrics);
            open.close(1024, 2048, None);
        });
    });
    group.finish();
    assert_eq!(metrics.open_connections(), 0);
}

fn policy_decision(c: &mut Criterion) {
    let state = MeshState::from_config(&policed_config()).expect("state");
    let src: SocketAddr = "10.7.3.4:40000".parse().expect("address");
    let dst = SocketAddr::new(workload_ip(7).into(), 8007);
    // As a connection carries it: read from the certificate once.
    let peer = Identity::new("cluster.local", "front7", "web").expect("valid identity");
    let mut group = c.benchmark_group("hot_paths");
    group.bench_function("policy_decision", |b| {
        b.iter(|| {
            let request = Request {
                peer: Some(black_box(&peer)),
                src,
                dst,
            };
            black_box(state.authorize(&request).is_ok())
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = workload_lookup, pool_connect, connect_request, flow_open_close, policy_decision
}
criterion_main!(benches);
