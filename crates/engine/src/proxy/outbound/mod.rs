//! Outbound (15001): connections the kernel redirected from a pod's apps.
//! Each one's original destination is read once, [`plan()`] decides what it
//! does, and this module carries the plan out: a tunnel from the pod's
//! HBONE pool, a direct connection from inside the pod, the next service
//! endpoint when one's node does not answer, or a refusal. One span per
//! connection, one access record when it closes or is refused.

mod connection;
pub(crate) mod gateway;
pub mod plan;

use std::{
    io::{self, Read as _},
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tracing::{Instrument, info_span, warn};

pub use plan::{
    Action, EndpointChoice, Hop, OutboundPlan, OutboundTrafficPolicy, ResolveHop, Through,
    TunnelHop, plan,
};

use super::{PodContext, connect_direct, finish, orig_dst::OrigDst, reap, refuse};
use crate::{
    dns::DnsError,
    hbone::{
        PoolError, PoolKey, Tunnel,
        wire::{self, Baggage},
    },
    logging::Chain,
    relay::relay_tunnel,
    state::{DeadEndpoints, ServiceEntry, random_index},
    telemetry::{Direction, FailReason, Flow, Peer, Protocol},
};
use connection::{Connection, Relaying};

/// Serves one outbound capture listener until the pod's engine stops
/// accepting ([`PodContext::stopping`]), then its connections to their end.
pub(super) async fn serve(listener: TcpListener, ctx: Arc<PodContext>, orig_dst: Arc<OrigDst>) {
    let mut connections = tokio::task::JoinSet::new();
    let mut stopping = ctx.stopping.subscribe();
    // Until its relay finishes cleanly, a client's connection may only end
    // in a reset (the agent could be killed while the tunnel opens).
    let inherited = super::prepare_listener(&listener, "outbound", ctx.mesh.keepalive);
    // The capture listeners are bound to one loopback address, which is
    // then every accepted socket's local address: no need to ask for it.
    let bound = listener
        .local_addr()
        .ok()
        .filter(|a| !a.ip().is_unspecified());
    while let Some((stream, peer)) =
        super::accept(&listener, &mut stopping, "outbound", &ctx.mesh.metrics).await
    {
        super::prepare_accepted(&stream, inherited, ctx.mesh.keepalive);
        // The record is looked up here, in order, before the next accept;
        // it was written before the client's SYN left.
        let dst = bound
            .map_or_else(|| stream.local_addr(), Ok)
            .map_err(|e| format!("cannot read the accepted socket's local address: {e}"))
            .and_then(|local| orig_dst.outbound(&stream, peer, local));
        let ctx = Arc::clone(&ctx);
        let src = ctx.client_addr(peer);
        let span =
            info_span!("outbound", pod = %ctx.identity.name, ns = %ctx.identity.namespace, %src);
        // Boxed before the task is made (see [`connection`]).
        let opening = {
            let ctx = Arc::clone(&ctx);
            Box::pin(async move { relaying(decide(stream, dst, src, &ctx).await?, &ctx).await })
        };
        connections.spawn(Connection::new(opening, ctx).instrument(span));
        reap(&mut connections);
    }
    finish(listener, connections).await;
}

/// The endpoint choice of a live connection from one pod: the agent's
/// dead-endpoint marks, each service's own balancing state, and what the
/// kernel's fast path already takes.
struct Live<'a> {
    dead: &'a DeadEndpoints,
    ctx: &'a PodContext,
}

impl EndpointChoice for Live<'_> {
    fn is_dead(&self, ip: IpAddr) -> bool {
        self.dead.is_dead(ip)
    }

    fn start(&self, service: &ServiceEntry) -> usize {
        service.next_start()
    }

    fn draw(&self, below: u64) -> u64 {
        random_index(usize::try_from(below).unwrap_or(usize::MAX)) as u64
    }

    fn taken_by_kernel(&self, vip: SocketAddr) -> Option<Arc<[IpAddr]>> {
        let fast = self.ctx.mesh.fast_path.get()?;
        fast.taken_by_kernel(self.ctx.netns_cookie, vip)
    }

    fn network(&self) -> &str {
        &self.ctx.mesh.network
    }
}

