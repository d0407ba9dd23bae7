//! The HBONE client: a pool of HTTP/2 connections keyed by (source
//! identity, destination identity, destination address), carrying up to
//! [`PoolSpread::max_streams`] tunnels each.
//!
//! One connection carries every stream it has room for only while it is
//! not busy: its bytes are encrypted and framed by one task on one core, so
//! concurrent bulk streams on one connection share one core whatever the
//! machine has. Once every connection to a key carries
//! [`PoolSpread::busy_streams`] streams, the pool dials another, up to
//! [`PoolSpread::max_connections`], and each new stream goes to the
//! least-loaded connection. Past that bound connections are dialled only
//! when all are full, as a single-connection pool would.
//!
//! One dial per key is in flight at a time: fifty connections opened at once
//! between one pod pair wait for one TLS handshake at a time, never fifty.
//! Connections idle longer than the idle timeout are dropped; connections
//! whose keepalive PING goes unanswered are never handed out again.

use std::{
    collections::HashMap,
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::client::SendRequest;
use http::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::debug;

use super::wire;
use crate::identity::Identity;

/// How often an idle connection is pinged.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a PING may go unanswered.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors opening a tunnel.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// Dialing (TCP + TLS) the destination failed.
    #[error("cannot reach the HBONE peer {addr}")]
    Dial {
        /// The peer's address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP/2 layer failed.
    #[error("HTTP/2 with the HBONE peer {addr} failed")]
    Http2 {
        /// The peer's address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: h2::Error,
    },
    /// The request could not be built.
    #[error("cannot build the CONNECT request for {authority}")]
    Request {
        /// The authority.
        authority: String,
        /// The error.
        #[source]
        source: http::Error,
    },
    /// The peer answered with a status other than 200.
    #[error("the HBONE peer {addr} refused the tunnel to {authority} with status {status}")]
    Refused {
        /// The peer's address.
        addr: SocketAddr,
        /// The requested authority.
        authority: String,
        /// The status.
        status: StatusCode,
    },
    /// The tunnel inside the one to a network gateway (double HBONE)
    /// could not be opened: its TLS, HTTP/2 or CONNECT failed.
    #[error("the tunnel through the network gateway {gateway} to {authority} failed")]
    Inner {
        /// The gateway's address.
        gateway: SocketAddr,
        /// The requested authority.
        authority: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// What a pooled connection is shared by. Built per connection from
/// shared values: cloning it copies no string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    /// Source workload identity (the certificate the dialer presents).
    pub src_identity: Identity,
    /// Destination workload identity (the one the server must present).
    pub dst_identity: Identity,
    /// Other identities the destination may present (a service's
    /// subjectAltNames).
    pub alt_identities: Arc<[Identity]>,
    /// The destination's HBONE address (pod IP:15008).
    pub dst_addr: SocketAddr,
}

/// How a pool spreads the streams to one key over connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpread {
    /// Open streams at which a connection counts as busy: a new stream
    /// dials another connection when every connection to its key carries
    /// this many. Two, not one: a tunnel whose relay is still finishing
    /// when its client opens the next connection must not cost a
    /// handshake, and two concurrent streams are the least that can
    /// contend for one connection's task.
    pub busy_streams: usize,
    /// Connections per key the pool opens to spread busy streams (at
    /// least 1). More than the agent's cores gains nothing; each costs a
    /// handshake and its buffers on both ends while it lives.
    pub max_connections: usize,
    /// Streams one connection carries at most (at least 1): a stream
    /// finding every connection to its key this full dials another,
    /// whatever `max_connections` says. ztunnel's
    /// `POOL_MAX_STREAMS_PER_CONNECTION` (`src/config.rs`, default 100,
    /// checked by `src/proxy/pool.rs` when a connection is handed out).
    pub max_streams: usize,
}

impl Default for PoolSpread {
    /// Two streams make a connection busy; up to four connections per
    /// key; 100 streams per connection.
    fn default() -> Self {
        Self {
            busy_streams: 2,
            max_connections: 4,
            max_streams: wire::MAX_STREAMS as usize,
        }
    }
}

/// Opens the transport (TCP + TLS) for a pool key.
pub trait Dialer: Send + Sync + 'static {
    /// The established transport.
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Dials `key.dst_addr` presenting `key.src_identity` and expecting
    /// `key.dst_identity`.
    fn dial(
        &self,
        key: &PoolKey,
    ) -> Pin<Box<dyn Future<Output = std::io::Result<Self::Io>> + Send>>;
}

