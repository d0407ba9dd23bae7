//! Which endpoint a connection goes to: locality routing and health policy,
//! an even choice among equally close endpoints, turns beside the fast path,
//! and weights by capacity.

use super::*;

#[test]
fn locality_routing_and_health_policy_choose_endpoints() {
    let state = MeshState::from_config(&LocalConfig::parse(LOCALITY, "locality").unwrap()).unwrap();
    let source = Identity::new("cluster.local", "shop", "default").unwrap();
    let choice = Fixed {
        dead: HashSet::new(),
        start: 0,
    };
    let order = |src: &str, dst: &str| -> Vec<String> {
        let plan = plan(
            &state,
            &source,
            src.parse().unwrap(),
            dst.parse().unwrap(),
            &choice,
        );
        match plan.action {
            Action::Failover(hops) => hops
                .iter()
                .map(|h| h.dst().map_or_else(String::new, |d| d.ip().to_string()))
                .collect(),
            Action::Hop(h) => vec![format!(
                "direct {}",
                h.dst().map_or_else(String::new, |d| d.to_string())
            )],
            Action::Refuse { detail, .. } => vec![detail],
        }
    };
    // Strict: only the client's zone; the unhealthy one never.
    assert_eq!(order("10.1.0.1", "10.96.1.1:80"), ["10.1.0.2", "10.1.0.3"]);
    // Failover: same zone and node first, same zone next, the rest last.
    assert_eq!(
        order("10.1.0.1", "10.96.1.2:80"),
        ["10.1.0.2", "10.1.0.3", "10.1.0.4"]
    );
    // A client the mesh does not know: strict has nothing to compare.
    assert_eq!(
        order("10.9.9.9", "10.96.1.1:80"),
        ["service shop/strict has no endpoints"]
    );
    // allowAll keeps the unhealthy endpoint.
    assert_eq!(
        order("10.1.0.1", "10.96.1.3:80"),
        ["10.1.0.2", "10.1.0.3", "10.1.0.4", "10.1.0.5"]
    );
    // Passthrough: the VIP itself, no endpoint chosen.
    assert_eq!(order("10.1.0.1", "10.96.1.4:80"), ["direct 10.96.1.4:80"]);
}

#[test]
fn the_choice_is_even_only_among_equally_close_live_endpoints() {
    let state = MeshState::from_config(&LocalConfig::parse(LOCALITY, "locality").unwrap()).unwrap();
    let client = state.workloads.by_ip("10.1.0.1".parse().unwrap());
    let client = client.map(std::sync::Arc::as_ref);
    let even = |vip: &str, dead: &[&str]| {
        let entry = state.services.by_vip(vip.parse().unwrap()).unwrap();
        let dead: Vec<IpAddr> = dead.iter().map(|ip| ip.parse().unwrap()).collect();
        entry
            .even_candidates(([0, 0, 0, 0], 80).into(), client, "", |ip| {
                dead.contains(&ip)
            })
            .map(|endpoints| {
                endpoints
                    .iter()
                    .map(|e| e.addr.ip().map_or_else(String::new, |ip| ip.to_string()))
                    .collect::<Vec<_>>()
            })
    };
    // No routing preference: every endpoint is as good as another.
    assert_eq!(
        even("10.96.1.3", &[]).unwrap(),
        ["10.1.0.2", "10.1.0.3", "10.1.0.4", "10.1.0.5"]
    );
    // ...unless one is dead, which the engine tries last.
    assert_eq!(even("10.96.1.3", &["10.1.0.4"]), None);
    // Strict keeps the client's zone, where both are equally close.
    assert_eq!(even("10.96.1.1", &[]).unwrap(), ["10.1.0.2", "10.1.0.3"]);
    // Failover orders them by closeness: no even choice.
    assert_eq!(even("10.96.1.2", &[]), None);
    // An endpoint known by DNS name only is the proxy's to resolve: the
    // kernel gets no choice.
    let mesh = MeshState::from_config(&LocalConfig::parse(MESH, "plan").unwrap()).unwrap();
    let api = mesh
        .services
        .by_vip("240.240.0.1".parse().unwrap())
        .unwrap();
    assert!(
        api.even_candidates(([0, 0, 0, 0], 443).into(), None, "", |_| false)
            .is_none()
    );
    assert_eq!(
        api.candidates(([0, 0, 0, 0], 443).into(), 0, None, "", |_| false)
            .len(),
        1
    );
}

/// A choice whose fast path takes some endpoints of every service.
struct Split {
    fixed: Fixed,
    taken: Arc<[IpAddr]>,
}

impl EndpointChoice for Split {
    fn is_dead(&self, ip: IpAddr) -> bool {
        self.fixed.is_dead(ip)
    }

    fn start(&self, service: &ServiceEntry) -> usize {
        self.fixed.start(service)
    }

    fn draw(&self, below: u64) -> u64 {
        self.fixed.draw(below)
    }

    fn taken_by_kernel(&self, _: SocketAddr) -> Option<Arc<[IpAddr]>> {
        Some(Arc::clone(&self.taken))
    }
}

