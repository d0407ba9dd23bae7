//! The shape of a workload (a pod) in the mesh model, as the local file
//! writes it and as istiod's `istio.workload.Workload` is translated into.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf, sync::Arc};

use serde::{Deserialize, Serialize};

use super::SharedStr;

/// Whether a workload speaks HBONE or plain TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    /// Mutual-TLS HTTP/2 CONNECT tunnels on port 15008.
    #[default]
    Hbone,
    /// Plain TCP (not in the mesh).
    Tcp,
}

/// Whether a workload should receive new connections through services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
pub enum WorkloadStatus {
    /// Ready.
    #[default]
    Healthy,
    /// Not ready: left out of its services' endpoints unless a service's
    /// health policy is `allowAll`. Direct connections to its address still
    /// go through.
    Unhealthy,
}

impl WorkloadStatus {
    fn is_healthy(&self) -> bool {
        *self == Self::Healthy
    }
}

/// Where a workload's or service's waypoint is: an address, or a service
/// hostname (`namespace/hostname`), and its HBONE port.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Waypoint {
    /// The waypoint's IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<IpAddr>,
    /// The network `address` is on (ztunnel `src/state/workload.rs`:
    /// `gatewayaddress::Destination::Address(NetworkAddress)`; istiod
    /// sends the gateway's network). Not given: a waypoint's is this
    /// node's network, a network gateway's its workload's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<SharedStr>,
    /// The waypoint service, `namespace/hostname`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Its HBONE port.
    #[serde(default = "default_hbone_port")]
    pub hbone_port: u16,
}

fn default_hbone_port() -> u16 {
    dataplane_common::HBONE_PORT
}

/// How the node proxy hands a workload its inbound tunnels when the
/// workload takes them itself: a waypoint "sandwiched" between two node
/// proxies (istiod sets it on the instances of a waypoint whose Gateway or
/// GatewayClass carries `ambient.istio.io/waypoint-inbound-binding:
/// PROXY/15088`: istio `pilot/pkg/serviceregistry/ambient/waypoints.go`
/// `makeInboundBinding`, `workloads.go` `computeWaypoint`; ztunnel
/// `src/state/workload.rs` `ApplicationTunnel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApplicationTunnel {
    /// What precedes the tunnel's bytes.
    pub protocol: AppTunnelProtocol,
    /// The port tunnels are delivered to instead of the one the client
    /// asked for; unset (xDS: 0): the asked one.
    #[serde(default)]
    pub port: Option<u16>,
}

/// What a workload's application tunnel puts before the client's bytes.
/// Written as ztunnel writes it (`NONE`, `PROXY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum AppTunnelProtocol {
    /// Nothing: the bytes as they come (only the port may change).
    None,
    /// A PROXY protocol v2 header (the client's address, the destination
    /// the client asked for, and its SPIFFE identity in TLV 0xD0), sent
    /// over loopback inside the pod (ztunnel `src/proxy/inbound.rs`
    /// `serve_connect`, `LOCALHOST_APP_TUNNEL`).
    Proxy,
}

/// Where a workload runs, for locality-aware load balancing. Each part is
/// one of few values a whole cluster shares, so istiod's are interned
/// (see [`super::interned`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Locality {
    /// Region (`topology.kubernetes.io/region`).
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub region: Arc<str>,
    /// Zone (`topology.kubernetes.io/zone`).
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub zone: Arc<str>,
    /// Subzone (`topology.istio.io/subzone`).
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub subzone: Arc<str>,
}

impl Locality {
    /// Whether no part is known.
    pub fn is_empty(&self) -> bool {
        self.region.is_empty() && self.zone.is_empty() && self.subzone.is_empty()
    }
}

/// The locality of a workload that has none.
static NO_LOCALITY: std::sync::LazyLock<Locality> = std::sync::LazyLock::new(Locality::default);

