//! Waypoints from Gateway objects and their attachment by the
//! `istio.io/use-waypoint` label, with istiod's rules (istio/istio
//! 86c9f01f, `pilot/pkg/serviceregistry/ambient/waypoints.go`, cited per
//! function).

use std::collections::BTreeMap;
use std::net::IpAddr;

use dataplane_user::istio_api::workload::{
    ApplicationTunnel, GatewayAddress, NamespacedHostname, NetworkAddress, WeightedWaypoint,
    application_tunnel, gateway_address,
};
use serde_json::Value;

use super::{Cluster, Index, strings};

/// The label a pod, Service or namespace names its waypoint with.
pub const USE_WAYPOINT: &str = "istio.io/use-waypoint";
/// The label naming the waypoint's namespace when it is not the object's.
pub const USE_WAYPOINT_NAMESPACE: &str = "istio.io/use-waypoint-namespace";
/// The label (on the Gateway or its GatewayClass) saying which traffic a
/// waypoint takes: `service` (the default), `workload`, `all` or `none`.
const WAYPOINT_FOR: &str = "istio.io/waypoint-for";
/// The label the gateway controller puts on a waypoint's own pods.
const GATEWAY_NAME: &str = "gateway.networking.k8s.io/gateway-name";
/// `annotation.AmbientWaypointInboundBinding`.
const INBOUND_BINDING: &str = "ambient.istio.io/waypoint-inbound-binding";
/// The HBONE port istiod gives every waypoint address (`getGatewayAddress`
/// hardcodes it).
const HBONE_PORT: u32 = 15008;

/// Which namespaces may attach to a waypoint (`WaypointSelector`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FromNamespaces {
    /// `Same` (istiod's default).
    Same,
    /// `All`.
    All,
    /// `Selector` with these `matchLabels` (`None`: a selector this
    /// stand-in cannot evaluate, `matchExpressions`; it matches nothing).
    Selector(Option<BTreeMap<String, String>>),
}

/// istiod's `Waypoint`: what a Gateway with a status address becomes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Waypoint {
    pub namespace: String,
    pub name: String,
    pub address: Option<GatewayAddress>,
    /// `DefaultBinding`, for the waypoint's own pods.
    pub binding: Option<ApplicationTunnel>,
    pub traffic_type: String,
    pub allowed: FromNamespaces,
}

/// Every waypoint among the Gateways, by `namespace/name`
/// (`gatewayToWaypointTransform`): a Gateway without status addresses is
/// not (yet) a waypoint; the traffic type is `service` unless the
/// GatewayClass's, then the Gateway's, `istio.io/waypoint-for` says
/// otherwise.
pub(crate) fn waypoints(index: &Index<'_>, cluster: &Cluster) -> BTreeMap<String, Waypoint> {
    let mut found = BTreeMap::new();
    for gateway in &index.gateways {
        let meta = &gateway["metadata"];
        let (Some(namespace), Some(name)) = (meta["namespace"].as_str(), meta["name"].as_str())
        else {
            continue;
        };
        if gateway["status"]["addresses"]
            .as_array()
            .is_none_or(Vec::is_empty)
        {
            continue;
        }
        let class = gateway["spec"]["gatewayClassName"]
            .as_str()
            .and_then(|c| index.gateway_classes.get(c).copied());
        let mut traffic_type = "service".to_owned();
        if let Some(tt) =
            class.and_then(|c| strings(&c["metadata"]["labels"]).get(WAYPOINT_FOR).copied())
        {
            traffic_type = tt.to_owned();
        }
        if let Some(tt) = strings(&meta["labels"]).get(WAYPOINT_FOR) {
            traffic_type = (*tt).to_owned();
        }
        let binding = inbound_binding(gateway, class);
        found.insert(
            format!("{namespace}/{name}"),
            Waypoint {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                address: gateway_address_of(gateway, namespace, &cluster.network),
                allowed: allowed_routes(gateway, binding.as_ref()),
                binding,
                traffic_type,
            },
        );
    }
    found
}

