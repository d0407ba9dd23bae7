#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]

use super::*;

fn config(text: &str, origin: &str) -> LocalConfig {
    LocalConfig::parse(text, origin).unwrap()
}

/// The file overrides istiod's `web` workload, its `api` service and its
/// `deny-all` policy, and holds 10.0.0.9, which istiod gives to `other`.
const FILE: &str = r#"
workloads:
- {uid: web, name: web-file, namespace: shop, workloadIps: [10.0.0.5]}
- {uid: mine, name: mine, namespace: shop, workloadIps: [10.0.0.9]}
services:
- {name: api, namespace: shop, hostname: api, vips: ['/10.96.0.1']}
policies:
- {name: deny-all, namespace: shop, scope: Namespace, action: Allow}
"#;

const XDS: &str = r#"
workloads:
- {uid: web, name: web-xds, namespace: shop, workloadIps: [10.0.0.5]}
- {uid: other, name: other, namespace: shop, workloadIps: [10.0.0.9]}
- {uid: db, name: db, namespace: shop, workloadIps: [10.0.0.6]}
services:
- {name: api, namespace: shop, hostname: api, vips: ['/10.96.0.2']}
- {name: db, namespace: shop, hostname: db, vips: ['/10.96.0.3', '/10.96.0.1']}
policies:
- {name: deny-all, namespace: shop, scope: Namespace, action: Deny}
- {name: extra, namespace: shop, scope: Global, action: Deny}
"#;

#[test]
fn file_entries_win_and_are_marked() {
    let file = config(FILE, "mesh.yaml");
    let xds = Translated {
        config: config(XDS, "xds://istiod:15012"),
        dropped: vec!["service shop/x: subject alt name `junk`".into()],
    };
    let (merged, provenance) = merge(&file, Some(("xds://istiod:15012", &xds)));
    assert_eq!(merged.origin, "mesh.yaml + xds://istiod:15012");
    let names: Vec<&str> = merged.workloads.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["web-file", "mine", "db"]);
    let api = merged
        .services
        .iter()
        .find(|s| s.hostname == "api")
        .unwrap();
    assert_eq!(api.vips, ["10.96.0.1".parse::<IpAddr>().unwrap()]);
    // istiod's db service keeps the VIP the file does not hold.
    let db = merged.services.iter().find(|s| s.hostname == "db").unwrap();
    assert_eq!(db.vips, ["10.96.0.3".parse::<IpAddr>().unwrap()]);
    let deny_all = merged
        .policies
        .iter()
        .find(|p| p.name == "deny-all")
        .unwrap();
    assert_eq!(deny_all.action, crate::config::Action::Allow);
    assert_eq!(merged.policies.len(), 2);
    assert_eq!(provenance.dropped.len(), 3, "{:?}", provenance.dropped);
    assert!(
        provenance
            .dropped
            .iter()
            .any(|d| d.contains("workload other"))
    );
    assert!(MeshState::from_config(&merged).is_ok());

    let dump = provenance.annotate(merged.to_json());
    let entry = |list: &str, i: usize| dump[list][i].clone();
    assert_eq!(entry("workloads", 0)["source"], "file");
    assert_eq!(entry("workloads", 0)["shadows"], "xds");
    assert_eq!(entry("workloads", 1)["source"], "file");
    assert!(entry("workloads", 1).get("shadows").is_none());
    assert_eq!(entry("workloads", 2)["source"], "xds");
    assert_eq!(entry("services", 0)["shadows"], "xds");
    assert_eq!(entry("services", 1)["source"], "xds");
    assert_eq!(entry("policies", 1)["source"], "xds");
    assert_eq!(dump["xdsDropped"].as_array().map(Vec::len), Some(3));
}

#[test]
fn without_istiod_the_file_is_the_state_and_the_dump_is_unmarked() {
    let file = config(FILE, "mesh.yaml");
    let (merged, provenance) = merge(&file, None);
    assert_eq!(merged, file);
    assert_eq!(provenance.annotate(merged.to_json()), file.to_json());
    // An empty file (the embedded default) leaves istiod's origin alone.
    let xds = Translated {
        config: config(XDS, "xds://istiod:15012"),
        dropped: Vec::new(),
    };
    let (merged, _) = merge(&LocalConfig::default(), Some(("xds://istiod:15012", &xds)));
    assert_eq!(merged.origin, "xds://istiod:15012");
    assert_eq!(merged.workloads.len(), 3);
}
