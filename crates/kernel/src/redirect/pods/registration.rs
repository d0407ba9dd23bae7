//! What one network namespace owns in the maps: the entries a pod needs,
//! what was written for it, and the keys they are written under.

use std::collections::HashSet;

use dataplane_common::{
    AgentConfig, IpAddr16, ListenerKey, NetnsAddr, NetnsPort, PodPort,
    maps::{IN_EXCL_PORTS, LISTENERS, OUT_EXCL_CIDRS, OUT_EXCL_PORTS, POD_INBOUND},
};

use super::super::{
    RedirectError,
    error::map_err,
    external::ExternalPodCapture,
    kernel_maps::{KernelMaps, collect_keys},
    keys::{addr16, cidr_key, cidr_key_cookie, ip_of},
};

/// The map entries one network namespace owns (besides its
/// `ENROLLED_NETNS` entry and its link).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Registration {
    /// The pod's IPs.
    pub(in crate::redirect) ips: HashSet<IpAddr16>,
    pub(super) out_ports: HashSet<u16>,
    pub(super) out_cidrs: HashSet<(u32, NetnsAddr)>,
    pub(super) in_ports: HashSet<PodPort>,
    /// Its `LISTENERS` keys.
    pub(in crate::redirect) listeners: HashSet<ListenerKey>,
}

impl Registration {
    /// The entries `pod` needs; its `LISTENERS` entries only `with_listeners`
    /// (for its IPv6 addresses only with `ipv6`, see [`listener_keys`]).
    pub(super) fn wanted(
        pod: &ExternalPodCapture<'_>,
        config: &AgentConfig,
        with_listeners: bool,
        ipv6: bool,
    ) -> Self {
        let ips: HashSet<IpAddr16> = pod.ips.iter().map(|ip| addr16(*ip)).collect();
        let ex = pod.exclusions;
        Self {
            out_ports: ex.outbound_ports.iter().copied().collect(),
            out_cidrs: ex
                .outbound_cidrs
                .iter()
                .map(|net| cidr_key(pod.netns_cookie, net))
                .collect(),
            in_ports: ips
                .iter()
                .flat_map(|ip| ex.inbound_ports.iter().map(|port| pod_port(*ip, *port)))
                .collect(),
            listeners: if with_listeners {
                listener_keys(&ips, config, ipv6)
            } else {
                HashSet::new()
            },
            ips,
        }
    }

    /// What the maps hold for `netns_cookie` (after an agent restart).
    pub(in crate::redirect) fn scan(
        maps: &KernelMaps,
        netns_cookie: u64,
    ) -> Result<Self, RedirectError> {
        let mut ips = HashSet::new();
        for entry in maps.pod_inbound.iter() {
            let (ip, pod) = entry.map_err(map_err(POD_INBOUND))?;
            if pod.netns_cookie == netns_cookie {
                ips.insert(ip);
            }
        }
        let out_ports = collect_keys(maps.out_excl_ports.keys(), OUT_EXCL_PORTS)?
            .into_iter()
            .filter(|k| k.netns_cookie == netns_cookie)
            .map(|k| k.port)
            .collect();
        let out_cidrs = collect_keys(maps.out_excl_cidrs.keys(), OUT_EXCL_CIDRS)?
            .into_iter()
            .map(|k| (k.prefix_len(), k.data()))
            .filter(|(_, data)| cidr_key_cookie(data) == netns_cookie)
            .collect();
        let in_ports = collect_keys(maps.in_excl_ports.keys(), IN_EXCL_PORTS)?
            .into_iter()
            .filter(|k| ips.contains(&k.pod_addr))
            .collect();
        let listeners = collect_keys(maps.listeners.keys(), LISTENERS)?
            .into_iter()
            .filter(|k| ips.contains(&k.pod_addr))
            .collect();
        Ok(Self {
            ips,
            out_ports,
            out_cidrs,
            in_ports,
            listeners,
        })
    }

    /// Adds `other`'s entries.
    pub(super) fn extend(&mut self, other: &Self) {
        self.ips.extend(&other.ips);
        self.out_ports.extend(&other.out_ports);
        self.out_cidrs.extend(&other.out_cidrs);
        self.in_ports.extend(&other.in_ports);
        self.listeners.extend(&other.listeners);
    }

    /// How many entries.
    pub(super) fn len(&self) -> usize {
        self.ips.len()
            + self.out_ports.len()
            + self.out_cidrs.len()
            + self.in_ports.len()
            + self.listeners.len()
    }

    /// The entries of `self` that `other` lacks.
    pub(super) fn minus(&self, other: &Self) -> Self {
        Self {
            ips: self.ips.difference(&other.ips).copied().collect(),
            out_ports: self
                .out_ports
                .difference(&other.out_ports)
                .copied()
                .collect(),
            out_cidrs: self
                .out_cidrs
                .difference(&other.out_cidrs)
                .copied()
                .collect(),
            in_ports: self.in_ports.difference(&other.in_ports).copied().collect(),
            listeners: self
                .listeners
                .difference(&other.listeners)
                .copied()
                .collect(),
        }
    }
}

pub(super) fn netns_port(netns_cookie: u64, port: u16) -> NetnsPort {
    NetnsPort {
        netns_cookie,
        port,
        _pad: [0; 6],
    }
}

fn pod_port(pod_addr: IpAddr16, port: u16) -> PodPort {
    PodPort {
        pod_addr,
        port,
        _pad: [0; 2],
    }
}

/// The `LISTENERS` keys of every role of every one of `ips`, of its IPv4
/// ones alone unless `ipv6` ([`super::super::RedirectorOptions::ipv6_listeners`]).
pub(in crate::redirect) fn listener_keys(
    ips: &HashSet<IpAddr16>,
    config: &AgentConfig,
    ipv6: bool,
) -> HashSet<ListenerKey> {
    ips.iter()
        .filter(|ip| ipv6 || ip_of(ip).to_canonical().is_ipv4())
        .flat_map(|ip| [config.inbound_port, config.hbone_port].map(|port| listener_key(*ip, port)))
        .collect()
}

fn listener_key(pod_addr: IpAddr16, port: u16) -> ListenerKey {
    ListenerKey {
        pod_addr,
        port,
        _pad: [0; 2],
    }
}
