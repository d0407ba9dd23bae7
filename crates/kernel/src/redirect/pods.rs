//! Enrolling pods: everything the kernel needs to capture one pod's
//! traffic, keyed by its network-namespace cookie, written idempotently and
//! removed without leaving anything behind.
//!
//! | map / object          | key                      | written for          |
//! |-----------------------|--------------------------|----------------------|
//! | `ENROLLED_NETNS`      | netns cookie             | outbound capture, engine readiness |
//! | `OUT_EXCL_PORTS`      | (cookie, port)           | outbound excluded ports |
//! | `OUT_EXCL_CIDRS`      | (cookie, CIDR)           | outbound excluded CIDRs |
//! | `POD_INBOUND`         | pod IP                   | inbound capture      |
//! | `IN_EXCL_PORTS`       | (pod IP, port)           | inbound excluded ports |
//! | `LISTENERS`           | (pod IP, role port)      | the engine's inbound and HBONE listeners |
//! | `POD_SOURCE`          | netns cookie             | the source address of outbound connections (external proxy only) |
//! | `links/sk_lookup_netns_<cookie>` | -             | `dp_sk_lookup` attached to the pod's netns |
//!
//! The redirector remembers what it wrote for each cookie, so a later
//! enrollment removes what is no longer wanted (an IP or an exclusion that
//! went away) and an unenrollment removes everything. After an agent restart
//! that memory is empty; it is then rebuilt by scanning the maps for the
//! cookie (and for the pod IPs registered under it).

use std::{
    collections::HashSet,
    net::IpAddr,
    os::fd::{AsRawFd, BorrowedFd},
};

use aya::maps::lpm_trie::Key;
use dataplane_common::{
    ENROLLED_CAPTURE_DNS, ENROLLED_CAPTURE_OUTBOUND, ENROLLED_ENGINE_READY,
    ENROLLED_ORIG_DST_BY_TUPLE, EnrolledNetns, ListenerKey, POD_CAPTURE_INBOUND, PodInbound,
    PodSource,
    maps::{
        ENROLLED_NETNS, IN_EXCL_PORTS, LISTENERS, OUT_EXCL_CIDRS, OUT_EXCL_PORTS, POD_INBOUND,
        POD_SOURCE,
    },
};
use tracing::{debug, info};

use super::{
    RedirectError, Redirector,
    error::map_err,
    external::ExternalPodCapture,
    kernel_maps::{absent_as_none, collect_keys, ignore_missing},
    keys::{addr16, ip_of},
    links, listeners,
};

mod registration;

pub(crate) use registration::Registration;
pub(super) use registration::listener_keys;
use registration::netns_port;

/// `BPF_EXIST`: update only an existing element.
const BPF_EXIST: u64 = 2;

/// Everything the kernel needs to capture one pod.
#[derive(Debug)]
pub struct PodCapture<'a> {
    /// Cookie of the pod's network namespace.
    pub netns_cookie: u64,
    /// The pod's network-namespace file, for the `sk_lookup` link.
    pub netns: BorrowedFd<'a>,
    /// The pod's IPs (inbound capture is keyed by them).
    pub ips: &'a [IpAddr],
    /// The node-side address toward the pod (the probe source), if any.
    pub node_addr: Option<IpAddr>,
    /// Ports and CIDRs the pod excludes from capture.
    pub exclusions: &'a Exclusions,
    /// The engine's inbound plaintext listener: listening on `[::]:15006`
    /// (dual-stack) in the pod's netns.
    pub inbound_listener: BorrowedFd<'a>,
    /// The engine's HBONE listener: listening on `[::]:15008` (dual-stack)
    /// in the pod's netns.
    pub hbone_listener: BorrowedFd<'a>,
    /// Capture the pod's DNS into its resolver on the agent's DNS port.
    pub dns_capture: bool,
}

