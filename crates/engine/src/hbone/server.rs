//! The HBONE server side: HTTP/2 over an established (mutual TLS)
//! connection, one CONNECT stream per tunnelled TCP connection.
//!
//! Responses: 200 tunnel up; 400 not CONNECT, malformed authority, the
//! authority's IP is not the IP this connection arrived on (no open relay;
//! unless the local workload takes its tunnels itself, see
//! [`super::app_tunnel`]) or its port is an engine port; 401 denied by
//! policy; 503 the app could not be reached (the client's stream then
//! ends).
//!
//! A connection with no open stream for [`ServerContext::idle_timeout`] is
//! closed (GOAWAY, then the connection ends): a client that keeps
//! connections it does not use, or never uses, cannot hold them forever.

use std::{
    future::Future,
    net::{IpAddr, SocketAddr},
    pin::Pin,
    sync::Arc,
    time::Duration,
};

use bytes::Bytes;
use h2::{SendStream, server::SendResponse};
use http::{HeaderValue, Request, Response, StatusCode};
use tokio::{
    io::{AsyncRead, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
    sync::{Notify, watch},
    time::{Instant, MissedTickBehavior},
};
use tracing::{Instrument, debug, info_span};

use super::{
    app_tunnel::{self, Delivery, LocalTunnel},
    head::{Authority, RequestHead},
    wire,
};
use crate::{
    addr::{canonical, is_engine_port},
    identity::Identity,
    logging::Chain,
    policy::{self, LiveConnections, LiveGuard},
    relay::{relay_tunnel, tunnel::Relay},
    telemetry::{
        Direction, FailReason, Flow, Metrics, OpenFlow, Peer, Protocol, ServiceRef, TraceId,
    },
};

/// Dials the app for an accepted tunnel.
pub type AppDialer = Arc<
    dyn Fn(IpAddr, SocketAddr) -> Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send>>
        + Send
        + Sync,
>;

/// How long the GOAWAY of an idle connection may take to leave before the
/// connection is dropped anyway (a peer that does not read cannot keep it).
const IDLE_GOAWAY_GRACE: Duration = Duration::from_secs(5);

/// Maps a hostname authority to the app's address.
pub type AuthorityResolver = Arc<dyn Fn(&str, SocketAddr) -> Option<SocketAddr> + Send + Sync>;

/// The service an inbound connection is attributed to: from the hostname
/// the client named (`forwarded: host=`, or a hostname authority) and the
/// app's address.
pub type ServiceAttributor =
    Arc<dyn Fn(Option<&str>, SocketAddr) -> Option<Arc<ServiceRef>> + Send + Sync>;

/// The local workload's application tunnel for a stream with this
/// authority arriving on this local address; `None` when it has none.
pub type AppTunnelLookup = Arc<dyn Fn(&Authority, SocketAddr) -> Option<LocalTunnel> + Send + Sync>;

/// Whether the local workload (a tunnel arriving on the given local
/// address) is the waypoint of the workload or service at the given
/// address ([`crate::state::MeshState::is_waypoint_of`]).
pub type WaypointCheck = Arc<dyn Fn(IpAddr, SocketAddr) -> bool + Send + Sync>;

/// Decides whether a connection may proceed; `Err` carries the reason.
pub type Authorizer = Arc<dyn Fn(&policy::Request<'_>) -> Result<(), String> + Send + Sync>;

/// What the server needs for every stream of one connection.
#[derive(Clone)]
pub struct ServerContext {
    /// The address the TLS connection arrived on (its local address).
    pub local: SocketAddr,
    /// The client's address.
    pub peer: SocketAddr,
    /// The client's verified SPIFFE identity, read from its certificate
    /// once per connection.
    pub peer_identity: Option<Identity>,
    /// Opens the connection to the app for a client at the given address.
    pub dial: AppDialer,
    /// The policy hook.
    pub authorize: Authorizer,
    /// Resolves a `hostname:port` authority (a service) arriving on the
    /// given local address to the app's address; `None` = unknown.
    pub resolve_authority: AuthorityResolver,
    /// The local workload's application tunnel, looked up per stream.
    pub app_tunnel: AppTunnelLookup,
    /// Whether this workload is the waypoint of what an authority naming
    /// another address names, looked up per stream.
    pub is_waypoint_of: WaypointCheck,
    /// Attributes each stream to a service, for telemetry.
    pub attribute: ServiceAttributor,
    /// Where open tunnels are registered so a policy change can close them.
    pub live: Option<Arc<LiveConnections>>,
    /// Flips to `true` when the agent drains: the server sends GOAWAY and
    /// lets open streams finish.
    pub shutdown: watch::Receiver<bool>,
    /// Where streams are counted.
    pub metrics: Arc<Metrics>,
    /// The client (its principal is the verified identity).
    pub source: Arc<Peer>,
    /// Whether the mesh state knows the client by its address; when it
    /// does not, each stream's `baggage` names it in telemetry
    /// ([`wire::Baggage::peer`]).
    pub source_known: bool,
    /// The workload this server belongs to.
    pub destination: Arc<Peer>,
    /// What the 200 says of `destination` in `baggage`
    /// ([`ServerContext::baggage_of`]), formatted once for all the
    /// connection's streams.
    pub destination_baggage: Option<HeaderValue>,
    /// A connection without an open stream for this long is closed.
    pub idle_timeout: Duration,
    /// The receive windows and frame size announced to the client.
    pub h2: wire::H2Settings,
}

impl std::fmt::Debug for ServerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerContext")
            .field("local", &self.local)
            .field("peer", &self.peer)
            .field("peer_identity", &self.peer_identity)
            .finish()
    }
}

