//! The resolver inside one pod: UDP and TCP on `127.0.0.1` and `[::1]`
//! port 15053, where the kernel programs steer the pod's DNS.
//!
//! Everything a client sends is bounded: a UDP query's size, queries in
//! flight per pod (more are dropped: the client retries), TCP connections
//! per pod (more are reset), a TCP connection's idle time and each
//! message's read and write time. Answers over UDP larger than the client
//! takes are sent truncated (TC) so it asks again over TCP, where answers
//! go up to 64 KiB.

use std::{net::IpAddr, sync::Arc, time::Duration};

use hickory_proto::op::{Message, OpCode, ResponseCode};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream, UdpSocket},
    sync::Semaphore,
    time::{Instant, timeout},
};
use tracing::debug;

use crate::state::MeshState;

use super::{
    DnsError, DnsSettings,
    answer::{Decision, decide, reply_to, udp_limit},
    metrics::AnswerKind,
};

/// Largest UDP query accepted (a larger datagram is dropped).
pub const MAX_UDP_QUERY: usize = 4096;
/// Largest UDP answer sent, whatever the client advertises.
pub const MAX_UDP_ANSWER: usize = 4096;
/// UDP queries of one pod being answered at once.
pub const MAX_UDP_IN_FLIGHT: usize = 256;
/// TCP connections of one pod at once.
pub const MAX_TCP_CONNECTIONS: usize = 64;
/// A TCP connection without a complete query this long is closed.
pub const TCP_IDLE: Duration = Duration::from_secs(10);
/// Time to write one answer over TCP.
pub const TCP_WRITE: Duration = Duration::from_secs(5);

/// One pod's resolver: its namespace (for search domains) and the
/// agent-wide settings.
#[derive(Debug)]
pub struct PodResolver {
    /// The pod's name (for the query log).
    pub pod: String,
    /// The pod's Kubernetes namespace.
    pub namespace: String,
    /// Agent-wide settings.
    pub settings: Arc<DnsSettings>,
}

/// `udp` or `tcp`, as the metrics label it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Datagrams.
    Udp,
    /// Length-prefixed messages over a stream.
    Tcp,
}

impl Transport {
    fn name(self) -> &'static str {
        match self {
            Self::Udp => "udp",
            Self::Tcp => "tcp",
        }
    }
}

impl PodResolver {
    /// The answer to the query `raw` (the full answer: UDP truncation is
    /// the caller's), and the parsed query; `None` to send nothing. Every
    /// query answered is counted and logged ([`PodResolver::log_query`]).
    pub async fn answer(&self, raw: &[u8], transport: Transport) -> Option<(Vec<u8>, Message)> {
        let started = Instant::now();
        let metrics = &self.settings.metrics;
        let request = match Message::from_vec(raw) {
            Ok(request) => request,
            Err(_) => {
                // A header is enough to say FORMERR; less is noise.
                let id = u16::from_be_bytes([*raw.first()?, *raw.get(1)?]);
                if raw.len() < 12 {
                    return None;
                }
                metrics.answer(AnswerKind::Formerr);
                self.log_query(None, transport, AnswerKind::Formerr, 0, started);
                let reply = Message::error_msg(id, OpCode::Query, ResponseCode::FormErr);
                let parsed = reply.clone();
                return reply.to_vec().ok().map(|r| (r, parsed));
            }
        };
        if request.metadata.message_type != hickory_proto::op::MessageType::Query {
            return None;
        }
        let qtype = request.queries.first().map_or_else(
            || "unknown".to_owned(),
            |q| q.query_type().to_string().to_lowercase(),
        );
        metrics.request(qtype, transport.name());
        let state = self.settings.mesh.state();
        let (domain, ipv6) = (&self.settings.domain, self.settings.ipv6);
        let decision = decide(&request, &self.namespace, domain, ipv6, |host| {
            mesh_addresses(&state, host, &self.namespace, domain)
        });
        drop(state);
        let (kind, reply) = match decision {
            Decision::Answer(answer) => {
                let kind = if answer.has_records {
                    AnswerKind::Mesh
                } else {
                    AnswerKind::Nodata
                };
                (kind, answer.message.to_vec().ok())
            }
            Decision::Forward => match self.settings.forwarder.forward(&request, raw).await {
                Ok(forwarded) => {
                    let code = forwarded.reply.get(3).map_or(0, |b| b & 0x0f);
                    let kind = match (forwarded.cached, code) {
                        (_, 3) => AnswerKind::Nxdomain,
                        (_, 2) => AnswerKind::Servfail,
                        (true, _) => AnswerKind::Cached,
                        (false, _) => AnswerKind::Forwarded,
                    };
                    (kind, Some(forwarded.reply))
                }
                Err(err) => {
                    let (code, kind) = match err {
                        DnsError::Busy { .. } => (ResponseCode::Refused, AnswerKind::Refused),
                        _ => (ResponseCode::ServFail, AnswerKind::Servfail),
                    };
                    debug!(error = %err, "DNS query not forwarded");
                    (kind, reply_to(&request, code).to_vec().ok())
                }
            },
        };
        metrics.answer(kind);
        let records = reply.as_deref().map_or(0, answer_count);
        self.log_query(Some(&request), transport, kind, records, started);
        Some((reply?, request))
    }