/// How an outbound connection goes once its way is open: what the
/// connection's task relays.
enum Way {
    /// Through this open tunnel, which already carried the client's first
    /// bytes, this many.
    Tunnel(TcpStream, Flow, Tunnel, u64),
    /// Straight to this address, from the pod.
    Direct(TcpStream, Flow, SocketAddr),
}

/// Decides the connection `stream` from `src` to its original
/// destination `dst` and carries the decision out up to the relay (a
/// tunnel open, or a direct hop chosen), which it returns for the caller;
/// `None` once the connection was refused.
async fn decide(
    stream: TcpStream,
    dst: Result<Option<SocketAddr>, String>,
    src: SocketAddr,
    ctx: &PodContext,
) -> Option<Way> {
    if let Some(detail) = ctx.unknown_workload().await {
        let flow = Flow {
            direction: Direction::Outbound,
            protocol: Protocol::Tcp,
            src,
            dst: dst.clone().ok().flatten(),
            source: Arc::clone(&ctx.peer),
            destination: Arc::default(),
            service: None,
            trace: None,
        };
        refuse(stream, &flow, ctx, FailReason::UnknownWorkload, &detail);
        return None;
    }
    // One snapshot decides the connection (and is let go before it is
    // relayed).
    let state = ctx.mesh.state();
    let flow = Flow {
        direction: Direction::Outbound,
        protocol: Protocol::Tcp,
        src,
        dst: None,
        source: ctx.own_peer(&state),
        destination: Arc::default(),
        service: None,
        trace: None,
    };
    let (reason, detail) = match dst {
        Ok(Some(dst)) => {
            let choice = Live {
                dead: &ctx.mesh.dead,
                ctx,
            };
            let policy = ctx.mesh.outbound_traffic_policy;
            let plan = plan(&state, &ctx.spiffe, src.ip(), dst, &choice, policy);
            if let Some(fast) = ctx.mesh.fast_path.get() {
                fast.consider(ctx, &state, src, &plan);
            }
            drop(state);
            return open_way(stream, flow, plan, ctx).await;
        }
        Ok(None) => (
            FailReason::NoOriginalDestination,
            "no original destination recorded for this connection".to_owned(),
        ),
        Err(err) => (FailReason::Internal, err),
    };
    refuse(stream, &flow, ctx, reason, &detail);
    None
}

