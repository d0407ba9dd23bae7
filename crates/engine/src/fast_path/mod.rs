//! The same-node fast path, user-space half: which connections may skip
//! the proxy, the revocation of that decision when the mesh changes, and
//! telemetry for connections the agent never saw. Kernel half and its
//! safety argument: `dataplane-ebpf/src/fast_path.rs`. Minimum kernel 5.9
//! (the capture it rides on); closing denied connections needs
//! `CONFIG_INET_DIAG_DESTROY`.
//!
//! A connection between two pods this agent serves on this node first goes
//! through the proxy like any other. While the engine plans it, [`FastPath::consider`]
//! decides the (client pod, destination address, port) pair once: both
//! pods are this agent's, the destination is the workload itself (no
//! waypoint), its identity is the one the plan expects, both workloads
//! allow the fast path, and the policies allow the client's identity. The
//! verdict goes into the kernel, and the pair's later connections go socket
//! to socket.
//!
//! A service VIP goes the same way for its endpoints on this node that
//! pass those checks (at most [`FAST_SERVICE_MAX_ENDPOINTS`]), when the
//! engine's choice among all its endpoints is even (no locality preference
//! orders them, none is dead): the verdict lists those endpoints and how
//! many the service has in all. The kernel draws one of all per
//! connection, uniformly at random; for one of this node's it rewrites the
//! destination to it, any other draw goes to the proxy, which then
//! chooses among the endpoints the kernel does not take. Round robin and
//! random both give each endpoint an equal share, and so does this split.
//!
//! Why that is safe without mutual TLS on the node-local hop: both
//! identities are held by this agent, which checked them; the client is
//! known by its socket's network namespace, which a pod cannot forge; the
//! bytes never leave the node's kernel. Users who require every byte to
//! pass through mutual TLS turn it off (`--fast-path off`, or a workload's
//! `fastPath: false`).
//!
//! A change of the mesh state voids the verdicts it concerns
//! ([`FastPath::revoke`], [`Affected`]): those whose client or destination
//! workload, service endpoints or policies it changed; a state built whole
//! or a mesh-wide policy voids every verdict at once. Open fast-path
//! connections it concerns that the new policies deny are then reset on
//! both ends through `sock_diag` (`SOCK_DESTROY`), the same thing `ss -K`
//! does. A verdict decided on a state no longer in force is not cached.

mod records;

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex, RwLock, Weak},
};

use dataplane_common::{FAST_SERVICE_MAX_ENDPOINTS, FastConn, IpAddr16, SockTuple};
use tracing::{debug, warn};

use crate::{
    identity::Identity,
    policy::Request,
    proxy::{
        PodContext,
        outbound::{Action, Hop, OutboundPlan, TunnelHop},
    },
    redirect::{FastPathTable, PinLayout, RedirectError},
    state::{Affected, EndpointAddr, MeshState},
};

pub use dataplane_kernel::sock_diag::DestroyError;

/// The fast path's state: the kernel maps and this node's pods.
pub struct FastPath {
    table: Mutex<FastPathTable>,
    pods: RwLock<Pods>,
    split: RwLock<SplitServices>,
    default_on: bool,
}

/// (client pod's namespace, VIP) -> the service's endpoints the kernel
/// takes, for the services it shares with the proxy.
type SplitServices = HashMap<(u64, SocketAddr), Arc<[IpAddr]>>;

/// This agent's pods by network namespace and by address. Weak: a pod
/// whose engine stopped is gone from here without a word.
#[derive(Default)]
struct Pods {
    by_cookie: HashMap<u64, Weak<PodContext>>,
    by_ip: HashMap<IpAddr, u64>,
}

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("default_on", &self.default_on)
            .finish()
    }
}

impl FastPath {
    /// Opens the instance's fast-path maps (voiding verdicts a previous
    /// agent left). `default_on`: the fast path for workloads that do not
    /// say.
    pub fn open(pins: &PinLayout, default_on: bool) -> Result<Self, RedirectError> {
        Ok(Self {
            table: Mutex::new(FastPathTable::open(pins)?),
            pods: RwLock::default(),
            split: RwLock::default(),
            default_on,
        })
    }

