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

/// istiod's entries of `XDS`, plus a note of something left out.
fn xds_entries() -> XdsEntries {
    let mut xds = XdsEntries::of_config(&config(XDS, "xds://istiod:15012"));
    xds.dropped.insert(
        crate::config::entries::DropKey::Translation("shop/x".into()),
        Arc::from(["service shop/x: subject alt name `junk`".to_owned()]),
    );
    xds
}

#[test]
fn file_entries_win_and_are_marked() {
    let file = config(FILE, "mesh.yaml");
    let xds = xds_entries();
    let state = merged_state(&file, Some(("xds://istiod:15012", &xds))).unwrap();
    let (merged, provenance) = (state.config(), &state.provenance);
    assert_eq!(merged.origin, "mesh.yaml + xds://istiod:15012");
    let names: Vec<&str> = merged.workloads.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["web-file", "mine", "db"]);
    let api = merged
        .services
        .iter()
        .find(|s| s.hostname == "api")
        .unwrap();
    assert_eq!(
        api.vips,
        ["10.96.0.1".parse::<crate::config::Vip>().unwrap()]
    );
    // istiod's db service keeps the VIP the file does not hold.
    let db = merged.services.iter().find(|s| s.hostname == "db").unwrap();
    assert_eq!(
        db.vips,
        ["10.96.0.3".parse::<crate::config::Vip>().unwrap()]
    );
    let deny_all = merged
        .policies
        .iter()
        .find(|p| p.name == "deny-all")
        .unwrap();
    assert_eq!(deny_all.action, crate::config::Action::Allow);
    assert_eq!(merged.policies.len(), 2);
    let dropped = provenance.dropped();
    assert_eq!(dropped.len(), 3, "{dropped:?}");
    assert!(dropped.iter().any(|d| d.contains("workload other")));
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
    let state = merged_state(&file, None).unwrap();
    let merged = state.config();
    assert_eq!(merged, file);
    assert_eq!(state.provenance.annotate(merged.to_json()), file.to_json());
    // An empty file (the embedded default) leaves istiod's origin alone.
    let xds = XdsEntries::of_config(&config(XDS, "xds://istiod:15012"));
    let state = merged_state(&LocalConfig::default(), Some(("xds://istiod:15012", &xds))).unwrap();
    assert_eq!(state.origin, "xds://istiod:15012");
    assert_eq!(state.workloads.len(), 3);
}

/// The file holds network addresses, not bare IPs (ztunnel keys
/// workloads and services by `NetworkAddress`): istiod's entries at the
/// same IPs on another network are other addresses and are kept; only
/// those on the file's networks are left out.
#[test]
fn the_file_holds_its_addresses_on_their_own_networks_only() {
    let file = config(
        r#"
workloads:
- {uid: mine, name: mine, namespace: shop, workloadIps: [10.0.0.9], network: east}
services:
- {name: api, namespace: shop, hostname: api, vips: ['east/10.96.0.1']}
"#,
        "mesh.yaml",
    );
    let xds = XdsEntries::of_config(&config(
        r#"
workloads:
- {uid: twin, name: twin, namespace: shop, workloadIps: [10.0.0.9], network: west}
- {uid: thief, name: thief, namespace: shop, workloadIps: [10.0.0.9], network: east}
services:
- {name: db, namespace: shop, hostname: db, vips: ['west/10.96.0.1', 'east/10.96.0.1', 'north/10.0.0.9']}
"#,
        "xds://istiod:15012",
    ));
    let state = merged_state(&file, Some(("xds://istiod:15012", &xds))).unwrap();
    let merged = state.config();
    let names: Vec<&str> = merged.workloads.iter().map(|w| w.name.as_str()).collect();
    assert_eq!(names, ["mine", "twin"]);
    let ip = "10.0.0.9".parse().unwrap();
    let at = |network| {
        state
            .workloads
            .by_addr(network, ip)
            .map(|w| w.workload.uid.to_string())
    };
    assert_eq!(at("east").as_deref(), Some("mine"));
    assert_eq!(at("west").as_deref(), Some("twin"));
    let db = merged.services.iter().find(|s| s.hostname == "db").unwrap();
    let vips: Vec<String> = db.vips.iter().map(ToString::to_string).collect();
    assert_eq!(vips, ["west/10.96.0.1", "north/10.0.0.9"]);
    let dropped = state.provenance.dropped();
    assert_eq!(dropped.len(), 2, "{dropped:?}");
    assert!(
        dropped.iter().any(|d| d.contains("workload thief")),
        "{dropped:?}"
    );
    assert!(
        dropped.iter().any(|d| d.contains("VIP east/10.96.0.1")),
        "{dropped:?}"
    );
}

/// A small deterministic generator (no `rand` dependency): the same
/// sequence every run, so a failure reproduces.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