/// Refuses, chooses a direct hop, or opens the tunnel the plan says;
/// returns the way for the caller to relay, `None` once the connection was
/// refused.
async fn open_way(
    stream: TcpStream,
    mut flow: Flow,
    plan: OutboundPlan,
    ctx: &PodContext,
) -> Option<Way> {
    flow.dst = Some(plan.dst);
    flow.service = plan.service.clone();
    let hops = match plan.action {
        Action::Refuse { reason, detail } => {
            refuse(stream, &flow, ctx, reason, &detail);
            return None;
        }
        Action::Hop(Hop::Direct { dst, workload }) => {
            flow.destination = destination(workload.as_deref().map(|w| &w.peer));
            return Some(Way::Direct(stream, flow, dst));
        }
        Action::Hop(Hop::Tunnel(hop)) => {
            flow.destination = Arc::clone(&hop.workload.peer);
            flow.protocol = Protocol::Hbone;
            flow.trace = Some(wire::new_trace_id());
            let early = match early_bytes(&stream, ctx) {
                Ok(early) => early,
                Err(err) => return client_failed(stream, &flow, ctx, &err),
            };
            return match open_tunnel(ctx, &hop, &flow, &early).await {
                Ok(tunnel) => Some(Way::Tunnel(stream, flow, tunnel, early.len() as u64)),
                Err(err) => {
                    let reason = Chain(&err).to_string();
                    refuse(stream, &flow, ctx, tunnel_failure(&err), &reason);
                    None
                }
            };
        }
        // A name to resolve first: the walk below does it.
        Action::Hop(hop @ Hop::Resolve(_)) => vec![hop],
        Action::Failover(hops) => hops,
    };
    let service = plan
        .service
        .as_deref()
        .map_or("-", |s| s.hostname.as_str())
        .to_owned();
    // Bytes read here could not go to a direct hop, which has its own
    // relay from the start: only a walk through tunnels alone sends them
    // early.
    let early = if hops.iter().all(Hop::is_tunnel) {
        match early_bytes(&stream, ctx) {
            Ok(early) => early,
            Err(err) => return client_failed(stream, &flow, ctx, &err),
        }
    } else {
        Bytes::new()
    };
    // Why the last endpoint known by name could not be tried.
    let mut unresolved = None;
    for hop in hops {
        let hop = match hop {
            Hop::Resolve(resolve) => match resolved(ctx, &flow, &resolve, plan.dst).await {
                Ok(hop) => hop,
                Err(err) => {
                    let err = Chain(&err).to_string();
                    warn!(%service, hostname = %resolve.hostname, error = %err,
                        "endpoint's DNS name did not resolve; trying the next one");
                    unresolved = Some(err);
                    continue;
                }
            },
            hop => hop,
        };
        flow.dst = hop.dst();
        let hop = match hop {
            Hop::Direct { dst, workload } => {
                flow.destination = destination(workload.as_deref().map(|w| &w.peer));
                return Some(Way::Direct(stream, flow, dst));
            }
            Hop::Tunnel(hop) => hop,
            Hop::Resolve(_) => continue,
        };
        flow.destination = Arc::clone(&hop.workload.peer);
        flow.protocol = Protocol::Hbone;
        flow.trace = flow.trace.or_else(|| Some(wire::new_trace_id()));
        match open_tunnel(ctx, &hop, &flow, &early).await {
            Ok(tunnel) => return Some(Way::Tunnel(stream, flow, tunnel, early.len() as u64)),
            // The endpoint's node did not answer: skip it for a while and
            // try the next one.
            Err(PoolError::Dial { addr, .. }) => {
                warn!(%service, endpoint = %addr, "endpoint unreachable; trying the next one");
                // The node that did not answer: the endpoint's, or a
                // waypoint instance's.
                ctx.mesh.dead.mark(hop.via.ip());
            }
            Err(err) => {
                let reason = Chain(&err).to_string();
                refuse(stream, &flow, ctx, tunnel_failure(&err), &reason);
                return None;
            }
        }
    }
    flow.dst = Some(plan.dst);
    let (reason, detail) = match unresolved {
        Some(err) => (
            FailReason::DnsFailed,
            format!("no endpoint of service {service} is reachable; the last name failed: {err}"),
        ),
        None => (
            FailReason::NoEndpoints,
            format!("no endpoint of service {service} is reachable"),
        ),
    };
    refuse(stream, &flow, ctx, reason, &detail);
    None
}

/// The hop to the workload of `hop` at an address its DNS name resolves
/// to now, chosen for a client that dialled `original` (ztunnel
/// `src/state.rs` `pick_workload_destination_or_resolve`), counted in
/// `istio_on_demand_dns_total` whatever the outcome, as ztunnel counts it.
async fn resolved(
    ctx: &PodContext,
    flow: &Flow,
    hop: &ResolveHop,
    original: SocketAddr,
) -> Result<Hop, DnsError> {
    ctx.mesh.metrics.on_demand_dns(&flow.source, &hop.hostname);
    let forwarder = ctx
        .mesh
        .resolver
        .get()
        .ok_or_else(|| DnsError::NoResolver {
            name: hop.hostname.to_string(),
        })?;
    let addrs = crate::dns::lookup_ip(forwarder, &hop.hostname).await?;
    let ip = crate::dns::choose(&addrs, original.ip(), random_index).ok_or_else(|| {
        DnsError::NoAddresses {
            name: hop.hostname.to_string(),
        }
    })?;
    Ok(hop.to(ip))
}