struct Pooled {
    send: SendRequest<Bytes>,
    streams: Arc<AtomicUsize>,
    alive: Arc<AtomicBool>,
    last_used: Mutex<Instant>,
    /// The connection's driver and keepalive tasks, aborted by
    /// [`HbonePool::close`].
    tasks: Vec<tokio::task::AbortHandle>,
}

/// A tunnel stream checked out of the pool; the stream slot is returned to
/// its connection when this is dropped.
#[derive(Debug)]
pub struct Tunnel {
    /// Data toward the destination.
    pub send: h2::SendStream<Bytes>,
    /// Data from the destination.
    pub recv: h2::RecvStream,
    _slot: StreamSlot,
}

/// A tunnel's place among its connection's streams, which the pool counts
/// to spread new streams; given back when dropped.
#[derive(Debug)]
pub struct StreamSlot(Arc<AtomicUsize>);

impl Tunnel {
    /// A tunnel on a connection of its own that no pool counts (the inner
    /// tunnel of double HBONE): its slot counts nothing.
    pub fn unpooled(send: h2::SendStream<Bytes>, recv: h2::RecvStream) -> Self {
        Self {
            send,
            recv,
            _slot: StreamSlot(Arc::new(AtomicUsize::new(1))),
        }
    }

    /// The stream's two halves, and its slot to hold while they are used.
    pub fn into_parts(self) -> (h2::SendStream<Bytes>, h2::RecvStream, StreamSlot) {
        (self.send, self.recv, self._slot)
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The pool.
pub struct HbonePool<D: Dialer> {
    dialer: D,
    conns: Mutex<HashMap<PoolKey, Vec<Arc<Pooled>>>>,
    dial_locks: Mutex<HashMap<PoolKey, Arc<tokio::sync::Mutex<()>>>>,
    idle_timeout: Duration,
    spread: PoolSpread,
    h2: wire::H2Settings,
    dials: AtomicU64,
    /// Set by [`HbonePool::close`]: streams failing from then on were
    /// closed by the agent, not lost.
    closed: AtomicBool,
}

impl<D: Dialer> std::fmt::Debug for HbonePool<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HbonePool")
            .field("dials", &self.dials.load(Ordering::Relaxed))
            .finish()
    }
}

/// Sends the CONNECT request on `conn`, and `early` right behind it, and
/// waits for the response head.
///
/// The client's first bytes go with the request instead of a round trip
/// later: HTTP/2 lets a client send a CONNECT stream's data before the
/// response (the proxy buffers it within the stream's flow-control window,
/// and discards it if the connection fails), as Envoy and the IETF's
/// connect-tcp draft expect. For a client that speaks first, the exchange
/// then costs one round trip between the nodes instead of two.
async fn open_stream(
    conn: &Pooled,
    request: http::Request<()>,
    early: &Bytes,
) -> Result<(http::Response<h2::RecvStream>, h2::SendStream<Bytes>), h2::Error> {
    let mut send_request = conn.send.clone().ready().await?;
    let (response, mut send) = send_request.send_request(request, false)?;
    if !early.is_empty() {
        send.send_data(early.clone(), false)?;
    }
    Ok((response.await?, send))
}

/// Whether the peer refused the stream without processing it: a GOAWAY
/// (the peer drains) or `REFUSED_STREAM` before any response.
fn unprocessed(err: &h2::Error) -> bool {
    err.is_go_away() || err.reason() == Some(h2::Reason::REFUSED_STREAM)
}