/// Serves one connection until the client closes it, it fails, it has
/// been idle (no open stream) for [`ServerContext::idle_timeout`], or the
/// agent drains.
pub async fn serve_connection<IO>(io: IO, ctx: ServerContext) -> Result<(), h2::Error>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let h2 = ctx.h2.clamped();
    let mut conn = h2::server::Builder::new()
        .initial_window_size(h2.stream_window)
        .initial_connection_window_size(h2.connection_window)
        .max_frame_size(h2.max_frame)
        .max_concurrent_streams(wire::MAX_STREAMS)
        .max_header_list_size(wire::MAX_HEADER_LIST)
        .handshake::<_, Bytes>(io)
        .await?;
    let mut shutdown = ctx.shutdown.clone();
    // Shared by the connection's streams, not copied into each.
    let ctx = Arc::new(ctx);
    let mut draining = *shutdown.borrow();
    if draining {
        conn.graceful_shutdown();
    }
    // Streams end in their own tasks, which do not wake this loop: idleness
    // is checked on a tick (an eighth of the timeout, at most 5 s), so a
    // connection is closed within a tick of the timeout after its last
    // stream ended.
    let idle_timeout = ctx.idle_timeout;
    let mut idle_check = tokio::time::interval(
        (idle_timeout / 8).clamp(Duration::from_millis(10), Duration::from_secs(5)),
    );
    idle_check.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last_active = Instant::now();
    let mut give_up: Option<Instant> = None;
    // Streams run in tasks of their own; when the connection's task is
    // dropped (the pod leaves, the drain deadline passes) the h2 connection
    // goes with it and every stream of it fails, which ends their tasks.
    loop {
        tokio::select! {
            accepted = conn.accept() => match accepted {
                Some(Ok((request, respond))) => {
                    last_active = Instant::now();
                    let ctx = Arc::clone(&ctx);
                    let span = info_span!(
                        "hbone_in",
                        src = %canonical(ctx.peer),
                        peer_identity = ctx.peer_identity.as_ref().map_or("-", Identity::as_uri),
                        trace_id = tracing::field::Empty,
                        forwarded_for = tracing::field::Empty,
                    );
                    // Boxed here: the stream's set-up (the request's head,
                    // the checks, policy, the dial) lives in this box, freed
                    // once the tunnel is open; the task then holds only the
                    // relay for the connection's life.
                    let accept = Box::pin(accept_stream(request, respond, Arc::clone(&ctx)));
                    tokio::spawn(handle_stream(accept, ctx).instrument(span));
                }
                Some(Err(err)) => return Err(err),
                None => return Ok(()),
            },
            changed = shutdown.changed(), if !draining => {
                if changed.is_err() || *shutdown.borrow() {
                    draining = true;
                    conn.graceful_shutdown();
                }
            }
            _ = idle_check.tick(), if give_up.is_none() => {
                if conn.has_streams() {
                    last_active = Instant::now();
                } else if last_active.elapsed() >= idle_timeout {
                    debug!(idle_ms = last_active.elapsed().as_millis() as u64, "HBONE connection idle, closing it");
                    // No stream is open, so nothing is cut: GOAWAY tells the
                    // client not to send more.
                    conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                    give_up = Some(Instant::now() + IDLE_GOAWAY_GRACE);
                }
            }
            () = tokio::time::sleep_until(give_up.unwrap_or_else(Instant::now)), if give_up.is_some() => {
                return Ok(());
            }
        }
    }
}

