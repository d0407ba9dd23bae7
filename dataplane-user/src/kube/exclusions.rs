//! The reconciler's side of annotation exclusions
//! ([`crate::enroll::annotations`]): each time it looks at a pod it reads
//! the exclusions the pod's annotations ask for; an enrolled pod whose
//! exclusions in force differ is updated in place (annotations added,
//! changed or removed take effect without re-enrolling). Ignored
//! annotations are reported once per value: a warning naming the pod, the
//! annotation, the value and the reason, and
//! `dataplane_kube_pod_annotations_ignored_total{annotation}`.

use std::collections::HashMap;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
};

use super::reconcile::PodView;
use crate::{
    enroll::annotations::{IgnoredAnnotation, parse_exclusions, warn_ignored},
    redirect::Exclusions,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AnnotationLabels {
    annotation: &'static str,
}

/// How many times pods' exclusion annotations were ignored, by annotation.
#[derive(Debug, Clone, Default)]
pub struct IgnoredAnnotationsMetric(Family<AnnotationLabels, Counter>);

impl IgnoredAnnotationsMetric {
    /// The counter, registered with the agent's metrics.
    pub fn registered(metrics: &crate::telemetry::Metrics) -> Self {
        let this = Self::default();
        metrics.register(
            "dataplane_kube_pod_annotations_ignored",
            "Pod capture-exclusion annotations ignored as a whole (invalid value, over the entry \
             cap, or not expressible by the kernel maps), by annotation; counted once per value",
            None,
            this.0.clone(),
        );
        this
    }

    /// The count for `annotation` (tests).
    pub fn get(&self, annotation: &'static str) -> u64 {
        self.0.get_or_create(&AnnotationLabels { annotation }).get()
    }
}

/// What the reconciler has reported of each pod's ignored annotations.
#[derive(Debug, Default)]
pub(super) struct AnnotationReports {
    reported: HashMap<String, Vec<IgnoredAnnotation>>,
}

impl AnnotationReports {
    /// The exclusions `pod`'s annotations ask for; what they ask that is
    /// ignored is reported when it is not what was reported last for it.
    pub(super) fn exclusions(
        &mut self,
        pod: &PodView,
        metric: &IgnoredAnnotationsMetric,
    ) -> Exclusions {
        let parsed = parse_exclusions(&pod.annotations);
        let last = self.reported.get(&pod.uid);
        if last != Some(&parsed.ignored) {
            let new: Vec<IgnoredAnnotation> = parsed
                .ignored
                .iter()
                .filter(|one| last.is_none_or(|last| !last.contains(one)))
                .cloned()
                .collect();
            warn_ignored(&pod.namespace, &pod.name, &new);
            for one in &new {
                metric
                    .0
                    .get_or_create(&AnnotationLabels {
                        annotation: one.annotation,
                    })
                    .inc();
            }
            if parsed.ignored.is_empty() {
                self.reported.remove(&pod.uid);
            } else {
                self.reported.insert(pod.uid.clone(), parsed.ignored);
            }
        }
        parsed.exclusions
    }

    /// Forgets a pod gone from the API.
    pub(super) fn forget(&mut self, uid: &str) {
        self.reported.remove(uid);
    }

    /// Forgets the pods a relist no longer has.
    pub(super) fn keep_only(&mut self, known: impl Fn(&str) -> bool) {
        self.reported.retain(|uid, _| known(uid));
    }
}