impl<D: Dialer> HbonePool<D> {
    /// A pool dialing with `dialer`, dropping connections idle for
    /// `idle_timeout`, spreading streams as [`PoolSpread::default`] says.
    pub fn new(dialer: D, idle_timeout: Duration) -> Arc<Self> {
        Self::with_spread(dialer, idle_timeout, PoolSpread::default())
    }

    /// [`HbonePool::new`] spreading streams as `spread` says.
    pub fn with_spread(dialer: D, idle_timeout: Duration, spread: PoolSpread) -> Arc<Self> {
        Self::with_settings(dialer, idle_timeout, spread, wire::H2Settings::default())
    }

    /// [`HbonePool::with_spread`] announcing `h2` in each connection's
    /// SETTINGS (clamped to what HTTP/2 allows).
    pub fn with_settings(
        dialer: D,
        idle_timeout: Duration,
        spread: PoolSpread,
        h2: wire::H2Settings,
    ) -> Arc<Self> {
        Arc::new(Self {
            dialer,
            conns: Mutex::new(HashMap::new()),
            dial_locks: Mutex::new(HashMap::new()),
            idle_timeout,
            spread: PoolSpread {
                busy_streams: spread.busy_streams.max(1),
                max_connections: spread.max_connections.max(1),
                max_streams: spread.max_streams.max(1),
            },
            h2: h2.clamped(),
            dials: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        })
    }

    /// Transports dialled so far (each is one TLS handshake).
    pub fn dials(&self) -> u64 {
        self.dials.load(Ordering::Relaxed)
    }

    /// Opens a tunnel to `authority` over a pooled connection for `key`,
    /// for the client at `source` that dialled the service `service` (its
    /// hostname), if it dialled one, with the client's `early` bytes sent
    /// behind the request (none if empty). Until the tunnel is returned
    /// they are the caller's to count: they are sent again if the stream
    /// must be retried, and lost with it if it fails. `baggage` and
    /// `traceparent` are the request's headers (one `traceparent` for the
    /// connection, retried or not, so that its records join).
    pub async fn connect(
        self: &Arc<Self>,
        key: &PoolKey,
        authority: &str,
        (source, service): (SocketAddr, Option<&str>),
        (baggage, traceparent): (&http::HeaderValue, &str),
        early: &Bytes,
    ) -> Result<Tunnel, PoolError> {
        let addr = key.dst_addr;
        let h2_err = |source| PoolError::Http2 { addr, source };
        let request = || {
            wire::connect_request(authority, source, service, baggage, traceparent).map_err(
                |source| PoolError::Request {
                    authority: authority.to_owned(),
                    source,
                },
            )
        };
        let (conn, slot) = self.checkout(key).await?;
        let (response, send, slot) = match open_stream(&conn, request()?, early).await {
            Ok((response, send)) => (response, send, slot),
            // The peer is draining (GOAWAY) and never processed this
            // stream: no byte reached the destination, so a fresh
            // connection may carry it (the peer's replacement, after an
            // upgrade, accepts it). Once only.
            Err(err) if unprocessed(&err) => {
                debug!(%addr, error = %err, "stream refused by a draining HBONE peer; retrying on a new connection");
                conn.alive.store(false, Ordering::Release);
                drop(slot);
                let (conn, slot) = self.checkout(key).await?;
                let (response, send) = open_stream(&conn, request()?, early)
                    .await
                    .map_err(h2_err)?;
                (response, send, slot)
            }
            Err(err) => return Err(h2_err(err)),
        };
        if response.status() != StatusCode::OK {
            return Err(PoolError::Refused {
                addr,
                authority: authority.to_owned(),
                status: response.status(),
            });
        }
        Ok(Tunnel {
            send,
            recv: response.into_body(),
            _slot: slot,
        })
    }

