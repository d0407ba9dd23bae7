//! Accept loops and per-connection handling: one span per connection, one
//! access-log record (target `access`) when it closes or is refused.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    net::{TcpListener, TcpStream},
    task::JoinSet,
};
use tracing::{Instrument, debug, info_span, warn};

use super::{PodContext, accept, canonical, hbone_addr, is_engine_port, relay, workload_peer};
use crate::{
    hbone::{self, PoolError, PoolKey, Tunnel, wire::Baggage},
    identity::Identity,
    logging::Chain,
    redirect::OrigDstTable,
    state::{MeshWorkload, Route},
    telemetry::{Direction, FailReason, Flow, Peer, Protocol},
};

/// How long a connection to the destination may take before the client's
/// connection is reset.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the outbound capture listener: each accepted connection goes to
/// its original destination, dialled from inside the pod with the proxy
/// mark.
pub(super) async fn serve_outbound(
    listener: TcpListener,
    ctx: Arc<PodContext>,
    orig_dst: Arc<Mutex<Option<OrigDstTable>>>,
) {
    let mut connections = JoinSet::new();
    let mut shutdown = ctx.mesh.shutdown.clone();
    while let Some((stream, peer)) = accept(&listener, &mut shutdown, "outbound").await {
        // The record is looked up here, in order, before the next accept;
        // it was written before the client's SYN left.
        let dst = stream
            .local_addr()
            .map_err(|e| e.to_string())
            .and_then(|local| {
                let mut table = orig_dst
                    .lock()
                    .map_err(|_| "original-destination table poisoned".to_owned())?;
                let recorded = match table.as_mut() {
                    Some(table) => table
                        .take(peer, local)
                        .map_err(|e| crate::logging::Chain(&e).to_string())?,
                    None => None,
                };
                // Not recorded by our programs: an iptables REDIRECT, if
                // anything, which netfilter remembers.
                Ok(recorded.or_else(|| {
                    super::netfilter::original_dst(&stream, local)
                        .ok()
                        .map(canonical)
                }))
            });
        let ctx = Arc::clone(&ctx);
        let src = ctx.client_addr(peer);
        let span =
            info_span!("outbound", pod = %ctx.identity.name, ns = %ctx.identity.namespace, %src);
        connections.spawn(
            async move {
                let mut flow = Flow {
                    direction: Direction::Outbound,
                    protocol: Protocol::Tcp,
                    src,
                    dst: None,
                    source: Arc::clone(&ctx.peer),
                    destination: Arc::default(),
                    service: None,
                };
                match dst {
                    Ok(Some(dst)) => {
                        flow.dst = Some(dst);
                        outbound(stream, flow, &ctx).await;
                    }
                    Ok(None) => refuse(
                        stream,
                        &flow,
                        &ctx,
                        FailReason::NoOriginalDestination,
                        "no original destination recorded for this connection",
                    ),
                    Err(err) => refuse(stream, &flow, &ctx, FailReason::Internal, &err),
                }
            }
            .instrument(span),
        );
        reap(&mut connections);
    }
    finish(listener, connections).await;
}