    /// One record per query answered, on the log target `dns` at debug
    /// level (`RUST_LOG=info,dns=debug` shows them), as ztunnel logs its
    /// DNS queries (`src/dns/server.rs` `access_log`: target `dns`, debug;
    /// the client workload and namespace, query type, domain, result and
    /// how many records). `request` is `None` for a query that did not
    /// parse (FORMERR).
    fn log_query(
        &self,
        request: Option<&Message>,
        transport: Transport,
        kind: AnswerKind,
        records: u16,
        started: Instant,
    ) {
        let query = request.and_then(|r| r.queries.first());
        // The name is at most 255 bytes: hickory refuses longer ones.
        let domain = query.map(|q| q.name().to_ascii());
        debug!(
            target: "dns",
            src_workload = %self.pod,
            src_namespace = %self.namespace,
            protocol = transport.name(),
            query = %query.map_or_else(|| "-".to_owned(), |q| q.query_type().to_string()),
            domain = domain.as_deref().unwrap_or("-"),
            result = kind.name(),
            answers = records,
            duration_us = started.elapsed().as_micros() as u64,
            "query answered"
        );
    }

    /// Serves UDP queries on `socket` until the task is aborted.
    pub async fn serve_udp(self: Arc<Self>, socket: UdpSocket) {
        let socket = Arc::new(socket);
        let in_flight = Arc::new(Semaphore::new(MAX_UDP_IN_FLIGHT));
        // One byte more than accepted, to tell an oversized datagram.
        let mut buf = vec![0u8; MAX_UDP_QUERY + 1];
        loop {
            let (n, peer) = match socket.recv_from(&mut buf).await {
                Ok(got) => got,
                Err(err) => {
                    debug!(error = %err, "DNS UDP receive failed");
                    continue;
                }
            };
            if n > MAX_UDP_QUERY {
                continue;
            }
            let Ok(permit) = Arc::clone(&in_flight).try_acquire_owned() else {
                self.settings.metrics.answer(AnswerKind::Refused);
                continue;
            };
            let query = buf[..n].to_vec();
            let (this, socket) = (Arc::clone(&self), Arc::clone(&socket));
            tokio::spawn(async move {
                let _permit = permit;
                if let Some(reply) = this.udp_reply(&query).await
                    && let Err(err) = socket.send_to(&reply, peer).await
                {
                    debug!(%peer, error = %err, "DNS UDP answer not sent");
                }
            });
        }
    }