/// The most of a client's first bytes that go with its tunnel's request:
/// enough for a request head or a TLS ClientHello, within any HTTP/2
/// peer's initial stream window (64 KiB less one).
const EARLY_MAX: usize = 16 * 1024;

/// What the client has sent so far, to go with the tunnel's request:
/// nothing when the agent sends no early data.
fn early_bytes(stream: &TcpStream, ctx: &PodContext) -> io::Result<Bytes> {
    if !ctx.mesh.early_data {
        return Ok(Bytes::new());
    }
    read_early(stream)
}

/// What the client has sent so far, read without waiting (empty if
/// nothing, or only its FIN, which the relay then reads again).
///
/// Read from the socket itself: the runtime learns of a new socket's
/// readiness only at its next turn, after the tunnel opened.
fn read_early(stream: &TcpStream) -> io::Result<Bytes> {
    let mut buf = [0u8; EARLY_MAX];
    match (&*socket2::SockRef::from(stream)).read(&mut buf) {
        Ok(n) => Ok(Bytes::copy_from_slice(&buf[..n])),
        Err(err) if err.kind() == io::ErrorKind::WouldBlock => Ok(Bytes::new()),
        Err(err) => Err(err),
    }
}

/// The client's connection failed (it was reset) before its tunnel
/// opened: nothing is opened for it.
fn client_failed(stream: TcpStream, flow: &Flow, ctx: &PodContext, err: &io::Error) -> Option<Way> {
    let detail = format!("the client's connection failed before its tunnel opened: {err}");
    refuse(stream, flow, ctx, FailReason::ClientFailed, &detail);
    None
}

/// Why a tunnel did not open, as ztunnel tells its failures apart
/// (`src/proxy/pool.rs` `ConnSpawner::new_pool_conn`: a connect to the
/// peer that timed out may be a NetworkPolicy; `src/proxy/metrics.rs`
/// `extract_failure_reason`: HTTP/2 errors are their own flag, the rest
/// `CONNECT`).
fn tunnel_failure(err: &PoolError) -> FailReason {
    match err {
        PoolError::Dial { source, .. } if source.kind() == io::ErrorKind::TimedOut => {
            FailReason::TunnelTimeout
        }
        PoolError::Http2 { .. } => FailReason::TunnelHttp2,
        PoolError::Dial { .. }
        | PoolError::Request { .. }
        | PoolError::Refused { .. }
        | PoolError::Inner { .. } => FailReason::Tunnel,
    }
}

/// The connection's far end in telemetry: the workload, or nobody known.
fn destination(peer: Option<&Arc<Peer>>) -> Arc<Peer> {
    peer.map(Arc::clone).unwrap_or_default()
}

/// Opens (or reuses a pooled connection for) the tunnel of `hop` for
/// `flow`'s client (and the service it dialled, if it dialled one),
/// sending the client's `early` bytes with the request.
async fn open_tunnel(
    ctx: &PodContext,
    hop: &TunnelHop,
    flow: &Flow,
    early: &Bytes,
) -> Result<Tunnel, PoolError> {
    let forwarded = (
        flow.src,
        flow.service.as_deref().map(|s| s.hostname.as_str()),
    );
    let key = PoolKey {
        src_identity: hop.src_identity.clone(),
        dst_identity: hop.dst_identity.clone(),
        alt_identities: Arc::clone(&hop.alt_identities),
        dst_addr: hop.via,
    };
    // Through a network gateway, both tunnels ask for the service by name.
    let authority = match &hop.through {
        Some(through) => through.authority.clone(),
        None => hop.dst.to_string(),
    };
    // What the mesh says of the pod (canonical service and revision, its
    // cluster), as Istio's node proxy fills it in.
    let source = &flow.source;
    let baggage = ctx
        .baggage
        .get(source, || {
            Baggage::of(source, &ctx.identity.namespace, &ctx.identity.name)
        })
        .map_err(|err| PoolError::Request {
            authority: authority.clone(),
            source: err.into(),
        })?;
    // One trace id for the connection, whichever hop carries it.
    let traceparent = wire::traceparent(flow.trace.unwrap_or_else(wire::new_trace_id));
    let Some(through) = &hop.through else {
        // Boxed: the dial and handshake state is large and only lives
        // while the tunnel opens, not for the connection's whole life.
        return Box::pin(ctx.pool.connect(
            &key,
            &authority,
            forwarded,
            (&baggage, &traceparent),
            early,
        ))
        .await;
    };
    // The outer tunnel carries no early bytes: they are the inner one's.
    let outer = Box::pin(ctx.pool.connect(
        &key,
        &authority,
        forwarded,
        (&baggage, &traceparent),
        &Bytes::new(),
    ))
    .await?;
    let headers = gateway::InnerHeaders {
        forwarded,
        baggage: &baggage,
        traceparent: &traceparent,
        origin_network: &ctx.mesh.network,
    };
    Box::pin(gateway::open_inner(
        ctx, hop, through, outer, headers, early,
    ))
    .await
}

