//! Changing an enrolled pod's exclusions in place: when a new request for
//! a pod differs from its enrollment only in [`PodSpec::exclusions`]
//! (its annotations changed), the kernel's exclusion entries are rewritten
//! for the same namespace and listeners. The engine, its certificate and
//! its connections stay; connections already open keep the path they took.

use std::os::fd::AsFd as _;

use super::{
    EnrollError, PodSpec, PodStatus,
    pods::{Enrollments, status_of},
    serving::Serving,
};
use crate::{
    proxy::PodNetns,
    redirect::{ExternalPodCapture, PodCapture},
};

impl Enrollments {
    /// Applies `spec` in place when it differs from the pod's enrollment
    /// only in its exclusions, in the same network namespace; `None` when
    /// it does not (a full re-enrollment is needed).
    pub(super) fn update_exclusions(
        &mut self,
        spec: &PodSpec,
    ) -> Result<Option<PodStatus>, EnrollError> {
        let Some(pod) = self.pods.get(&spec.uid) else {
            return Ok(None);
        };
        let mut same_but_exclusions = spec.clone();
        same_but_exclusions.exclusions = pod.spec.exclusions.clone();
        if same_but_exclusions != pod.spec {
            return Ok(None);
        }
        // The same path may name a new namespace (a restarted sandbox).
        let same_netns = PodNetns::open(&spec.netns)
            .and_then(|netns| netns.identity())
            .ok()
            .zip(pod.netns.identity().ok())
            .is_some_and(|(new, old)| new == old);
        if !same_netns {
            return Ok(None);
        }
        let dns_capture = match &pod.serving {
            Serving::Builtin(_) => pod.dns.is_some(),
            Serving::External(_) => self
                .settings
                .dns
                .as_ref()
                .is_some_and(|dns| dns.captures(spec.dns_capture)),
        };
        if let Some(redirector) = self.redirector.as_mut() {
            match &pod.serving {
                Serving::Builtin(builtin) => redirector.enroll_pod(&PodCapture {
                    netns_cookie: pod.cookie,
                    netns: pod.netns.fd(),
                    ips: &spec.ips,
                    node_addr: spec.node_addr,
                    exclusions: &spec.exclusions,
                    inbound_listener: builtin.listeners.inbound.as_fd(),
                    hbone_listener: builtin.listeners.hbone.as_fd(),
                    dns_capture,
                })?,
                // The listeners registered for it (ztunnel's, once
                // harvested) are kept.
                Serving::External(_) => redirector.enroll_external_pod(&ExternalPodCapture {
                    netns_cookie: pod.cookie,
                    netns: pod.netns.fd(),
                    ips: &spec.ips,
                    node_addr: spec.node_addr,
                    exclusions: &spec.exclusions,
                    dns_capture,
                })?,
            }
        }
        tracing::info!(
            pod = %spec.name,
            namespace = %spec.namespace,
            uid = %spec.uid,
            exclusions = ?spec.exclusions,
            "pod's capture exclusions changed in place"
        );
        let status = match self.pods.get_mut(&spec.uid) {
            Some(pod) => {
                pod.spec.exclusions = spec.exclusions.clone();
                status_of(pod)
            }
            None => return Ok(None),
        };
        self.persist()?;
        Ok(Some(status))
    }
}