#[test]
fn the_proxy_takes_turns_among_the_endpoints_the_fast_path_leaves_it() {
    let state = MeshState::from_config(&LocalConfig::parse(LOCALITY, "locality").unwrap()).unwrap();
    let source = Identity::new("cluster.local", "shop", "default").unwrap();
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let order = |start: usize, dead: &[&str]| -> Vec<String> {
        let choice = Split {
            fixed: Fixed {
                dead: dead.iter().map(|d| ip(d)).collect(),
                start,
            },
            taken: [ip("10.1.0.2"), ip("10.1.0.4")].into(),
        };
        let dst = "10.96.1.3:80".parse().unwrap();
        match plan(&state, &source, ip("10.1.0.1"), dst, &choice).action {
            Action::Failover(hops) => hops
                .iter()
                .map(|h| h.dst().map_or_else(String::new, |d| d.ip().to_string()))
                .collect(),
            other => vec![format!("{other:?}")],
        }
    };
    // The others in turn, whatever runs of taken ones lie between them;
    // the taken ones last.
    for (start, first, second) in [(0, "3", "5"), (1, "5", "3"), (2, "3", "5"), (3, "5", "3")] {
        assert_eq!(
            order(start, &[]),
            [
                format!("10.1.0.{first}"),
                format!("10.1.0.{second}"),
                "10.1.0.2".to_owned(),
                "10.1.0.4".to_owned()
            ],
            "start {start}"
        );
    }
    // A dead one of the others is tried after the live one, every time.
    for start in 0..2 {
        assert_eq!(
            order(start, &["10.1.0.3"]),
            ["10.1.0.5", "10.1.0.3", "10.1.0.2", "10.1.0.4"]
        );
    }
}

/// Endpoints weighted by their workloads' capacity (a WorkloadEntry's
/// `weight`; ztunnel `load_balance` draws with `choose_weighted`): round
/// robin gives each its weight's turns per round, a random draw its share;
/// weight 0 is never chosen first; unequal weights leave the kernel no
/// even choice.
#[test]
fn endpoints_are_chosen_in_proportion_to_their_capacity() {
    const WEIGHTED: &str = r#"
workloads:
- {uid: big, name: big, namespace: shop, workloadIps: [10.1.0.2], capacity: 3,
   services: {'shop/w.shop.svc.cluster.local': {80: 80}}}
- {uid: none, name: none, namespace: shop, workloadIps: [10.1.0.3], capacity: 0,
   services: {'shop/w.shop.svc.cluster.local': {80: 80}}}
- {uid: small, name: small, namespace: shop, workloadIps: [10.1.0.4],
   services: {'shop/w.shop.svc.cluster.local': {80: 80}}}
services:
- {name: w, namespace: shop, hostname: w.shop.svc.cluster.local, vips: ['/10.96.2.1'],
   ports: {80: 80}}
- {name: r, namespace: shop, hostname: r.shop.svc.cluster.local, vips: ['/10.96.2.2'],
   ports: {80: 80}, loadBalancing: random}
"#;
    let mut text = WEIGHTED.to_owned();
    // The same endpoints in the random service too.
    text = text.replace(
        "{'shop/w.shop.svc.cluster.local': {80: 80}}",
        "{'shop/w.shop.svc.cluster.local': {80: 80}, 'shop/r.shop.svc.cluster.local': {80: 80}}",
    );
    let state = MeshState::from_config(&LocalConfig::parse(&text, "weighted").unwrap()).unwrap();
    let first = |entry: &ServiceEntry| {
        let start = entry.next_start();
        let candidates = entry.candidates(([0, 0, 0, 0], 80).into(), start, None, "", |_| false);
        candidates[0].workload.workload.name.clone()
    };
    let count = |vip: &str, n: usize| {
        let entry = state.services.by_vip(vip.parse().unwrap()).unwrap();
        let mut counts = std::collections::BTreeMap::new();
        for _ in 0..n {
            *counts.entry(first(entry)).or_insert(0usize) += 1;
        }
        counts
    };
    let rr = count("10.96.2.1", 400);
    assert_eq!(rr.get("big"), Some(&300), "{rr:?}");
    assert_eq!(rr.get("small"), Some(&100), "{rr:?}");
    assert_eq!(rr.get("none"), None, "{rr:?}");
    // 4,000 draws of p = 3/4: 3,000 expected, sd 27; the bounds are 20 sd
    // away.
    let random = count("10.96.2.2", 4000);
    let big = random.get("big").copied().unwrap_or(0);
    assert!((2450..=3550).contains(&big), "{random:?}");
    assert_eq!(random.get("none"), None, "{random:?}");
    let entry = state.services.by_vip("10.96.2.1".parse().unwrap()).unwrap();
    assert!(
        entry
            .even_candidates(([0, 0, 0, 0], 80).into(), None, "", |_| false)
            .is_none()
    );
    // Every endpoint stays a candidate for failover, in rotation order.
    assert_eq!(
        entry
            .candidates(([0, 0, 0, 0], 80).into(), 0, None, "", |_| false)
            .len(),
        3
    );
}
