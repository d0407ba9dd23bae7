//! Checks on a pod's network namespace: never the node's own, and still
//! the one the path names.

use super::{EnrollError, PodSpec};
use crate::proxy::PodNetns;

/// Refuses the agent's own network namespace and the init process's: on a
/// host-network agent they are the node's, and enrolling them would bind
/// the engine's ports on the node and capture the node's traffic.
/// Namespaces are compared by identity (device and inode), not by path.
pub(super) fn refuse_host_netns(spec: &PodSpec, netns: &PodNetns) -> Result<(), EnrollError> {
    use std::os::unix::fs::MetadataExt as _;
    let netns_err = |source| EnrollError::Netns {
        uid: spec.uid.clone(),
        path: spec.netns.clone(),
        source,
    };
    let held = netns.identity().map_err(netns_err)?;
    for (path, whose) in [
        ("/proc/self/ns/net", "agent's own"),
        ("/proc/1/ns/net", "node's (init process)"),
    ] {
        // An unreadable reference (no /proc/1 in a restricted pid
        // namespace) cannot be compared; the other one still is.
        if std::fs::metadata(path).is_ok_and(|m| (m.dev(), m.ino()) == held) {
            return Err(EnrollError::HostNetns {
                uid: spec.uid.clone(),
                path: spec.netns.clone(),
                whose,
            });
        }
    }
    Ok(())
}

/// Whether the path still names the namespace we hold open.
pub(super) fn netns_still_there(netns: &PodNetns) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(held) = netns.identity() else {
        return false;
    };
    std::fs::metadata(netns.path()).is_ok_and(|m| (m.dev(), m.ino()) == held)
}
