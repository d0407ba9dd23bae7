//! What serves an enrolled pod's captured traffic: this agent's own engine,
//! or a node proxy outside the agent (a stock Istio ztunnel, handed the
//! pod's network namespace over ZDS) whose in-pod listeners the kernel
//! programs point at. Enrollment treats both alike; only these methods
//! tell them apart.

use crate::{
    identity::Identity,
    proxy::{PodEngine, PodListeners, RetiredEngine},
    zds::ZtunnelPeer,
};

/// The server of one enrolled pod.
pub(super) enum Serving {
    /// This agent's engine.
    Builtin(BuiltinPod),
    /// An external node proxy; this agent only captures.
    External(ExternalPod),
}

/// A pod served by an external node proxy (ztunnel).
#[derive(Debug, Default)]
pub(super) struct ExternalPod {
    /// The ztunnel connection whose listeners the kernel points the pod's
    /// inbound at, once harvested.
    pub(super) served_by: Option<ZtunnelPeer>,
    /// Why it is not served (no ztunnel connected, ztunnel's error, a
    /// failed harvest).
    pub(super) problem: Option<String>,
}

/// A pod served by this agent's engine.
pub(super) struct BuiltinPod {
    /// The pod's identity (its certificate is rotated while any pod uses it).
    pub(super) identity: Identity,
    /// Duplicates of the listening sockets the engine serves, so that a
    /// re-enrollment in the same namespace hands the same sockets to the
    /// new engine: the ports never close, no connection is refused.
    pub(super) listeners: PodListeners,
    /// The engine.
    pub(super) engine: PodEngine,
    /// Engines of earlier enrollments in the same namespace, still
    /// finishing the connections they accepted; they end with the pod.
    pub(super) retired: Vec<RetiredEngine>,
}

impl Serving {
    /// Stops serving: this agent's engine, and any previous one still
    /// finishing, close their listeners and connections; an external proxy
    /// is told separately.
    pub(super) fn stop(self) {
        if let Self::Builtin(pod) = self {
            pod.engine.stop();
        }
    }

    /// Hands over to a new server of the same listening sockets: this
    /// agent's engine stops accepting and lets what it accepted finish,
    /// for up to `deadline` ([`PodEngine::retire`]); an external proxy is
    /// told separately. Returns the engines still finishing, this one and
    /// earlier ones, for [`Serving::keep_retired`].
    pub(super) fn retire(self, deadline: std::time::Duration) -> Vec<RetiredEngine> {
        match self {
            Self::Builtin(pod) => {
                let mut retired = pod.retired;
                retired.retain(|engine| !engine.is_finished());
                retired.push(pod.engine.retire(deadline));
                retired
            }
            Self::External(_) => Vec::new(),
        }
    }

    /// Keeps the pod's previous engines until they finish or the pod
    /// stops being served.
    pub(super) fn keep_retired(&mut self, retired: Vec<RetiredEngine>) {
        if let Self::Builtin(pod) = self {
            pod.retired.extend(retired);
        }
    }

    /// Closes the pod's pooled HBONE connections (this agent's engine only).
    pub(super) fn close_pool(&self) {
        if let Self::Builtin(pod) = self {
            pod.engine.close_pool();
        }
    }

    /// The identity whose certificate this agent keeps for the pod.
    pub(super) fn identity(&self) -> Option<&Identity> {
        match self {
            Self::Builtin(pod) => Some(&pod.identity),
            Self::External(_) => None,
        }
    }

    /// The listening sockets this agent owns for the pod.
    pub(super) fn listeners(&self) -> Option<&PodListeners> {
        match self {
            Self::Builtin(pod) => Some(&pod.listeners),
            Self::External(_) => None,
        }
    }
}
