//! Kubernetes node integration, agent side: enroll the pods of this node
//! that opted in to the mesh and unenroll those that are gone, from a watch
//! of the Kubernetes API.
//!
//! The CNI plugin ([`crate::cni`]) enrolls each new pod before its first
//! packet; the reconciler covers everything the plugin cannot see: pods
//! that already ran when the agent started or while the plugin was not
//! installed, pods whose namespace or own labels change their opt-in, and
//! pods deleted while the agent was down.
//!
//! - [`optin`]: which pods are in the mesh (shared with the plugin).
//! - [`reconcile`]: the decisions, against a [`PodEnroller`].
//! - [`watch`]: list/watch of pods (`spec.nodeName=<node>`) and namespaces.
//! - [`netns`]: finding a running pod's network namespace.
//! - [`annotate`]: the `ambient.istio.io/redirection` annotation that
//!   tells istiod which pods are captured.
//!
//! The reconciler runs inside the agent and calls its
//! [`Enrollments`] directly rather than through the control socket: one
//! process, one lock, no serialisation, and errors keep their types.

pub mod annotate;
pub mod exclusions;
pub mod netns;
pub mod optin;
pub mod reconcile;
pub mod watch;

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use kube::{
    Client, Config,
    config::{KubeConfigOptions, Kubeconfig, KubeconfigError},
};

pub use netns::{NetnsLocator, ProcNetnsLocator};
pub use reconcile::{PodEnroller, PodView, Reconciler, ReconcilerSettings};

use crate::{enroll::Enroller, logging::Chain};

/// How often the reconciler re-evaluates every pod.
pub const RESYNC_INTERVAL: Duration = Duration::from_secs(10);

/// How long an enrolled pod unknown to the API survives (the CNI plugin may
/// enroll a pod just before the watch delivers it).
pub const UNKNOWN_GRACE: Duration = Duration::from_secs(30);

/// Errors setting up the Kubernetes client.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The kubeconfig file is unreadable or invalid.
    #[error("cannot use kubeconfig {path}")]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: KubeconfigError,
    },
    /// No kubeconfig given and none could be inferred.
    #[error(
        "no Kubernetes configuration: not in a cluster (KUBERNETES_SERVICE_HOST unset) and no KUBECONFIG or ~/.kube/config; pass --kubeconfig"
    )]
    Infer(#[source] kube::config::InferConfigError),
    /// --kube without --node.
    #[error(
        "--kube needs this node's name: pass --node (DaemonSet: DATAPLANE_NODE from spec.nodeName)"
    )]
    NodeRequired,
    /// The client could not be built from the configuration.
    #[error("cannot build a Kubernetes client")]
    Client(#[source] kube::Error),
}

/// A client from `kubeconfig`, or inferred (in-cluster service account,
/// then `$KUBECONFIG`, then `~/.kube/config`).
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, KubeError> {
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig_err = |source| KubeError::Kubeconfig {
                path: path.to_path_buf(),
                source,
            };
            let file = Kubeconfig::read_from(path).map_err(kubeconfig_err)?;
            Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(kubeconfig_err)?
        }
        None => Config::infer().await.map_err(KubeError::Infer)?,
    };
    Client::try_from(config).map_err(KubeError::Client)
}

/// What the agent's reconciler needs.
#[derive(Debug, Clone)]
pub struct AgentReconcilerOptions {
    /// This node's name (`spec.nodeName` of its pods); required.
    pub node: Option<String>,
    /// Kubeconfig; inferred when `None`.
    pub kubeconfig: Option<PathBuf>,
    /// Trust domain of enrolled pods' identities.
    pub trust_domain: String,
    /// Uids of the configured workloads, never unenrolled by the reconciler.
    pub keep: HashSet<String>,
    /// Which pods belong in the mesh.
    pub rule: optin::EnrollmentRule,
}

/// The agent's Kubernetes tasks, running until aborted.
#[derive(Debug)]
pub struct KubeTasks {
    /// The reconciler's watch.
    pub reconcile: tokio::task::JoinHandle<()>,
    /// The redirection annotator.
    pub annotate: tokio::task::JoinHandle<()>,
    /// How the annotations stand, for `status`.
    pub annotations: Arc<std::sync::Mutex<annotate::AnnotationStatus>>,
}

/// Starts the agent's reconciler against its enrollments, and the
/// annotator that tells istiod which of them are captured.
pub async fn start_for_agent(
    options: AgentReconcilerOptions,
    enroller: Enroller,
    metrics: &crate::telemetry::Metrics,
) -> Result<KubeTasks, KubeError> {
    let node = options.node.ok_or(KubeError::NodeRequired)?;
    let client = client(options.kubeconfig.as_deref()).await?;
    let annotations = Arc::default();
    let annotate = annotate::spawn(
        client.clone(),
        enroller.view(),
        metrics,
        Arc::clone(&annotations),
    );
    let reconciler = Reconciler::new(
        Arc::new(AgentEnroller(enroller)),
        Arc::new(ProcNetnsLocator::default()),
        ReconcilerSettings {
            trust_domain: options.trust_domain,
            keep: options.keep,
            unknown_grace: UNKNOWN_GRACE,
            rule: Arc::new(options.rule),
            ignored_annotations: exclusions::IgnoredAnnotationsMetric::registered(metrics),
        },
    );
    tracing::info!(node = %node, "reconciling this node's pods from the Kubernetes API");
    Ok(KubeTasks {
        reconcile: watch::spawn(client, &node, reconciler, RESYNC_INTERVAL),
        annotate,
        annotations,
    })
}

/// The agent's enrollment actor as a [`PodEnroller`]. The reconciler
/// calls it from a blocking thread, where waiting for the actor is fine.
struct AgentEnroller(Enroller);

impl PodEnroller for AgentEnroller {
    fn enrolled(&self) -> Vec<String> {
        let snapshot = self.0.view().snapshot();
        snapshot.pods.iter().map(|p| p.spec.uid.clone()).collect()
    }

    fn enroll(&self, spec: crate::enroll::PodSpec) -> Result<(), String> {
        self.0
            .add_blocking(spec)
            .map(drop)
            .map_err(|e| Chain(&e).to_string())
    }

    fn unenroll(&self, uid: &str) -> Result<(), String> {
        self.0
            .remove_blocking(uid.to_owned())
            .map(drop)
            .map_err(|e| Chain(&e).to_string())
    }

    fn enrolled_spec(&self, uid: &str) -> Option<crate::enroll::PodSpec> {
        let snapshot = self.0.view().snapshot();
        snapshot
            .pods
            .iter()
            .find(|p| p.spec.uid == uid)
            .map(|p| p.spec.clone())
    }
}