/// What relays an open `way`: the tunnel's relay, or the direct
/// connection made and its relay (`None` if it could not be made).
async fn relaying(way: Way, ctx: &PodContext) -> Option<Relaying> {
    match way {
        Way::Tunnel(stream, flow, tunnel, early) => {
            if early > 0 {
                ctx.mesh.metrics.early_data_sent();
            }
            let open = flow.open(&ctx.mesh.metrics);
            let (send, recv, slot) = tunnel.into_parts();
            let relay =
                relay_tunnel(stream, send, recv, open.meter_from_client()).sent_before(early);
            Some(Relaying::Tunnel(relay, open, slot))
        }
        Way::Direct(stream, flow, dst) => {
            let (relay, open) = connect_direct(stream, flow, (None, dst), ctx).await?;
            Some(Relaying::Plain(relay, open))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::AsyncWriteExt as _;

    use super::*;

    /// A connected loopback pair: (the client's end, the engine's end).
    async fn pair() -> io::Result<(TcpStream, TcpStream)> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let client = TcpStream::connect(listener.local_addr()?).await?;
        let (engine, _) = listener.accept().await?;
        Ok((client, engine))
    }

    /// Waits (bounded) until `engine` has something to read, without
    /// reading it.
    async fn wait_readable(engine: &TcpStream) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(10), engine.readable()).await??;
        Ok(())
    }

    #[tokio::test]
    async fn early_bytes_are_what_the_client_sent_or_nothing() -> anyhow::Result<()> {
        // Nothing sent yet: nothing, at once.
        let (mut client, engine) = pair().await?;
        assert!(read_early(&engine)?.is_empty());
        // Sent: all of it, up to the bound.
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await?;
        wait_readable(&engine).await?;
        assert_eq!(&read_early(&engine)?[..], b"GET / HTTP/1.1\r\n\r\n");
        let big = vec![7u8; 3 * EARLY_MAX];
        client.write_all(&big).await?;
        wait_readable(&engine).await?;
        let early = read_early(&engine)?;
        assert!(
            !early.is_empty() && early.len() <= EARLY_MAX,
            "{}",
            early.len()
        );
        Ok(())
    }

    #[tokio::test]
    async fn a_fin_alone_is_left_for_the_relay() -> anyhow::Result<()> {
        let (mut client, engine) = pair().await?;
        client.shutdown().await?;
        wait_readable(&engine).await?;
        assert!(read_early(&engine)?.is_empty());
        // The relay still reads the end of the stream.
        let mut buf = [0u8; 8];
        assert_eq!(engine.try_read(&mut buf)?, 0);
        Ok(())
    }

    #[tokio::test]
    async fn a_client_that_reset_is_an_error() -> anyhow::Result<()> {
        let (client, engine) = pair().await?;
        // SO_LINGER 0: the close is a reset.
        socket2::SockRef::from(&client).set_linger(Some(Duration::ZERO))?;
        drop(client);
        wait_readable(&engine).await?;
        let err = read_early(&engine).err().map(|e| e.kind());
        assert_eq!(err, Some(io::ErrorKind::ConnectionReset));
        Ok(())
    }
}