    /// The UDP answer to `query`: truncated (TC, question and OPT only)
    /// when larger than the client takes.
    async fn udp_reply(&self, query: &[u8]) -> Option<Vec<u8>> {
        let (reply, request) = self.answer(query, Transport::Udp).await?;
        if reply.len() <= udp_limit(&request, MAX_UDP_ANSWER) {
            return Some(reply);
        }
        self.settings.metrics.answer(AnswerKind::Truncated);
        let mut truncated = match Message::from_vec(&reply) {
            Ok(full) => full.truncate(),
            Err(_) => reply_to(&request, ResponseCode::ServFail),
        };
        truncated.metadata.truncation = true;
        truncated.to_vec().ok()
    }

    /// Accepts TCP connections on `listener` until the task is aborted.
    pub async fn serve_tcp(self: Arc<Self>, listener: TcpListener) {
        let connections = Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS));
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(err) => {
                    debug!(error = %err, "DNS TCP accept failed");
                    // Out of descriptors or memory: give the system a moment.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
                self.settings.metrics.answer(AnswerKind::Refused);
                reset(stream);
                continue;
            };
            let this = Arc::clone(&self);
            tokio::spawn(async move {
                let _permit = permit;
                if let Err(err) = this.serve_connection(stream).await {
                    debug!(%peer, error = %err, "DNS TCP connection ended");
                }
            });
        }
    }

    /// Answers length-prefixed queries on one connection, in order, until
    /// the client closes it or stays idle too long.
    async fn serve_connection(&self, mut stream: TcpStream) -> std::io::Result<()> {
        loop {
            let read = async {
                let len = match stream.read_u16().await {
                    Ok(len) => usize::from(len),
                    Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
                    Err(err) => return Err(err),
                };
                let mut query = vec![0u8; len];
                stream.read_exact(&mut query).await?;
                Ok(Some(query))
            };
            let query = match timeout(TCP_IDLE, read).await {
                Ok(Ok(Some(query))) => query,
                Ok(Ok(None)) => return Ok(()),
                Ok(Err(err)) => {
                    reset(stream);
                    return Err(err);
                }
                Err(_) => {
                    reset(stream);
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
            };
            let Some((reply, _)) = self.answer(&query, Transport::Tcp).await else {
                reset(stream);
                return Ok(());
            };
            let Ok(len) = u16::try_from(reply.len()) else {
                reset(stream);
                return Ok(());
            };
            let mut framed = Vec::with_capacity(reply.len() + 2);
            framed.extend_from_slice(&len.to_be_bytes());
            framed.extend_from_slice(&reply);
            match timeout(TCP_WRITE, stream.write_all(&framed)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => return Err(err),
                Err(_) => {
                    reset(stream);
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
            }
        }
    }
}

/// How many answer records a DNS message holds (its header's ANCOUNT);
/// 0 for one too short to have a header.
fn answer_count(message: &[u8]) -> u16 {
    match message.get(6..8) {
        Some(&[hi, lo]) => u16::from_be_bytes([hi, lo]),
        _ => 0,
    }
}

/// Closes `stream` with a reset (linger 0): an abnormal end is never a
/// clean close.
fn reset(stream: TcpStream) {
    // Failing to set linger leaves a clean close, the best left to do.
    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
}

/// The addresses the mesh answers for `host` to a pod of `namespace` in
/// the cluster domain `domain`; `None` when the mesh does not answer for
/// it (ztunnel `src/dns/server.rs` `find_server`, `get_addresses`,
/// `service_family_allowed`).
fn mesh_addresses(
    state: &MeshState,
    host: &str,
    namespace: &str,
    domain: &str,
) -> Option<Vec<IpAddr>> {
    // Only the services visible to the pod's namespace, its own first.
    let entry = state.services.by_hostname_for(host, namespace)?;
    // A single-family service has no record of the other family, which
    // matters for a headless one whose pods are dual-stack.
    let families = entry.service.ip_families;
    let allowed = move |ip: &IpAddr| families.is_none_or(|f| f.accepts(*ip));
    if entry.service.vips.is_empty() {
        // Without a VIP only a Kubernetes headless service is answered;
        // any other (a ServiceEntry without addresses) is asked upstream,
        // where its name is real (by the same domain test).
        if !is_cluster_service(&entry.service.hostname, domain) {
            return None;
        }
        // Headless: the endpoints' own addresses.
        return Some(
            entry
                .endpoints()
                .iter()
                .flat_map(|w| w.workload.workload_ips.iter().copied())
                .filter(allowed)
                .collect(),
        );
    }
    // The VIPs on the client's network only (`client.network ==
    // vip.network`); a pod of this node is on its network.
    let network = state.workloads.network();
    Some(
        entry
            .service
            .vips
            .iter()
            .filter(|vip| *vip.network == *network)
            .map(|vip| vip.ip)
            .filter(allowed)
            .collect(),
    )
}

/// Whether `hostname` is a Kubernetes Service's (`*.svc.<domain>`), as
/// ztunnel tells them from ServiceEntries (`dns/server.rs` `find_server`).
fn is_cluster_service(hostname: &str, domain: &str) -> bool {
    hostname
        .strip_suffix(domain)
        .is_some_and(|rest| rest.ends_with(".svc."))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test inputs are fixed")]
mod tests {
    use super::*;
    use crate::config::LocalConfig;

    /// `web` and `db` are served by a dual-stack pod; `web` has a VIP of
    /// each family, `db` is headless; each comes in every `ipFamilies`.
    fn state() -> MeshState {
        let mut text = String::from(
            "workloads:\n- {uid: p, name: p, namespace: a, workloadIps: [10.0.0.2, 'fd00::2'], services: {",
        );
        let families = [
            ("auto", ""),
            ("v4", "IPv4"),
            ("v6", "IPv6"),
            ("dual", "Dual"),
        ];
        for (name, _) in families {
            text.push_str(&format!(
                "a/web-{name}.a.svc.cluster.local: {{}}, a/db-{name}.a.svc.cluster.local: {{}}, "
            ));
        }
        text.push_str("}}\nservices:\n");
        for (i, (name, family)) in families.iter().enumerate() {
            let family = if family.is_empty() {
                String::new()
            } else {
                format!(", ipFamilies: {family}")
            };
            text.push_str(&format!(
                "- {{name: web-{name}, namespace: a, hostname: web-{name}.a.svc.cluster.local, \
                 vips: ['/10.96.0.{i}', '/fd00:96::{i}'], ports: {{80: 80}}{family}}}\n\
                 - {{name: db-{name}, namespace: a, hostname: db-{name}.a.svc.cluster.local, \
                 ports: {{80: 80}}{family}}}\n"
            ));
        }
        MeshState::from_config(&LocalConfig::parse(&text, "dns").unwrap()).unwrap()
    }

    fn families(state: &MeshState, host: &str) -> (usize, usize) {
        let addrs = mesh_addresses(state, host, "a", "cluster.local").unwrap();
        let v4 = addrs.iter().filter(|ip| ip.is_ipv4()).count();
        (v4, addrs.len() - v4)
    }

    /// ztunnel `src/dns/server.rs` `service_family_allowed`: a service of
    /// one family has no record of the other, VIP or headless.
    #[test]
    fn a_single_family_service_has_no_address_of_the_other_family() {
        let state = state();
        for kind in ["web", "db"] {
            let host = |family: &str| format!("{kind}-{family}.a.svc.cluster.local");
            assert_eq!(families(&state, &host("auto")), (1, 1), "{kind}");
            assert_eq!(families(&state, &host("dual")), (1, 1), "{kind}");
            assert_eq!(families(&state, &host("v4")), (1, 0), "{kind}");
            assert_eq!(families(&state, &host("v6")), (0, 1), "{kind}");
        }
        assert!(
            mesh_addresses(&state, "other.a.svc.cluster.local", "a", "cluster.local").is_none()
        );
    }
}
