//! What the agent reports about itself: the `status` screen, the
//! configuration dump and the certificate list, served on the control
//! socket (for `dataplane status|config-dump|certs`) and the admin
//! endpoint's `/config_dump`. The dump also carries ztunnel's sections
//! (`workloads`, `services`, `policies`, `certificates`, `workloadState`,
//! see [`ztunnel_dump`]) so that `istioctl ztunnel-config` reads it.

pub mod ztunnel_dump;

mod certs;
mod config_dump;
mod status;

use std::{path::Path, sync::Arc, time::Instant};

pub use certs::CertInfo;
pub use status::{PodCaptureState, ProgramStatus, StatusReport, XdsTypeView, XdsView};

use serde::{Deserialize, Serialize};

use crate::{
    enroll::{DepartedPod, Enroller, PodStatus},
    mesh::MeshContext,
    readiness::Readiness,
    redirect::PinLayout,
};

/// Everything the reports read.
pub struct AgentView {
    /// The configuration the agent was started with (its instance, capture
    /// mode, fail-open setting, ...).
    pub config: Arc<crate::agent::config::AgentConfig>,
    /// Where the HTTP endpoints listen.
    pub endpoints: Endpoints,
    /// Start-up progress and drain state.
    pub readiness: Arc<Readiness>,
    /// Workloads, certificates, connections.
    pub mesh: Arc<MeshContext>,
    /// Enrolled pods, and enrollment commands.
    pub enroller: Enroller,
    /// The kernel programs attached (none under iptables capture).
    pub kernel: Option<KernelPrograms>,
    /// Where the instance's kernel state is pinned.
    pub pins: PinLayout,
    /// When the agent started.
    pub started: Instant,
    /// The stream to istiod, with `--xds`.
    pub xds: Option<Arc<std::sync::Mutex<crate::xds::XdsStatus>>>,
    /// The pods' `ambient.istio.io/redirection` annotations, with `--kube`.
    pub annotations: Option<Arc<std::sync::Mutex<crate::kube::annotate::AnnotationStatus>>>,
}

impl std::fmt::Debug for AgentView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentView")
            .field("instance", &self.config.state.instance)
            .finish()
    }
}

/// Where the agent's HTTP endpoints listen (`None`: not serving, e.g. the
/// port was taken).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Endpoints {
    /// `GET /healthz/ready`.
    pub readiness: Option<std::net::SocketAddr>,
    /// `GET /metrics`.
    pub metrics: Option<std::net::SocketAddr>,
    /// `/config_dump`, `/logging`, `/quitquitquit` (loopback only).
    pub admin: Option<std::net::SocketAddr>,
}

/// The kernel programs the agent attached, as reports name them.
#[derive(Debug, Clone)]
pub struct KernelPrograms {
    /// Program names.
    pub programs: Vec<&'static str>,
    /// The cgroup they are attached to.
    pub cgroup: std::path::PathBuf,
}

impl AgentView {
    fn pods_and_departed(&self) -> (Vec<PodStatus>, Vec<DepartedPod>) {
        let snapshot = self.enroller.view().snapshot();
        (snapshot.pods.clone(), snapshot.departed.clone())
    }
}

/// The names in `dir`, sorted; none when it cannot be read.
fn list_dir(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}