/// `getGatewayAddress`: the first `Hostname` status address, as
/// `namespace/hostname`, else the first parsable `IPAddress` on the
/// cluster's network; HBONE port 15008 either way.
fn gateway_address_of(gateway: &Value, namespace: &str, network: &str) -> Option<GatewayAddress> {
    let addresses = gateway["status"]["addresses"].as_array()?;
    let typed = |kind: &'static str| {
        addresses
            .iter()
            .filter(move |a| a["type"] == kind)
            .filter_map(|a| a["value"].as_str())
    };
    let destination = if let Some(hostname) = typed("Hostname").next() {
        gateway_address::Destination::Hostname(NamespacedHostname {
            namespace: namespace.to_owned(),
            hostname: hostname.to_owned(),
        })
    } else {
        let ip = typed("IPAddress").find_map(|v| v.parse::<IpAddr>().ok())?;
        gateway_address::Destination::Address(NetworkAddress {
            network: network.to_owned(),
            address: match ip {
                IpAddr::V4(v4) => v4.octets().to_vec(),
                IpAddr::V6(v6) => v6.octets().to_vec(),
            },
            length: None,
        })
    };
    Some(GatewayAddress {
        destination: Some(destination),
        hbone_mtls_port: HBONE_PORT,
    })
}

/// `makeInboundBinding`: the Gateway's, else its class's,
/// `ambient.istio.io/waypoint-inbound-binding`, `PROTOCOL` or
/// `PROTOCOL/port` with `NONE` or `PROXY`; anything else is no binding.
/// An unparsable port is 0, as istiod's ignored `ParseUint` error leaves it.
fn inbound_binding(gateway: &Value, class: Option<&Value>) -> Option<ApplicationTunnel> {
    let value = strings(&gateway["metadata"]["annotations"])
        .get(INBOUND_BINDING)
        .map(|v| (*v).to_owned())
        .or_else(|| {
            class.and_then(|c| {
                strings(&c["metadata"]["annotations"])
                    .get(INBOUND_BINDING)
                    .map(|v| (*v).to_owned())
            })
        })?;
    let parts: Vec<&str> = value.split('/').collect();
    if parts.len() > 2 {
        return None;
    }
    let protocol = match parts[0] {
        "NONE" => application_tunnel::Protocol::None,
        "PROXY" => application_tunnel::Protocol::Proxy,
        _ => return None,
    };
    let port = parts.get(1).map_or(0, |p| p.parse::<u32>().unwrap_or(0));
    Some(ApplicationTunnel {
        protocol: protocol as i32,
        port,
    })
}