/// One workload (pod).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Workload {
    /// Unique id, e.g. `cluster1//v1/Pod/default/web-0`. Shared: from
    /// istiod it is the resource's name, held once for both.
    pub uid: Arc<str>,
    /// Pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: SharedStr,
    /// Service account (the identity's last component).
    #[serde(default = "default_service_account")]
    pub service_account: SharedStr,
    /// SPIFFE trust domain.
    #[serde(default = "default_trust_domain")]
    pub trust_domain: SharedStr,
    /// Pod IPs.
    #[serde(default, skip_serializing_if = "<[IpAddr]>::is_empty")]
    pub workload_ips: Box<[IpAddr]>,
    /// A DNS name the workload is reached at when it has no IPs (a
    /// ServiceEntry endpoint with `resolution: DNS`, as istiod sends it:
    /// `serviceEntryWorkloadBuilder` in istio
    /// `pilot/pkg/serviceregistry/ambient/workloads.go`), resolved when a
    /// connection picks it (ztunnel `src/state.rs`
    /// `resolve_on_demand_dns`).
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub hostname: SharedStr,
    /// The pod shares its node's network namespace (`hostNetwork`): its IPs
    /// are the node's, shared with every other such pod, so they name no
    /// workload (ztunnel `WorkloadStore::insert` indexes such workloads by
    /// uid only; istiod sends `network_mode: HOST_NETWORK`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub host_network: bool,
    /// Its share of its services' new connections relative to the other
    /// endpoints' (unset: 1; a WorkloadEntry's `weight`, istiod's
    /// `capacity`; ztunnel `src/state.rs` `load_balance` chooses by it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u32>,
    /// Protocol the workload accepts.
    #[serde(default)]
    pub protocol: Protocol,
    /// Node the workload runs on.
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub node: SharedStr,
    /// Network namespace path, for workloads this agent enrolls at start
    /// (standalone mode).
    /// Boxed: only standalone mode's workloads have one, and inline it
    /// took 24 of every workload's bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<Box<PathBuf>>,
    /// Services this workload is an endpoint of: `namespace/hostname` ->
    /// service port -> target port.
    #[serde(default, skip_serializing_if = "ServicePorts::is_empty")]
    pub services: ServicePorts,
    /// `namespace/name` of WorkloadSelector-scoped policies that apply.
    #[serde(default, skip_serializing_if = "<[String]>::is_empty")]
    pub authorization_policies: Box<[String]>,
    /// Readiness, as Kubernetes sees it.
    #[serde(default, skip_serializing_if = "WorkloadStatus::is_healthy")]
    pub status: WorkloadStatus,
    /// The waypoint in front of this workload, if any. Boxed: few
    /// workloads have one, and inline it took 48 of every workload's bytes
    /// (`benches/mesh_memory.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<Box<Waypoint>>,
    /// How inbound tunnels are handed to it, when it takes them itself
    /// (a sandwiched waypoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub application_tunnel: Option<ApplicationTunnel>,
    /// The network the workload's IPs belong to (empty: the default one).
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub network: SharedStr,
    /// The east-west gateway a client on another network reaches this
    /// workload through (istiod's `network_gateway`; ztunnel
    /// `src/state/workload.rs` `Workload::network_gateway`). Written as a
    /// waypoint is: an address or a `namespace/hostname`, and the
    /// gateway's HBONE port (`hbone_mtls_port`). Boxed, as `waypoint`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_gateway: Option<Box<Waypoint>>,
    /// Canonical service (`service.istio.io/canonical-name`).
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub canonical_name: SharedStr,
    /// Canonical revision (`service.istio.io/canonical-revision`).
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub canonical_revision: SharedStr,
    /// The owning workload (e.g. the Deployment's name), named in
    /// telemetry in place of the pod name when set.
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub workload_name: SharedStr,
    /// The cluster the workload runs in.
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub cluster_id: SharedStr,
    /// Region, zone and subzone; none when unknown. Shared: a cluster has
    /// few, and inline the three strings took 48 bytes of every workload
    /// (`benches/mesh_memory.rs`). Read through [`Workload::locality`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locality: Option<Arc<Locality>>,
    /// Capture this workload's DNS when the agent enrolls it from the
    /// config (standalone mode); unset: the agent's `--dns-capture`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_capture: Option<bool>,
    /// Whether connections between this workload and another pod of the
    /// same node may take the kernel fast path (no proxy, no mutual TLS on
    /// the node-local hop); unset: the agent's `--fast-path`. Both ends
    /// must allow it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fast_path: Option<bool>,
}

impl Workload {
    /// Its weight in its services' endpoint choice (ztunnel:
    /// `capacity.unwrap_or(1)`).
    pub fn weight(&self) -> u32 {
        self.capacity.unwrap_or(1)
    }

    /// Where it runs (every part empty when unknown).
    pub fn locality(&self) -> &Locality {
        self.locality.as_deref().unwrap_or(&NO_LOCALITY)
    }

    /// The IPs that name this workload (where a connection to them is a
    /// connection to it): its own, none for a host-network pod.
    pub fn own_ips(&self) -> &[IpAddr] {
        if self.host_network {
            &[]
        } else {
            &self.workload_ips
        }
    }
}

/// The services a workload is an endpoint of and, for each, its service
/// ports' target ports: a map, written as one (`namespace/hostname` ->
/// service port -> target port), held as sorted slices. Nearly every
/// workload is in one or two services with a port or two: two nested
/// `BTreeMap`s allocated about 600 bytes of eleven-slot nodes for that,
/// the slices about 50 (`benches/mesh_memory.rs`). A key is a
/// [`SharedStr`]: the endpoints of a service translated from istiod share
/// one copy of its name ([`super::interned::Strings::name`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicePorts(Box<[(SharedStr, Ports)]>);

/// One service's port mapping on a workload, sorted by service port.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ports(Box<[(u16, u16)]>);

impl Ports {
    /// The target port of service port `port`.
    pub fn target(&self, port: u16) -> Option<u16> {
        self.0
            .binary_search_by_key(&port, |(service, _)| *service)
            .ok()
            .map(|at| self.0[at].1)
    }

    /// Service port -> target port, by service port.
    pub fn iter(&self) -> impl Iterator<Item = (u16, u16)> + '_ {
        self.0.iter().copied()
    }
}