/// Relays a CONNECT stream once `accept` opened it.
async fn handle_stream<F>(accept: Pin<Box<F>>, ctx: Arc<ServerContext>)
where
    F: Future<Output = Option<Accepted>>,
{
    // Moved out and dropped here, so the set-up's box is freed before the
    // relay starts.
    let accepted = {
        let accept = accept;
        accept.await
    };
    // Moved whole into what the task keeps: the parts of `Accepted` a
    // destructuring here would leave behind (its socket and stream handles
    // moved out) would stay in the task's state, unused, as long as the
    // connection lives.
    let Some(Running {
        mut relay,
        open,
        _live,
        kill,
    }) = accepted.map(|accepted| accepted.start(&ctx))
    else {
        return;
    };
    let result = match kill {
        // The relay is polled by reference, not moved into the select: a
        // revoked connection is recorded before the relay (whose drop
        // resets the app's socket and the stream) goes, so whoever sees
        // the reset finds it counted.
        Some(kill) => tokio::select! {
            result = &mut relay => result,
            // Policy now denies it: recorded as closed by the agent, then
            // the return drops the relay.
            () = kill.notified() => return open.revoke(),
        },
        None => relay.await,
    };
    // The relay's `sent` went from the app (the server) into the tunnel.
    match result {
        Ok(t) => open.close(t.received, t.sent, None),
        Err(err) => open.close(0, 0, Some(&Chain(&err).to_string())),
    }
}

/// A CONNECT stream that was allowed and whose app answered: what its
/// relay needs.
struct Accepted {
    app: TcpStream,
    send: SendStream<Bytes>,
    body: h2::RecvStream,
    dst: SocketAddr,
    open: OpenFlow,
}

/// What a stream's task holds while its tunnel is relayed.
struct Running {
    relay: Relay,
    open: OpenFlow,
    /// The connection's entry among the live ones, while it lives.
    _live: Option<LiveGuard>,
    /// Notified once policy no longer allows the connection.
    kill: Option<Arc<Notify>>,
}

impl Accepted {
    /// Registers the connection as live (if policy is watched) and makes
    /// its relay.
    fn start(self, ctx: &ServerContext) -> Running {
        let Accepted {
            app,
            send,
            body,
            dst,
            open,
        } = self;
        let (_live, kill) = match &ctx.live {
            Some(live) => {
                let (guard, kill) =
                    live.register(ctx.peer_identity.as_ref(), canonical(ctx.peer), dst);
                (Some(guard), Some(kill))
            }
            None => (None, None),
        };
        let meter = open.meter_from_server();
        Running {
            relay: relay_tunnel(app, send, body, meter),
            open,
            _live,
            kill,
        }
    }
}

