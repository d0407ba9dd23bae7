//! The seed of the redirection work, end to end in the running kernel:
//! `cgroup/connect4` attached to a test cgroup steers a real process's
//! connection to a listener in its network namespace, and user space recovers
//! the original destination from the map keyed by namespace and tuple.
//!
//! Topology per test: one network namespace (`lo` up, 10.99.0.1/32 on `lo` so
//! the "real" destination exists and answers `direct`), one cgroup, one bpffs
//! directory, one redirector instance. Guards remove all of it.

use std::{
    net::{SocketAddr, TcpListener},
    time::Duration,
};

use dataplane_common::DEFAULT_PROXY_MARK;
use dataplane_tests::{BpffsDir, Cgroup, Netns, Responder, counters, redirector_node::dial_in};
use dataplane_user::redirect::{OrigDstTable, PinLayout, Redirector, RedirectorOptions};

const REAL_DST: &str = "10.99.0.1:8080";
const LIMIT: Duration = Duration::from_secs(20);

/// One pod-like sandbox with the redirector attached to its cgroup.
/// Field order is drop order: the redirector detaches before its pins,
/// cgroup and namespace go.
struct Sandbox {
    redirector: Option<Redirector>,
    capture: Responder,
    direct: Responder,
    cgroup: Cgroup,
    netns: Netns,
    _bpffs: BpffsDir,
    pins: PinLayout,
}

impl Sandbox {
    fn new(tag: &str) -> anyhow::Result<Self> {
        let bpffs = BpffsDir::new(tag)?;
        let netns = Netns::new(tag)?;
        netns.ip(&["addr", "add", "10.99.0.1/32", "dev", "lo"])?;
        let cgroup = Cgroup::new(tag)?;

        // The capture listener answers with the original destination it
        // recovers; the real destination answers "direct".
        let pins = PinLayout::new(bpffs.path(), "seed");
        let redirector = Redirector::attach(&RedirectorOptions::new(
            cgroup.path().to_path_buf(),
            pins.clone(),
        ))?;
        let mut table = OrigDstTable::open(&pins, netns.cookie()?)?;
        let capture_listener = netns.run(|| TcpListener::bind("127.0.0.1:15001"))??;
        let capture = Responder::start(capture_listener, move |req| {
            match table.take(req.peer, req.local) {
                Ok(Some(orig)) => format!("orig={orig}").into_bytes(),
                Ok(None) => b"orig=none".to_vec(),
                Err(e) => format!("error={e}").into_bytes(),
            }
        })?;
        let direct_listener = netns.run(|| TcpListener::bind(REAL_DST))??;
        let direct = Responder::start(direct_listener, |_| b"direct".to_vec())?;
        Ok(Self {
            redirector: Some(redirector),
            capture,
            direct,
            cgroup,
            netns,
            _bpffs: bpffs,
            pins,
        })
    }

    fn enroll(&mut self) -> anyhow::Result<()> {
        let cookie = self.netns.cookie()?;
        self.redirector
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("redirector gone"))?
            .enroll_netns(cookie)?;
        Ok(())
    }

    /// Runs `dp-probe connect` in the namespace, inside the cgroup or not.
    fn probe(&self, dst: &str, in_cgroup: bool, extra: &[&str]) -> anyhow::Result<String> {
        let cgroup = in_cgroup.then_some(&self.cgroup);
        dial_in(&self.netns, cgroup, dst, extra)?
            .map_err(|stderr| anyhow::anyhow!("probe to {dst} failed: {stderr}"))
    }

    fn counter(&self, name: &str) -> anyhow::Result<u64> {
        counters::one(&self.pins, name)
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some(r) = self.redirector.take()
            && let Err(e) = r.shutdown(dataplane_user::redirect::ExitMode::Detach)
        {
            eprintln!("cleanup: {e}");
        }
    }
}

#[test]
fn enrolled_connection_is_steered_and_orig_dst_recovered() -> anyhow::Result<()> {
    let mut sb = Sandbox::new("c4steer")?;
    sb.enroll()?;

    let reply = sb.probe(REAL_DST, true, &[])?;
    assert_eq!(reply, format!("orig={REAL_DST}"));

    let req = sb
        .capture
        .next_request(LIMIT)
        .ok_or_else(|| anyhow::anyhow!("capture listener saw no request"))?;
    assert_eq!(req.body, b"hello");
    assert_eq!(req.local, "127.0.0.1:15001".parse::<SocketAddr>()?);
    assert!(
        sb.direct.drain().is_empty(),
        "real destination must not be reached"
    );
    assert_eq!(sb.counter("redirected_outbound")?, 1);
    assert_eq!(sb.counter("orig_dst_recorded")?, 1);
    Ok(())
}

#[test]
fn original_destination_record_is_consumed_once() -> anyhow::Result<()> {
    let mut sb = Sandbox::new("c4once")?;
    sb.enroll()?;
    assert_eq!(sb.probe(REAL_DST, true, &[])?, format!("orig={REAL_DST}"));
    let req = sb
        .capture
        .next_request(LIMIT)
        .ok_or_else(|| anyhow::anyhow!("no request"))?;
    let mut table = OrigDstTable::open(&sb.pins, sb.netns.cookie()?)?;
    assert_eq!(table.take(req.peer, req.local)?, None);
    Ok(())
}