mod random_pushes {
    use std::collections::HashMap;

    use super::Lcg;
    use crate::istio_api::{
        security::Authorization,
        workload::{self, Address, NetworkAddress, Port, PortList, address},
    };
    use crate::xds::{XdsResources, resources::Versioned};
    use std::sync::Arc;

    fn held<T: crate::xds::translate::IntoModel>(resource: T) -> Arc<Versioned<T>> {
        Arc::new(Versioned::new(&Arc::from(""), "1", &resource))
    }

    fn ip(last: u8) -> Vec<u8> {
        vec![10, 0, 0, last]
    }

    fn service_key(i: u64) -> String {
        format!("shop/s{i}.shop")
    }

    /// One random change to `r`: a workload, service or policy put or
    /// removed, over small pools of names and addresses so that entries
    /// often claim one another's addresses and share services.
    pub fn mutate(r: &mut XdsResources, rng: &mut Lcg) {
        match rng.below(7) {
            0..=2 => {
                let uid = format!("w{:02}", rng.below(12));
                let mut addresses = vec![ip(1 + rng.below(9) as u8)];
                if rng.below(4) == 0 {
                    addresses.push(ip(1 + rng.below(9) as u8));
                }
                let services: HashMap<String, PortList> = (0..rng.below(3))
                    .map(|_| {
                        let port = 80 + rng.below(2) as u32;
                        (
                            service_key(rng.below(4)),
                            PortList {
                                ports: vec![Port {
                                    service_port: port,
                                    target_port: 8000 + port,
                                }],
                            },
                        )
                    })
                    .collect();
                // Another namespace and selector policies, so that a
                // policy change reaches some workloads and not others.
                let namespace = if rng.below(3) == 0 { "web" } else { "shop" };
                let authorization_policies = (0..rng.below(3) / 2)
                    .map(|_| format!("shop/p{}", rng.below(4)))
                    .collect();
                let w = workload::Workload {
                    uid: uid.clone(),
                    name: format!("{uid}-v{}", rng.below(3)),
                    namespace: namespace.into(),
                    addresses,
                    services,
                    status: rng.below(4) as i32 % 2,
                    authorization_policies,
                    // Some on another network, at the same addresses:
                    // claims and the index are by network address.
                    network: if rng.below(4) == 0 { "east" } else { "" }.into(),
                    ..Default::default()
                };
                let address = Address {
                    r#type: Some(address::Type::Workload(w)),
                };
                r.addresses.insert(uid.into(), held(address));
            }
            3 => {
                let i = rng.below(4);
                let vip = if rng.below(2) == 0 {
                    ip(6 + rng.below(4) as u8)
                } else {
                    vec![10, 96, 0, 1 + rng.below(3) as u8]
                };
                let s = workload::Service {
                    name: format!("s{i}"),
                    namespace: "shop".into(),
                    hostname: format!("s{i}.shop"),
                    addresses: vec![NetworkAddress {
                        network: String::new(),
                        address: vip,
                        length: None,
                    }],
                    ports: vec![Port {
                        service_port: 80,
                        target_port: 8080 + rng.below(2) as u32,
                    }],
                    ..Default::default()
                };
                let address = Address {
                    r#type: Some(address::Type::Service(s)),
                };
                r.addresses.insert(service_key(i).into(), held(address));
            }
            4 => {
                let name = format!("p{}", rng.below(4));
                let a = Authorization {
                    name: name.clone(),
                    namespace: "shop".into(),
                    scope: rng.below(3) as i32,
                    action: rng.below(2) as i32,
                    ..Default::default()
                };
                r.authorizations
                    .insert(format!("shop/{name}").into(), held(a));
            }
            5 => {
                let name = if rng.below(2) == 0 {
                    format!("w{:02}", rng.below(12))
                } else {
                    service_key(rng.below(4))
                };
                r.addresses.remove(name.as_str());
            }
            _ => {
                r.authorizations
                    .remove(format!("shop/p{}", rng.below(4)).as_str());
            }
        }
    }
}

/// The file beside istiod in the equivalence test: it replaces istiod's
/// `w03`, service `s1` and policy `p1`, and holds 10.0.0.2 and 10.96.0.1.
const RANDOM_FILE: &str = r#"
workloads:
- {uid: w03, name: w03-file, namespace: shop, workloadIps: [10.0.0.2],
   services: {'shop/s1.shop': {80: 8080}}}
services:
- {name: s1, namespace: shop, hostname: s1.shop, vips: ['/10.96.0.1'], ports: {80: 8080}}
policies:
- {name: p1, namespace: shop, scope: Namespace, action: Allow}
"#;