/// Serves the inbound plaintext listener: the accepted socket's local
/// address is the original destination (sk_lookup does not rewrite it).
pub(super) async fn serve_inbound(listener: TcpListener, ctx: Arc<PodContext>) {
    let mut connections = JoinSet::new();
    let mut shutdown = ctx.mesh.shutdown.clone();
    while let Some((stream, peer)) = accept(&listener, &mut shutdown, "inbound").await {
        let ctx = Arc::clone(&ctx);
        let span = info_span!("inbound", pod = %ctx.identity.name, ns = %ctx.identity.namespace, src = %canonical(peer));
        connections.spawn(
            async move {
                // sk_lookup keeps the original destination as the local
                // address; an iptables REDIRECT leaves it to netfilter.
                let local = stream.local_addr().map(|local| {
                    if local.port() == dataplane_common::INBOUND_PLAINTEXT_PORT {
                        super::netfilter::original_dst(&stream, local).unwrap_or(local)
                    } else {
                        local
                    }
                });
                // Plaintext: the client's identity is not verified, only
                // its address is known.
                let mut flow = Flow {
                    direction: Direction::Inbound,
                    protocol: Protocol::Tcp,
                    src: canonical(peer),
                    dst: None,
                    source: Arc::new(Peer {
                        principal: None,
                        ..(*ctx.mesh.peer_at(canonical(peer).ip())).clone()
                    }),
                    destination: Arc::clone(&ctx.peer),
                    service: None,
                };
                let local = match local {
                    Ok(local) => canonical(local),
                    Err(err) => {
                        return refuse(stream, &flow, &ctx, FailReason::Internal, &err.to_string());
                    }
                };
                flow.dst = Some(local);
                if is_engine_port(local.port()) {
                    return refuse(
                        stream,
                        &flow,
                        &ctx,
                        FailReason::EnginePort,
                        "destination is an engine port",
                    );
                }
                if let Err(reason) = ctx.mesh.authorize(&crate::hbone::AuthzRequest {
                    peer_identity: None,
                    src: canonical(peer),
                    dst: local,
                }) {
                    return refuse(stream, &flow, &ctx, FailReason::Denied, &reason);
                }
                let (_live, kill) = ctx.mesh.live.register(None, canonical(peer), local);
                tokio::select! {
                    () = forward(stream, flow, local, &ctx) => {}
                    () = kill.notified() => {}
                }
            }
            .instrument(span),
        );
        reap(&mut connections);
    }
    finish(listener, connections).await;
}

/// Sends a captured outbound connection on: to a service VIP through one of
/// its endpoints (the next one when an endpoint's node does not answer), to
/// a mesh workload speaking HBONE through a tunnel, anything else as plain
/// TCP.
async fn outbound(stream: TcpStream, mut flow: Flow, ctx: &PodContext) {
    let Some(dst) = flow.dst else {
        return refuse(
            stream,
            &flow,
            ctx,
            FailReason::NoOriginalDestination,
            "no destination",
        );
    };
    let state = ctx.mesh.state();
    match state.route(dst, &ctx.mesh.dead) {
        Route::Unknown => forward(stream, flow, dst, ctx).await,
        Route::Workload(workload) if !workload.speaks_hbone() => {
            flow.destination = workload_peer(&workload);
            forward(stream, flow, dst, ctx).await;
        }
        Route::Workload(workload) => {
            flow.destination = workload_peer(&workload);
            flow.protocol = Protocol::Hbone;
            match open_tunnel(ctx, &workload, dst, &[], flow.src).await {
                Ok(tunnel) => relay_tunnel(stream, flow, tunnel, ctx).await,
                Err(err) => refuse(
                    stream,
                    &flow,
                    ctx,
                    FailReason::Tunnel,
                    &Chain(&err).to_string(),
                ),
            }
        }
        Route::Service {
            service,
            candidates,
            alt_identities,
        } => {
            // Istio labels the service by hostname.
            flow.service = Some(service.rsplit('/').next().unwrap_or(&service).to_owned());
            if candidates.is_empty() {
                let reason = format!("service {service} has no endpoints");
                return refuse(stream, &flow, ctx, FailReason::NoEndpoints, &reason);
            }
            for endpoint in candidates {
                flow.dst = Some(endpoint.addr);
                flow.destination = workload_peer(&endpoint.workload);
                if !endpoint.workload.speaks_hbone() {
                    return forward(stream, flow, endpoint.addr, ctx).await;
                }
                flow.protocol = Protocol::Hbone;
                match open_tunnel(
                    ctx,
                    &endpoint.workload,
                    endpoint.addr,
                    &alt_identities,
                    flow.src,
                )
                .await
                {
                    Ok(tunnel) => return relay_tunnel(stream, flow, tunnel, ctx).await,
                    // The endpoint's node did not answer: skip it for a
                    // while and try the next one.
                    Err(PoolError::Dial { addr, .. }) => {
                        warn!(%service, endpoint = %addr, "endpoint unreachable; trying the next one");
                        ctx.mesh.dead.mark(endpoint.addr.ip());
                    }
                    Err(err) => {
                        let reason = Chain(&err).to_string();
                        return refuse(stream, &flow, ctx, FailReason::Tunnel, &reason);
                    }
                }
            }
            flow.dst = Some(dst);
            let reason = format!("no endpoint of service {service} is reachable");
            refuse(stream, &flow, ctx, FailReason::NoEndpoints, &reason);
        }
    }
}