/// A pod's two inbound listeners, by role.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RoleListeners<'a> {
    /// Listening on the inbound plaintext port (`[::]:15006`, dual-stack)
    /// in the pod's netns.
    pub inbound: BorrowedFd<'a>,
    /// Listening on the HBONE port (`[::]:15008`, dual-stack) in the pod's
    /// netns.
    pub hbone: BorrowedFd<'a>,
}

/// Traffic of one pod that is never captured.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Exclusions {
    /// Destination ports of outbound connections left alone.
    pub outbound_ports: Vec<u16>,
    /// Destination networks of outbound connections left alone.
    pub outbound_cidrs: Vec<ipnet::IpNet>,
    /// Pod ports whose inbound connections go straight to the application.
    pub inbound_ports: Vec<u16>,
    /// No inbound capture at all (Istio's
    /// `ambient.istio.io/bypass-inbound-capture`): connections to the
    /// pod's ports reach its apps directly, while its outbound traffic and
    /// DNS stay captured and HBONE tunnels still reach the engine's 15008
    /// listener, which is bound in the pod like any server.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bypass_inbound: bool,
}

impl Redirector {
    /// Captures the pod: (re)writes every map entry for it, (re)inserts its
    /// listeners into `LISTENERS` for each pod IP, attaches `dp_sk_lookup`
    /// to its network namespace (link pinned at
    /// `links/sk_lookup_netns_<cookie>`, replacing a previous generation's
    /// link make-before-break) and finally marks the namespace enrolled with
    /// `CAPTURE_OUTBOUND | ENGINE_READY`.
    ///
    /// Idempotent. Entries of a previous registration of the same cookie
    /// that are no longer wanted (an IP or exclusion removed) are removed.
    ///
    /// The listeners must be listening TCP sockets able to take every pod IP
    /// (a dual-stack `[::]` socket for a dual-stack pod); anything else is
    /// refused with [`RedirectError::UnusableListener`] before any state is
    /// written.
    pub fn enroll_pod(&mut self, pod: &PodCapture<'_>) -> Result<(), RedirectError> {
        let listeners = RoleListeners {
            inbound: pod.inbound_listener,
            hbone: pod.hbone_listener,
        };
        let spec = ExternalPodCapture {
            netns_cookie: pod.netns_cookie,
            netns: pod.netns,
            ips: pod.ips,
            node_addr: pod.node_addr,
            exclusions: pod.exclusions,
            dns_capture: pod.dns_capture,
        };
        self.enroll_with(&spec, Some(listeners), Server::Engine)
    }

    /// [`Redirector::enroll_pod`] with the listeners given, or (`None`)
    /// keeping those already registered for the pod's current IPs. The
    /// namespace is marked `ENGINE_READY` only when every pod IP has both
    /// listeners registered.
    pub(super) fn enroll_with(
        &mut self,
        pod: &ExternalPodCapture<'_>,
        listeners: Option<RoleListeners<'_>>,
        server: Server,
    ) -> Result<(), RedirectError> {
        let cookie = pod.netns_cookie;
        if let Some(listeners) = listeners {
            self.check_listeners(pod.ips, listeners)?;
        }
        let previous = match self.registry.get(&cookie) {
            Some(registered) => registered.clone(),
            None => Registration::scan(&self.maps, cookie)?,
        };
        let mut wanted =
            Registration::wanted(pod, &self.config, listeners.is_some(), self.ipv6_listeners);
        if listeners.is_none() {
            // Sockets we hold no descriptor of: keep the entries of IPs the
            // pod still has until the next harvest replaces them.
            let all = listener_keys(&wanted.ips, &self.config, self.ipv6_listeners);
            wanted.listeners = previous.listeners.intersection(&all).copied().collect();
        }
        // Remember everything that may be in the maps before writing, so
        // that a failure half-way still lets `unenroll_pod` find it all.
        let mut known = previous.clone();
        known.extend(&wanted);
        self.registry.insert(cookie, known);

        self.write_entries(pod, &wanted, listeners)?;
        // Before outbound capture can start (`set_enrolled` below), so
        // that no connection of the pod reaches the proxy from loopback.
        self.write_source(cookie, pod.ips, server)?;
        links::attach_sk_lookup(&mut self.ebpf, &self.pins, cookie, pod.netns)?;
        let ready =
            wanted.listeners == listener_keys(&wanted.ips, &self.config, self.ipv6_listeners);
        let by_tuple = server == Server::External && self.external_by_tuple;
        self.set_enrolled(cookie, enrolled_flags(pod.dns_capture, ready, by_tuple))?;
        let stale = previous.minus(&wanted);
        self.remove_entries(cookie, &stale)?;
        info!(
            netns_cookie = cookie,
            ips = ?pod.ips,
            listeners = wanted.listeners.len(),
            stale_entries = stale.len(),
            "pod enrolled"
        );
        self.registry.insert(cookie, wanted);
        Ok(())
    }

