//! Telling istiod which pods are captured: the `ambient.istio.io/redirection`
//! annotation, written as istio-cni writes it.
//!
//! istiod gives a pod's workload `TunnelProtocol: HBONE` only when the pod
//! carries `ambient.istio.io/redirection: enabled` (istio/istio 86c9f01f,
//! `pilot/pkg/serviceregistry/ambient/workloads.go`, `setTunnelProtocol`);
//! without it every peer sends the pod plaintext, or refuses it under
//! STRICT mTLS. istio-cni writes it with a merge patch on the `pods/status`
//! subresource (`cni/pkg/util/podutil.go`: `AnnotateEnrolledPod` writes
//! `enabled`, `AnnotatePartiallyEnrolledPod` `pending`,
//! `AnnotateUnenrollPod` removes it, a pod already gone being no error).
//!
//! Here one task follows the enrolled pods, however they were enrolled (CNI
//! plugin, reconciler, a restarted agent's re-adoption), and writes what
//! each one's capture is: `enabled` once captured and served, `pending`
//! while an external proxy (`--engine ztunnel`) has not acknowledged it,
//! removed when the pod leaves. A failed patch (API down, 403, conflict) is
//! retried with backoff; capture never waits for it and is never undone by
//! it. `status` and `/metrics` show how it stands.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::{
    enroll::{PodStatus, PodsView},
    logging::Chain,
    telemetry::Metrics,
};

/// The annotation istiod reads.
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";
/// Its value once a pod is captured (`AmbientRedirectionEnabled`).
pub const ENABLED: &str = "enabled";
/// Its value while a pod is partly captured (`AmbientRedirectionPending`).
pub const PENDING: &str = "pending";

/// The first retry of a failed patch waits this long, doubling up to
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait between retries.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Bound on one patch request.
const PATCH_TIMEOUT: Duration = Duration::from_secs(10);

/// A pod, as the API names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodKey {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// How the annotations stand, for `status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AnnotationStatus {
    /// Pods whose annotation is as their capture is.
    pub written: usize,
    /// Pods whose annotation is not yet (a patch failed or is on its way).
    pub pending: usize,
    /// The last patch that failed, while any is pending.
    pub last_error: Option<String>,
}

/// The value each enrolled pod's annotation should have.
pub fn wanted(pods: &[PodStatus]) -> HashMap<PodKey, &'static str> {
    pods.iter()
        .map(|pod| {
            let served = pod.external.as_ref().is_none_or(|e| e.served);
            let key = PodKey {
                namespace: pod.spec.namespace.clone(),
                name: pod.spec.name.clone(),
            };
            (key, if served { ENABLED } else { PENDING })
        })
        .collect()
}

/// The merge patch that sets the annotation to `value`, or removes it.
pub fn patch_body(value: Option<&str>) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {REDIRECTION_ANNOTATION: value}}})
}

