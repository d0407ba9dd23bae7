//! Which endpoints a client should prefer: those on a network it can
//! reach, then those sharing its locality (a service's routing
//! preferences).

use std::net::IpAddr;

use crate::config::{IpFamily, RoutingScope};

use super::MeshWorkload;

/// Whether a client on `network` can reach `workload` itself, at its
/// own address: only on its own network.
///
/// ztunnel `src/state.rs` `load_balance` drops an endpoint without an
/// address unless it is on another network and has a network gateway
/// (istiod sends a workload's gateway to every client, so a same-network
/// one must never use it); an endpoint on another network that it picks
/// is reached through its gateway by double HBONE, and refused without
/// one (`src/proxy/outbound.rs` `build_request_through_gateway`:
/// `NoValidDestination`). Here an endpoint on another network without a
/// gateway is left out instead, so the connection goes to a reachable
/// endpoint rather than failing on that one. A pod address of another
/// network is no pod to the client (ztunnel keys addresses by network).
pub fn on_reachable_network(workload: &crate::config::Workload, network: &str) -> bool {
    *workload.network == *network
}

/// Which of `ips` (a workload's addresses) a connection first dialled to
/// `original` goes to, for a service of `families` (ztunnel
/// `src/state.rs` `pick_workload_destination_or_resolve`): `original`
/// itself when it is one of them; else, among those `families` allows,
/// the first of `original`'s family, else the first. `None` when none is
/// allowed.
pub fn pick_address(
    ips: &[IpAddr],
    original: IpAddr,
    families: Option<IpFamily>,
) -> Option<IpAddr> {
    if ips.contains(&original) {
        return Some(original);
    }
    let same_family =
        |ip: &IpAddr| ip.to_canonical().is_ipv4() == original.to_canonical().is_ipv4();
    let mut allowed = ips
        .iter()
        .copied()
        .filter(|ip| families.is_none_or(|f| f.accepts(*ip)));
    let first = allowed.next()?;
    if same_family(&first) {
        return Some(first);
    }
    Some(allowed.find(same_family).unwrap_or(first))
}

/// How many of `preferences`, in order, `endpoint` shares with `source`
/// (the count stops at the first difference), and its rank. A leading
/// `network` preference is Istio's "same network first": a match ranks
/// above any match of the others, a mismatch is skipped so the others
/// still rank.
pub(super) fn locality_rank(
    preferences: &[RoutingScope],
    source: &MeshWorkload,
    endpoint: &MeshWorkload,
) -> (usize, usize) {
    let (s, e) = (&source.workload, &endpoint.workload);
    let network_first = preferences.first() == Some(&RoutingScope::Network);
    let (mut matched, mut rank) = (0, 0);
    for (i, scope) in preferences.iter().enumerate() {
        let same = match scope {
            RoutingScope::Region => s.locality().region == e.locality().region,
            RoutingScope::Zone => s.locality().zone == e.locality().zone,
            RoutingScope::Subzone => s.locality().subzone == e.locality().subzone,
            RoutingScope::Node => s.node == e.node,
            RoutingScope::Cluster => s.cluster_id == e.cluster_id,
            RoutingScope::Network => s.network == e.network,
        };
        if i == 0 && network_first {
            if same {
                matched += 1;
                rank += preferences.len();
            }
            continue;
        }
        if !same {
            break;
        }
        matched += 1;
        rank += 1;
    }
    (matched, rank)
}
