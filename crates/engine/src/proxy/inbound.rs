//! Inbound plaintext (15006): connections `sk_lookup` assigned from outside
//! the pod to the pod's IPs. The client is known only by its address (no
//! identity is verified), policy decides, and an allowed connection is
//! relayed to the app inside the pod; it stays registered for re-checks
//! while open, so a policy change that denies it closes it.

use std::sync::Arc;

use tokio::net::TcpListener;
use tracing::{Instrument, info_span};

use super::{PodContext, accept, connect_direct, finish, orig_dst::OrigDst, reap, record, refuse};
use crate::{
    addr::{canonical, is_engine_port},
    policy::Request,
    telemetry::{Direction, FailReason, Flow, Peer, Protocol},
};

/// Serves the inbound plaintext listener until the pod's engine stops
/// accepting ([`PodContext::stopping`]), then its connections to their end.
pub(super) async fn serve(listener: TcpListener, ctx: Arc<PodContext>, orig_dst: Arc<OrigDst>) {
    let mut connections = tokio::task::JoinSet::new();
    let mut stopping = ctx.stopping.subscribe();
    // Until its relay finishes cleanly, a client's connection may only end
    // in a reset.
    let inherited = super::prepare_listener(&listener, "inbound", ctx.mesh.keepalive);
    while let Some((stream, peer)) =
        accept(&listener, &mut stopping, "inbound", &ctx.mesh.metrics).await
    {
        super::prepare_accepted(&stream, inherited, ctx.mesh.keepalive);
        let ctx = Arc::clone(&ctx);
        let orig_dst = Arc::clone(&orig_dst);
        let src = canonical(peer);
        let span =
            info_span!("inbound", pod = %ctx.identity.name, ns = %ctx.identity.namespace, %src);
        connections.spawn(
            async move {
                let local = stream
                    .local_addr()
                    .map(|local| orig_dst.inbound(&stream, local));
                // One snapshot decides the connection (and is let go before
                // it is relayed).
                let state = ctx.mesh.state();
                let mut flow = Flow {
                    direction: Direction::Inbound,
                    protocol: Protocol::Tcp,
                    src,
                    dst: None,
                    source: Arc::new(Peer {
                        principal: None,
                        ..(*state.peer_at(src.ip())).clone()
                    }),
                    destination: ctx.own_peer(&state),
                    service: None,
                    trace: None,
                };
                let local = match local {
                    Ok(local) => canonical(local),
                    Err(err) => {
                        return refuse(stream, &flow, &ctx, FailReason::Internal, &err.to_string());
                    }
                };
                flow.dst = Some(local);
                flow.service = state.attribute_service(None, local);
                if is_engine_port(local.port()) {
                    return refuse(
                        stream,
                        &flow,
                        &ctx,
                        FailReason::EnginePort,
                        "destination is an engine port",
                    );
                }
                if let Some(detail) = ctx.unknown_workload().await {
                    return refuse(stream, &flow, &ctx, FailReason::UnknownWorkload, &detail);
                }
                let request = Request {
                    peer: None,
                    src,
                    dst: local,
                };
                if let Err(reason) = state.authorize(&request) {
                    return refuse(stream, &flow, &ctx, FailReason::Denied, &reason);
                }
                drop(state);
                let (_live, kill) = ctx.mesh.live.register(None, src, local);
                // The pod holds this tuple until the connection is gone: no
                // transparent connection to the app may take it meanwhile.
                let _tuple = ctx
                    .original_source
                    .as_ref()
                    .map(|transparent| transparent.ports.hold(src, local));
                // One wait for the kill, through the connect and the relay.
                let killed = kill.notified();
                tokio::pin!(killed);
                let connect = connect_direct(stream, flow, (Some(src.ip()), local), &ctx);
                let opened = tokio::select! {
                    opened = connect => opened,
                    () = &mut killed => None,
                };
                if let Some((mut relay, open)) = opened {
                    // Polled by reference, not moved into the select: a
                    // revoked connection is recorded before its relay
                    // (whose drop resets both sockets) goes.
                    tokio::select! {
                        result = &mut relay => record(result, open),
                        () = &mut killed => open.revoke(),
                    }
                }
            }
            .instrument(span),
        );
        reap(&mut connections);
    }
    finish(listener, connections).await;
}