    /// A connection with a free stream slot: the least-loaded one, or a
    /// new one when every connection is busy and the key has room for
    /// another (or every connection is full).
    async fn checkout(
        self: &Arc<Self>,
        key: &PoolKey,
    ) -> Result<(Arc<Pooled>, StreamSlot), PoolError> {
        if let Some(found) = self.find(key, Need::Spread) {
            return Ok(found);
        }
        let dial_lock = {
            let mut locks = lock(&self.dial_locks);
            Arc::clone(locks.entry(key.clone()).or_default())
        };
        let _dialing = dial_lock.lock().await;
        // Whoever held the lock before us may have dialled already.
        if let Some(found) = self.find(key, Need::Spread) {
            return Ok(found);
        }
        let pooled = match self.dial(key).await {
            Ok(pooled) => pooled,
            // A dial meant to spread load failed (the peer may bound its
            // connections per client): a busy connection still carries
            // the stream.
            Err(err) => {
                return match self.find(key, Need::Share) {
                    Some(found) => {
                        debug!(peer = %key.dst_addr, error = %err, "cannot open another HBONE connection; sharing a busy one");
                        Ok(found)
                    }
                    None => Err(err),
                };
            }
        };
        let slot = take_slot(&pooled);
        lock(&self.conns)
            .entry(key.clone())
            .or_default()
            .push(Arc::clone(&pooled));
        Ok((pooled, slot))
    }

    /// The least-loaded live connection to `key` with a free stream slot,
    /// its slot claimed; `None` when there is none, or when `need` is
    /// [`Need::Spread`], every connection is busy and the key has room for
    /// another.
    fn find(&self, key: &PoolKey, need: Need) -> Option<(Arc<Pooled>, StreamSlot)> {
        let mut conns = lock(&self.conns);
        let list = conns.get_mut(key)?;
        list.retain(|c| c.alive.load(Ordering::Acquire));
        let limit = self.spread.max_streams;
        // Slots are only claimed under the `conns` lock (released ones
        // only make room), so the count read here holds until the claim.
        let (least, load) = list
            .iter()
            .map(|c| (c, c.streams.load(Ordering::Acquire)))
            .filter(|&(_, load)| load < limit)
            .min_by_key(|&(_, load)| load)?;
        let spread = list.len() < self.spread.max_connections;
        if need == Need::Spread && spread && load >= self.spread.busy_streams {
            return None;
        }
        if let Ok(mut t) = least.last_used.lock() {
            *t = Instant::now();
        }
        Some((Arc::clone(least), take_slot(least)))
    }

    async fn dial(self: &Arc<Self>, key: &PoolKey) -> Result<Arc<Pooled>, PoolError> {
        let addr = key.dst_addr;
        self.dials.fetch_add(1, Ordering::Relaxed);
        let io = self
            .dialer
            .dial(key)
            .await
            .map_err(|source| PoolError::Dial { addr, source })?;
        let (send, mut connection) = h2::client::Builder::new()
            .initial_window_size(self.h2.stream_window)
            .initial_connection_window_size(self.h2.connection_window)
            .max_frame_size(self.h2.max_frame)
            .max_header_list_size(wire::MAX_HEADER_LIST)
            .max_concurrent_streams(wire::MAX_STREAMS)
            .handshake::<_, Bytes>(io)
            .await
            .map_err(|source| PoolError::Http2 { addr, source })?;
        let alive = Arc::new(AtomicBool::new(true));
        let ping_pong = connection.ping_pong();
        let driver_alive = Arc::clone(&alive);
        let driver = tokio::spawn(async move {
            if let Err(err) = connection.await {
                debug!(peer = %addr, error = %err, "HBONE connection ended");
            }
            driver_alive.store(false, Ordering::Release);
        });
        let mut tasks = vec![driver.abort_handle()];
        if let Some(ping_pong) = ping_pong {
            tasks.push(tokio::spawn(keepalive(ping_pong, Arc::clone(&alive))).abort_handle());
        }
        tracing::info!(peer = %addr, dst_identity = %key.dst_identity, "HBONE connection established");
        Ok(Arc::new(Pooled {
            send,
            streams: Arc::new(AtomicUsize::new(0)),
            alive,
            last_used: Mutex::new(Instant::now()),
            tasks,
        }))
    }