/// `makeAllowedRoutes`: the listener the binding names (by port, else the
/// `istio.io/PROXY` one for PROXY), else the HBONE listener on 15008,
/// gives the namespaces allowed (`makeWaypointSelector`); none: `Same`.
fn allowed_routes(gateway: &Value, binding: Option<&ApplicationTunnel>) -> FromNamespaces {
    let listeners = gateway["spec"]["listeners"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let bound = binding.and_then(|b| {
        listeners.iter().find(|l| {
            if b.port != 0 {
                l["port"].as_u64() == Some(u64::from(b.port))
            } else {
                b.protocol == application_tunnel::Protocol::Proxy as i32
                    && l["protocol"] == "istio.io/PROXY"
            }
        })
    });
    let listener = bound.or_else(|| {
        listeners
            .iter()
            .find(|l| l["protocol"] == "HBONE" && l["port"].as_u64() == Some(u64::from(HBONE_PORT)))
    });
    let Some(namespaces) = listener.map(|l| &l["allowedRoutes"]["namespaces"]) else {
        return FromNamespaces::Same;
    };
    match namespaces["from"].as_str() {
        Some("All") => FromNamespaces::All,
        Some("Selector") => {
            let selector = &namespaces["selector"];
            let expressions = selector["matchExpressions"]
                .as_array()
                .is_some_and(|e| !e.is_empty());
            FromNamespaces::Selector((!expressions).then(|| {
                strings(&selector["matchLabels"])
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            }))
        }
        _ => FromNamespaces::Same,
    }
}

impl Waypoint {
    /// `AllowsAttachmentFromNamespaceOrLookup`: whether objects of
    /// `namespace` may use this waypoint.
    fn allows(&self, namespace: &str, index: &Index<'_>) -> bool {
        match &self.allowed {
            FromNamespaces::All => true,
            FromNamespaces::Same => self.namespace == namespace,
            FromNamespaces::Selector(None) => false,
            FromNamespaces::Selector(Some(wanted)) => {
                let labels = index
                    .namespaces
                    .get(namespace)
                    .map(|ns| strings(&ns["metadata"]["labels"]))
                    .unwrap_or_default();
                wanted
                    .iter()
                    .all(|(k, v)| labels.get(k.as_str()) == Some(&v.as_str()))
            }
        }
    }
}

/// `GetUseWaypoint`: the waypoint `labels` name (`namespace/name`, the
/// namespace from `istio.io/use-waypoint-namespace`, else `default_ns`),
/// and whether they opt out with `none`.
pub(crate) fn use_waypoint(
    labels: &BTreeMap<&str, &str>,
    default_ns: &str,
) -> (Option<String>, bool) {
    match labels.get(USE_WAYPOINT) {
        Some(&"none") => (None, true),
        Some(name) => {
            let namespace = labels
                .get(USE_WAYPOINT_NAMESPACE)
                .copied()
                .unwrap_or(default_ns);
            (Some(format!("{namespace}/{name}")), false)
        }
        None => (None, false),
    }
}

/// `fetchWaypointForTarget`: the object's own label first (`none` opts
/// out, even of its namespace's), then its namespace's; a named waypoint
/// that does not exist or does not allow the namespace is none (istiod
/// reports it in status), and the namespace is not consulted then.
fn for_target<'w>(
    meta: &Value,
    index: &Index<'_>,
    waypoints: &'w BTreeMap<String, Waypoint>,
) -> Option<&'w Waypoint> {
    let namespace = meta["namespace"].as_str()?;
    let (named, none) = use_waypoint(&strings(&meta["labels"]), namespace);
    if none {
        return None;
    }
    let named = match named {
        Some(named) => named,
        None => {
            let ns = index.namespaces.get(namespace)?;
            use_waypoint(&strings(&ns["metadata"]["labels"]), namespace).0?
        }
    };
    waypoints.get(&named).filter(|w| w.allows(namespace, index))
}

/// `fetchWaypointForService`: a waypoint (`gateway.istio.io/managed:
/// istio.io-mesh-controller`) or east-west gateway's own Service has none;
/// the waypoint must take `service` or `all` traffic.
pub(crate) fn for_service<'w>(
    meta: &Value,
    index: &Index<'_>,
    waypoints: &'w BTreeMap<String, Waypoint>,
) -> Option<&'w Waypoint> {
    let managed = strings(&meta["labels"])
        .get("gateway.istio.io/managed")
        .copied();
    if matches!(
        managed,
        Some("istio.io-mesh-controller" | "istio.io-eastwest-controller")
    ) {
        return None;
    }
    for_target(meta, index, waypoints)
        .filter(|w| matches!(w.traffic_type.as_str(), "service" | "all"))
}

/// `computeWaypoint` for a pod: a waypoint's own pod (labelled with its
/// Gateway's name) gets the Gateway's inbound binding as its application
/// tunnel and no waypoint; any other pod the waypoint
/// `fetchWaypointForWorkload` finds, which must take `workload` or `all`
/// traffic (the default `service` one from a namespace label is silently
/// none).
pub(crate) fn for_pod(
    meta: &Value,
    index: &Index<'_>,
    waypoints: &BTreeMap<String, Waypoint>,
) -> (Option<ApplicationTunnel>, Option<GatewayAddress>) {
    let instance_of = strings(&meta["labels"])
        .get(GATEWAY_NAME)
        .filter(|name| !name.is_empty())
        .and_then(|name| {
            let namespace = meta["namespace"].as_str()?;
            waypoints.get(&format!("{namespace}/{name}"))
        });
    if let Some(instance_of) = instance_of {
        return (instance_of.binding, None);
    }
    let waypoint = for_target(meta, index, waypoints)
        .filter(|w| matches!(w.traffic_type.as_str(), "workload" | "all"));
    (None, waypoint.and_then(|w| w.address.clone()))
}

