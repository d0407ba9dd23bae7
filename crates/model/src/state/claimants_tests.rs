//! Several workloads at one network address, as ztunnel holds them
//! (`src/state/workload.rs`: `WorkloadByAddr::Single`/`Many`, every
//! claimant kept; `WorkloadByAddr::get` finds a pod first, then one
//! speaking HBONE; `remove_uid` leaves the others). Its own test,
//! `overlapping_workload_ip`, puts a pod and a WorkloadEntry at one IP:
//! the pod is found, and once it goes, the WorkloadEntry.

#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use std::{net::IpAddr, sync::Arc};

use super::*;
use crate::config::{changes::Changes, entries::EntryKey};

const POD: &str = "cluster1//Pod/default/my-pod";
const ENTRY: &str = "cluster1/networking.istio.io/WorkloadEntry/default/my-we";

fn ip() -> IpAddr {
    "10.0.0.1".parse().unwrap()
}

/// A workload `uid` at 10.0.0.1 on `network`, speaking `protocol`.
fn workload(uid: &str, network: &str, protocol: &str) -> Arc<Workload> {
    let text = format!(
        "workloads:\n- {{uid: '{uid}', name: n, namespace: default, workloadIps: [10.0.0.1], network: '{network}', protocol: {protocol}}}\n"
    );
    Arc::clone(&LocalConfig::parse(&text, "t").unwrap().workloads[0])
}

/// `state` with `name` (an istiod resource name: entry order is name
/// order) set to `workload`, or removed.
fn put(state: &MeshState, name: &str, workload: Option<Arc<Workload>>) -> MeshState {
    state
        .apply(&Changes {
            workloads: vec![(EntryKey::xds(name), workload)],
            ..Changes::default()
        })
        .unwrap()
}

fn found(state: &MeshState, network: &str) -> Option<String> {
    state
        .workloads
        .by_addr(network, ip())
        .map(|w| w.workload.uid.to_string())
}

#[test]
fn a_pod_is_found_before_a_workload_entry_and_the_other_stays_when_one_goes() {
    // In both entry orders (names `a` and `b` swapped).
    for (pod_name, entry_name) in [("a", "b"), ("b", "a")] {
        let empty = MeshState::default();
        let one = put(&empty, pod_name, Some(workload(POD, "", "HBONE")));
        let both = put(&one, entry_name, Some(workload(ENTRY, "", "HBONE")));
        assert_eq!(found(&both, "").as_deref(), Some(POD), "{pod_name}");
        assert_eq!(both.workloads.claimants("", ip()).len(), 2);
        assert_eq!(both.workloads.by_addr.crowded_count(), 1);
        // The pod goes: the WorkloadEntry is found in its place.
        let entry_only = put(&both, pod_name, None);
        assert_eq!(found(&entry_only, "").as_deref(), Some(ENTRY));
        assert_eq!(entry_only.workloads.by_addr.crowded_count(), 0);
        // Then the WorkloadEntry: nobody.
        let none = put(&entry_only, entry_name, None);
        assert_eq!(found(&none, ""), None);
        assert_eq!(none.workloads.by_addr.network_count(), 0);
        // The other way round: the WorkloadEntry goes, the pod stays.
        let pod_only = put(&both, entry_name, None);
        assert_eq!(found(&pod_only, "").as_deref(), Some(POD));
        assert_eq!(pod_only.workloads.claimants("", ip()).len(), 1);
        // The state it was made from is untouched.
        assert_eq!(found(&both, "").as_deref(), Some(POD));
    }
}

#[test]
fn of_non_pods_one_speaking_hbone_is_found_and_a_pod_beats_it_whatever_its_protocol() {
    let empty = MeshState::default();
    let tcp_entry = format!("{ENTRY}-tcp");
    let hbone_entry = format!("{ENTRY}-hbone");
    // `a` comes first in entry order: the HBONE one wins by rank, not order.
    let state = put(&empty, "b", Some(workload(&tcp_entry, "", "TCP")));
    let state = put(&state, "a", Some(workload(&hbone_entry, "", "HBONE")));
    assert_eq!(found(&state, "").as_deref(), Some(hbone_entry.as_str()));
    // A plain-TCP pod beats both.
    let state = put(&state, "0", Some(workload(POD, "", "TCP")));
    assert_eq!(found(&state, "").as_deref(), Some(POD));
    // The HBONE one turned TCP (an update in place): the pod still; and
    // once the pod goes, of the two now alike the last in entry order.
    let state = put(&state, "a", Some(workload(&hbone_entry, "", "TCP")));
    assert_eq!(found(&state, "").as_deref(), Some(POD));
    let state = put(&state, "0", None);
    assert_eq!(found(&state, "").as_deref(), Some(tcp_entry.as_str()));
    // Back to HBONE: it is found again.
    let state = put(&state, "a", Some(workload(&hbone_entry, "", "HBONE")));
    assert_eq!(found(&state, "").as_deref(), Some(hbone_entry.as_str()));
}

#[test]
fn the_same_claimants_give_the_same_answer_whatever_order_they_came_in() {
    let claimants = [
        ("x", workload("we-1", "", "HBONE")),
        ("y", workload("we-2", "", "HBONE")),
        ("z", workload("we-3", "", "HBONE")),
    ];
    let mut answers = Vec::new();
    for order in [[0, 1, 2], [2, 1, 0], [1, 2, 0]] {
        let mut state = MeshState::default();
        for i in order {
            let (name, w) = &claimants[i];
            state = put(&state, name, Some(Arc::clone(w)));
        }
        answers.push(found(&state, "").unwrap());
    }
    // All alike: the last in entry order (ztunnel: the last inserted).
    assert_eq!(answers, ["we-3", "we-3", "we-3"]);
}

#[test]
fn claimants_of_one_ip_on_two_networks_are_apart() {
    let state = put(
        &MeshState::default(),
        "a",
        Some(workload(ENTRY, "east", "HBONE")),
    );
    let state = put(&state, "b", Some(workload(POD, "west", "HBONE")));
    assert_eq!(found(&state, "east").as_deref(), Some(ENTRY));
    assert_eq!(found(&state, "west").as_deref(), Some(POD));
    assert_eq!(state.workloads.by_addr.crowded_count(), 0);
    // The pod moves to east: it wins there, west is empty.
    let state = put(&state, "b", Some(workload(POD, "east", "HBONE")));
    assert_eq!(found(&state, "east").as_deref(), Some(POD));
    assert_eq!(found(&state, "west"), None);
    assert_eq!(state.workloads.by_addr.network_count(), 1);
    // And leaves again: east has the WorkloadEntry alone.
    let state = put(&state, "b", Some(workload(POD, "west", "HBONE")));
    assert_eq!(found(&state, "east").as_deref(), Some(ENTRY));
    assert_eq!(state.workloads.by_addr.crowded_count(), 0);
}