#[test]
fn netns_not_enrolled_is_untouched() -> anyhow::Result<()> {
    let sb = Sandbox::new("c4noenr")?;
    assert_eq!(sb.probe(REAL_DST, true, &[])?, "direct");
    assert!(sb.capture.drain().is_empty());
    assert_eq!(sb.counter("redirected_outbound")?, 0);
    assert!(sb.counter("skipped_not_enrolled")? >= 1);
    Ok(())
}

#[test]
fn process_outside_the_cgroup_is_untouched() -> anyhow::Result<()> {
    let mut sb = Sandbox::new("c4nocg")?;
    sb.enroll()?;
    assert_eq!(sb.probe(REAL_DST, false, &[])?, "direct");
    assert_eq!(sb.counter("redirected_outbound")?, 0);
    Ok(())
}

#[test]
fn proxy_marked_socket_is_exempt() -> anyhow::Result<()> {
    let mut sb = Sandbox::new("c4mark")?;
    sb.enroll()?;
    let mark = format!("{DEFAULT_PROXY_MARK:#x}");
    assert_eq!(sb.probe(REAL_DST, true, &["--mark", &mark])?, "direct");
    assert_eq!(sb.counter("exempt_proxy_mark")?, 1);
    assert_eq!(sb.counter("redirected_outbound")?, 0);
    Ok(())
}

#[test]
fn loopback_destination_is_exempt() -> anyhow::Result<()> {
    let mut sb = Sandbox::new("c4lo")?;
    sb.enroll()?;
    let lo = sb.netns.run(|| TcpListener::bind("127.0.0.1:0"))??;
    let lo_addr = lo.local_addr()?.to_string();
    let _lo_server = Responder::start(lo, |_| b"loopback".to_vec())?;
    assert_eq!(sb.probe(&lo_addr, true, &[])?, "loopback");
    assert_eq!(sb.counter("exempt_loopback")?, 1);
    Ok(())
}

#[test]
fn unenroll_restores_direct_traffic() -> anyhow::Result<()> {
    let mut sb = Sandbox::new("c4unenr")?;
    sb.enroll()?;
    assert_eq!(sb.probe(REAL_DST, true, &[])?, format!("orig={REAL_DST}"));
    let cookie = sb.netns.cookie()?;
    let redirector = sb
        .redirector
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("redirector gone"))?;
    redirector.unenroll_netns(cookie)?;
    redirector.unenroll_netns(cookie)?; // idempotent
    assert_eq!(sb.probe(REAL_DST, true, &[])?, "direct");
    Ok(())
}

#[test]
fn two_namespaces_dialling_from_the_same_tuple_keep_their_own_destinations() -> anyhow::Result<()> {
    use std::io::{Read as _, Write as _};

    use dataplane_tests::{probe_binary, spawn_in};
    // Apps in two pods connect from the same source port: both connections
    // are 127.0.0.1:P -> 127.0.0.1:15001 inside their own namespace, which
    // is what two pods dialling at once often get from the kernel's port
    // choice. Each pod's engine must find its own pod's destination.
    const SOURCE_PORT: &str = "40123";
    const OTHER_DST: &str = "10.99.0.2:9090";
    let mut sb = Sandbox::new("c4twin")?;
    sb.enroll()?;
    let other = Netns::new("c4twin")?;
    let other_listener = other.run(|| TcpListener::bind("127.0.0.1:15001"))??;
    sb.redirector
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("redirector gone"))?
        .enroll_netns(other.cookie()?)?;

    // The other pod's connection waits in its listener's queue, its record
    // written, while the first pod's goes through its engine.
    let mut cmd = std::process::Command::new(probe_binary()?);
    cmd.args(["connect", OTHER_DST, "hello", "--bind-port", SOURCE_PORT]);
    let other_client = spawn_in(cmd, Some(other.path()), Some(sb.cgroup.path()))?;
    dataplane_tests::traffic::wait_until("the other pod's record", || {
        Ok(sb.counter("orig_dst_recorded")? == 1)
    })?;
    assert_eq!(
        sb.probe(REAL_DST, true, &["--bind-port", SOURCE_PORT])?,
        format!("orig={REAL_DST}")
    );

    let (mut conn, peer) = other_listener.accept()?;
    assert_eq!(peer.port().to_string(), SOURCE_PORT);
    let mut table = OrigDstTable::open(&sb.pins, other.cookie()?)?;
    let found = table.take(peer, conn.local_addr()?)?;
    conn.set_read_timeout(Some(LIMIT))?;
    let mut request = Vec::new();
    conn.read_to_end(&mut request)?;
    conn.write_all(format!("orig={found:?}").as_bytes())?;
    drop(conn);
    let out = other_client.wait(LIMIT)?;
    assert_eq!(found, Some(OTHER_DST.parse()?), "{out:?}");
    assert_eq!(out.code, Some(0), "{out:?}");
    Ok(())
}