/// What a state says about every address, hostname and policy of the
/// equivalence test's pools, and what its dump shows.
fn observe(state: &MeshState) -> Vec<String> {
    let mut seen = vec![
        format!("{:?}", state.config()),
        state
            .provenance
            .annotate(state.config().to_json())
            .to_string(),
    ];
    for last in 1..=10 {
        for prefix in ["10.0.0", "10.96.0"] {
            let ip: IpAddr = format!("{prefix}.{last}").parse().unwrap();
            seen.push(format!(
                "{ip}: workload {:?} on east {:?} service {:?}",
                state.workloads.by_ip(ip).map(|w| &w.workload.uid),
                state.workloads.by_addr("east", ip).map(|w| &w.workload.uid),
                state.services.by_vip(ip).map(|s| &s.service.hostname)
            ));
        }
    }
    for i in 0..4 {
        let host = format!("s{i}.shop");
        let endpoints = state.services.by_hostname(&host).map(|s| {
            s.endpoints()
                .iter()
                .map(|w| w.workload.uid.clone())
                .collect::<Vec<_>>()
        });
        seen.push(format!("{host}: {endpoints:?}"));
    }
    seen.push(format!("policies {}", state.policies.len()));
    seen
}

#[test]
fn a_state_changed_push_by_push_is_the_state_built_whole() {
    use crate::xds::XdsResources;
    let file = config(RANDOM_FILE, "mesh.yaml");
    let index = FileIndex::of(&file);
    let mut rng = Lcg(7);
    let mut resources = XdsResources::default();
    let mut model = XdsModel::default();
    let mut state = merged_state(&file, Some(("xds", &XdsEntries::default()))).unwrap();
    let (mut conflicts, mut shadowed, mut untouched) = (0, 0, 0);
    for push in 0..400 {
        // A push changes one to three resources (the client coalesces).
        for _ in 0..=rng.below(3) {
            random_pushes::mutate(&mut resources, &mut rng);
        }
        model.update(&resources);
        let mut provenance = state.provenance.clone();
        let changes = merge_changes(&index, model.entries(), model.pending(), &mut provenance);
        if push % 7 == 3 {
            // The state made from it refused: the next one takes this
            // push's changes in with its own.
            continue;
        }
        model.taken_in();
        let (mut next, affected) = state.apply_tracked(&changes).unwrap();
        next.provenance = provenance;
        // Whatever a connection's decision or a fast-path verdict depends
        // on that the push changed, the change says it concerns.
        for ip in pool_addresses() {
            if seen_at(&state, ip) != seen_at(&next, ip) {
                assert!(
                    affected.concerns(&next, ip),
                    "push {push}: {ip} changed ({:?} -> {:?}) but {affected:?} does not concern it",
                    seen_at(&state, ip),
                    seen_at(&next, ip)
                );
            } else if !affected.concerns(&next, ip) {
                untouched += 1;
            }
        }
        let whole_entries = XdsModel::default().update(&resources).clone();
        let whole = merged_state(&file, Some(("xds", &whole_entries))).unwrap();
        assert_eq!(
            observe(&next),
            observe(&whole),
            "push {push}: the state changed entry by entry differs from the one built whole"
        );
        conflicts += usize::from(!next.provenance.dropped().is_empty());
        shadowed += usize::from(!next.provenance.shadows.is_empty());
        state = next;
    }
    // The pools are small enough that conflicts and file overrides happen.
    assert!(conflicts > 50, "only {conflicts} pushes had a conflict");
    assert!(
        shadowed > 50,
        "only {shadowed} pushes had an entry the file replaces"
    );
    // A change reaches only part of the pools: not everything is re-checked.
    assert!(
        untouched > 2000,
        "only {untouched} addresses were left alone by 400 pushes"
    );
}

/// The workload and service addresses of the equivalence test's pools.
fn pool_addresses() -> impl Iterator<Item = IpAddr> {
    (1..=10).flat_map(|last| {
        ["10.0.0", "10.96.0"].map(|prefix| format!("{prefix}.{last}").parse().unwrap())
    })
}

/// What connections to `ip` and fast-path verdicts for it depend on in
/// `state`: the workload there (identity, namespace, selector policies,
/// settings), the service there and its endpoints, and the decision on a
/// connection to it.
fn seen_at(state: &MeshState, ip: IpAddr) -> String {
    let request = crate::policy::Request {
        peer: None,
        src: "10.9.9.9:1234".parse().unwrap(),
        dst: std::net::SocketAddr::new(ip, 8080),
    };
    format!(
        "workload {:?} service {:?} decision {:?}",
        state
            .workloads
            .by_ip(ip)
            .map(|w| (&w.workload, &w.identity)),
        state.services.by_vip(ip).map(|s| (
            &s.service,
            s.endpoints()
                .iter()
                .map(|w| w.workload.uid.clone())
                .collect::<Vec<_>>()
        )),
        state.authorize(&request)
    )
}
