//! Inbound HBONE (15008): mutual TLS with the pod's own certificate,
//! clients verified against the mesh root and trust domain (the verified
//! peer certificate is read once per connection), then the HBONE server
//! ([`crate::hbone::serve_connection`]) serves its CONNECT streams to the
//! pod's apps, asking policy for each.
//!
//! Until a client has finished its handshake (TLS, then the HTTP/2 preface
//! and first SETTINGS) it holds a place among the node's pending
//! handshakes ([`super::handshakes`]): it is reset if it takes longer than
//! the handshake timeout or if a bound sheds it. Its socket lingers 0 until
//! then, so either end is a reset that gives the descriptor back at once.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use socket2::SockRef;
use tokio::{
    net::{TcpListener, TcpStream},
    task::JoinSet,
    time::Instant,
};
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, debug, info_span, warn};

use super::{
    PodContext, accept, finish,
    handshakes::{HandshakeSlot, ShedSignal},
    reap,
    revocation::ResetOnDrop,
};
use crate::{
    addr::canonical,
    hbone::linger::LingerOnClose,
    hbone::{self, PrefaceWatch, ServerContext, app_tunnel::LocalTunnel, head::Authority},
    identity::Identity,
    logging::Chain,
    telemetry::{FailReason, Peer},
    tls,
};

/// Accepts HBONE connections until the pod's engine stops accepting
/// ([`PodContext::stopping`]: its connections then get GOAWAY and finish),
/// or until the task is dropped.
pub(super) async fn serve(listener: TcpListener, ctx: Arc<PodContext>) {
    let acceptor = TlsAcceptor::from(Arc::clone(&ctx.server_tls));
    let mut stopping = ctx.stopping.subscribe();
    // Accepted sockets inherit the listener's keepalive (set at every
    // start: a listener handed over by an older agent may lack it).
    let keepalive = ctx.mesh.keepalive;
    let inherited = match super::keepalive::apply(keepalive, SockRef::from(&listener)) {
        Ok(()) => true,
        Err(err) => {
            warn!(listener = "hbone", error = %err, "cannot set the listener's keepalive; setting it on each connection");
            false
        }
    };
    // Owned here, not detached: stopping the pod ends them. Open HBONE
    // connections drain on their own (GOAWAY).
    let mut connections = JoinSet::new();
    while let Some((stream, peer)) =
        accept(&listener, &mut stopping, "hbone", &ctx.mesh.metrics).await
    {
        if !inherited {
            let _ = super::keepalive::apply(keepalive, SockRef::from(&stream));
        }
        // Admitted here, in accept order, before the connection gets a task;
        // while too many shed connections are still open this waits, and
        // new ones wait in the kernel's backlog.
        let (slot, shed) = ctx
            .mesh
            .handshakes
            .admit(&ctx.identity.uid, canonical(peer).ip())
            .await;
        let acceptor = acceptor.clone();
        let ctx = Arc::clone(&ctx);
        let span = info_span!("hbone_conn", pod = %ctx.identity.name, src = %canonical(peer));
        connections
            .spawn(serve_connection(stream, peer, (slot, shed), acceptor, ctx).instrument(span));
        reap(&mut connections);
    }
    finish(listener, connections).await;
}

