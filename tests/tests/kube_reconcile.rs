//! The reconciler against a stand-in Kubernetes API replaying recorded
//! list and watch responses (`kube_fixtures/`): opt-in by namespace label
//! and pod label (Istio's default enablement selectors), opt-out, host-network and IP-less pods left alone,
//! watch events applied, a watch that drops and resumes from its last
//! `resourceVersion`, a `410 Gone` that forces a relist which unenrolls the
//! pods deleted meanwhile, and enrolled pods unknown to the API removed
//! after the grace period. Enrollment is recorded, not performed (the agent
//! end-to-end test is `kube_agent.rs`).

use std::{
    collections::{BTreeMap, HashSet},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use dataplane_tests::{
    TempDir,
    cni_kubeapi::{FakeApi, WatchStep, fixture, pod_uid},
};
use dataplane_user::{
    enroll::PodSpec,
    kube::{NetnsLocator, PodEnroller, Reconciler, ReconcilerSettings, watch},
};
use serde_json::Value;

/// Records enrollments instead of performing them.
#[derive(Default)]
struct Recorder {
    enrolled: Mutex<BTreeMap<String, PodSpec>>,
    history: Mutex<Vec<String>>,
}

impl Recorder {
    fn uids(&self) -> Vec<String> {
        self.enrolled
            .lock()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    fn spec(&self, uid: &str) -> Option<PodSpec> {
        self.enrolled.lock().ok()?.get(uid).cloned()
    }

    fn history(&self) -> Vec<String> {
        self.history.lock().map(|h| h.clone()).unwrap_or_default()
    }

    fn preset(&self, uid: &str) {
        if let Ok(mut m) = self.enrolled.lock() {
            m.insert(
                uid.to_owned(),
                PodSpec {
                    uid: uid.to_owned(),
                    name: uid.to_owned(),
                    namespace: "elsewhere".into(),
                    service_account: "default".into(),
                    trust_domain: "cluster.local".into(),
                    netns: PathBuf::from("/var/run/netns/preset"),
                    ips: vec![[10, 9, 9, 9].into()],
                    node_addr: None,
                    exclusions: Default::default(),
                    dns_capture: None,
                    fast_path: None,
                },
            );
        }
    }
}

impl PodEnroller for Recorder {
    fn enrolled(&self) -> Vec<String> {
        self.uids()
    }

    fn enroll(&self, spec: PodSpec) -> Result<(), String> {
        if let Ok(mut h) = self.history.lock() {
            h.push(format!("enroll {}", spec.name));
        }
        if let Ok(mut m) = self.enrolled.lock() {
            m.insert(spec.uid.clone(), spec);
        }
        Ok(())
    }

    fn unenroll(&self, uid: &str) -> Result<(), String> {
        let removed = self.enrolled.lock().ok().and_then(|mut m| m.remove(uid));
        if let (Ok(mut h), Some(spec)) = (self.history.lock(), removed) {
            h.push(format!("unenroll {}", spec.name));
        }
        Ok(())
    }

    fn enrolled_spec(&self, uid: &str) -> Option<PodSpec> {
        self.spec(uid)
    }
}

/// Every pod "runs" in /var/run/netns/fake-<uid>.
struct FakeLocator;

impl NetnsLocator for FakeLocator {
    fn locate(&self, uid: &str) -> Option<PathBuf> {
        Some(PathBuf::from(format!("/var/run/netns/fake-{uid}")))
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !done() {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

struct Uids {
    web: String,
    db: String,
    legacy: String,
    plain: String,
    hostnet: String,
    pending: String,
    api: String,
    late: String,
}

impl Uids {
    fn new() -> Self {
        Self {
            web: pod_uid(),
            db: pod_uid(),
            legacy: pod_uid(),
            plain: pod_uid(),
            hostnet: pod_uid(),
            pending: pod_uid(),
            api: pod_uid(),
            late: pod_uid(),
        }
    }

    fn vars(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("NODE", "node-a"),
            ("UID_WEB", &self.web),
            ("UID_DB", &self.db),
            ("UID_LEGACY", &self.legacy),
            ("UID_PLAIN", &self.plain),
            ("UID_HOSTNET", &self.hostnet),
            ("UID_PENDING", &self.pending),
            ("UID_API", &self.api),
            ("UID_LATE", &self.late),
            ("NS_UID_SHOP", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c01"),
            ("NS_UID_LEGACY", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c02"),
            ("NS_UID_KUBE_SYSTEM", "a3c1b5e2-7f00-4b1e-9d55-0e6f7a8b9c03"),
        ]
    }
}

fn events(value: Value) -> Vec<WatchStep> {
    value
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(WatchStep::Event)
        .collect()
}

#[test]
fn list_watch_drop_resume_and_gone_relist_reconcile_the_node() -> anyhow::Result<()> {
    let uids = Uids::new();
    let vars = uids.vars();
    let api = FakeApi::start()?;
    let dir = TempDir::new("kuberec")?;
    let kubeconfig = api.write_kubeconfig(dir.path())?;

    api.push_list("/api/v1/pods", fixture("pods_list.json", &vars)?);
    let mut first_watch = events(fixture("pods_watch_1.json", &vars)?);
    first_watch.push(WatchStep::Close);
    api.push_watch("/api/v1/pods", first_watch);
    api.push_watch(
        "/api/v1/pods",
        vec![WatchStep::Event(fixture("watch_gone.json", &vars)?)],
    );
    api.push_list("/api/v1/pods", fixture("pods_list_2.json", &vars)?);
    api.push_list(
        "/api/v1/namespaces",
        fixture("namespaces_list.json", &vars)?,
    );

    let recorder = Arc::new(Recorder::default());
    recorder.preset("stale-uid"); // enrolled, unknown to the API
    recorder.preset("configured-uid"); // from the agent's own config
    let reconciler = Reconciler::new(
        Arc::clone(&recorder) as Arc<dyn PodEnroller>,
        Arc::new(FakeLocator),
        ReconcilerSettings {
            trust_domain: "example.org".into(),
            keep: HashSet::from(["configured-uid".to_owned()]),
            unknown_grace: Duration::from_millis(600),
            rule: Default::default(),
            ignored_annotations: Default::default(),
        },
    );
    let runtime = tokio::runtime::Runtime::new()?;
    let client = runtime.block_on(dataplane_user::kube::client(Some(&kubeconfig)))?;
    let task = {
        let _entered = runtime.enter();
        watch::spawn(client, "node-a", reconciler, Duration::from_millis(200))
    };

    // After list, watch, drop, resume, 410 and relist.
    let mut expected = vec![
        "configured-uid".to_owned(),
        uids.pending.clone(),
        uids.late.clone(),
    ];
    expected.sort();
    wait_for("the node's pods to settle", || recorder.uids() == expected)?;
    let history = recorder.history();
    for step in [
        "enroll web-7d9c8b6f5-x2x4q",
        "enroll legacy-1",
        "enroll api-6b5f7c9d4-q8w7e",
        "enroll worker-5c4d-abcde",
        "unenroll legacy-1",
        "unenroll web-7d9c8b6f5-x2x4q",
        "unenroll api-6b5f7c9d4-q8w7e",
        "enroll late-1",
        "unenroll stale-uid",
    ] {
        assert!(
            history.contains(&step.to_owned()),
            "{step} missing from {history:#?}"
        );
    }
    for never in ["db-0", "plain-1", "kube-proxy-8xk2p"] {
        assert!(
            !history.iter().any(|h| h.ends_with(never)),
            "{never} must not be touched: {history:#?}"
        );
    }
    let position = |s: &str| history.iter().position(|h| h == s);
    assert!(position("enroll web-7d9c8b6f5-x2x4q") < position("unenroll web-7d9c8b6f5-x2x4q"));

    let requests = api.requests();
    let pod_lists: Vec<_> = requests
        .iter()
        .filter(|r| r.path == "/api/v1/pods" && !r.is_watch())
        .collect();
    assert!(pod_lists.len() >= 2, "a relist after 410: {requests:#?}");
    assert_eq!(
        pod_lists[0].query.get("fieldSelector").map(String::as_str),
        Some("spec.nodeName=node-a")
    );
    let pod_watches: Vec<_> = requests
        .iter()
        .filter(|r| r.path == "/api/v1/pods" && r.is_watch())
        .collect();
    assert!(pod_watches.len() >= 3, "{pod_watches:#?}");
    assert_eq!(
        pod_watches[0]
            .query
            .get("resourceVersion")
            .map(String::as_str),
        Some("1210"),
        "the first watch starts at the list's version"
    );
    assert_eq!(
        pod_watches[1]
            .query
            .get("resourceVersion")
            .map(String::as_str),
        Some("1214"),
        "the dropped watch resumes from the last event's version"
    );
    assert_eq!(
        pod_watches[2]
            .query
            .get("resourceVersion")
            .map(String::as_str),
        Some("1290"),
        "after the relist, from the new list's version"
    );

    // Service account, addresses, namespace and trust domain reach the
    // enrollment (seen on the pod enrolled from the relist).
    let late = recorder
        .spec(&uids.late)
        .ok_or_else(|| anyhow::anyhow!("late-1 not enrolled"))?;
    assert_eq!(late.namespace, "shop");
    assert_eq!(late.trust_domain, "example.org");
    assert_eq!(late.ips, vec![std::net::IpAddr::from([10, 244, 1, 17])]);
    assert_eq!(
        late.netns,
        PathBuf::from(format!("/var/run/netns/fake-{}", uids.late))
    );

    // The namespace opts in as a whole: plain-1 follows, legacy-1 keeps
    // its own opt-out.
    api.send_event(
        "/api/v1/namespaces",
        fixture("namespace_legacy_ambient.json", &vars)?,
    );
    wait_for("plain-1 to be enrolled", || {
        recorder.uids().contains(&uids.plain)
    })?;
    assert!(!recorder.uids().contains(&uids.legacy));

    // A deletion on the live watch unenrolls at once.
    let mut deleted = fixture("pods_list_2.json", &vars)?["items"][5].clone();
    deleted["metadata"]["resourceVersion"] = "1301".into();
    api.send_event(
        "/api/v1/pods",
        serde_json::json!({"type": "DELETED", "object": deleted}),
    );
    wait_for("late-1 to be unenrolled", || {
        !recorder.uids().contains(&uids.late)
    })?;

    task.abort();
    runtime.shutdown_timeout(Duration::from_secs(2));
    Ok(())
}

#[test]
fn service_account_and_dual_stack_addresses_come_from_the_pod() -> anyhow::Result<()> {
    let uids = Uids::new();
    let vars = uids.vars();
    let api = FakeApi::start()?;
    let dir = TempDir::new("kubesa")?;
    let kubeconfig = api.write_kubeconfig(dir.path())?;
    api.push_list("/api/v1/pods", fixture("pods_list.json", &vars)?);
    api.push_list(
        "/api/v1/namespaces",
        fixture("namespaces_list.json", &vars)?,
    );
    let recorder = Arc::new(Recorder::default());
    let reconciler = Reconciler::new(
        Arc::clone(&recorder) as Arc<dyn PodEnroller>,
        Arc::new(FakeLocator),
        ReconcilerSettings {
            trust_domain: "cluster.local".into(),
            keep: HashSet::new(),
            unknown_grace: Duration::from_secs(30),
            rule: Default::default(),
            ignored_annotations: Default::default(),
        },
    );
    let runtime = tokio::runtime::Runtime::new()?;
    let client = runtime.block_on(dataplane_user::kube::client(Some(&kubeconfig)))?;
    let task = {
        let _entered = runtime.enter();
        watch::spawn(client, "node-a", reconciler, Duration::from_secs(5))
    };
    wait_for("web to be enrolled", || recorder.uids().contains(&uids.web))?;
    let web = recorder
        .spec(&uids.web)
        .ok_or_else(|| anyhow::anyhow!("web not enrolled"))?;
    assert_eq!(web.service_account, "web");
    assert_eq!(web.name, "web-7d9c8b6f5-x2x4q");
    assert_eq!(
        web.ips,
        vec![
            std::net::IpAddr::from([10, 244, 1, 11]),
            "fd00:10:244:1::b".parse()?
        ]
    );
    let mut enrolled = recorder.uids();
    enrolled.sort();
    let mut expected = vec![uids.web.clone(), uids.legacy.clone()];
    expected.sort();
    assert_eq!(enrolled, expected, "only the opted-in pods with IPs");
    task.abort();
    runtime.shutdown_timeout(Duration::from_secs(2));
    Ok(())
}