/// Opens (or reuses a pooled connection for) a tunnel to `dst` in
/// `workload`, accepting the workload's identity or any of `alt`.
async fn open_tunnel(
    ctx: &PodContext,
    workload: &MeshWorkload,
    dst: SocketAddr,
    alt: &[Identity],
    src: SocketAddr,
) -> Result<Tunnel, PoolError> {
    let key = PoolKey {
        src_identity: ctx.spiffe.to_uri(),
        dst_identity: workload.identity.to_uri(),
        alt_identities: alt.iter().map(Identity::to_uri).collect(),
        dst_addr: hbone_addr(dst),
    };
    let baggage = Baggage {
        cluster: "Kubernetes".into(),
        namespace: ctx.identity.namespace.clone(),
        workload: ("pod".into(), ctx.identity.name.clone()),
        service: ctx.identity.name.clone(),
        version: "latest".into(),
    };
    // Boxed: the dial and handshake state is large and only lives while
    // the tunnel opens, not for the connection's whole life.
    Box::pin(ctx.pool.connect(&key, &dst.to_string(), src, &baggage)).await
}

/// Relays through an open tunnel; the flow's record is written as it ends.
async fn relay_tunnel(stream: TcpStream, flow: Flow, tunnel: Tunnel, ctx: &PodContext) {
    let open = flow.open(&ctx.mesh.metrics);
    let _ = stream.set_nodelay(true);
    let Tunnel { send, recv, .. } = tunnel;
    match hbone::relay(stream, send, recv, open.meter_from_client()).await {
        Ok(t) => open.close(t.sent, t.received, None),
        Err(err) => open.close(0, 0, Some(&Chain(&err).to_string())),
    }
}

/// Connects to `dst` from inside the pod and relays.
async fn forward(downstream: TcpStream, flow: Flow, dst: SocketAddr, ctx: &PodContext) {
    let upstream = match ctx.netns.connector(dst, ctx.mark) {
        Ok(socket) => {
            match Box::pin(tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(dst))).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(err)) => {
                    let reason = format!("connect failed: {err}");
                    return refuse(downstream, &flow, ctx, FailReason::ConnectFailed, &reason);
                }
                Err(_) => {
                    let reason = "connect timed out";
                    return refuse(downstream, &flow, ctx, FailReason::ConnectTimeout, reason);
                }
            }
        }
        Err(err) => {
            let reason = format!("cannot create socket in pod: {err}");
            return refuse(downstream, &flow, ctx, FailReason::Internal, &reason);
        }
    };
    let open = flow.open(&ctx.mesh.metrics);
    let _ = downstream.set_nodelay(true);
    debug!(%dst, "connected");
    match relay(downstream, upstream, open.meter_from_client()).await {
        Ok(t) => open.close(t.sent, t.received, None),
        Err(err) => open.close(0, 0, Some(&Chain(&err).to_string())),
    }
}

/// Resets the client connection, counts it and writes its record.
fn refuse(stream: TcpStream, flow: &Flow, ctx: &PodContext, reason: FailReason, detail: &str) {
    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    drop(stream);
    flow.refuse(&ctx.mesh.metrics, reason, detail);
}

/// Stops accepting (the listener closes) and lets the connections in flight
/// finish; the agent's drain deadline aborts what is left.
async fn finish(listener: TcpListener, mut connections: JoinSet<()>) {
    drop(listener);
    while connections.join_next().await.is_some() {}
}

/// Collects finished connection tasks so the set does not grow.
fn reap(connections: &mut JoinSet<()>) {
    while connections.try_join_next().is_some() {}
}