/// Checks the request, asks policy, dials the app and answers 200; or
/// answers the refusal and records it (`None`).
async fn accept_stream(
    request: Request<h2::RecvStream>,
    mut respond: SendResponse<Bytes>,
    ctx: Arc<ServerContext>,
) -> Option<Accepted> {
    let ctx = &*ctx;
    let mut flow = Flow {
        direction: Direction::Inbound,
        protocol: Protocol::Hbone,
        src: canonical(ctx.peer),
        dst: None,
        source: Arc::clone(&ctx.source),
        destination: Arc::clone(&ctx.destination),
        service: None,
        trace: None,
    };
    let Checked {
        head,
        asked,
        delivery,
    } = match check(&request, ctx) {
        Ok(checked) => checked,
        Err((status, fail, reason)) => {
            reject(&mut respond, status, ctx, &flow, fail, &reason);
            return None;
        }
    };
    record_head(&head);
    // The client's trace id, or a fresh one when it sent none, as ztunnel
    // (`src/proxy/inbound.rs` `extract_traceparent`).
    flow.trace = Some(
        head.trace
            .map_or_else(wire::new_trace_id, |t| TraceId::from_u128(t.trace_id)),
    );
    if !ctx.source_known
        && let Some(baggage) = &head.baggage
    {
        flow.source = Arc::new(baggage.peer(ctx.source.principal.clone()));
    }
    let dst = delivery.app;
    flow.dst = Some(dst);
    let named = match &head.authority {
        Authority::Host { name, .. } => Some(name.as_str()),
        Authority::Addr(_) => head.forwarded_host.as_deref(),
    };
    // By the port asked for: an application tunnel's port is no service's.
    flow.service = (ctx.attribute)(named, asked);
    let authz = policy::Request {
        peer: ctx.peer_identity.as_ref(),
        src: canonical(ctx.peer),
        dst,
    };
    if let Err(reason) = (ctx.authorize)(&authz) {
        let status = StatusCode::UNAUTHORIZED;
        reject(
            &mut respond,
            status,
            ctx,
            &flow,
            FailReason::Denied,
            &reason,
        );
        return None;
    }
    // The TCP peer is the client: its engine dials from inside the client
    // pod. `forwarded: for=` is never used for this, as any mesh identity
    // could claim any address there.
    let from = delivery.from.unwrap_or(canonical(ctx.peer).ip());
    let opened = match (ctx.dial)(from, delivery.connect).await {
        Ok(app) => open_tunnel(app, &delivery, ctx).await,
        Err(err) => Err(format!("app unreachable: {err}")),
    };
    let app = match opened {
        Ok(app) => app,
        Err(reason) => {
            let status = StatusCode::SERVICE_UNAVAILABLE;
            reject(
                &mut respond,
                status,
                ctx,
                &flow,
                FailReason::AppUnreachable,
                &reason,
            );
            return None;
        }
    };
    let send = match respond.send_response(ok_with_baggage(ctx.destination_baggage.as_ref()), false)
    {
        Ok(send) => send,
        Err(err) => {
            let reason = format!("cannot send 200: {err}");
            flow.refuse(&ctx.metrics, FailReason::Tunnel, &reason);
            return None;
        }
    };
    Some(Accepted {
        app,
        send,
        body: request.into_body(),
        dst,
        open: flow.open(&ctx.metrics),
    })
}

/// Starts the app's connection as its application tunnel asks: for PROXY,
/// the header first (ztunnel writes it in `serve_connect` before it copies
/// a byte). Written before the 200, so a failure is the client's 503.
async fn open_tunnel(
    mut app: TcpStream,
    delivery: &Delivery,
    ctx: &ServerContext,
) -> Result<TcpStream, String> {
    let Some(destination) = delivery.proxy_destination else {
        return Ok(app);
    };
    let header =
        app_tunnel::proxy_header(canonical(ctx.peer), destination, ctx.peer_identity.as_ref())
            .map_err(|err| Chain(&err).to_string())?;
    app.write_all(&header)
        .await
        .map_err(|err| format!("cannot write the PROXY protocol header to the app: {err}"))?;
    Ok(app)
}

/// A request that passed [`check`].
struct Checked {
    head: RequestHead,
    /// The app's address for the port asked for (the local workload's IP).
    asked: SocketAddr,
    /// Where the stream goes.
    delivery: Delivery,
}

