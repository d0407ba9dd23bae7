//! Inbound HBONE (15008): mutual TLS with the pod's own certificate,
//! clients verified against the mesh root and trust domain (the verified
//! peer certificate is read once per connection), then the HBONE server
//! ([`crate::hbone::serve_connection`]) serves its CONNECT streams to the
//! pod's apps, asking policy for each.

use std::{sync::Arc, time::Duration};

use tokio::{net::TcpListener, task::JoinSet};
use tokio_rustls::TlsAcceptor;
use tracing::{Instrument, debug, info_span, warn};

use super::{PodContext, accept, finish, reap};
use crate::{
    addr::canonical,
    hbone::{self, ServerContext},
    identity::Identity,
    logging::Chain,
    telemetry::{FailReason, Peer},
    tls,
};

/// How long a client may take to complete the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts HBONE connections until the task is dropped.
pub(super) async fn serve(listener: TcpListener, ctx: Arc<PodContext>) {
    let acceptor = TlsAcceptor::from(Arc::clone(&ctx.server_tls));
    let mut shutdown = ctx.mesh.shutdown.clone();
    // Owned here, not detached: stopping the pod ends them. Open HBONE
    // connections drain on their own (GOAWAY).
    let mut connections = JoinSet::new();
    while let Some((stream, peer)) = accept(&listener, &mut shutdown, "hbone").await {
        let acceptor = acceptor.clone();
        let ctx = Arc::clone(&ctx);
        let span = info_span!("hbone_conn", pod = %ctx.identity.name, src = %canonical(peer));
        connections.spawn(
            async move {
                let local = match stream.local_addr() {
                    Ok(local) => local,
                    Err(err) => return warn!(error = %err, "no local address"),
                };
                let _ = stream.set_nodelay(true);
                let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(err)) => {
                        ctx.mesh.metrics.failed("inbound", FailReason::TlsHandshake.as_str());
                        return warn!(target: "access", direction = "inbound", protocol = "HBONE", src = %canonical(peer), error = %err, "TLS handshake refused");
                    }
                    Err(_) => {
                        ctx.mesh.metrics.failed("inbound", FailReason::TlsHandshake.as_str());
                        return warn!(target: "access", direction = "inbound", protocol = "HBONE", src = %canonical(peer), "TLS handshake timed out");
                    }
                };
                // Parsed from the certificate once; streams share it.
                let peer_identity = tls::peer_identity(tls.get_ref().1);
                let source = Arc::new(Peer {
                    principal: peer_identity.as_ref().map(Identity::to_uri),
                    ..(*ctx.mesh.peer_at(canonical(peer).ip())).clone()
                });
                let netns = ctx.netns.clone();
                let mark = ctx.mark;
                let server = ServerContext {
                    local,
                    peer,
                    peer_identity,
                    dial: Arc::new(move |dst| {
                        let socket = netns.connector(dst, mark);
                        Box::pin(async move { socket?.connect(dst).await })
                    }),
                    authorize: {
                        let mesh = Arc::clone(&ctx.mesh);
                        Arc::new(move |request| mesh.authorize(request))
                    },
                    resolve_authority: {
                        let mesh = Arc::clone(&ctx.mesh);
                        Arc::new(move |authority, local| mesh.state().resolve_hostname(authority, local.ip()))
                    },
                    live: Some(Arc::clone(&ctx.mesh.live)),
                    shutdown: ctx.mesh.shutdown.clone(),
                    metrics: Arc::clone(&ctx.mesh.metrics),
                    source,
                    destination: Arc::clone(&ctx.peer),
                };
                if let Err(err) = hbone::serve_connection(tls, server).await {
                    debug!(error = %Chain(&err), "HBONE connection ended with an error");
                }
            }
            .instrument(span),
        );
        reap(&mut connections);
    }
    finish(listener, connections).await;
}