    /// Starts turning the kernel's close records into telemetry, for as
    /// long as the agent runs. Must run inside a tokio runtime.
    pub fn report_closed(
        self: &Arc<Self>,
        pins: &PinLayout,
        mesh: Weak<crate::mesh::MeshContext>,
    ) -> Result<(), RedirectError> {
        let ring = FastPathTable::closed_records(pins)?;
        records::spawn(Arc::clone(self), ring, mesh);
        Ok(())
    }

    /// A pod this agent's engine now serves.
    pub fn register(&self, ctx: &Arc<PodContext>) {
        let mut pods = write(&self.pods);
        let Pods { by_cookie, by_ip } = &mut *pods;
        // Pods whose engines stopped leave dead entries: drop them here, so
        // the index stays as large as the node's pods, whatever the churn.
        by_cookie.retain(|_, pod| pod.strong_count() > 0);
        by_ip.retain(|_, cookie| by_cookie.contains_key(cookie));
        by_cookie.insert(ctx.netns_cookie, Arc::downgrade(ctx));
        for ip in &ctx.ips {
            by_ip.insert(ip.to_canonical(), ctx.netns_cookie);
        }
    }

    /// The engine serving the pod of namespace `cookie`, if it still runs.
    fn pod(&self, cookie: u64) -> Option<Arc<PodContext>> {
        read(&self.pods).by_cookie.get(&cookie)?.upgrade()
    }

    /// The engine serving the pod at `ip`, if it is this agent's.
    fn pod_at(&self, ip: IpAddr) -> Option<Arc<PodContext>> {
        let cookie = *read(&self.pods).by_ip.get(&ip.to_canonical())?;
        self.pod(cookie)
    }

    /// Whether `pod` allows the fast path.
    fn allows(&self, state: &MeshState, pod: &PodContext) -> bool {
        self.allows_pod(state, pod.fast_path, &pod.ips)
    }

    /// Whether the pod at `ips` whose enrollment said `own` allows the fast
    /// path: its own setting (its annotation), else its workload's
    /// `fastPath`, else the agent's `--fast-path`.
    /// A workload with an application tunnel never does: what it is sent
    /// must reach it as the tunnel says (its port, a PROXY header).
    pub fn allows_pod(&self, state: &MeshState, own: Option<bool>, ips: &[IpAddr]) -> bool {
        let workload = ips.iter().find_map(|ip| state.workloads.by_ip(*ip));
        if workload.is_some_and(|w| w.workload.application_tunnel.is_some()) {
            return false;
        }
        own.or_else(|| workload.and_then(|w| w.workload.fast_path))
            .unwrap_or(self.default_on)
    }

    /// Decides, for the connection from `client` of pod `ctx` that the
    /// engine is about to carry out as `plan`, whether the pair's later
    /// connections may go socket to socket; caches "yes" in the kernel.
    pub fn consider(
        &self,
        ctx: &PodContext,
        state: &MeshState,
        client: SocketAddr,
        plan: &OutboundPlan,
    ) {
        match (&plan.action, &plan.service) {
            (Action::Hop(Hop::Tunnel(hop)), None) => {
                self.consider_workload(ctx, state, client, plan.dst, hop);
            }
            (Action::Failover(hops), Some(_)) => {
                self.consider_service(ctx, state, client, plan.dst, hops);
            }
            // A passthrough service, a direct hop or a refusal: nothing
            // the fast path could carry.
            _ => {}
        }
    }

