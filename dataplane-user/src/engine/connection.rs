//! Accept loops and per-connection handling: one span per connection, one
//! access-log record (target `access`) when it closes or is refused.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::{
    net::{TcpListener, TcpStream},
    task::JoinSet,
};
use tracing::{Instrument, debug, info, info_span, warn};

use super::{PodContext, canonical, hbone_addr, is_engine_port, log_accept_error, relay};
use crate::{
    hbone::{self, PoolError, PoolKey, Tunnel, wire::Baggage},
    identity::Identity,
    logging::Chain,
    redirect::OrigDstTable,
    state::{MeshWorkload, Route},
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
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                log_accept_error(&err, "outbound");
                continue;
            }
        };
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
        let span = info_span!("outbound", pod = %ctx.identity.name, ns = %ctx.identity.namespace, src = %canonical(peer));
        connections.spawn(
            async move {
                match dst {
                    Ok(Some(dst)) => outbound(stream, peer, dst, &ctx).await,
                    Ok(None) => refuse(
                        stream,
                        peer,
                        None,
                        "outbound",
                        "no original destination recorded for this connection",
                    ),
                    Err(err) => refuse(stream, peer, None, "outbound", &err),
                }
            }
            .instrument(span),
        );
        reap(&mut connections);
    }
}

/// Serves the inbound plaintext listener: the accepted socket's local
/// address is the original destination (sk_lookup does not rewrite it).
pub(super) async fn serve_inbound(listener: TcpListener, ctx: Arc<PodContext>) {
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                log_accept_error(&err, "inbound");
                continue;
            }
        };
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
                match local {
                    Ok(local) if is_engine_port(local.port()) => refuse(
                        stream,
                        peer,
                        Some(canonical(local)),
                        "inbound",
                        "destination is an engine port",
                    ),
                    Ok(local)
                        if let Err(reason) = ctx.mesh.authorize(&crate::hbone::AuthzRequest {
                            peer_identity: None,
                            src: canonical(peer),
                            dst: canonical(local),
                        }) =>
                    {
                        refuse(stream, peer, Some(canonical(local)), "inbound", &reason)
                    }
                    Ok(local) => {
                        let dst = canonical(local);
                        let (_live, kill) = ctx.mesh.live.register(None, canonical(peer), dst);
                        tokio::select! {
                            () = forward(stream, peer, dst, &ctx, "inbound") => {}
                            () = kill.notified() => {}
                        }
                    }
                    Err(err) => refuse(stream, peer, None, "inbound", &err.to_string()),
                }
            }
            .instrument(span),
        );
        reap(&mut connections);
    }
}

