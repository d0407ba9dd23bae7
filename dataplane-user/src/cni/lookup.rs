//! The plugin's look-up of a pod in the Kubernetes API: whether it opted
//! in (the same rule as the reconciler, [`crate::kube::optin`]), its uid
//! and service account. Done by the plugin itself, not the agent, so a pod
//! outside the mesh starts even when the agent is down.

use std::{path::Path, time::Duration};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;

use crate::{
    kube::optin::{EnrollmentRule, OptIn, OptInInput},
    logging::Chain,
};

use super::spec::PodRef;

/// What the API says about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    /// `metadata.uid`.
    pub uid: String,
    /// `spec.serviceAccountName` (`default` when unset).
    pub service_account: String,
    /// The opt-in decision.
    pub opt_in: OptIn,
    /// The pod's `ambient.istio.io/dns-capture` annotation, if set.
    pub dns_capture: Option<bool>,
    /// The pod's [`FAST_PATH_ANNOTATION`](crate::enroll::FAST_PATH_ANNOTATION),
    /// if set.
    pub fast_path: Option<bool>,
    /// What the pod's annotations leave uncaptured.
    pub exclusions: crate::redirect::Exclusions,
    /// Exclusion annotations ignored, and why (for the plugin's log).
    pub ignored: Vec<String>,
}

/// Looks the pod and its namespace up through `kubeconfig`, within
/// `timeout`. The error is a sentence for the CNI error's details.
pub fn lookup(
    kubeconfig: &Path,
    pod: &PodRef,
    rule: &EnrollmentRule,
    timeout: Duration,
) -> Result<PodFacts, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    runtime.block_on(async {
        match tokio::time::timeout(timeout, lookup_async(kubeconfig, pod, rule)).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "the Kubernetes API did not answer within {}s",
                timeout.as_secs()
            )),
        }
    })
}

async fn lookup_async(
    kubeconfig: &Path,
    pod_ref: &PodRef,
    rule: &EnrollmentRule,
) -> Result<PodFacts, String> {
    let client = crate::kube::client(Some(kubeconfig))
        .await
        .map_err(|e| Chain(&e).to_string())?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod_ref.namespace);
    let pod = pods.get(&pod_ref.name).await.map_err(|e| {
        format!(
            "cannot get pod {}/{}: {}",
            pod_ref.namespace,
            pod_ref.name,
            Chain(&e)
        )
    })?;
    let namespaces: Api<Namespace> = Api::all(client);
    let namespace = namespaces
        .get(&pod_ref.namespace)
        .await
        .map_err(|e| format!("cannot get namespace {}: {}", pod_ref.namespace, Chain(&e)))?;
    let empty = Default::default();
    let spec = pod.spec.as_ref();
    let annotations = pod.metadata.annotations.as_ref();
    let opt_in = rule.decide(OptInInput {
        namespace: &pod_ref.namespace,
        pod_labels: pod.metadata.labels.as_ref().unwrap_or(&empty),
        pod_annotations: annotations.unwrap_or(&empty),
        host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        namespace_labels: namespace.metadata.labels.as_ref().unwrap_or(&empty),
    });
    let parsed = annotations
        .map(crate::enroll::parse_exclusions)
        .unwrap_or_default();
    Ok(PodFacts {
        uid: pod
            .metadata
            .uid
            .clone()
            .ok_or_else(|| format!("pod {}/{} has no uid", pod_ref.namespace, pod_ref.name))?,
        service_account: spec
            .and_then(|s| s.service_account_name.clone())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "default".into()),
        opt_in,
        dns_capture: annotations.and_then(crate::dns::annotation_setting),
        fast_path: annotations
            .and_then(|a| crate::enroll::annotation_flag(a, crate::enroll::FAST_PATH_ANNOTATION)),
        exclusions: parsed.exclusions,
        ignored: parsed.ignored.iter().map(ToString::to_string).collect(),
    })
}
