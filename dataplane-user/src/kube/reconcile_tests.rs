#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use std::sync::Mutex;

use super::*;

/// Enrolled uids, and the specs of those it enrolled.
#[derive(Default)]
struct Fake(Mutex<Vec<String>>, Mutex<HashMap<String, PodSpec>>);

impl PodEnroller for Fake {
    fn enrolled(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
    fn enroll(&self, spec: PodSpec) -> Result<(), String> {
        let mut uids = self.0.lock().unwrap();
        if !uids.contains(&spec.uid) {
            uids.push(spec.uid.clone());
        }
        self.1.lock().unwrap().insert(spec.uid.clone(), spec);
        Ok(())
    }
    fn unenroll(&self, uid: &str) -> Result<(), String> {
        self.0.lock().unwrap().retain(|u| u != uid);
        self.1.lock().unwrap().remove(uid);
        Ok(())
    }
    fn enrolled_spec(&self, uid: &str) -> Option<PodSpec> {
        self.1.lock().unwrap().get(uid).cloned()
    }
}

struct Everywhere;

impl NetnsLocator for Everywhere {
    fn locate(&self, uid: &str) -> Option<PathBuf> {
        Some(PathBuf::from(format!("/var/run/netns/{uid}")))
    }
}

fn pod(uid: &str, ns: &str) -> PodView {
    PodView {
        uid: uid.into(),
        name: uid.into(),
        namespace: ns.into(),
        service_account: "default".into(),
        ips: vec![IpAddr::from([10, 0, 0, 1])],
        labels: BTreeMap::new(),
        annotations: BTreeMap::new(),
        host_network: false,
        finished: false,
        deleting: false,
    }
}

#[test]
fn the_istio_dns_capture_annotation_reaches_the_pod_spec() {
    let mut view = pod("u1", "shop");
    assert_eq!(
        spec_of(&view, "cluster.local", "/x".into()).dns_capture,
        None
    );
    view.annotations.insert(
        crate::dns::DNS_CAPTURE_ANNOTATION.to_owned(),
        "false".to_owned(),
    );
    assert_eq!(
        spec_of(&view, "cluster.local", "/x".into()).dns_capture,
        Some(false)
    );
}

#[test]
fn the_istio_bypass_inbound_capture_annotation_reaches_the_pod_spec() {
    let mut view = pod("u1", "shop");
    let spec = |view: &PodView| spec_of(view, "cluster.local", "/x".into());
    assert!(!spec(&view).exclusions.bypass_inbound);
    for (value, bypass) in [
        ("true", true),
        ("1", true),
        ("false", false),
        ("yes", false),
    ] {
        view.annotations.insert(
            crate::enroll::BYPASS_INBOUND_CAPTURE_ANNOTATION.to_owned(),
            value.to_owned(),
        );
        assert_eq!(spec(&view).exclusions.bypass_inbound, bypass, "{value}");
    }
}

#[test]
fn the_fast_path_annotation_reaches_the_pod_spec() {
    let mut view = pod("u1", "shop");
    assert_eq!(spec_of(&view, "cluster.local", "/x".into()).fast_path, None);
    for (value, setting) in [("false", Some(false)), ("1", Some(true)), ("maybe", None)] {
        view.annotations.insert(
            crate::enroll::FAST_PATH_ANNOTATION.to_owned(),
            value.to_owned(),
        );
        assert_eq!(
            spec_of(&view, "cluster.local", "/x".into()).fast_path,
            setting,
            "{value}"
        );
    }
}

fn ambient() -> BTreeMap<String, String> {
    BTreeMap::from([(optin::DATAPLANE_MODE.to_owned(), "ambient".to_owned())])
}

fn reconciler(fake: &Arc<Fake>, grace: Duration) -> Reconciler {
    Reconciler::new(
        Arc::clone(fake) as Arc<dyn PodEnroller>,
        Arc::new(Everywhere),
        ReconcilerSettings {
            trust_domain: "cluster.local".into(),
            keep: HashSet::from(["kept".to_owned()]),
            unknown_grace: grace,
            rule: Arc::default(),
            ignored_annotations: IgnoredAnnotationsMetric::default(),
        },
    )
}

#[test]
fn annotation_changes_on_an_enrolled_pod_change_its_exclusions_in_place() {
    use crate::enroll::annotations::EXCLUDE_OUTBOUND_PORTS;
    let fake = Arc::new(Fake::default());
    let mut r = reconciler(&fake, Duration::ZERO);
    let annotated = |value: Option<&str>| {
        let mut view = pod("a", "mesh");
        if let Some(value) = value {
            view.annotations
                .insert(EXCLUDE_OUTBOUND_PORTS.to_owned(), value.to_owned());
        }
        view
    };
    let ports = || fake.enrolled_spec("a").unwrap().exclusions.outbound_ports;
    let ignored = |r: &Reconciler| r.settings.ignored_annotations.get(EXCLUDE_OUTBOUND_PORTS);
    r.namespaces_listed(vec![("mesh".into(), ambient())]);
    assert_eq!(r.pods_listed(vec![annotated(Some("80"))]).enrolled, ["a"]);
    assert_eq!(ports(), [80]);
    assert_eq!(
        r.pod_applied(annotated(Some("80, 443"))),
        Changes::default()
    );
    assert_eq!(ports(), [80, 443]);
    // Invalid: ignored as a whole, reported once per value, still
    // enrolled.
    r.pod_applied(annotated(Some("80,http")));
    assert_eq!(ports(), Vec::<u16>::new());
    assert_eq!(ignored(&r), 1);
    r.pod_applied(annotated(Some("80,http")));
    r.reconcile_all();
    assert_eq!(ignored(&r), 1);
    r.pod_applied(annotated(Some("8080")));
    assert_eq!(ports(), [8080]);
    r.pod_applied(annotated(None));
    assert_eq!(ports(), Vec::<u16>::new());
    assert_eq!(fake.enrolled(), ["a"]);
}

#[test]
fn nothing_happens_before_both_lists() {
    let fake = Arc::new(Fake::default());
    fake.0.lock().unwrap().push("stale".into());
    let mut r = reconciler(&fake, Duration::ZERO);
    assert_eq!(r.pods_listed(vec![pod("a", "mesh")]), Changes::default());
    assert_eq!(fake.enrolled(), ["stale"]);
    let changes = r.namespaces_listed(vec![("mesh".into(), ambient())]);
    assert_eq!(changes.enrolled, ["a"]);
    assert_eq!(changes.unenrolled, ["stale"]);
}

#[test]
fn unknown_pods_wait_out_the_grace_and_kept_ones_stay() {
    let fake = Arc::new(Fake::default());
    fake.0
        .lock()
        .unwrap()
        .extend(["fresh".to_owned(), "kept".to_owned()]);
    let mut r = reconciler(&fake, Duration::from_secs(3600));
    r.namespaces_listed(vec![]);
    r.pods_listed(vec![]);
    assert_eq!(r.reconcile_all(), Changes::default());
    assert_eq!(fake.enrolled(), ["fresh", "kept"]);
}

#[test]
fn sidecar_pods_and_excluded_namespaces_are_left_out_or_taken_out() {
    let fake = Arc::new(Fake::default());
    let mut r = reconciler(&fake, Duration::ZERO);
    r.namespaces_listed(vec![
        ("mesh".into(), ambient()),
        ("kube-system".into(), ambient()),
    ]);
    let mut sidecar = pod("s", "mesh");
    sidecar
        .annotations
        .insert(optin::SIDECAR_STATUS.to_owned(), "{}".to_owned());
    let changes = r.pods_listed(vec![pod("a", "mesh"), sidecar, pod("k", "kube-system")]);
    assert_eq!(changes.enrolled, ["a"]);
    // One enrolled before it was injected (by hand, or an older rule)
    // is taken out.
    fake.0.lock().unwrap().push("k".into());
    assert_eq!(r.reconcile_all().unenrolled, ["k"]);
}

#[test]
fn terminating_pods_keep_their_capture_and_finished_ones_lose_it() {
    let fake = Arc::new(Fake::default());
    let mut r = reconciler(&fake, Duration::ZERO);
    r.namespaces_listed(vec![("mesh".into(), ambient())]);
    r.pods_listed(vec![pod("a", "mesh"), pod("b", "mesh")]);
    let mut deleting = pod("a", "mesh");
    deleting.deleting = true;
    assert_eq!(r.pod_applied(deleting), Changes::default());
    let mut done = pod("b", "mesh");
    done.finished = true;
    assert_eq!(r.pod_applied(done).unenrolled, ["b"]);
    assert_eq!(fake.enrolled(), ["a"]);
    // The namespace opting out takes its pods out.
    assert_eq!(
        r.namespace_applied("mesh".into(), BTreeMap::new()),
        Changes::default(),
        "a deleting pod is left alone"
    );
}

#[test]
fn ignored_annotations_are_reported_again_once_the_pod_was_gone() {
    use crate::enroll::annotations::EXCLUDE_INBOUND_PORTS;
    let fake = Arc::new(Fake::default());
    let mut r = reconciler(&fake, Duration::ZERO);
    let mut bad = pod("a", "mesh");
    bad.annotations
        .insert(EXCLUDE_INBOUND_PORTS.to_owned(), "*".to_owned());
    let ignored = |r: &Reconciler| r.settings.ignored_annotations.get(EXCLUDE_INBOUND_PORTS);
    r.namespaces_listed(vec![("mesh".into(), ambient())]);
    assert_eq!(r.pods_listed(vec![bad.clone()]).enrolled, ["a"]);
    assert_eq!(ignored(&r), 1);
    r.pods_listed(vec![bad.clone()]);
    assert_eq!(ignored(&r), 1, "once per value");
    // Gone from a relist (unenrolled, forgotten), then back: reported
    // again.
    r.pods_listed(vec![]);
    r.pods_listed(vec![bad]);
    assert_eq!(ignored(&r), 2);
}
