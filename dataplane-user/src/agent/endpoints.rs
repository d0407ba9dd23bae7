//! The agent's HTTP endpoints (readiness, metrics, admin): bound at
//! start-up, or once the port is free when taking over.

use std::{future::Future, net::SocketAddr};

use tokio::{net::TcpListener, task::JoinHandle};
use tracing::{info, warn};

use crate::handover;

/// An endpoint's listener, now or once its port is free.
pub(super) type ListenerSoon = std::pin::Pin<Box<dyn Future<Output = Option<TcpListener>> + Send>>;

/// Binds an HTTP endpoint. A port already in use (another agent on the
/// same host) is logged loudly and start-up goes on: probes and scrapes
/// then fail, which is visible, instead of the node losing its data plane.
/// With `--takeover` the port in use is the agent's being taken over from:
/// it is bound as soon as that agent exits (see [`handover`]).
pub(super) async fn bind_endpoint(
    name: &'static str,
    paths: &'static str,
    addr: SocketAddr,
    takeover: bool,
) -> Option<(ListenerSoon, SocketAddr)> {
    match crate::httpd::bind(addr).await {
        Ok(listener) => {
            // Port 0 asks the kernel for one: report the one it chose.
            let bound = listener.local_addr().unwrap_or(addr);
            info!(addr = %bound, "{name} endpoint listening ({paths})");
            Some((Box::pin(std::future::ready(Some(listener))), bound))
        }
        Err(err) if takeover && err.kind() == std::io::ErrorKind::AddrInUse => {
            info!(%addr, "{name} endpoint: the port is the running agent's; bound once it exits");
            Some((Box::pin(handover::bind_when_free(name, addr)), addr))
        }
        Err(err) => {
            warn!(%addr, error = %err, "cannot serve the {name} endpoint; set --{name}-addr");
            None
        }
    }
}

/// Binds an HTTP endpoint (see [`bind_endpoint`]) and serves it.
pub(super) async fn start_endpoint<F, Fut>(
    name: &'static str,
    paths: &'static str,
    addr: SocketAddr,
    takeover: bool,
    serve: F,
) -> Option<(JoinHandle<()>, SocketAddr)>
where
    F: FnOnce(TcpListener) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (listener, bound) = bind_endpoint(name, paths, addr, takeover).await?;
    let serve = async move {
        if let Some(listener) = listener.await {
            serve(listener).await;
        }
    };
    Some((tokio::spawn(serve), bound))
}
