//! ServiceEntries (`networking.istio.io/v1`) in the Kubernetes-fed
//! istiod: their Services, with the waypoint of their labels as a
//! Service's, and a `workloadSelector` selecting pods of their namespace
//! (istio/istio 86c9f01f, `pilot/pkg/serviceregistry/ambient/services.go`
//! `serviceEntriesInfo`, `workloads.go` `podWorkloadBuilder` with
//! `PILOT_ENABLE_SERVICEENTRY_SELECT_PODS` on, its default). The Services
//! and endpoint workloads themselves are built as
//! [`crate::istiod_serviceentry`] builds them.

use std::collections::{BTreeMap, BTreeSet};

use dataplane_user::istio_api::workload;
use serde_json::Value;

use super::services::{ServiceInfo, Source};
use super::waypoints::{self, Waypoint};
use super::{Cluster, Index, strings};
use crate::istiod_serviceentry::service_entry_addresses;

/// `serviceEntriesInfo`: one info per host, selecting by
/// `spec.workloadSelector.labels`, its port names by number, with the
/// waypoint `fetchWaypointForService` finds for the entry (its own label,
/// else its namespace's; every entry is public without the mesh's
/// `serviceEntryVisibility`, so a waypoint elsewhere is allowed) and its
/// weighted waypoints.
pub(crate) fn infos(
    entry: &Value,
    index: &Index<'_>,
    waypoints: &BTreeMap<String, Waypoint>,
    cluster: &Cluster,
) -> Vec<ServiceInfo> {
    let (meta, spec) = (&entry["metadata"], &entry["spec"]);
    let selector: BTreeMap<String, String> = strings(&spec["workloadSelector"]["labels"])
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let port_names: BTreeMap<u32, String> = spec["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let number = u32::try_from(p["number"].as_u64()?).ok()?;
            Some((number, p["name"].as_str().unwrap_or_default().to_owned()))
        })
        .collect();
    let waypoint = waypoints::for_service(meta, index, waypoints);
    let weighted = waypoints::weighted(meta, waypoint, index, waypoints);
    let (services, _) = service_entry_addresses(entry, cluster);
    services
        .into_iter()
        .map(|mut service| {
            service.waypoint = waypoint.and_then(|w| w.address.clone());
            service.weighted_waypoints = weighted.clone();
            ServiceInfo {
                service,
                target_port_names: BTreeMap::new(),
                port_names: port_names.clone(),
                selector: selector.clone(),
                source: Source::ServiceEntry,
                created: meta["creationTimestamp"].as_str().map(str::to_owned),
                object_name: meta["name"].as_str().unwrap_or_default().to_owned(),
            }
        })
        .collect()
}

/// `serviceEntryWorkloadBuilder`'s workloads for `entry`, in the entry's
/// Services that survived `selectWorkloadServices` (`selected`) only: an
/// entry pruned entirely has none, and an implicit (DNS, no endpoints)
/// endpoint of a pruned host is none.
pub(crate) fn workloads(
    entry: &Value,
    selected: &[ServiceInfo],
    cluster: &Cluster,
) -> Vec<workload::Workload> {
    let meta = &entry["metadata"];
    let (name, namespace) = (
        meta["name"].as_str().unwrap_or_default(),
        meta["namespace"].as_str().unwrap_or_default(),
    );
    let kept: BTreeSet<String> = selected
        .iter()
        .filter(|s| {
            s.source == Source::ServiceEntry
                && s.object_name == name
                && s.service.namespace == namespace
        })
        .map(|s| format!("{}/{}", s.service.namespace, s.service.hostname))
        .collect();
    let (_, workloads) = service_entry_addresses(entry, cluster);
    workloads
        .into_iter()
        .filter_map(|mut w| {
            w.services.retain(|key, _| kept.contains(key));
            (!w.services.is_empty()).then_some(w)
        })
        .collect()
}
