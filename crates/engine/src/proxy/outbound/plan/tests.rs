//! One row per routing rule: a destination, the endpoints found dead, and
//! the plan written out in words.

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use super::*;
use crate::config::LocalConfig;

mod endpoints;
mod rules;
mod waypoints;

/// [`super::plan`] under the default policy, `ALLOW_ANY`, which every
/// row but the registry-only ones plans under.
fn plan(
    state: &MeshState,
    source: &Identity,
    src: IpAddr,
    dst: SocketAddr,
    choice: &impl EndpointChoice,
) -> OutboundPlan {
    super::plan(
        state,
        source,
        src,
        dst,
        choice,
        OutboundTrafficPolicy::AllowAny,
    )
}

/// Three HBONE workloads behind one VIP (two on one node, one on
/// another), a plain-TCP workload, a dual-stack workload, a service
/// without endpoints, and a ServiceEntry's whose endpoint has a DNS name
/// and no IP.
const MESH: &str = r#"
workloads:
- uid: a
  name: a
  namespace: shop
  serviceAccount: echo
  workloadIps: [10.1.0.11]
  services: {'shop/echo.shop.svc.cluster.local': {80: 9000}}
- uid: b
  name: b
  namespace: shop
  serviceAccount: echo
  workloadIps: [10.1.0.12]
  services: {'shop/echo.shop.svc.cluster.local': {80: 9000}}
- uid: c
  name: c
  namespace: shop
  serviceAccount: echo-v2
  workloadIps: [10.2.0.11]
  services: {'shop/echo.shop.svc.cluster.local': {80: 9001}}
- uid: legacy
  name: legacy
  namespace: old
  serviceAccount: legacy
  protocol: TCP
  workloadIps: [10.1.0.20]
- uid: dual
  name: dual
  namespace: shop
  serviceAccount: dual
  workloadIps: [10.1.0.30, 'fd00:1::30']
- uid: Kubernetes/networking.istio.io/ServiceEntry/shop/api/api.example.com
  name: api
  namespace: shop
  protocol: TCP
  hostname: api.example.com
  services: {'shop/api.example.com': {443: 8443}}
- uid: no-address
  name: no-address
  namespace: shop
  services: {'shop/api.example.com': {443: 8443}}
services:
- name: echo
  namespace: shop
  hostname: echo.shop.svc.cluster.local
  vips: ['/10.96.0.10', '/fd00:96::10']
  ports: {80: 9000}
  subjectAltNames: ['cluster.local/ns/shop/sa/echo-canary']
- name: empty
  namespace: shop
  hostname: empty.shop.svc.cluster.local
  vips: ['/10.96.0.11']
- name: private
  namespace: shop
  hostname: private.shop.svc.cluster.local
  vips: ['/10.96.0.12']
  visibility: namespace
- name: api
  namespace: shop
  hostname: api.example.com
  vips: ['/240.240.0.1']
  ports: {443: 443}
"#;

/// A client address the mesh does not know.
const CLIENT: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 9, 9, 9));

/// Fixed inputs: endpoints found dead, and where balancing starts.
struct Fixed {
    dead: HashSet<IpAddr>,
    start: usize,
}

impl EndpointChoice for Fixed {
    fn is_dead(&self, ip: IpAddr) -> bool {
        self.dead.contains(&ip)
    }

    fn start(&self, _: &ServiceEntry) -> usize {
        self.start
    }

    /// The start as the draw, so a table row picks the weighted waypoint.
    fn draw(&self, below: u64) -> u64 {
        self.start as u64 % below
    }
}

/// The plan in words: `tunnel DST via VIA expecting ID[|ALT]`,
/// `direct DST [to WORKLOAD]`, `refuse REASON: DETAIL`, hops joined by
/// ` then `, prefixed by `[service] ` for a VIP.
fn describe(plan: &OutboundPlan) -> String {
    let hop = |hop: &Hop| match hop {
        Hop::Direct { dst, workload } => match workload {
            Some(w) => format!("direct {dst} to {}", w.workload.name),
            None => format!("direct {dst}"),
        },
        Hop::Tunnel(t) => {
            let mut expected = vec![t.dst_identity.to_uri()];
            expected.extend(t.alt_identities.iter().map(Identity::to_uri));
            format!(
                "tunnel {} via {} expecting {}",
                t.dst,
                t.via,
                expected.join("|")
            )
        }
        Hop::Resolve(r) => format!(
            "resolve {}:{} to {}{}",
            r.hostname,
            r.port,
            r.workload.workload.name,
            if r.workload.speaks_hbone() {
                " (tunnel)"
            } else {
                ""
            }
        ),
    };
    let action = match &plan.action {
        Action::Hop(h) => hop(h),
        Action::Failover(hops) => hops.iter().map(hop).collect::<Vec<_>>().join(" then "),
        Action::Refuse { reason, detail } => format!("refuse {}: {detail}", reason.as_str()),
    };
    match &plan.service {
        Some(service) => format!("[{}/{}] {action}", service.namespace, service.hostname),
        None => action,
    }
}

const ID: &str = "spiffe://cluster.local/ns/shop/sa/";

/// A client in zone-a on node-1 and endpoints spread over zones and nodes
/// (one unhealthy), behind services that differ only in their routing and
/// health policy.
const LOCALITY: &str = r#"
workloads:
- {uid: client, name: client, namespace: shop, workloadIps: [10.1.0.1], node: node-1, locality: {region: r, zone: zone-a}}
- {uid: near, name: near, namespace: shop, workloadIps: [10.1.0.2], node: node-1, locality: {region: r, zone: zone-a},
   services: {'shop/strict': {80: 80}, 'shop/failover': {80: 80}, 'shop/all': {80: 80}, 'shop/through': {80: 80}}}
- {uid: zone, name: zone, namespace: shop, workloadIps: [10.1.0.3], node: node-2, locality: {region: r, zone: zone-a},
   services: {'shop/strict': {80: 80}, 'shop/failover': {80: 80}, 'shop/all': {80: 80}}}
- {uid: far, name: far, namespace: shop, workloadIps: [10.1.0.4], node: node-3, locality: {region: r, zone: zone-b},
   services: {'shop/strict': {80: 80}, 'shop/failover': {80: 80}, 'shop/all': {80: 80}}}
- {uid: sick, name: sick, namespace: shop, workloadIps: [10.1.0.5], node: node-1, status: Unhealthy, locality: {region: r, zone: zone-a},
   services: {'shop/strict': {80: 80}, 'shop/failover': {80: 80}, 'shop/all': {80: 80}}}
services:
- {name: s, namespace: shop, hostname: strict, vips: ['/10.96.1.1'], ports: {80: 80}, routing: {mode: strict, preferences: [region, zone]}}
- {name: f, namespace: shop, hostname: failover, vips: ['/10.96.1.2'], ports: {80: 80}, routing: {mode: failover, preferences: [zone, node]}}
- {name: a, namespace: shop, hostname: all, vips: ['/10.96.1.3'], ports: {80: 80}, healthPolicy: allowAll}
- {name: t, namespace: shop, hostname: through, vips: ['/10.96.1.4'], ports: {80: 80}, routing: {mode: passthrough}}
"#;