/// Sends a captured outbound connection on: to a service VIP through one of
/// its endpoints (the next one when an endpoint's node does not answer), to
/// a mesh workload speaking HBONE through a tunnel, anything else as plain
/// TCP.
async fn outbound(stream: TcpStream, peer: SocketAddr, dst: SocketAddr, ctx: &PodContext) {
    let state = ctx.mesh.state();
    match state.route(dst, &ctx.mesh.dead) {
        Route::Unknown => forward(stream, peer, dst, ctx, "outbound").await,
        Route::Workload(workload) if !workload.speaks_hbone() => {
            forward(stream, peer, dst, ctx, "outbound").await;
        }
        Route::Workload(workload) => match open_tunnel(ctx, &workload, dst, &[], peer).await {
            Ok((tunnel, key)) => relay_tunnel(stream, peer, dst, tunnel, &key, None).await,
            Err(err) => refuse(
                stream,
                peer,
                Some(dst),
                "outbound",
                &Chain(&err).to_string(),
            ),
        },
        Route::Service {
            service,
            candidates,
            alt_identities,
        } => {
            if candidates.is_empty() {
                let reason = format!("service {service} has no endpoints");
                return refuse(stream, peer, Some(dst), "outbound", &reason);
            }
            for endpoint in candidates {
                if !endpoint.workload.speaks_hbone() {
                    return forward(stream, peer, endpoint.addr, ctx, "outbound").await;
                }
                match open_tunnel(
                    ctx,
                    &endpoint.workload,
                    endpoint.addr,
                    &alt_identities,
                    peer,
                )
                .await
                {
                    Ok((tunnel, key)) => {
                        return relay_tunnel(
                            stream,
                            peer,
                            endpoint.addr,
                            tunnel,
                            &key,
                            Some(&service),
                        )
                        .await;
                    }
                    // The endpoint's node did not answer: skip it for a
                    // while and try the next one.
                    Err(PoolError::Dial { addr, .. }) => {
                        warn!(%service, endpoint = %addr, "endpoint unreachable; trying the next one");
                        ctx.mesh.dead.mark(endpoint.addr.ip());
                    }
                    Err(err) => {
                        return refuse(
                            stream,
                            peer,
                            Some(endpoint.addr),
                            "outbound",
                            &Chain(&err).to_string(),
                        );
                    }
                }
            }
            let reason = format!("no endpoint of service {service} is reachable");
            refuse(stream, peer, Some(dst), "outbound", &reason);
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
    peer: SocketAddr,
) -> Result<(Tunnel, PoolKey), PoolError> {
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
    let tunnel = ctx
        .pool
        .connect(&key, &dst.to_string(), canonical(peer), &baggage)
        .await?;
    Ok((tunnel, key))
}

/// Relays through an open tunnel and writes the access record.
async fn relay_tunnel(
    stream: TcpStream,
    peer: SocketAddr,
    dst: SocketAddr,
    tunnel: Tunnel,
    key: &PoolKey,
    service: Option<&str>,
) {
    let started = Instant::now();
    let _ = stream.set_nodelay(true);
    let Tunnel { send, recv, .. } = tunnel;
    let result = hbone::relay(stream, send, recv).await;
    let duration_ms = started.elapsed().as_millis() as u64;
    let service = service.unwrap_or("-");
    match result {
        Ok(t) => info!(
            target: "access",
            direction = "outbound",
            protocol = "HBONE",
            src = %canonical(peer),
            dst = %dst,
            service,
            dst_identity = %key.dst_identity,
            bytes_sent = t.sent,
            bytes_received = t.received,
            duration_ms,
            "connection closed"
        ),
        Err(err) => info!(
            target: "access",
            direction = "outbound",
            protocol = "HBONE",
            src = %canonical(peer),
            dst = %dst,
            service,
            dst_identity = %key.dst_identity,
            duration_ms,
            error = %Chain(&err),
            "connection failed"
        ),
    }
}

/// Connects to `dst` from inside the pod and relays.
async fn forward(
    downstream: TcpStream,
    peer: SocketAddr,
    dst: SocketAddr,
    ctx: &PodContext,
    direction: &'static str,
) {
    let started = Instant::now();
    let upstream = match ctx.netns.connector(dst, ctx.mark) {
        Ok(socket) => match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(dst)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => {
                return refuse(
                    downstream,
                    peer,
                    Some(dst),
                    direction,
                    &format!("connect failed: {err}"),
                );
            }
            Err(_) => {
                return refuse(downstream, peer, Some(dst), direction, "connect timed out");
            }
        },
        Err(err) => {
            return refuse(
                downstream,
                peer,
                Some(dst),
                direction,
                &format!("cannot create socket in pod: {err}"),
            );
        }
    };
    let _ = downstream.set_nodelay(true);
    debug!(%dst, "connected");
    let result = relay(downstream, upstream).await;
    let duration_ms = started.elapsed().as_millis() as u64;
    match result {
        Ok(t) => info!(
            target: "access",
            direction,
            src = %canonical(peer),
            dst = %dst,
            bytes_sent = t.sent,
            bytes_received = t.received,
            duration_ms,
            "connection closed"
        ),
        Err(err) => info!(
            target: "access",
            direction,
            src = %canonical(peer),
            dst = %dst,
            duration_ms,
            error = %crate::logging::Chain(&err),
            "connection failed"
        ),
    }
}

/// Resets the client connection and logs why.
fn refuse(
    stream: TcpStream,
    peer: SocketAddr,
    dst: Option<SocketAddr>,
    direction: &'static str,
    reason: &str,
) {
    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    drop(stream);
    let dst = dst
        .map(|d| d.to_string())
        .unwrap_or_else(|| "unknown".into());
    warn!(target: "access", direction, src = %canonical(peer), dst, reason, "connection refused");
}

/// Collects finished connection tasks so the set does not grow.
fn reap(connections: &mut JoinSet<()>) {
    while connections.try_join_next().is_some() {}
}