/// Validates method and authority; says where the stream goes.
fn check(
    request: &Request<h2::RecvStream>,
    ctx: &ServerContext,
) -> Result<Checked, (StatusCode, FailReason, String)> {
    let bad = |reason: String| (StatusCode::BAD_REQUEST, FailReason::BadRequest, reason);
    let head = RequestHead::parse(request.method(), request.uri(), request.headers())
        .map_err(|err| bad(err.to_string()))?;
    let dst = match &head.authority {
        Authority::Addr(dst) => canonical(*dst),
        Authority::Host { name, port } => {
            (ctx.resolve_authority)(&format!("{name}:{port}"), ctx.local)
                .map(canonical)
                .ok_or_else(|| {
                    bad(format!(
                        "authority `{}` is not a known service hostname:port",
                        head.authority
                    ))
                })?
        }
    };
    let local = canonical(ctx.local).ip();
    let tunnel = (ctx.app_tunnel)(&head.authority, ctx.local);
    // A workload with its own tunnel is told the destination asked for
    // and decides (a waypoint's is the workload or service behind it); a
    // waypoint without one gets the stream when the authority's workload
    // or service names it as its waypoint (it then matches on L7 alone):
    // ztunnel `src/proxy/inbound.rs` `validate_destination` lets only
    // those through, checking an address authority only (a hostname is
    // resolved on this workload above).
    if dst.ip() != local
        && tunnel.is_none()
        && !(matches!(head.authority, Authority::Addr(_))
            && (ctx.is_waypoint_of)(dst.ip(), ctx.local))
    {
        return Err(bad(
            "authority IP is not the IP this connection arrived on".to_owned()
        ));
    }
    if is_engine_port(dst.port()) {
        return Err(bad("authority port is an engine port".to_owned()));
    }
    // Always the local workload's address: the tunnel ends here.
    let asked = SocketAddr::new(local, dst.port());
    let delivery = Delivery::new(
        asked,
        tunnel.and_then(|t| t.asked),
        tunnel.map(|t| t.tunnel),
        tunnel.is_none_or(|t| t.localhost),
    );
    if delivery.proxy_destination.is_some() && tunnel.is_some_and(|t| t.asked.is_none()) {
        // PROXY names addresses, not hostnames (ztunnel: `NoIPForService`).
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            FailReason::AppUnreachable,
            format!(
                "service `{}` has no VIP to name in the PROXY header",
                head.authority
            ),
        ));
    }
    if is_engine_port(delivery.app.port()) {
        return Err(bad(
            "the workload's application tunnel port is an engine port".to_owned(),
        ));
    }
    Ok(Checked {
        head,
        asked,
        delivery,
    })
}

/// Puts what the client side said about itself on the stream's span, so
/// the two ends' logs can be joined (trace id) and the original client
/// seen. Information only: nothing is decided on it.
fn record_head(head: &RequestHead) {
    let span = tracing::Span::current();
    if let Some(trace) = head.trace {
        span.record(
            "trace_id",
            tracing::field::display(format_args!("{:032x}", trace.trace_id)),
        );
    }
    if let Some(client) = head.forwarded_for {
        span.record("forwarded_for", tracing::field::display(client));
    }
}

fn reject(
    respond: &mut SendResponse<Bytes>,
    status: StatusCode,
    ctx: &ServerContext,
    flow: &Flow,
    reason: FailReason,
    detail: &str,
) {
    let detail = format!("{} {detail}", status.as_u16());
    // Counted before the answer leaves, so the peer never learns of the
    // refusal before this agent's metrics show it.
    flow.refuse(&ctx.metrics, reason, &detail);
    let _ = respond.send_response(status_only(status), true);
}

impl ServerContext {
    /// The `baggage` a 200 carries for `destination`, as Istio's node
    /// proxy answers; `None` (left out) if it cannot be a header.
    pub fn baggage_of(destination: &Peer) -> Option<HeaderValue> {
        wire::Baggage::of(destination, "", "").value().ok()
    }
}

/// The 200 that opens a tunnel, carrying what the destination is in
/// `baggage`.
fn ok_with_baggage(baggage: Option<&HeaderValue>) -> Response<()> {
    let mut response = status_only(StatusCode::OK);
    if let Some(value) = baggage {
        response.headers_mut().insert("baggage", value.clone());
    }
    response
}

fn status_only(status: StatusCode) -> Response<()> {
    let mut response = Response::new(());
    *response.status_mut() = status;
    response
}
