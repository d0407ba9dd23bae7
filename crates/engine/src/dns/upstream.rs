//! Forwarding to the upstream servers: the query as the pod sent it (EDNS
//! and all), over UDP first and again over TCP when the answer is
//! truncated, one server after another within a time budget, and a bounded
//! cache of the answers.
//!
//! Upstream sockets live in the agent's own network namespace (the node's,
//! whose resolv.conf names the servers) and carry the proxy mark, so the
//! kernel programs never capture them.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use hickory_proto::op::{Message, ResponseCode};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    sync::Semaphore,
    time::timeout,
};

use super::{DnsError, metrics::DnsMetrics};

/// How long one server gets to answer one attempt.
pub const SERVER_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a query may take upstream in all, every server and retry
/// included: below a stub resolver's usual 5 s, so it gets SERVFAIL rather
/// than silence.
pub const UPSTREAM_BUDGET: Duration = Duration::from_millis(3500);
/// Upstream queries in flight at once, over all pods.
pub const MAX_IN_FLIGHT: usize = 1024;
/// Cached answers at most.
pub const CACHE_ENTRIES: usize = 4096;
/// Bytes of cached answers at most.
pub const CACHE_BYTES: usize = 8 << 20;
/// Longest time an answer is cached, whatever its TTL.
pub const MAX_CACHE_TTL: Duration = Duration::from_secs(300);
/// How long an answer without records (NXDOMAIN, NODATA) is cached.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(5);
/// Largest DNS message (the TCP length prefix is 16 bits).
pub const MAX_MESSAGE: usize = 65_535;

/// Cache key: the question and the bits that change the answer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct CacheKey {
    name: String,
    qtype: u16,
    qclass: u16,
    dnssec_ok: bool,
    checking_disabled: bool,
}

impl CacheKey {
    fn of(request: &Message) -> Option<Self> {
        let [query] = request.queries.as_slice() else {
            return None;
        };
        Some(Self {
            name: query.name().to_ascii().to_ascii_lowercase(),
            qtype: u16::from(query.query_type()),
            qclass: u16::from(query.query_class()),
            dnssec_ok: request.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok),
            checking_disabled: request.metadata.checking_disabled,
        })
    }
}

#[derive(Debug)]
struct Cached {
    reply: Vec<u8>,
    stored: Instant,
    expires: Instant,
}

/// The answer cache: bounded in entries and bytes.
#[derive(Debug, Default)]
struct Cache {
    entries: HashMap<CacheKey, Cached>,
    bytes: usize,
}

impl Cache {
    fn get(&mut self, key: &CacheKey, now: Instant) -> Option<Vec<u8>> {
        let entry = self.entries.get(key)?;
        if entry.expires > now {
            return Some(aged(&entry.reply, now.duration_since(entry.stored)));
        }
        self.remove(key);
        None
    }

    fn remove(&mut self, key: &CacheKey) {
        if let Some(old) = self.entries.remove(key) {
            self.bytes -= old.reply.len();
        }
    }

    fn insert(&mut self, key: CacheKey, reply: Vec<u8>, expires: Instant, now: Instant) {
        if reply.len() > CACHE_BYTES / 16 {
            return;
        }
        self.remove(&key);
        if self.entries.len() >= CACHE_ENTRIES || self.bytes + reply.len() > CACHE_BYTES {
            let expired: Vec<CacheKey> = self
                .entries
                .iter()
                .filter(|(_, e)| e.expires <= now)
                .map(|(k, _)| k.clone())
                .collect();
            for k in &expired {
                self.remove(k);
            }
        }
        while self.entries.len() >= CACHE_ENTRIES || self.bytes + reply.len() > CACHE_BYTES {
            let Some(victim) = self.entries.keys().next().cloned() else {
                break;
            };
            self.remove(&victim);
        }
        self.bytes += reply.len();
        self.entries.insert(
            key,
            Cached {
                reply,
                stored: now,
                expires,
            },
        );
    }
}

/// Forwards queries to the upstream servers.
#[derive(Debug)]
pub struct Forwarder {
    servers: Vec<SocketAddr>,
    mark: u32,
    cache: Mutex<Cache>,
    in_flight: Semaphore,
    metrics: Arc<DnsMetrics>,
}

/// A forwarded answer.
#[derive(Debug)]
pub struct Forwarded {
    /// The reply as the server sent it, with the request's id.
    pub reply: Vec<u8>,
    /// Whether it came from the cache.
    pub cached: bool,
}

