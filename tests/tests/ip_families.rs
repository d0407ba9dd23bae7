//! Which address of a dual-stack endpoint a connection to a service goes
//! to: the address of the family the client dialled, within the service's
//! `ipFamilies` (ztunnel `src/state.rs` `finalize_upstream` ->
//! `pick_workload_destination_or_resolve`): an IPv6-only service's
//! endpoint at its IPv6 address whichever VIP was dialled, a dual-stack
//! service's in the VIP's family. The app sees the address it was reached
//! at; a stock ztunnel (`DATAPLANE_ZTUNNEL`) is held to the same choice.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
    time::Duration,
};

use dataplane_tests::{
    mesh::{NAMESPACE, TwoNodes, endpoint_of, hbone_workload, service},
    topology::Pod,
    traffic::{echo, echo_server},
    ztunnel_client::ztunnel_asks,
};
use dataplane_user::config::{IpFamily, LocalConfig};

const SIX_VIP4: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 96, 0, 41));
const SIX_VIP6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x41));
const DUAL_VIP4: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 96, 0, 42));
const DUAL_VIP6: IpAddr = IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x42));

/// The world's mesh with the services `six` (IPv6 only) and `dual` (both
/// families), each with a VIP of either family, port 80 -> 9000, whose
/// one endpoint is `endpoint` (a workload named `name` with both of its
/// addresses; `enrolled` or not).
fn mesh(w: &TwoNodes, (endpoint, name): (&Pod, &str), enrolled: bool) -> LocalConfig {
    let mut config = w.mesh_config();
    let mut six = service("six", NAMESPACE, SIX_VIP4, &[(80, 9000)]);
    six.vips.push(SIX_VIP6.into());
    six.ip_families = Some(IpFamily::IPv6);
    let mut dual = service("dual", NAMESPACE, DUAL_VIP4, &[(80, 9000)]);
    dual.vips.push(DUAL_VIP6.into());
    dual.ip_families = Some(IpFamily::Dual);
    config.workloads.retain(|w| w.name != name);
    let mut workload = hbone_workload(endpoint, name, "node2");
    if !enrolled {
        workload.netns = None;
    }
    endpoint_of(&mut workload, &six);
    endpoint_of(&mut workload, &dual);
    config.workloads.push(Arc::new(workload));
    config.services.extend([six, dual]);
    config
}

/// Each VIP dialled, and the family of the endpoint address it must reach.
const CASES: [(IpAddr, bool, &str); 3] = [
    (
        SIX_VIP4,
        true,
        "an IPv6-only service dialled at its IPv4 VIP",
    ),
    (DUAL_VIP6, true, "a dual-stack service at its IPv6 VIP"),
    (DUAL_VIP4, false, "a dual-stack service at its IPv4 VIP"),
];

fn endpoint_addr(pod: &Pod, v6: bool) -> IpAddr {
    if v6 { pod.ip6.into() } else { pod.ip4.into() }
}

#[test]
fn a_dual_stack_endpoint_is_reached_in_the_family_dialled_within_the_services() -> anyhow::Result<()>
{
    let w = TwoNodes::new("ipf")?;
    let (_a1, _a2) = w.agents("ipf", &mesh(&w, (&w.remote, "remote"), true))?;
    let app = echo_server(&w.remote, 9000)?;
    for (seed, (vip, v6, case)) in (1u64..).zip(CASES) {
        echo(&w.client, SocketAddr::new(vip, 80), 64, seed)?;
        let request = app
            .next_request(Duration::from_secs(20))
            .ok_or_else(|| anyhow::anyhow!("{case}: the app served no connection"))?;
        assert_eq!(
            request.local.ip().to_canonical(),
            endpoint_addr(&w.remote, v6),
            "{case}"
        );
    }
    Ok(())
}

/// A stock ztunnel as the client's node proxy asks the endpoint (the
/// `plain` pod, out of the mesh, where a stand-in records the CONNECT)
/// for the same address.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn a_stock_ztunnel_reaches_a_dual_stack_endpoint_in_the_same_family() -> anyhow::Result<()> {
    let w = TwoNodes::new("ipz")?;
    for (n, (vip, v6, case)) in CASES.into_iter().enumerate() {
        let config = mesh(&w, (&w.plain, "target"), false);
        let tag = format!("ipz{n}");
        let asked = ztunnel_asks(
            &w,
            &tag,
            config,
            ("target", 15008),
            SocketAddr::new(vip, 80),
        )?;
        let expected = SocketAddr::new(endpoint_addr(&w.plain, v6), 9000);
        assert_eq!(asked, [expected.to_string()], "{case}");
    }
    Ok(())
}