/// One accepted connection: handshake under its deadline and the bounds,
/// then the HBONE server.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    (slot, mut shed): (HandshakeSlot, ShedSignal),
    acceptor: TlsAcceptor,
    ctx: Arc<PodContext>,
) {
    let local = match stream.local_addr() {
        Ok(local) => local,
        Err(err) => return warn!(error = %err, "no local address"),
    };
    let _ = stream.set_nodelay(true);
    let _ = SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    let deadline = Instant::now() + ctx.mesh.handshakes.limits().timeout;
    // As ztunnel, before the handshake: it cannot fetch the certificate of
    // a local workload it does not know, and the peer sees the connection
    // fail (reset here: the socket lingers 0).
    if let Some(detail) = ctx.unknown_workload().await {
        ctx.mesh
            .metrics
            .failed("inbound", FailReason::UnknownWorkload.as_str());
        return warn!(target: "access", direction = "inbound", protocol = "HBONE", src = %canonical(peer), error = %detail, "connection refused: local workload unknown");
    }
    // The handshake is pinned out of the select, not built inside it: a
    // select drops its futures before a branch's handler runs, and this
    // one owns the socket (its drop is the reset). Kept until the handler
    // returns, a timed-out handshake is counted and written before the
    // peer sees the reset. Its own block, so it is not kept beside the
    // connection once done.
    let tls = {
        let handshake = tokio::time::timeout_at(deadline, acceptor.accept(stream));
        tokio::pin!(handshake);
        tokio::select! {
            tls = &mut handshake => match tls {
                Ok(Ok(tls)) => tls,
                Ok(Err(err)) => {
                    ctx.mesh.metrics.failed("inbound", FailReason::TlsHandshake.as_str());
                    return warn!(target: "access", direction = "inbound", protocol = "HBONE", src = %canonical(peer), error = %err, "TLS handshake refused");
                }
                Err(_) => return timed_out(&ctx, peer, "TLS"),
            },
            Some(reason) = shed.recv() => return debug!(reason = reason.as_str(), "handshake shed (TLS)"),
        }
    };
    // With revocation lists, the client's chain is checked again whenever
    // they change; a revoked client's connection is reset.
    let watched = super::revocation::Watched::client_of(&ctx.mesh.roots, &tls);
    // Parsed from the certificate once; streams share it.
    let peer_identity = tls::peer_identity(tls.get_ref().1);
    let known = ctx.mesh.peer_at(canonical(peer).ip());
    // The mesh's default peer is what it answers for an address it does
    // not know: the streams' baggage then says who the client is.
    let source_known = *known != Peer::default();
    let source = Arc::new(Peer {
        principal: peer_identity
            .as_ref()
            .map(|id: &Identity| id.as_uri().into()),
        ..(*known).clone()
    });
    let destination = ctx.own_peer(&ctx.mesh.state());
    let server = ServerContext {
        local,
        peer,
        peer_identity,
        dial: {
            let ctx = Arc::clone(&ctx);
            Arc::new(move |client, dst| {
                let ctx = Arc::clone(&ctx);
                Box::pin(async move { ctx.connect_app(Some(client), dst).await })
            })
        },
        authorize: {
            let mesh = Arc::clone(&ctx.mesh);
            Arc::new(move |request| mesh.authorize(request))
        },
        resolve_authority: {
            let mesh = Arc::clone(&ctx.mesh);
            Arc::new(move |authority, local| mesh.state().resolve_hostname(authority, local.ip()))
        },
        app_tunnel: {
            let ctx = Arc::clone(&ctx);
            Arc::new(move |authority, local| {
                let state = ctx.mesh.state();
                let tunnel = ctx.app_tunnel(&state)?;
                let asked = match authority {
                    Authority::Addr(addr) => Some(canonical(*addr)),
                    Authority::Host { name, port } => state.hostname_vip(name, *port, local.ip()),
                };
                Some(LocalTunnel {
                    tunnel,
                    asked,
                    localhost: ctx.mesh.localhost_app_tunnel,
                })
            })
        },
        is_waypoint_of: {
            let ctx = Arc::clone(&ctx);
            Arc::new(move |target, local| {
                let state = ctx.mesh.state();
                ctx.own_workload(&state)
                    .is_some_and(|own| state.is_waypoint_of(target, own, canonical(local).ip()))
            })
        },
        attribute: {
            let mesh = Arc::clone(&ctx.mesh);
            Arc::new(move |named, dst| mesh.state().attribute_service(named, dst))
        },
        live: Some(Arc::clone(&ctx.mesh.live)),
        shutdown: ctx.stopping.subscribe(),
        metrics: Arc::clone(&ctx.mesh.metrics),
        source,
        source_known,
        destination_baggage: ServerContext::baggage_of(&destination),
        destination,
        idle_timeout: ctx.mesh.hbone_idle_timeout,
        h2: ctx.mesh.h2,
    };
    // The handshake is complete once the client's preface and SETTINGS are
    // in: from then on the connection ends as HTTP/2 ends it (GOAWAY, a
    // clean close), and its place among pending handshakes is free.
    // When HTTP/2 closes the connection, the peer's last frames are read
    // before the socket goes, so the close reaches it as a FIN.
    let (tls, reset) = ResetOnDrop::new(tls);
    let io = PrefaceWatch::new(
        LingerOnClose::new(tls),
        move |tls: &LingerOnClose<ResetOnDrop>| {
            let _ = SockRef::from(tls.get_ref().get_ref().get_ref().0).set_linger(None);
            drop(slot);
        },
    );
    let revoked = async {
        match &watched {
            Some(watched) => watched.revoked().await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(revoked);
    let serve = hbone::serve_connection(io, server);
    tokio::pin!(serve);
    let mut handshaking = true;
    let result = loop {
        tokio::select! {
            result = &mut serve => break result,
            () = &mut revoked => {
                // Dropping the connection (and its streams) with linger 0.
                reset.switch();
                return warn!(target: "access", direction = "inbound", protocol = "HBONE", src = %canonical(peer), "connection reset: the peer's certificate was revoked");
            }
            shed_now = shed.recv(), if handshaking => match shed_now {
                Some(reason) => return debug!(reason = reason.as_str(), "handshake shed (HTTP/2 preface)"),
                None => handshaking = false,
            },
            () = tokio::time::sleep_until(deadline), if handshaking => {
                if shed.is_released() {
                    handshaking = false;
                } else {
                    return timed_out(&ctx, peer, "HTTP/2 preface and SETTINGS");
                }
            }
        }
    };
    if let Err(err) = result {
        debug!(error = %Chain(&err), "HBONE connection ended with an error");
    }
}

/// Counts and records a connection whose handshake took too long; the
/// caller's return drops (and resets) it.
fn timed_out(ctx: &PodContext, peer: SocketAddr, phase: &'static str) {
    ctx.mesh
        .metrics
        .failed("inbound", FailReason::HandshakeTimeout.as_str());
    warn!(target: "access", direction = "inbound", protocol = "HBONE", src = %canonical(peer), phase, timeout_ms = ctx.mesh.handshakes.limits().timeout.as_millis() as u64, "HBONE handshake timed out");
}