impl Forwarder {
    /// A forwarder to `servers`, its sockets marked with `mark`.
    pub fn new(servers: Vec<SocketAddr>, mark: u32, metrics: Arc<DnsMetrics>) -> Self {
        Self {
            servers,
            mark,
            cache: Mutex::new(Cache::default()),
            in_flight: Semaphore::new(MAX_IN_FLIGHT),
            metrics,
        }
    }

    /// The upstream servers.
    pub fn servers(&self) -> &[SocketAddr] {
        &self.servers
    }

    /// The answer to `request` (whose wire form is `raw`), from the cache
    /// or the first upstream server that gives a valid one in time.
    pub async fn forward(&self, request: &Message, raw: &[u8]) -> Result<Forwarded, DnsError> {
        let key = CacheKey::of(request);
        let now = Instant::now();
        if let Some(key) = &key {
            let hit = self
                .cache
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(key, now);
            if let Some(mut reply) = hit {
                reply[..2].copy_from_slice(&request.metadata.id.to_be_bytes());
                return Ok(Forwarded {
                    reply,
                    cached: true,
                });
            }
        }
        let _permit = self.in_flight.try_acquire().map_err(|_| DnsError::Busy {
            limit: MAX_IN_FLIGHT,
        })?;
        let deadline = tokio::time::Instant::now() + UPSTREAM_BUDGET;
        let mut last = DnsError::NoUpstream;
        for server in &self.servers {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let started = Instant::now();
            self.metrics.upstream_request();
            match self
                .ask(*server, request, raw, left.min(SERVER_TIMEOUT))
                .await
            {
                Ok((reply, parsed)) => {
                    self.metrics.upstream_duration(started.elapsed());
                    if let Some(key) = key {
                        self.remember(key, &reply, &parsed, now);
                    }
                    return Ok(Forwarded {
                        reply,
                        cached: false,
                    });
                }
                Err(err) => {
                    self.metrics.upstream_failure();
                    tracing::debug!(%server, error = %err, "upstream DNS server failed");
                    last = err;
                }
            }
        }
        Err(last)
    }

    fn remember(&self, key: CacheKey, reply: &[u8], parsed: &Message, now: Instant) {
        let code = parsed.metadata.response_code;
        if parsed.metadata.truncation
            || (code != ResponseCode::NoError && code != ResponseCode::NXDomain)
        {
            return;
        }
        let ttl = parsed
            .answers
            .iter()
            .chain(parsed.authorities.iter())
            .map(|r| Duration::from_secs(u64::from(r.ttl)))
            .min();
        let ttl = match (ttl, parsed.answers.is_empty()) {
            (Some(ttl), false) => ttl.min(MAX_CACHE_TTL),
            _ => NEGATIVE_TTL,
        };
        if ttl.is_zero() {
            return;
        }
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, reply.to_vec(), now + ttl, now);
    }

    /// One server: UDP, then TCP if the answer is truncated.
    async fn ask(
        &self,
        server: SocketAddr,
        request: &Message,
        raw: &[u8],
        limit: Duration,
    ) -> Result<(Vec<u8>, Message), DnsError> {
        let io = |source| DnsError::Upstream { server, source };
        let attempt = async {
            let reply = self.ask_udp(server, raw).await.map_err(io)?;
            let parsed = check_reply(server, request, &reply)?;
            if !parsed.metadata.truncation {
                return Ok((reply, parsed));
            }
            let reply = self.ask_tcp(server, raw).await.map_err(io)?;
            let parsed = check_reply(server, request, &reply)?;
            Ok((reply, parsed))
        };
        timeout(limit, attempt)
            .await
            .map_err(|_| DnsError::UpstreamTimeout { server, limit })?
    }

    fn socket(&self, server: SocketAddr, ty: Type, protocol: Protocol) -> std::io::Result<Socket> {
        let socket = Socket::new(
            Domain::for_address(server),
            ty.nonblocking().cloexec(),
            Some(protocol),
        )?;
        if self.mark != 0 {
            socket.set_mark(self.mark)?;
        }
        Ok(socket)
    }

    async fn ask_udp(&self, server: SocketAddr, raw: &[u8]) -> std::io::Result<Vec<u8>> {
        let socket = self.socket(server, Type::DGRAM, Protocol::UDP)?;
        let socket = tokio::net::UdpSocket::from_std(socket.into())?;
        socket.connect(server).await?;
        socket.send(raw).await?;
        let mut buf = vec![0u8; MAX_MESSAGE];
        // A connected socket only receives from `server`; a reply that
        // does not match is checked by the caller.
        let n = socket.recv(&mut buf).await?;
        buf.truncate(n);
        Ok(buf)
    }

    async fn ask_tcp(&self, server: SocketAddr, raw: &[u8]) -> std::io::Result<Vec<u8>> {
        let socket = self.socket(server, Type::STREAM, Protocol::TCP)?;
        let socket = tokio::net::TcpSocket::from_std_stream(socket.into());
        let mut stream = socket.connect(server).await?;
        let len = u16::try_from(raw.len())
            .map_err(|_| std::io::Error::other("query longer than a DNS message"))?;
        let mut framed = Vec::with_capacity(raw.len() + 2);
        framed.extend_from_slice(&len.to_be_bytes());
        framed.extend_from_slice(raw);
        stream.write_all(&framed).await?;
        let len = usize::from(stream.read_u16().await?);
        let mut buf = vec![0u8; len];
        stream.read_exact(&mut buf).await?;
        Ok(buf)
    }
}