impl FromIterator<(u16, u16)> for Ports {
    /// The last mapping of a service port given twice wins, as a map's.
    fn from_iter<I: IntoIterator<Item = (u16, u16)>>(iter: I) -> Self {
        let map: BTreeMap<u16, u16> = iter.into_iter().collect();
        Self(map.into_iter().collect())
    }
}

impl From<&BTreeMap<u16, u16>> for Ports {
    fn from(map: &BTreeMap<u16, u16>) -> Self {
        Self(map.iter().map(|(s, t)| (*s, *t)).collect())
    }
}

impl From<BTreeMap<u16, u16>> for Ports {
    fn from(map: BTreeMap<u16, u16>) -> Self {
        Self::from(&map)
    }
}

impl ServicePorts {
    /// Whether the workload is in no service.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The services' keys, sorted.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(key, _)| key.as_str())
    }

    /// Each service's key and port mapping, by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Ports)> {
        self.0.iter().map(|(key, ports)| (key.as_str(), ports))
    }

    /// The port mapping for service `key`, if the workload is in it.
    pub fn get(&self, key: &str) -> Option<&Ports> {
        self.0
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .ok()
            .map(|at| &self.0[at].1)
    }

    /// Whether the workload is in service `key`.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Makes the workload an endpoint of `key` with `ports` (replacing any
    /// mapping it had for it).
    pub fn insert(&mut self, key: impl Into<SharedStr>, ports: Ports) {
        let key = key.into();
        match self.0.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(at) => self.0[at].1 = ports,
            Err(at) => {
                let mut entries = std::mem::take(&mut self.0).into_vec();
                entries.insert(at, (key, ports));
                self.0 = entries.into_boxed_slice();
            }
        }
    }
}

impl<K: Into<SharedStr>, P: Into<Ports>> FromIterator<(K, P)> for ServicePorts {
    /// The last mapping of a key given twice wins, as a map's.
    fn from_iter<I: IntoIterator<Item = (K, P)>>(iter: I) -> Self {
        let map: BTreeMap<SharedStr, Ports> = iter
            .into_iter()
            .map(|(k, p)| (k.into(), p.into()))
            .collect();
        Self(map.into_iter().collect())
    }
}

impl Serialize for ServicePorts {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, ports) in &self.0 {
            let ports: BTreeMap<u16, u16> = ports.iter().collect();
            map.serialize_entry(key.as_str(), &ports)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for ServicePorts {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let map = BTreeMap::<String, BTreeMap<u16, u16>>::deserialize(deserializer)?;
        Ok(map.into_iter().collect())
    }
}

fn default_service_account() -> SharedStr {
    "default".into()
}

fn default_trust_domain() -> SharedStr {
    "cluster.local".into()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use super::*;

    #[test]
    fn a_workload_stays_small() {
        // The mesh holds one per pod: at 10k workloads every 8 bytes here
        // are 80 KB (`benches/mesh_memory.rs`). Shared strings are one
        // pointer, rare fields boxed.
        assert_eq!(size_of::<SharedStr>(), 8);
        let size = size_of::<Workload>();
        assert!(size <= 232, "a workload grew to {size} bytes");
    }

    #[test]
    fn service_ports_read_and_write_as_the_map_they_replace() {
        let text = "b/svc: {80: 8080, 443: 8443}\na/svc: {9090: 9091}\n";
        let ports: ServicePorts = serde_yaml_ng::from_str(text).unwrap();
        let keys: Vec<&str> = ports.keys().collect();
        assert_eq!(keys, ["a/svc", "b/svc"]);
        let b = ports.get("b/svc").unwrap();
        assert_eq!(
            (b.target(80), b.target(443), b.target(81)),
            (Some(8080), Some(8443), None)
        );
        assert!(!ports.contains_key("c/svc"));
        let map: BTreeMap<String, BTreeMap<u16, u16>> =
            serde_yaml_ng::from_str(&serde_yaml_ng::to_string(&ports).unwrap()).unwrap();
        assert_eq!(map, serde_yaml_ng::from_str(text).unwrap());
    }

    #[test]
    fn service_ports_keep_the_last_of_a_key_given_twice_as_a_map_would() {
        let mut ports: ServicePorts = [
            ("s".to_owned(), Ports::from_iter([(80, 1), (80, 2)])),
            ("r".to_owned(), Ports::from_iter([(1, 1)])),
            ("s".to_owned(), Ports::from_iter([(81, 3)])),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            ports.get("s").map(|p| p.iter().collect::<Vec<_>>()),
            Some(vec![(81, 3)])
        );
        ports.insert("a".to_owned(), Ports::from_iter([(80, 2), (80, 1)]));
        ports.insert("r".to_owned(), Ports::default());
        let all: Vec<(&str, Vec<(u16, u16)>)> =
            ports.iter().map(|(k, p)| (k, p.iter().collect())).collect();
        assert_eq!(
            all,
            [("a", vec![(80, 1)]), ("r", vec![]), ("s", vec![(81, 3)])]
        );
    }
}
