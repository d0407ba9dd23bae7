//! Kubernetes node integration, runtime side: the chained CNI plugin
//! (`dataplane-cni`) and `dataplane install-cni`, which puts it on the
//! node.
//!
//! On pod creation the container runtime runs the primary network plugin
//! (which creates the pod's interface and assigns its IPs), then this
//! plugin, which asks the agent over its control socket
//! (`/run/dataplane/default/agent.sock`) to enroll the pod and returns only
//! once capture is in place: the application's very first connection is
//! captured. Configuration (in the `.conflist`, written by `install-cni`):
//!
//! ```json
//! {
//!   "type": "dataplane-cni",
//!   "agentSocket": "/run/dataplane/default/agent.sock",
//!   "onAgentUnreachable": "fail",
//!   "agentTimeoutSeconds": 30,
//!   "kubeconfig": "/etc/cni/net.d/ZZZ-dataplane-cni-kubeconfig",
//!   "trustDomain": "cluster.local"
//! }
//! ```
//!
//! - [`spec`]: the CNI protocol (environment, configuration, errors).
//! - [`plugin`]: ADD, DEL, CHECK, STATUS, GC, VERSION.
//! - [`lookup`]: the pod's opt-in, uid and service account from the API.
//! - [`install`]: `dataplane install-cni`.

pub mod install;
pub mod lookup;
pub mod plugin;
pub mod spec;

/// Largest network configuration read from stdin, in bytes.
pub const MAX_CONFIG: u64 = 1 << 20;