    /// Refuses listeners `sk_lookup` could not use for these pod IPs.
    pub(super) fn check_listeners(
        &self,
        ips: &[IpAddr],
        listeners: RoleListeners<'_>,
    ) -> Result<(), RedirectError> {
        let serves_v4 = ips.iter().any(|ip| ip.to_canonical().is_ipv4());
        // IPv4-only listeners (`ipv6_listeners` off) are not asked to take
        // the pod's IPv6 addresses: those get no `LISTENERS` entry.
        let serves_v6 = self.ipv6_listeners && ips.iter().any(|ip| ip.to_canonical().is_ipv6());
        for (socket, port) in [
            (listeners.inbound, self.config.inbound_port),
            (listeners.hbone, self.config.hbone_port),
        ] {
            listeners::check(socket, port, serves_v4, serves_v6)?;
        }
        Ok(())
    }

    /// Stops capturing the pod with this netns cookie: removes its
    /// `ENROLLED_NETNS` entry, detaches and unpins its `sk_lookup` link, and
    /// removes every map entry it owns (found by scanning the maps when this
    /// agent did not enroll it itself). Idempotent; missing state is not an
    /// error.
    pub fn unenroll_pod(&mut self, netns_cookie: u64) -> Result<(), RedirectError> {
        self.unenroll_netns(netns_cookie)?;
        ignore_missing(self.maps.pod_source.remove(&netns_cookie), POD_SOURCE)?;
        links::detach_sk_lookup(&self.pins, netns_cookie)?;
        let registered = match self.registry.get(&netns_cookie) {
            Some(registered) => registered.clone(),
            None => Registration::scan(&self.maps, netns_cookie)?,
        };
        self.remove_entries(netns_cookie, &registered)?;
        self.registry.remove(&netns_cookie);
        info!(netns_cookie, "pod unenrolled");
        Ok(())
    }

    /// Sets or clears `ENROLLED_ENGINE_READY` for every enrolled network
    /// namespace. While it is clear, `connect4`/`connect6` apply the
    /// fail-open/fail-closed setting.
    pub fn set_engine_ready(&mut self, ready: bool) -> Result<(), RedirectError> {
        for cookie in self.enrolled_cookies()? {
            let current = absent_as_none(self.maps.enrolled.get(&cookie, 0), ENROLLED_NETNS)?;
            let Some(mut value) = current else {
                continue;
            };
            if ready {
                value.flags |= ENROLLED_ENGINE_READY;
            } else {
                value.flags &= !ENROLLED_ENGINE_READY;
            }
            // BPF_EXIST: a namespace unenrolled meanwhile stays unenrolled.
            ignore_missing(
                self.maps.enrolled.insert(cookie, value, BPF_EXIST),
                ENROLLED_NETNS,
            )?;
        }
        debug!(ready, "engine readiness set");
        Ok(())
    }

    /// Network-namespace cookies currently in `ENROLLED_NETNS`.
    pub fn enrolled_cookies(&self) -> Result<Vec<u64>, RedirectError> {
        collect_keys(self.maps.enrolled.keys(), ENROLLED_NETNS)
    }