    /// Closes every pooled connection at once (their streams end with
    /// them) and forgets the dial locks: the pod that owned the pool left.
    /// Returns how many connections were closed.
    pub fn close(&self) -> usize {
        self.closed.store(true, Ordering::Release);
        let closed: Vec<Arc<Pooled>> = lock(&self.conns)
            .drain()
            .flat_map(|(_, list)| list)
            .collect();
        for pooled in &closed {
            pooled.alive.store(false, Ordering::Release);
            for task in &pooled.tasks {
                task.abort();
            }
        }
        lock(&self.dial_locks).clear();
        closed.len()
    }

    /// Whether [`HbonePool::close`] was called: a tunnel that fails after
    /// it was closed by the agent (its pod left, or the drain deadline
    /// passed), whichever of its relay's cancellation and its
    /// connection's end the runtime got to first.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Drops connections with no open stream that were idle longer than
    /// the idle timeout. Returns how many were dropped.
    pub fn evict_idle(&self) -> usize {
        let mut conns = lock(&self.conns);
        let mut evicted = 0;
        for list in conns.values_mut() {
            list.retain(|c| {
                let idle = c
                    .last_used
                    .lock()
                    .map(|t| t.elapsed() >= self.idle_timeout)
                    .unwrap_or(true);
                let keep = c.alive.load(Ordering::Acquire)
                    && (c.streams.load(Ordering::Acquire) > 0 || !idle);
                if !keep {
                    evicted += 1;
                }
                keep
            });
        }
        conns.retain(|_, list| !list.is_empty());
        // A dial lock nobody waits on, for a key with no connection, is
        // only memory: destinations come and go.
        lock(&self.dial_locks)
            .retain(|key, dial| Arc::strong_count(dial) > 1 || conns.contains_key(key));
        evicted
    }

    /// Dial locks held (one per destination being or recently dialled).
    pub fn dial_locks(&self) -> usize {
        lock(&self.dial_locks).len()
    }

    /// Open pooled connections.
    pub fn connections(&self) -> usize {
        lock(&self.conns).values().map(Vec::len).sum()
    }

    /// Open streams on each live connection to `key`, in the order the
    /// connections were dialled.
    pub fn load(&self, key: &PoolKey) -> Vec<usize> {
        lock(&self.conns).get(key).map_or_else(Vec::new, |list| {
            list.iter()
                .filter(|c| c.alive.load(Ordering::Acquire))
                .map(|c| c.streams.load(Ordering::Acquire))
                .collect()
        })
    }

    /// Runs idle eviction until dropped (or the pool is gone).
    pub fn eviction(self: &Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        let pool = Arc::downgrade(self);
        let period = (self.idle_timeout / 2).max(Duration::from_millis(100));
        async move {
            let mut ticker = tokio::time::interval(period);
            loop {
                ticker.tick().await;
                match pool.upgrade() {
                    Some(pool) => {
                        pool.evict_idle();
                    }
                    None => return,
                }
            }
        }
    }
}

/// What [`HbonePool::find`] accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    /// A connection that is not busy, unless the key already has all the
    /// connections it may spread over.
    Spread,
    /// Any connection with a free stream slot.
    Share,
}

fn take_slot(pooled: &Pooled) -> StreamSlot {
    pooled.streams.fetch_add(1, Ordering::AcqRel);
    StreamSlot(Arc::clone(&pooled.streams))
}

async fn keepalive(mut ping_pong: h2::PingPong, alive: Arc<AtomicBool>) {
    loop {
        tokio::time::sleep(KEEPALIVE_INTERVAL).await;
        if !alive.load(Ordering::Acquire) {
            return;
        }
        let pong =
            tokio::time::timeout(KEEPALIVE_TIMEOUT, ping_pong.ping(h2::Ping::opaque())).await;
        if !matches!(pong, Ok(Ok(_))) {
            debug!("HBONE keepalive PING unanswered; retiring the connection");
            alive.store(false, Ordering::Release);
            return;
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}