/// A cached reply with every record's TTL lowered by the time it spent in
/// the cache (so clients do not keep it longer than the server said); the
/// reply as stored when it does not parse again or no whole second passed.
fn aged(reply: &[u8], age: Duration) -> Vec<u8> {
    let age = u32::try_from(age.as_secs()).unwrap_or(u32::MAX);
    if age == 0 {
        return reply.to_vec();
    }
    let Ok(mut message) = Message::from_vec(reply) else {
        return reply.to_vec();
    };
    for record in message
        .answers
        .iter_mut()
        .chain(message.authorities.iter_mut())
        .chain(message.additionals.iter_mut())
    {
        record.ttl = record.ttl.saturating_sub(age);
    }
    message.to_vec().unwrap_or_else(|_| reply.to_vec())
}

/// Parses an upstream reply and checks it answers `request`.
fn check_reply(server: SocketAddr, request: &Message, reply: &[u8]) -> Result<Message, DnsError> {
    let bad = |reason: &'static str| DnsError::BadReply { server, reason };
    let parsed = Message::from_vec(reply).map_err(|_| bad("unparseable"))?;
    if parsed.metadata.id != request.metadata.id {
        return Err(bad("id differs from the query's"));
    }
    if parsed.queries != request.queries {
        return Err(bad("question differs from the query's"));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> CacheKey {
        CacheKey {
            name: name.into(),
            qtype: 1,
            qclass: 1,
            dnssec_ok: false,
            checking_disabled: false,
        }
    }

    #[test]
    #[expect(clippy::unwrap_used, reason = "fixed test input")]
    fn cached_answers_count_their_ttl_down() {
        use hickory_proto::{
            op::{MessageType, OpCode},
            rr::{Name, RData, Record, rdata::A},
        };
        let mut reply = Message::new(1, MessageType::Response, OpCode::Query);
        reply.answers.push(Record::from_rdata(
            Name::from_ascii("a.example.").unwrap(),
            60,
            RData::A(A(std::net::Ipv4Addr::LOCALHOST)),
        ));
        let raw = reply.to_vec().unwrap();
        let now = Instant::now();
        let mut cache = Cache::default();
        cache.insert(key("a"), raw.clone(), now + Duration::from_secs(60), now);
        assert_eq!(cache.get(&key("a"), now), Some(raw));
        let later = cache.get(&key("a"), now + Duration::from_secs(25)).unwrap();
        assert_eq!(Message::from_vec(&later).unwrap().answers[0].ttl, 35);
    }

    #[test]
    fn the_cache_expires_and_stays_within_its_bounds() {
        let now = Instant::now();
        let mut cache = Cache::default();
        cache.insert(key("a"), vec![1; 10], now + Duration::from_secs(1), now);
        assert_eq!(cache.get(&key("a"), now), Some(vec![1; 10]));
        assert_eq!(cache.get(&key("a"), now + Duration::from_secs(2)), None);
        assert_eq!(cache.bytes, 0);
        for i in 0..CACHE_ENTRIES + 10 {
            cache.insert(
                key(&i.to_string()),
                vec![0; 4],
                now + Duration::from_secs(9),
                now,
            );
        }
        assert_eq!(cache.entries.len(), CACHE_ENTRIES);
        assert_eq!(cache.bytes, CACHE_ENTRIES * 4);
        // An answer too large for a fair share of the budget is not kept.
        cache.insert(
            key("big"),
            vec![0; CACHE_BYTES],
            now + Duration::from_secs(9),
            now,
        );
        assert_eq!(cache.get(&key("big"), now), None);
    }
}