    /// Starts capturing the outbound traffic of the network namespace with
    /// this cookie (`CAPTURE_OUTBOUND | ENGINE_READY`), without any of
    /// [`Redirector::enroll_pod`]'s inbound state. Idempotent.
    pub fn enroll_netns(&mut self, netns_cookie: u64) -> Result<(), RedirectError> {
        self.set_enrolled(
            netns_cookie,
            ENROLLED_CAPTURE_OUTBOUND | ENROLLED_ENGINE_READY,
        )
    }

    /// Stops capturing the outbound traffic of the network namespace with
    /// this cookie. Idempotent.
    pub fn unenroll_netns(&mut self, netns_cookie: u64) -> Result<(), RedirectError> {
        ignore_missing(self.maps.enrolled.remove(&netns_cookie), ENROLLED_NETNS)
    }

    pub(super) fn set_enrolled(
        &mut self,
        netns_cookie: u64,
        flags: u32,
    ) -> Result<(), RedirectError> {
        let value = EnrolledNetns {
            flags,
            _pad: [0; 4],
        };
        self.maps
            .enrolled
            .insert(netns_cookie, value, 0)
            .map_err(map_err(ENROLLED_NETNS))
    }

    /// Writes the entries of `wanted`, its listeners only when given:
    /// listeners and exclusions before the pod IPs that make `sk_lookup`
    /// act on them, so that it never sees a pod without them.
    fn write_entries(
        &mut self,
        pod: &ExternalPodCapture<'_>,
        wanted: &Registration,
        listeners: Option<RoleListeners<'_>>,
    ) -> Result<(), RedirectError> {
        if let Some(listeners) = listeners {
            self.write_listeners(&wanted.listeners, listeners)?;
        }
        let cookie = pod.netns_cookie;
        let maps = &mut self.maps;
        for port in &wanted.out_ports {
            maps.out_excl_ports
                .insert(netns_port(cookie, *port), 1, 0)
                .map_err(map_err(OUT_EXCL_PORTS))?;
        }
        for (bits, data) in &wanted.out_cidrs {
            maps.out_excl_cidrs
                .insert(&Key::new(*bits, *data), 1, 0)
                .map_err(map_err(OUT_EXCL_CIDRS))?;
        }
        for key in &wanted.in_ports {
            maps.in_excl_ports
                .insert(key, 1, 0)
                .map_err(map_err(IN_EXCL_PORTS))?;
        }
        let inbound = PodInbound {
            netns_cookie: cookie,
            node_addr: pod.node_addr.map(addr16).unwrap_or_default(),
            // Without the flag `sk_lookup` leaves the pod's inbound
            // connections to the kernel's own lookup (istio-cni skips its
            // 15006 REDIRECT the same way).
            flags: if pod.exclusions.bypass_inbound {
                0
            } else {
                POD_CAPTURE_INBOUND
            },
            _pad: [0; 4],
        };
        for ip in &wanted.ips {
            maps.pod_inbound
                .insert(ip, inbound, 0)
                .map_err(map_err(POD_INBOUND))?;
        }
        Ok(())
    }

    /// Writes the pod's `POD_SOURCE` entry when an external proxy serves
    /// it, so `connect4`/`connect6` bind its captured connections to its
    /// first address of each family: a stock ztunnel must see the pod as
    /// the client, as under istio-cni's `REDIRECT`. Our engine takes the
    /// client from the pod it serves, so its pods keep the loopback source
    /// (and have no entry: one left from an earlier enrollment is removed).
    fn write_source(
        &mut self,
        netns_cookie: u64,
        ips: &[IpAddr],
        server: Server,
    ) -> Result<(), RedirectError> {
        let source = pod_source(ips);
        if server != Server::External || source == PodSource::default() {
            return ignore_missing(self.maps.pod_source.remove(&netns_cookie), POD_SOURCE);
        }
        self.maps
            .pod_source
            .insert(netns_cookie, source, 0)
            .map_err(map_err(POD_SOURCE))
    }