    /// [`Self::consider`] for a workload dialled at its own address `dst`.
    fn consider_workload(
        &self,
        ctx: &PodContext,
        state: &MeshState,
        client: SocketAddr,
        dst: SocketAddr,
        hop: &TunnelHop,
    ) {
        // A waypoint must see the traffic it fronts.
        if hop.via.ip().to_canonical() != dst.ip().to_canonical() {
            return;
        }
        let Some(server) = self.peer_pod(ctx, state, client, dst, &hop.dst_identity) else {
            return;
        };
        if !self.allows(state, ctx) {
            return;
        }
        let result = {
            let mut table = lock(&self.table);
            // Decided on a state no longer in force: its revocation has run
            // already and would not void this verdict.
            if !ctx.mesh.is_current(state) {
                return;
            }
            table.allow(ctx.netns_cookie, dst, server.netns_cookie)
        };
        match result {
            Ok(()) => {
                debug!(pod = %ctx.identity.name, %dst, server = %server.identity.name, "fast path allowed")
            }
            Err(err) => {
                warn!(pod = %ctx.identity.name, %dst, error = %err, "cannot cache the fast-path verdict; connections stay on the proxy")
            }
        }
    }

    /// [`Self::consider`] for the service VIP `vip`, whose endpoints the
    /// plan lists as `hops`. The endpoints that are pods of this node the
    /// client may reach go on the fast path, provided the engine's choice
    /// among all the endpoints is even (no locality order, none dead): the
    /// kernel then draws among all of them uniformly, as the engine would,
    /// connects directly when the draw is one of this node's, and leaves
    /// the others to the proxy, which then chooses among those only
    /// ([`Self::taken_by_kernel`]). Each endpoint keeps its share.
    fn consider_service(
        &self,
        ctx: &PodContext,
        state: &MeshState,
        client: SocketAddr,
        vip: SocketAddr,
        hops: &[Hop],
    ) {
        // Cheap refusals first: this runs for every proxied connection to a
        // service. A waypoint must see the traffic it fronts (its hops are
        // tunnels whose `via` is not the endpoint).
        let fronted = hops
            .iter()
            .any(|hop| matches!(hop, Hop::Tunnel(t) if t.via.ip() != t.dst.ip()));
        let any_here = hops
            .iter()
            .any(|hop| hop.dst().is_some_and(|dst| self.pod_at(dst.ip()).is_some()));
        if fronted || !any_here || !self.allows(state, ctx) {
            return;
        }
        // The service the proxy's plan chose for this pod.
        let Some(entry) = state.services.by_vip_for(vip.ip(), &ctx.spiffe.namespace) else {
            return;
        };
        // The kernel knows services by their VIPs only, not by a range.
        let dialled = vip.ip().to_canonical();
        if !entry
            .service
            .vips
            .iter()
            .any(|v| v.ip == dialled && v.network == state.workloads.network())
        {
            return;
        }
        let source = state.workloads.by_ip(client.ip()).map(Arc::as_ref);
        let Some(endpoints) = entry.even_candidates(vip, source, &ctx.mesh.network, |ip| {
            ctx.mesh.dead.is_dead(ip)
        }) else {
            return;
        };
        if endpoints.len() != hops.len() {
            return;
        }
        let mut here = Vec::new();
        let mut taken = Vec::new();
        for endpoint in &endpoints {
            // (`even_candidates` has no endpoint known by name only.)
            let EndpointAddr::Ip(target) = endpoint.addr else {
                continue;
            };
            if here.len() == FAST_SERVICE_MAX_ENDPOINTS || !endpoint.workload.speaks_hbone() {
                continue;
            }
            // A socket keeps its family, so the kernel needs the endpoint's
            // address of the VIP's family, one the service's families
            // allow (the engine, which dials anew, may cross families:
            // an IPv6-only service's endpoint dialled at an IPv4 VIP is
            // left to it).
            let families = entry.service.ip_families;
            let Some(ip) = endpoint
                .workload
                .workload
                .workload_ips
                .iter()
                .map(|ip| ip.to_canonical())
                .find(|ip| ip.is_ipv4() == vip.is_ipv4())
                .filter(|ip| families.is_none_or(|f| f.accepts(*ip)))
            else {
                continue;
            };
            let addr = SocketAddr::new(ip, target.port());
            let identity = &endpoint.workload.identity;
            // An endpoint that fails a check stays the proxy's to reach.
            if let Some(server) = self.peer_pod(ctx, state, client, addr, identity) {
                here.push((addr, server.netns_cookie));
                taken.push(target.ip());
            }
        }
        if here.is_empty() {
            return;
        }
        let key = (ctx.netns_cookie, vip);
        // The proxy learns what the kernel takes before the kernel does,
        // so it never chooses those while the verdict holds.
        let shared = here.len() < endpoints.len();
        // Most calls find the entry as they would write it: skip the write
        // lock then, since every proxied connection of the pair gets here.
        let known = read(&self.split).get(&key).map(|known| **known == *taken);
        match (shared, known) {
            (true, Some(true)) | (false, None) => {}
            (true, _) => {
                write(&self.split).insert(key, taken.into());
            }
            (false, Some(_)) => {
                write(&self.split).remove(&key);
            }
        }
        let result = {
            let mut table = lock(&self.table);
            if !ctx.mesh.is_current(state) {
                write(&self.split).remove(&key);
                return;
            }
            table.allow_service(ctx.netns_cookie, vip, &here, endpoints.len())
        };
        match result {
            Ok(()) => {
                debug!(pod = %ctx.identity.name, %vip, here = here.len(), endpoints = endpoints.len(), "fast path allowed to the service's endpoints on this node")
            }
            Err(err) => {
                write(&self.split).remove(&key);
                warn!(pod = %ctx.identity.name, %vip, error = %err, "cannot cache the fast-path verdict; connections stay on the proxy")
            }
        }
    }