/// The label naming a canary waypoint beside the primary one.
pub const USE_WAYPOINT_CANARY: &str = "istio.io/use-waypoint-canary";
/// The label naming the canary's namespace when it is not the object's.
pub const USE_WAYPOINT_CANARY_NAMESPACE: &str = "istio.io/use-waypoint-canary-namespace";
/// The annotation giving the canary's share, a percentage (default 0).
pub const USE_WAYPOINT_CANARY_WEIGHT: &str = "istio.io/use-waypoint-canary-weight";

/// `buildWeightedWaypoints`: with a `primary` waypoint and a usable canary,
/// `[{primary, 100 - weight}, {canary, weight}]`; else none (istiod
/// reports why in status and keeps the primary alone).
///
/// The canary (`ResolveUseWaypointCanary`) is read at the level the
/// primary came from: the namespace's labels and annotation are consulted
/// only when the object has no `istio.io/use-waypoint` of its own
/// (`getUseWaypointCanary`: the object's canary label, else its
/// namespace's, the canary's namespace from the same labels, defaulting
/// to the object's; `none` or empty: no canary). The weight
/// (`getCanaryWeight`) is the object's annotation, else (same rule) its
/// namespace's, else 0; not an integer in 0..=100 drops the canary. So
/// does a canary that is the primary, or (`resolveCanaryWaypoint`) one
/// that does not exist, does not allow the object's namespace or does not
/// take service traffic.
pub(crate) fn weighted(
    meta: &Value,
    primary: Option<&Waypoint>,
    index: &Index<'_>,
    waypoints: &BTreeMap<String, Waypoint>,
) -> Vec<WeightedWaypoint> {
    let Some(primary) = primary else {
        return Vec::new();
    };
    let Some(namespace) = meta["namespace"].as_str() else {
        return Vec::new();
    };
    let labels = strings(&meta["labels"]);
    let annotations = strings(&meta["annotations"]);
    let ns_meta = match use_waypoint(&labels, namespace).0 {
        Some(_) => None,
        None => index.namespaces.get(namespace).map(|ns| &ns["metadata"]),
    };
    let ns_labels = ns_meta.map(|m| strings(&m["labels"])).unwrap_or_default();
    let canary_labels = if !labels.contains_key(USE_WAYPOINT_CANARY)
        && ns_labels.contains_key(USE_WAYPOINT_CANARY)
    {
        &ns_labels
    } else {
        &labels
    };
    let Some(canary) = canary_labels
        .get(USE_WAYPOINT_CANARY)
        .filter(|v| !v.is_empty() && **v != "none")
    else {
        return Vec::new();
    };
    let canary_ns = canary_labels
        .get(USE_WAYPOINT_CANARY_NAMESPACE)
        .copied()
        .unwrap_or(namespace);
    let canary_name = format!("{canary_ns}/{canary}");
    if canary_name == format!("{}/{}", primary.namespace, primary.name) {
        return Vec::new();
    }
    let ns_annotations = ns_meta
        .map(|m| strings(&m["annotations"]))
        .unwrap_or_default();
    let weight = match annotations
        .get(USE_WAYPOINT_CANARY_WEIGHT)
        .or_else(|| ns_annotations.get(USE_WAYPOINT_CANARY_WEIGHT))
    {
        // Go's `strconv.Atoi`: an optional sign, decimal digits, no spaces.
        Some(text) => match text.parse::<i64>().ok().and_then(|n| u32::try_from(n).ok()) {
            Some(n) if n <= 100 => n,
            _ => return Vec::new(),
        },
        None => 0,
    };
    let Some(canary) = waypoints.get(&canary_name).filter(|w| {
        w.allows(namespace, index) && matches!(w.traffic_type.as_str(), "service" | "all")
    }) else {
        return Vec::new();
    };
    vec![
        WeightedWaypoint {
            destination: primary.address.clone(),
            weight: 100 - weight,
        },
        WeightedWaypoint {
            destination: canary.address.clone(),
            weight,
        },
    ]
}