    /// Inserts (or replaces) the `LISTENERS` entries `keys`, each with the
    /// listener of its role.
    pub(super) fn write_listeners(
        &mut self,
        keys: &HashSet<ListenerKey>,
        listeners: RoleListeners<'_>,
    ) -> Result<(), RedirectError> {
        for key in keys {
            let socket = if key.port == self.config.hbone_port {
                listeners.hbone
            } else {
                listeners.inbound
            };
            self.maps
                .listeners
                .insert(key, socket.as_raw_fd(), 0)
                .map_err(|source| RedirectError::Listener {
                    pod_addr: ip_of(&key.pod_addr),
                    port: key.port,
                    source,
                })?;
        }
        Ok(())
    }

    /// Removes the entries of `registered` that belong to `netns_cookie`.
    /// An IP another pod has registered since (IPs are reused) is left to
    /// that pod, with its listeners and excluded ports.
    pub(super) fn remove_entries(
        &mut self,
        netns_cookie: u64,
        registered: &Registration,
    ) -> Result<(), RedirectError> {
        let maps = &mut self.maps;
        let mut foreign = HashSet::new();
        for ip in &registered.ips {
            match maps.pod_inbound_of(ip)? {
                Some(pod) if pod.netns_cookie != netns_cookie => {
                    foreign.insert(*ip);
                }
                Some(_) => ignore_missing(maps.pod_inbound.remove(ip), POD_INBOUND)?,
                None => {}
            }
        }
        for key in &registered.listeners {
            if !foreign.contains(&key.pod_addr) {
                ignore_missing(maps.listeners.remove(key), LISTENERS)?;
            }
        }
        for key in &registered.in_ports {
            if !foreign.contains(&key.pod_addr) {
                ignore_missing(maps.in_excl_ports.remove(key), IN_EXCL_PORTS)?;
            }
        }
        for port in &registered.out_ports {
            ignore_missing(
                maps.out_excl_ports.remove(&netns_port(netns_cookie, *port)),
                OUT_EXCL_PORTS,
            )?;
        }
        for cidr in &registered.out_cidrs {
            maps.remove_cidr(*cidr)?;
        }
        Ok(())
    }
}

/// The `POD_SOURCE` value of a pod with these IPs: the first IPv4 and the
/// first IPv6 address (the pod's primary ones, in the order the CNI result
/// or the API gave them); all zero for a family the pod lacks.
fn pod_source(ips: &[IpAddr]) -> PodSource {
    let first = |v4: bool| {
        ips.iter()
            .map(|ip| ip.to_canonical())
            .find(|ip| ip.is_ipv4() == v4)
            .map(addr16)
            .unwrap_or_default()
    };
    PodSource {
        v4: first(true),
        v6: first(false),
    }
}

/// Who accepts a captured pod's outbound connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Server {
    /// Our engine, which reads each original destination under the pod's
    /// namespace ([`super::OrigDstTable`]).
    Engine,
    /// An external in-pod proxy, whose `getsockopt(SO_ORIGINAL_DST)` finds
    /// it under the socket's namespace where the kernel can tell it, else
    /// under the tuple alone (`ENROLLED_ORIG_DST_BY_TUPLE`).
    External,
}

/// `ENROLLED_NETNS` flags of a captured pod.
pub(super) fn enrolled_flags(dns_capture: bool, engine_ready: bool, by_tuple: bool) -> u32 {
    let mut flags = ENROLLED_CAPTURE_OUTBOUND;
    if by_tuple {
        flags |= ENROLLED_ORIG_DST_BY_TUPLE;
    }
    if dns_capture {
        flags |= ENROLLED_CAPTURE_DNS;
    }
    if engine_ready {
        flags |= ENROLLED_ENGINE_READY;
    }
    flags
}