    /// The endpoints of the service at `vip` (as the engine addresses
    /// them) that the kernel connects the client pod of namespace `netns`
    /// to directly, when it leaves the service's other endpoints to the
    /// proxy: a connection from that pod the proxy sees is one the kernel
    /// drew for the others, so the proxy chooses among those.
    pub fn taken_by_kernel(&self, netns: u64, vip: SocketAddr) -> Option<Arc<[IpAddr]>> {
        read(&self.split).get(&(netns, vip)).cloned()
    }

    /// The pod of this node at `dst` that the client `ctx` may reach on
    /// the fast path: it is another pod than the client, it holds
    /// `identity`, it allows the fast path, and the policies allow the
    /// client's identity to `dst`.
    fn peer_pod(
        &self,
        ctx: &PodContext,
        state: &MeshState,
        client: SocketAddr,
        dst: SocketAddr,
        identity: &Identity,
    ) -> Option<Arc<PodContext>> {
        let server = self.pod_at(dst.ip())?;
        if server.spiffe != *identity || server.netns_cookie == ctx.netns_cookie {
            return None;
        }
        if !self.allows(state, &server) {
            return None;
        }
        let request = Request {
            peer: Some(&ctx.spiffe),
            src: client,
            dst,
        };
        state.authorize(&request).ok()?;
        Some(server)
    }

    /// The mesh changed (as far as `affected` reaches): voids the verdicts
    /// the change concerns, then resets the open fast-path connections
    /// `state` denies among those it concerns. Returns how many were
    /// reset.
    pub fn revoke(&self, state: &MeshState, affected: &Affected) -> usize {
        let open = {
            let mut table = lock(&self.table);
            self.void(&mut table, state, affected);
            // Both ends of a fast-path connection are this node's pods: only
            // a policy change or a change of one of them can concern one.
            let here = affected.policies_changed()
                || affected.addrs.iter().any(|ip| self.pod_at(*ip).is_some());
            if !here {
                return 0;
            }
            match table.open_connections() {
                Ok(open) => open,
                Err(err) => {
                    warn!(error = %err, "cannot list open fast-path connections to re-check them");
                    return 0;
                }
            }
        };
        let mut reset = 0;
        for (tuple, conn) in open {
            // A changed client (its identity, say) can be denied by a
            // destination the change does not otherwise concern.
            let (src, dst) = tuple_addrs(&tuple);
            if !affected.concerns(state, dst.ip()) && !affected.touches(src.ip()) {
                continue;
            }
            if let Some(reason) = self.denied(state, &tuple, &conn) {
                reset += usize::from(self.reset(&tuple, &conn, &reason));
            }
        }
        reset
    }