/// What is left to write: pods whose annotation differs from what is
/// wanted (`Some(value)`), and pods written before that are gone (`None`).
fn work(
    wanted: &HashMap<PodKey, &'static str>,
    written: &HashMap<PodKey, &'static str>,
) -> Vec<(PodKey, Option<&'static str>)> {
    let mut work: Vec<_> = wanted
        .iter()
        .filter(|(key, value)| written.get(*key) != Some(value))
        .map(|(key, value)| (key.clone(), Some(*value)))
        .chain(
            written
                .keys()
                .filter(|key| !wanted.contains_key(*key))
                .map(|key| (key.clone(), None)),
        )
        .collect();
    work.sort();
    work
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// `/metrics` of the annotator.
#[derive(Debug, Clone, Default)]
struct AnnotationMetrics {
    patches: Family<ResultLabels, Counter>,
    pending: Gauge,
}

impl AnnotationMetrics {
    fn registered(metrics: &Metrics) -> Self {
        let this = Self::default();
        metrics.register(
            "dataplane_kube_redirection_patches",
            "Patches of pods' ambient.istio.io/redirection annotation (pods/status), by result \
             (ok, failed)",
            None,
            this.patches.clone(),
        );
        metrics.register(
            "dataplane_kube_redirection_pending",
            "Enrolled or departed pods whose ambient.istio.io/redirection annotation is not yet \
             as their capture is (retried with backoff)",
            None,
            this.pending.clone(),
        );
        this
    }
}

/// Starts the annotator; it runs until the task is aborted. `status` is
/// what `dataplane status` shows of it.
pub fn spawn(
    client: Client,
    view: PodsView,
    metrics: &Metrics,
    status: Arc<Mutex<AnnotationStatus>>,
) -> tokio::task::JoinHandle<()> {
    let metrics = AnnotationMetrics::registered(metrics);
    tokio::spawn(run(client, view, metrics, status))
}

async fn run(
    client: Client,
    mut view: PodsView,
    metrics: AnnotationMetrics,
    status: Arc<Mutex<AnnotationStatus>>,
) {
    let mut written: HashMap<PodKey, &'static str> = HashMap::new();
    let mut backoff = FIRST_BACKOFF;
    let mut retry_at: Option<Instant> = None;
    let mut last_error: Option<String> = None;
    loop {
        let wanted = wanted(&view.snapshot().pods);
        let todo = work(&wanted, &written);
        let mut failed = false;
        if retry_at.is_none_or(|at| Instant::now() >= at) {
            for (key, value) in &todo {
                match patch(&client, key, *value).await {
                    Ok(()) => {
                        metrics
                            .patches
                            .get_or_create(&ResultLabels { result: "ok" })
                            .inc();
                        debug!(pod = %key.name, namespace = %key.namespace, value = ?value, "redirection annotation written");
                        match value {
                            Some(value) => written.insert(key.clone(), value),
                            None => written.remove(key),
                        };
                    }
                    Err(err) => {
                        metrics
                            .patches
                            .get_or_create(&ResultLabels { result: "failed" })
                            .inc();
                        warn!(pod = %key.name, namespace = %key.namespace, error = %err, retry_in_ms = backoff.as_millis() as u64, "cannot write the pod's ambient.istio.io/redirection annotation; istiod will not treat it as captured until it is written; retrying");
                        last_error = Some(format!("{}/{}: {err}", key.namespace, key.name));
                        failed = true;
                    }
                }
            }
        }
        let pending = work(&wanted, &written).len();
        if failed {
            retry_at = Some(Instant::now() + backoff);
            backoff = (backoff * 2).min(MAX_BACKOFF);
        } else if pending == 0 {
            if retry_at.is_some() {
                info!("every pod's ambient.istio.io/redirection annotation is written again");
            }
            retry_at = None;
            backoff = FIRST_BACKOFF;
            last_error = None;
        }
        metrics
            .pending
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
        if let Ok(mut status) = status.lock() {
            *status = AnnotationStatus {
                written: written.len(),
                pending,
                last_error: last_error.clone(),
            };
        }
        tokio::select! {
            changed = view.changed() => if changed.is_err() {
                return;
            },
            () = sleep_until(retry_at) => {}
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Writes (or removes) one pod's annotation. A pod the API does not know
/// is done with (istio-cni ignores it when removing).
async fn patch(client: &Client, key: &PodKey, value: Option<&str>) -> Result<(), String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &key.namespace);
    let body = patch_body(value);
    let params = PatchParams::default();
    let patch = Patch::Merge(&body);
    let request = pods.patch_status(&key.name, &params, &patch);
    match tokio::time::timeout(PATCH_TIMEOUT, request).await {
        Ok(Ok(_)) => Ok(()),
        // Gone, or never a pod of this API (a workload of the agent's own
        // config file): nothing to tell istiod about it.
        Ok(Err(kube::Error::Api(status))) if status.code == 404 => Ok(()),
        Ok(Err(err)) => Err(Chain(&err).to_string()),
        Err(_) => Err(format!(
            "the Kubernetes API did not answer within {}s",
            PATCH_TIMEOUT.as_secs()
        )),
    }
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use super::*;

    fn key(name: &str) -> PodKey {
        PodKey {
            namespace: "shop".into(),
            name: name.into(),
        }
    }

    #[test]
    fn the_patch_is_istio_cnis() {
        // `AnnotateEnrolledPod` and `AnnotateUnenrollPod`, byte for byte.
        assert_eq!(
            patch_body(Some(ENABLED)).to_string(),
            r#"{"metadata":{"annotations":{"ambient.istio.io/redirection":"enabled"}}}"#
        );
        assert_eq!(
            patch_body(None).to_string(),
            r#"{"metadata":{"annotations":{"ambient.istio.io/redirection":null}}}"#
        );
    }

    #[test]
    fn only_what_changed_is_written_and_departed_pods_are_cleared() {
        let wanted = HashMap::from([(key("a"), ENABLED), (key("b"), PENDING)]);
        let written = HashMap::from([
            (key("a"), ENABLED),
            (key("b"), ENABLED),
            (key("c"), ENABLED),
        ]);
        assert_eq!(
            work(&wanted, &written),
            [(key("b"), Some(PENDING)), (key("c"), None)]
        );
        assert!(work(&wanted, &wanted).is_empty());
        let _ = serde_json::to_string(&AnnotationStatus::default()).unwrap();
    }
}