    /// Voids the verdicts `affected` concerns: every one for a change that
    /// reaches everything, else those whose client pod's workload, whose
    /// destination, or (for a service) any of whose endpoints it concerns.
    fn void(&self, table: &mut FastPathTable, state: &MeshState, affected: &Affected) {
        if affected.all {
            let revoked = table.revoke_all();
            // With the verdicts void the kernel takes no endpoint: the
            // proxy chooses among all again.
            write(&self.split).clear();
            if let Err(err) = revoked {
                // The generation could not be bumped: verdicts of the old
                // state stay. Say so loudly; the next change retries.
                warn!(error = %err, "cannot void the fast-path verdicts; the previous mesh state still decides them");
            }
            return;
        }
        let client_changed = |netns: u64| {
            self.pod(netns)
                .is_some_and(|pod| pod.ips.iter().any(|ip| affected.touches(*ip)))
        };
        let voided = table.revoke_where(|cached, endpoints| {
            client_changed(cached.src_netns)
                || affected.concerns(state, cached.dst.ip())
                || endpoints.iter().any(|e| affected.concerns(state, e.ip()))
        });
        match voided {
            Ok(voided) => {
                let mut split = write(&self.split);
                for cached in voided.iter().filter(|c| c.service) {
                    split.remove(&(cached.src_netns, cached.dst));
                }
            }
            Err(err) => {
                warn!(error = %err, "cannot void the fast-path verdicts a change concerns; voiding all");
                self.void(table, state, &Affected::everything());
            }
        }
    }

    /// Why `state` no longer allows the open connection `tuple`, if it
    /// does not.
    fn denied(&self, state: &MeshState, tuple: &SockTuple, conn: &FastConn) -> Option<String> {
        let Some(client) = self.pod(conn.src_netns_cookie) else {
            // The client's engine is gone: the pod was unenrolled, its
            // connections are no longer the mesh's to police.
            return None;
        };
        let (src, dst) = tuple_addrs(tuple);
        let request = Request {
            peer: Some(&client.spiffe),
            src,
            dst,
        };
        state.authorize(&request).err()
    }

    /// Resets both ends of a connection the policies now deny.
    fn reset(&self, tuple: &SockTuple, conn: &FastConn, reason: &str) -> bool {
        let (src, dst) = tuple_addrs(tuple);
        let mut done = false;
        for (cookie, local, remote) in [
            (conn.src_netns_cookie, src, dst),
            (conn.dst_netns_cookie, dst, src),
        ] {
            let Some(pod) = self.pod(cookie) else {
                continue;
            };
            match dataplane_kernel::sock_diag::destroy(pod.netns.fd(), local, remote) {
                Ok(found) => done |= found,
                Err(err) => {
                    warn!(%src, %dst, pod = %pod.identity.name, error = %err, "cannot reset a fast-path connection the policies now deny");
                }
            }
        }
        if done {
            // An agent-closed connection: at `warn`, as every record
            // that is not a clean close (`telemetry::flow`).
            warn!(target: "access", direction = "outbound", protocol = "FAST_PATH", %src, %dst, reason, "connection closed: denied by a policy change");
        }
        done
    }
}

/// A socket address from the kernel's 16-byte form.
pub(crate) fn socket_addr(addr: IpAddr16, port: u16) -> SocketAddr {
    SocketAddr::new(Ipv6Addr::from(addr.octets()).to_canonical(), port)
}

fn tuple_addrs(tuple: &SockTuple) -> (SocketAddr, SocketAddr) {
    (
        socket_addr(tuple.src_addr, tuple.src_port),
        socket_addr(tuple.dst_addr, tuple.dst_port),
    )
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
